"""Recording a decode for training: at sampled decision steps, every resident token's features, each teacher's
score, and its future utility over the next ``horizon`` steps.

The pieces both recorders share live here:

- `Riders`: the `FeatureTracker` and the teacher policies, fed the attention of the cache they ride on. They see
  the unreduced attention of every query row of the step (``group_reduce = "none"``), from which each teacher's own
  view is rebuilt exactly (mean or max over the group, its observation window, sums and squares), so teacher scores
  are the teachers' real scores on the resident tokens. Their state lives in the layer's state dict under prefixed
  names, so the cache keeps it aligned (and evicts it) like any policy state.
- `step_labels`: what one future query contributes to each label of every slot.
- `Recorder`: the off-policy recorder, a non-evicting observer of a full-cache decode; labels accumulate online,
  from the same run's next ``horizon`` steps. (`learnkv.traces.onpolicy` records under eviction.)

Labels of a decision at step t, per (layer, KV head, token), over the steps t+1 .. t+horizon:
``future_sum`` (attention mass received, group mean), ``future_max`` (max over the steps and the group's heads),
``future_out`` (how much dropping the token would move each step's attention output: per query head g,
``a_g |v - o_g| / (1 - a_g)`` with ``o_g`` the head's attention output, group mean, summed over the steps),
``reenter`` (whether the token is ever in the top ``label_budget`` share of a step's attention).

Rows of a batch record exactly what each records alone: everything is per row (live tokens, label shares), padding
slots are dropped when a decision is extracted (`Decision`), and a decision whose horizon runs past the row's own end
(its EOS) is dropped, as it is alone, even while other rows of the batch go on decoding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from learnkv.features import FeatureTracker, group_mean_max
from learnkv.policies import make_policy
from learnkv.policies.base import LayerView, Policy

#: the budget teachers are resolved for (their budget-dependent windows), whatever the row: so a row's teacher scores
#: never depend on the other rows of its batch
TEACHER_BUDGET = 64
#: float labels, in trace-column order (``reenter`` is the boolean one)
FLOAT_LABELS = ("future_sum", "future_max", "future_out")


def teacher_view(view: LayerView, teacher: Policy, state: dict[str, Tensor], keep) -> LayerView:
    """The view ``teacher`` would get from the attention function, rebuilt from an unreduced view
    (``attn [B, H, G, W, T]``)."""
    attn = attn_sum = attn_sq = None
    if teacher.needs_attention:
        if teacher.group_reduce in ("none", "mean+max"):  # the group axis kept, or its mean and max on it
            rows = view.attn if teacher.group_reduce == "none" else group_mean_max(view.attn)  # [B, H, G or 2, q, T]
            attn = rows[:, :, :, -min(teacher.obs_window, rows.shape[3]):, :]
            attn_sum = rows.sum(dim=3)
        else:
            rows = view.attn.amax(dim=2) if teacher.group_reduce == "max" else view.attn.mean(dim=2)  # [B, H, q, T]
            attn = rows[:, :, -min(teacher.obs_window, rows.shape[2]):, :]
            attn_sum = rows.sum(dim=2)
            attn_sq = (rows * rows).sum(dim=2) if teacher.needs_sq_sum else None
    return LayerView(layer=view.layer, step=view.step, keys=view.keys, values=view.values, positions=view.positions,
                     n_new=view.n_new, attn=attn, attn_sum=attn_sum, attn_sq_sum=attn_sq, keep=keep, state=state,
                     live=view.live)


def label_keep(live: list[int], label_budget: float) -> list[int]:
    """Per row, the label budget's share of its live tokens (at least one)."""
    return [max(1, math.ceil(label_budget * n)) for n in live]


def step_labels(attn: Tensor, values: Tensor, keep: list[int]) -> dict[str, Tensor]:
    """What one step's query gives each label, for every slot.

    Parameters
    ----------
    attn : Tensor
        ``[B, H, G, T]`` the step's query row, per query head of each KV head (0 on padding and dead slots).
    values : Tensor
        ``[B, H, T, D]`` the cached values.
    keep : list of int
        Per row, how many top slots count as re-entering (`label_keep`).

    Returns
    -------
    dict
        ``future_sum``, ``future_max``, ``future_out`` (float32) and ``reenter`` (bool), each ``[B, H, T]``.
    """
    mean, gmax = attn.mean(dim=2), attn.amax(dim=2)
    v = values.float()
    out = attn @ v  # [B, H, G, D] each query head's attention output (before the output projection)
    # the difference itself, not |v|^2 - 2 v.o + |o|^2, which cancels catastrophically where v ~ o (a ~ 1)
    dist = (v[:, :, None, :, :] - out[:, :, :, None, :]).norm(dim=-1)  # [B, H, G, T]
    delta = (attn * dist / (1 - attn).clamp(min=1e-6)).mean(dim=2)
    k = min(max(keep), mean.shape[-1])
    top = torch.zeros_like(mean, dtype=torch.bool)
    counted = torch.arange(k, device=mean.device) < torch.tensor(keep, device=mean.device)[:, None, None]
    top.scatter_(-1, mean.topk(k, dim=-1).indices, counted.expand(*mean.shape[:2], k))
    return {"future_sum": mean, "future_max": gmax, "future_out": delta, "reenter": top}


