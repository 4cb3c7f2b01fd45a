"""Learned: evicts by an exported scorer's scores over the online trace features."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

import kernels
from learnkv.policies.base import LayerView, Policy
from learnkv.fields import setting
from learnkv.pooling import POOLING


@dataclass
class Learned(Policy):
    """A trained per-layer scorer (`learnkv.scorer`) applied to every cached token each time the cache evicts.

    The same `learnkv.features.FeatureTracker` that produced the training traces runs online here, so the scorer
    sees exactly the features it was trained on. The scorer artifact is checked as the serving runtime checks it
    (`learnkv.scorer.artifact`): format, feature version and pooling rule when the policy is resolved; the model's
    name, layer and KV-head counts when `generate` hands it the model (`check_model`); weights checksum, shapes and
    finiteness, and the KV-head count and layer index of what it is shown, on first use.

    Decode-time cost: the feature tracker folds every step's attention into its state (in place, a few tensor ops
    per layer); the features, the scorer and the eviction run only every ``interval`` steps (a lagged schedule, as
    LazyEviction's and R-KV's: the cache evicts down to ``budget - interval + 1`` so it never exceeds the budget in
    between). In a batch, rows fill their budgets at different steps, so some row is due at most steps: the features
    are then computed for the due rows only. Measured on the CPU torch path (bundled SmolLM2, budget 128, interval 8,
    one thread, bench/RESULTS.md "Where a decode step's eviction time goes"): a step costs 1.24x the full cache's at
    batch 1 and 1.41x at batch 16 (1.35x and 2.08x before those changes).

    Parameters
    ----------
    scorer : str
        Path of an exported scorer directory (`python train.py` prints it as ``artifact: PATH``).
    n_sink, n_recent : int or float
        Protected sinks and recent window, as for every policy.
    interval : int or None
        Score and evict every ``interval`` steps. None: a sixteenth of the budget, between 1 and 8.
    """

    name = "learned"
    group_reduce = "none"
    pooling = POOLING  # the rule its exported artifact records: logits compare within a row only, so ranks
    scorer: str | None = setting(None)
    n_sink: int | float = setting(4, ge=0, fraction=True)
    n_recent: int | float = setting(8, ge=0, fraction=True)
    interval: int | None = setting(None, ge=1)

    @property
    def obs_window(self) -> int:
        return 1 << 30  # the tracker seeds its statistics from every prefill query row

    def params(self) -> dict:
        return {"scorer": self.scorer, "n_sink": self.n_sink, "n_recent": self.n_recent, "interval": self.interval}

    def resolve_defaults(self, budget: int) -> dict:
        if not self.scorer:
            raise ValueError("policy 'learned' needs a scorer artifact: --scorer PATH (train one with `python train.py`)")
        if not Path(self.scorer).exists():
            raise ValueError(f"scorer artifact {self.scorer!r} does not exist")
        from learnkv.scorer.artifact import read_artifact_manifest

        read_artifact_manifest(self.scorer)  # refuses a wrong format or feature version now, not mid-decode
        return {}

    def resolve(self, budget: int) -> Policy:
        """As `Policy.resolve`; the default interval is the longest up to a sixteenth of the budget (at most 8)
        whose headroom still leaves the sink and recent windows room, so a budget that fits the windows at every
        step also fits them by default."""
        if self.interval is not None:
            return super().resolve(budget)
        for interval in range(min(8, max(1, budget // 16)), 1, -1):
            try:
                return super(Learned, dataclasses.replace(self, interval=interval)).resolve(budget)
            except ValueError:
                continue
        return super(Learned, dataclasses.replace(self, interval=1)).resolve(budget)

    def check_model(self, model) -> None:
        """Refuse a scorer trained for another model than ``model`` (a loaded HF causal LM): its name (the id or
        folder it was loaded from; unnamed test models skip this), layer count and KV-head count."""
        from learnkv.scorer.artifact import check_binding, read_artifact_manifest

        cfg = model.config
        check_binding(read_artifact_manifest(self.scorer), self.scorer, model=getattr(cfg, "name_or_path", "") or None,
                      n_layers=cfg.num_hidden_layers,
                      n_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)

    def _loaded(self, view: LayerView):
        cached = self.__dict__.get("_loaded_scorer")
        if cached is None:
            from learnkv.features import FeatureTracker
            from learnkv.scorer.artifact import load_scorer

            model, manifest = load_scorer(self.scorer, expect_kv_heads=view.keys.shape[1])
            cached = self.__dict__["_loaded_scorer"] = (model, FeatureTracker(manifest["n_layers"]))
        if view.layer >= cached[0].n_layers:
            raise ValueError(f"scorer {self.scorer!r} has {cached[0].n_layers} layers; the model has more")
        return cached

    def update(self, view: LayerView) -> None:
        _, tracker = self._loaded(view)
        self.__dict__["_fused_features"] = None
        if _fused_step(view):
            # one launch updates the state and computes the features; `score`, which the cache calls right after
            # this update when it evicts, takes them from here (only the latest layer's are kept)
            feats = kernels.decode_features(view.attn, view.keys, view.values, view.positions, view.layer,
                                            tracker.n_layers, view.step, view.state)  # fmt: skip
            self.__dict__["_fused_features"] = (view.layer, view.step, view.positions, feats)
            return
        tracker.update(view.attn, view.positions, view.n_new, view.step, view.state)

    def score(self, view: LayerView) -> Tensor:
        model, tracker = self._loaded(view)
        fused, self.__dict__["_fused_features"] = self.__dict__.get("_fused_features"), None
        if fused is not None and fused[:2] == (view.layer, view.step) and fused[2] is view.positions:
            feats = fused[3]
        else:
            feats = self._features(tracker, view)
        model = model.to(feats.device)
        return model(feats, view.layer, view.values if model.content_dim else None)

    @staticmethod
    def _features(tracker, view: LayerView) -> Tensor:
        """The tracker's features ``[B, H, T, F]``, computed only for the rows that evict now (see `_due_rows`); the
        other rows' are zeros, and they keep every live token whatever their scores. The features are computed within
        a row, so a row's are the same in any batch; the scorer then runs on the whole ``[B, H, T, F]`` tensor, so
        each row's scores are bit for bit those of scoring every row (a matmul's rounding can depend on its row count)."""
        due = _due_rows(view)
        args = (view.attn, view.keys, view.values, view.positions)
        if due is None:
            return tracker.features(*args, view.layer, view.step, view.state)
        idx = torch.tensor(due, device=view.positions.device)
        sub = tracker.features(*(t[idx] for t in args), view.layer, view.step, {n: t[idx] for n, t in view.state.items()})
        return sub.new_zeros(*view.positions.shape, sub.shape[-1]).index_copy_(0, idx, sub)


def _due_rows(view: LayerView) -> list[int] | None:
    """The rows that evict in this step (they keep fewer than their live tokens), or None if every row does.

    With one decode batch, rows fill their budgets at different steps (different prompt lengths), so a lagged
    schedule's decisions fall on different steps: at batch 16 and an interval of 8, some row evicts at nearly every
    step, and scoring every row then would cost the features of the whole batch at every step."""
    if view.positions.shape[0] == 1:
        return None
    keep, live = view.keep_rows(), view.live_tokens()
    due = [b for b, (k, n) in enumerate(zip(keep, live)) if k < n]
    return None if len(due) == len(keep) else due


def _fused_step(view: LayerView) -> bool:
    """A decode step (one new fp32 query row, state from the prefill) on the kernel path: `kernels.decode_features`.
    The prefill and multi-token steps stay on the torch tracker, as does everything on the torch path."""
    attn = view.attn
    return (
        view.step >= 1
        and view.n_new == 1
        and attn is not None
        and attn.ndim == 5
        and attn.shape[3] == 1
        and attn.dtype == torch.float32
        and "f.acc" in view.state
        and kernels.use_triton(attn, view.keys, view.values, view.positions)
    )
