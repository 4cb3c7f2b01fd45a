"""Learned: evicts by an exported scorer's scores over the online trace features."""

from __future__ import annotations

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
    between). On the CPU torch path, scoring and evicting at every step costs about 1.5x the full cache's decode
    step; every 4-8 steps, 1.1-1.2x (docs/learned-notes.md).

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
        return {"interval": self.interval if self.interval is not None else min(8, max(1, budget // 16))}

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
            feats = tracker.features(view.attn, view.keys, view.values, view.positions, view.layer, view.step,
                                     view.state)  # fmt: skip
        model = model.to(feats.device)
        return model(feats, view.layer, view.values if model.content_dim else None)


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