def new_labels(shape, device) -> dict[str, Tensor]:
    zeros = torch.zeros(shape, dtype=torch.float32, device=device)
    return {"future_sum": zeros, "future_max": zeros.clone(), "future_out": zeros.clone(),
            "reenter": zeros.bool()}


def add_labels(acc: dict[str, Tensor], step: dict[str, Tensor], T: int) -> None:
    """Fold one step's labels of the first ``T`` slots into ``acc`` (in place)."""
    acc["future_sum"] += step["future_sum"][..., :T]
    acc["future_out"] += step["future_out"][..., :T]
    torch.maximum(acc["future_max"], step["future_max"][..., :T], out=acc["future_max"])
    acc["reenter"] |= step["reenter"][..., :T]


def add_labels_by_position(acc: dict[str, Tensor], step: dict[str, Tensor], now: Tensor, then: Tensor) -> None:
    """Fold one step's labels into ``acc`` (in place) where the slots moved since the decision: the tokens at
    ``then [R, H, T]`` (the decision's positions) are found among ``now [R, H, S]`` (the step's; -1 dead or
    padding, live positions ascending). A token no longer held (dropped by a sliding window's age) gets 0."""
    key = now.cummax(dim=-1).values  # non-decreasing: dead slots (-1) take their left neighbour's position
    index = torch.searchsorted(key.contiguous(), then.contiguous()).clamp(max=now.shape[-1] - 1)
    found = (now.gather(-1, index) == then) & (then >= 0)
    at = {k: v.gather(-1, index) for k, v in step.items()}
    acc["future_sum"] += at["future_sum"] * found
    acc["future_out"] += at["future_out"] * found
    torch.maximum(acc["future_max"], at["future_max"] * found, out=acc["future_max"])
    acc["reenter"] |= at["reenter"] & found


class Riders:
    """The feature tracker and the teachers riding on a cache: state under ``f.`` (tracker) and ``t.NAME.``."""

    def __init__(self, n_layers: int, teachers: tuple[str, ...], label_budget: float):
        self.tracker = FeatureTracker(n_layers)
        self.names = tuple(teachers)
        self.teachers = {name: make_policy(name).resolve(TEACHER_BUDGET) for name in teachers}
        self.label_budget = label_budget
        self._views: dict[str, LayerView] = {}
        self._mean_max: Tensor | None = None  # the latest update's group mean and max, for `snapshot`

    def update(self, view: LayerView) -> None:
        """Fold the step's attention (``view.attn [B, H, G, W, T]``, every query row) into every rider's state."""
        st = view.state
        self._mean_max = group_mean_max(view.attn)
        self.tracker.update(self._mean_max, view.positions, view.n_new, view.step, st)
        keep = label_keep(view.live_tokens(), self.label_budget)
        for name, teacher in self.teachers.items():
            prefix = f"t.{name}."
            sub = {k[len(prefix):]: v for k, v in st.items() if k.startswith(prefix)}
            tv = teacher_view(view, teacher, sub, keep)
            teacher.update(tv)
            for k, v in sub.items():
                st[prefix + k] = v
            self._views[name] = tv

    def snapshot(self, view: LayerView, rows: list[int]) -> "Snapshot":
        """Right after `update` of the same view: the `Snapshot` of batch rows ``rows`` (their positions, features
        and each teacher's scores; the recorder adds what else it keeps)."""
        feats = self.tracker.features(self._mean_max, view.keys, view.values, view.positions, view.layer, view.step,
                                      view.state)
        T = view.positions.shape[-1]
        # a teacher whose observation window covers every slot protects them all: no preference (zeros), instead
        # of its score of an empty prefix (only in caches smaller than the window, e.g. tiny test prompts)
        scores = {name: t.score(self._views[name]).float() if t.obs_window < T else view.positions.new_zeros(
            view.positions.shape, dtype=torch.float32) for name, t in self.teachers.items()}
        return Snapshot(view.step, view.layer, rows, take_rows(view.positions, rows), take_rows(feats, rows),
                        {k: take_rows(v, rows) for k, v in scores.items()})


