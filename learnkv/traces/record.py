"""Recorder: rides along a full-cache decode and snapshots, at sampled decision steps, every cached token's
features, each teacher's score, and (``horizon`` steps later) its oracle future utility.

It is a non-evicting policy with ``group_reduce = "none"``: the attention function hands it the unreduced
attention of all the step's query rows, from which it rebuilds exactly the view each teacher would get if it ran
alone (mean or max over the group, its own observation window, sums and squares), so teacher scores in the traces
are the teachers' real scores. Teacher and tracker state live in the layer's state dict under prefixed names, so
the cache keeps them aligned like any policy state.

Labels of a decision at step t, per (layer, KV head, token), over the next ``horizon`` steps:
``future_sum`` (attention mass received, group mean), ``future_max`` (max over the steps and the group's heads),
``reenter`` (whether the token is ever in the top ``label_budget`` share of the step's attention).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from learnkv.features import FeatureTracker
from learnkv.policies import make_policy
from learnkv.policies.base import LayerView, Policy


def teacher_view(view: LayerView, teacher: Policy, state: dict[str, Tensor], keep: int) -> LayerView:
    """The view ``teacher`` would get from the attention function, rebuilt from an unreduced view."""
    attn = attn_sum = attn_sq = None
    if teacher.needs_attention:
        rows = view.attn.amax(dim=2) if teacher.group_reduce == "max" else view.attn.mean(dim=2)  # [B, H, q, T]
        attn = rows[:, :, -min(teacher.obs_window, rows.shape[2]) :, :]
        attn_sum = rows.sum(dim=2)
        attn_sq = (rows * rows).sum(dim=2) if teacher.needs_sq_sum else None
    return LayerView(layer=view.layer, step=view.step, keys=view.keys, values=view.values, positions=view.positions,
                     n_new=view.n_new, attn=attn, attn_sum=attn_sum, attn_sq_sum=attn_sq, keep=keep, state=state)


@dataclass
class Pending:
    """A decision snapshot waiting for its future attention."""

    step: int
    layer: int
    positions: Tensor  # [B, H, T]
    features: Tensor  # [B, H, T, F]
    teachers: dict[str, Tensor]  # name -> [B, H, T]
    future_sum: Tensor
    future_max: Tensor
    reenter: Tensor
    seen: int = 0


@dataclass
class Recorder(Policy):
    """Observer policy for trace collection (never evicts).

    Parameters
    ----------
    n_layers : int
        Decoder layers of the model.
    teachers : tuple[str, ...]
        Registered policy names whose scores are recorded.
    decision_steps : frozenset[int]
        Decode steps at which to snapshot.
    horizon : int
        H, the label horizon in decode steps.
    label_budget : float
        Budget, as a share of the cached tokens, that defines ``reenter`` and the teachers' ``keep``.
    """

    name = "recorder"
    evicts = False
    needs_attention = True
    group_reduce = "none"

    n_layers: int = 1
    teachers: tuple[str, ...] = ()
    decision_steps: frozenset = frozenset()
    horizon: int = 32
    label_budget: float = 0.25

    def __post_init__(self):
        self.tracker = FeatureTracker(self.n_layers)
        self._teachers: dict[str, Policy] = {}
        self.rows: list[Pending] = []  # finished decisions
        self._pending: list[Pending] = []

    def params(self) -> dict:
        return {"teachers": list(self.teachers), "horizon": self.horizon, "label_budget": self.label_budget}

    @property
    def obs_window(self) -> int:
        return 1 << 30  # every query row of the step (the prefill's too): teachers' stats are rebuilt from them

    def _teacher(self, name: str, keep: int) -> Policy:
        # teachers are resolved against the label budget of the first decision; windows stay fixed after that
        if name not in self._teachers:
            self._teachers[name] = make_policy(name).resolve(max(keep, 64))
        return self._teachers[name]

    def update(self, view: LayerView) -> None:
        st = view.state
        T = view.positions.shape[-1]
        keep = max(1, math.ceil(self.label_budget * T))
        self.tracker.update(view.attn, view.positions, view.n_new, view.step, st)
        teacher_states = {}
        for name in self.teachers:
            teacher = self._teacher(name, keep)
            prefix = f"t.{name}."
            sub = {k[len(prefix):]: v for k, v in st.items() if k.startswith(prefix)}
            teacher.update(teacher_view(view, teacher, sub, keep))
            for k, v in sub.items():
                st[prefix + k] = v
            teacher_states[name] = sub
        if view.step > 0:
            self._accumulate_labels(view, keep)
        if view.step in self.decision_steps:
            feats = self.tracker.features(view.attn, view.keys, view.values, view.positions, view.layer, view.step, st)
            scores = {
                name: self._teachers[name].score(teacher_view(view, self._teachers[name], teacher_states[name], keep)).float()
                for name in self.teachers
            }
            zeros = torch.zeros(view.positions.shape, dtype=torch.float32, device=view.keys.device)
            self._pending.append(Pending(view.step, view.layer, view.positions.clone(), feats, scores, zeros.clone(),
                                         zeros.clone(), zeros.bool()))

    def _accumulate_labels(self, view: LayerView, keep: int) -> None:
        row = view.attn[:, :, :, -1, :]  # [B, H, G, T] the current query
        mean, gmax = row.mean(dim=2), row.amax(dim=2)
        top = torch.zeros_like(mean, dtype=torch.bool).scatter(-1, mean.topk(min(keep, mean.shape[-1]), dim=-1).indices, True)
        still = []
        for p in self._pending:
            if p.layer != view.layer or p.step >= view.step:
                still.append(p)
                continue
            T = p.positions.shape[-1]  # full cache: slots never move, the first T are the decision's tokens
            p.future_sum += mean[..., :T]
            p.future_max = torch.maximum(p.future_max, gmax[..., :T])
            p.reenter |= top[..., :T]
            p.seen += 1
            if p.seen >= self.horizon:
                self.rows.append(p)
            else:
                still.append(p)
        self._pending = still

    def unfinished(self) -> int:
        """Decisions whose horizon ran past the end of the generation (dropped)."""
        return len(self._pending)
