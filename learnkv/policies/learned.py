"""Learned: evicts by an exported scorer's scores over the online trace features."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

from learnkv.policies.base import LayerView, Policy


@dataclass
class Learned(Policy):
    """A trained per-layer scorer (`learnkv.scorer`) applied to every cached token each time the cache evicts.

    The same `learnkv.features.FeatureTracker` that produced the training traces runs online here, so the scorer
    sees exactly the features it was trained on. The scorer artifact is checked (format, feature version, weights
    checksum, layer count) when the policy is resolved and on first use.

    Parameters
    ----------
    scorer : str
        Path of an exported scorer directory (`python train.py` prints it as ``artifact: PATH``).
    n_sink, n_recent : int or float
        Protected sinks and recent window, as for every policy.
    """

    name = "learned"
    group_reduce = "none"
    scorer: str | None = None
    n_sink: int | float = 4
    n_recent: int | float = 8

    @property
    def obs_window(self) -> int:
        return 1 << 30  # the tracker seeds its statistics from every prefill query row

    def params(self) -> dict:
        return {"scorer": self.scorer, "n_sink": self.n_sink, "n_recent": self.n_recent}

    def resolve_defaults(self, budget: int) -> dict:
        if not self.scorer:
            raise ValueError("policy 'learned' needs a scorer artifact: --scorer PATH (train one with `python train.py`)")
        if not Path(self.scorer).exists():
            raise ValueError(f"scorer artifact {self.scorer!r} does not exist")
        from learnkv.scorer.artifact import read_artifact_manifest

        read_artifact_manifest(self.scorer)  # refuses a wrong format or feature version now, not mid-decode
        return {}

    def _loaded(self, n_layers_seen: int):
        cached = self.__dict__.get("_loaded_scorer")
        if cached is None:
            from learnkv.features import FeatureTracker
            from learnkv.scorer.artifact import load_scorer

            model, manifest = load_scorer(self.scorer)
            cached = self.__dict__["_loaded_scorer"] = (model, FeatureTracker(manifest["n_layers"]))
        if n_layers_seen >= cached[0].n_layers:
            raise ValueError(f"scorer {self.scorer!r} has {cached[0].n_layers} layers; the model has more")
        return cached

    def update(self, view: LayerView) -> None:
        _, tracker = self._loaded(view.layer)
        tracker.update(view.attn, view.positions, view.n_new, view.step, view.state)

    def score(self, view: LayerView) -> Tensor:
        model, tracker = self._loaded(view.layer)
        feats = tracker.features(view.attn, view.keys, view.values, view.positions, view.layer, view.step, view.state)
        model = model.to(feats.device)
        return model(feats, view.layer)