@dataclass
class Decision:
    """One recorded decision of one prompt in one layer: the resident tokens (the cache's padding dropped), per KV
    head. Where heads hold different numbers (the ``head`` and ``global`` allocations), each is padded at the front
    to the fullest one's n: position -1, every other field 0 (`resident`).

    ``positions [H, n]``, ``features [H, n, F]``, ``teachers`` and ``labels``: name -> ``[H, n]``; ``evicts``:
    whether the acting policy evicted at this step; ``budget``: the row's budget (None: full cache); ``values``:
    the tokens' value vectors ``[H, n, D]`` (their content at creation, TRIM-KV's signal), if recorded.
    """

    step: int
    layer: int
    positions: Tensor
    features: Tensor
    teachers: dict[str, Tensor]
    labels: dict[str, Tensor]
    evicts: bool = False
    budget: int | None = None
    values: Tensor | None = None


def resident(x: Tensor, valid: Tensor, fill: float = 0) -> Tensor:
    """``x [H, T, ...]`` at the slots where ``valid [H, T]`` holds, as ``[H, n, ...]`` in slot order, n the most any
    head holds. Heads that hold fewer (under the ``head`` and ``global`` allocations a cache's KV heads differ) are
    padded at the front with ``fill`` (-1 for positions, which marks padding wherever a `Decision` is read)."""
    H, T = valid.shape
    counts = valid.sum(-1)
    n = int(counts.max()) if H else 0
    if bool((counts == n).all()):
        return x[valid].reshape(H, n, *x.shape[2:])
    # a stable sort of the flags puts each head's dead slots first and its resident ones last, both in slot order
    order = torch.sort(valid.to(torch.uint8), dim=-1, stable=True).indices[:, T - n:]
    tail = [1] * (x.dim() - 2)
    out = x.gather(1, order.view(H, n, *tail).expand(H, n, *x.shape[2:]))
    pad = torch.arange(n, device=valid.device)[None, :] < (n - counts)[:, None]
    return out.masked_fill(pad.view(H, n, *tail), fill)


def row_steps(decision_steps, B: int) -> list[frozenset]:
    """Per row, its decision steps (one set for every row, or one per row)."""
    if isinstance(decision_steps, (frozenset, set)):
        return [frozenset(decision_steps)] * B
    steps = [frozenset(s) for s in decision_steps]
    if len(steps) != B:
        raise ValueError(f"{len(steps)} decision-step sets for a batch of {B} rows")
    return steps


def horizon_fits(step: int, horizon: int, new_tokens: int) -> bool:
    """Whether decision ``step`` has ``horizon`` steps of future inside its row's own generation (the last step fed
    is ``new_tokens - 1``: the row's EOS, or its last token, is never fed)."""
    return step + horizon <= new_tokens - 1


@dataclass
class Snapshot:
    """One layer of a batch at a decision step, before any eviction: the candidates of the rows that decide here.

    Only those rows are kept (``rows``, batch indices; the tensors' first dimension R follows them): at length a
    batch row's snapshot of every layer is ~50 MB, and rows decide at different steps, so a whole batch per step
    would hold ~B times the memory (8 rows at ~2,700 tokens: ~35 GB for 8 decisions per row).
    Off-policy (`Recorder`), ``labels`` accumulate online while the full cache decodes on (``seen`` steps so far).
    On-policy (`learnkv.traces.onpolicy.OnPolicyRecorder`), ``keys`` and ``values`` are kept to branch the state
    after the decode, and ``evicts`` says per row whether the acting policy evicted here.
    """

    step: int
    layer: int
    rows: list[int]
    positions: Tensor  # [R, H, T]
    features: Tensor  # [R, H, T, F]
    teachers: dict[str, Tensor]  # name -> [R, H, T]
    values: Tensor | None = None  # [R, H, T, D]
    keys: Tensor | None = None  # [R, H, T, D], on-policy only
    evicts: list[bool] | None = None  # per row of ``rows``, on-policy only
    labels: dict[str, Tensor] = field(default_factory=dict)  # name -> [R, H, T], off-policy only
    seen: int = 0

    def index(self, row: int) -> int:
        """Where batch row ``row`` is in this snapshot's tensors."""
        return self.rows.index(row)

    def decision(self, row: int, labels: dict[str, Tensor] | None = None, record_values: bool = False,
                 **extra) -> Decision:
        """Batch row ``row``'s resident tokens as a `Decision`: ``labels`` already per resident token, or (None)
        this snapshot's own accumulated ``labels``; ``extra`` (``evicts``, ``budget``) passes through."""
        i = self.index(row)
        ok = self.positions[i] >= 0
        if labels is None:
            labels = {k: resident(v[i], ok) for k, v in self.labels.items()}
        values = resident(self.values[i], ok) if record_values and self.values is not None else None
        return Decision(self.step, self.layer, resident(self.positions[i], ok, -1), resident(self.features[i], ok),
                        {k: resident(v[i], ok) for k, v in self.teachers.items()}, labels, values=values, **extra)


def take_rows(x: Tensor, rows: list[int]) -> Tensor:
    """``x``'s batch rows ``rows``, as a copy (a snapshot must not follow the cache as it changes)."""
    return x[rows]  # advanced indexing copies


@dataclass
class Recorder(Policy):
    """Observer policy for off-policy trace collection (never evicts): the full cache decodes.

    Parameters
    ----------
    n_layers : int
        Decoder layers of the model.
    teachers : tuple[str, ...]
        Registered policy names whose scores are recorded.
    decision_steps : frozenset[int] or sequence of them
        Decode steps at which to snapshot, for every row or per row of the batch.
    horizon : int
        H, the label horizon in decode steps.
    label_budget : float
        Share of the cached tokens that defines ``reenter`` and the teachers' ``keep``.
    record_values : bool
        Also record each token's value vector (`Decision.values`).
    """

    name = "recorder"
    evicts = False
    needs_attention = True
    group_reduce = "none"

    n_layers: int = 1
    teachers: tuple[str, ...] = ()
    decision_steps: frozenset | tuple = frozenset()
    horizon: int = 32
    label_budget: float = 0.25
    record_values: bool = False

    def __post_init__(self):
        self.riders = Riders(self.n_layers, self.teachers, self.label_budget)
        self.rows: list[Snapshot] = []  # decisions whose horizon is complete
        self._pending: list[Snapshot] = []

    @property
    def tracker(self) -> FeatureTracker:
        return self.riders.tracker

    def params(self) -> dict:
        return {"teachers": list(self.teachers), "horizon": self.horizon, "label_budget": self.label_budget}

    @property
    def obs_window(self) -> int:
        return 1 << 30  # every query row of the step (the prefill's too): teachers' stats are rebuilt from them

    def update(self, view: LayerView) -> None:
        self.riders.update(view)
        if view.step > 0 and self._pending:
            self._accumulate_labels(view)
        rows = [b for b, steps in enumerate(row_steps(self.decision_steps, view.positions.shape[0]))
                if view.step in steps]
        if rows:
            snap = self.riders.snapshot(view, rows)
            # values go to the shard as float16 anyway (`learnkv.traces.collect`): half the memory, same shard
            snap.values = take_rows(view.values, rows).half() if self.record_values else None
            snap.labels = new_labels(snap.positions.shape, view.keys.device)
            self._pending.append(snap)

    def _accumulate_labels(self, view: LayerView) -> None:
        mine = [p for p in self._pending if p.layer == view.layer and p.step < view.step]
        if not mine:
            return
        labels = step_labels(view.attn[:, :, :, -1, :], view.values,
                             label_keep(view.live_tokens(), self.label_budget))
        for p in mine:
            step = {k: take_rows(v, p.rows) for k, v in labels.items()}
            T = p.positions.shape[-1]
            # one slot appended per step since the decision: nothing compacted, the first T slots are the decision's
            # (the full cache's slots never move; no host sync to tell)
            if view.positions.shape[-1] == T + p.seen + 1:
                add_labels(p.labels, step, T)
            else:  # a sliding layer dropped its oldest tokens since the decision (`BudgetCache._drop_by_age`)
                add_labels_by_position(p.labels, step, take_rows(view.positions, p.rows), p.positions)
            p.seen += 1
            if p.seen >= self.horizon:
                self.rows.append(p)
                self._pending.remove(p)

    def decisions(self, row: int, new_tokens: int) -> list[Decision]:
        """The finished decisions of batch row ``row`` (generated ``new_tokens``), in (step, layer) order."""
        out = []
        for p in sorted(self.rows, key=lambda r: (r.step, r.layer)):
            if row not in p.rows or not horizon_fits(p.step, self.horizon, new_tokens):
                continue
            out.append(p.decision(row, record_values=self.record_values))
        return out
