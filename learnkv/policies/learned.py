"""Learned: evicts by an exported scorer's scores over the online trace features."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from learnkv import kernels
from learnkv.features import NORMS, SPARE_ROWS, FeatureTracker, fill_unknown, stacked
from learnkv.fields import setting
from learnkv.policies.base import LayerView, Policy
from learnkv.pooling import POOLING
from learnkv.scorer.artifact import (cached_kv_heads, check_binding, load_scorer, read_artifact_manifest,
                                     trained_allocation)
from learnkv.scorer.model import Scorer


#: the slots (rows x KV heads x slots) a refresh of stacked layers reads out features for at once, a few layers'
#: worth at batch 8 and 1k slots: each op then runs on both threads (torch splits an elementwise op from 32,768
#: elements; one layer's 19k ran on one) while its columns stay in cache (every layer at once, 30x that, ran slower
#: than one by one). bench/RESULTS.md, "The learned refresh, a few layers at a time"
READ_OUT_SLOTS = 1 << 17

#: the scorer's content term of each token (`Scorer.content_term`: its value vector against the layer's content
#: weights, a constant per token), per-token state of a scorer with content features on a CPU: NaN until the first
#: score that sees the token computes it (`cached_content`)
CONTENT = "s.content"


@dataclass
class Decoding:
    """What the learned policy holds while it decodes, besides its per-token state (which the cache keeps in
    ``view.state``): built at its first update, for the copy `Policy.resolve` made for one decode.

    Attributes
    ----------
    scorer : Scorer
        The loaded artifact's per-layer MLP.
    tracker : FeatureTracker
        The online feature tracker (the same that produced the training traces).
    fused : tuple or None
        ``(layer, step, positions, features)`` of the latest fused update on the kernel path, for the `score`
        that follows it at the same layer and step.
    """

    scorer: Scorer
    tracker: FeatureTracker
    fused: tuple[int, int, Tensor, Tensor] | None = None

    def scorer_on(self, device: torch.device) -> Scorer:
        """The scorer, moved to ``device`` if it is not there (`Module.to` walks every parameter: once, not at
        every layer's score)."""
        if self.scorer.w1.device != device:
            self.scorer.to(device)
        return self.scorer


@dataclass
class Learned(Policy):
    """A trained per-layer scorer (`learnkv.scorer`) applied to every cached token, evicting the lowest-scored.

    The same `learnkv.features.FeatureTracker` that produced the training traces runs online here, so the scorer
    sees exactly the features it was trained on. The scorer artifact is checked as the serving runtime checks it
    (`learnkv.scorer.artifact`): format, feature version and pooling rule when the policy is resolved; the model's
    name, layer and KV-head counts when `generate` hands it the model (`check_model`); weights checksum, shapes and
    finiteness, and the KV-head count and layer index of what it is shown, on first use.

    Decode-time cost and schedule: the feature tracker folds every step's attention into its state (in place, a
    few tensor ops per layer); each token's key and value norms are state too, computed once, at the first refresh
    that sees the token (`FeatureTracker`, ``cache_norms``). The features and the scorer run only every ``refresh`` steps; their scores are kept
    as per-token state (compacted with the cache), and every step that overflows evicts by the latest scores, so
    the cache stays at its full budget. Tokens that arrived since the last refresh have no score yet and are kept.
    This is not the lagged schedule (``interval > 1``, as LazyEviction's and R-KV's: evict every ``interval``
    steps down to ``budget - interval + 1``), which gives up ``(interval - 1) / 2`` slots on average: on
    validation prompts (SmolLM2, 50% of the final length, n = 8) it cost the learned policy a third more KL than
    evicting every step (bench/RESULTS.md, "The learned policy: schedule, label, traces"). The cache runs that
    schedule (`Policy.refresh`): it scores at each refresh (a few layers' features at once on a stacked step,
    `score_layers`, then each layer's scorer) and evicts by the kept scores in between, for every layer of a decode step at once on the CPU torch path (one tracker update and one selection
    for the whole model; `BudgetCache`, "Batching"). There (budget 128, two threads, ``slack=16``, bench/RESULTS.md
    "Stacked layers") a step costs 1.15x the full cache's at batch 1 and 1.14x at batch 16; with ``slack=0`` a
    compaction of every layer at every step comes on top.

    Compared across heads and layers (``allocation=head|global``) its scores are ``logit``
    (`learnkv.allocation.normalisation_for`: a softmax per head, what its listwise loss fits), or ``raw`` for a scorer
    trained for ``global`` (one scale throughout).

    Parameters
    ----------
    scorer : str
        Path of an exported scorer directory (`python train.py` prints it as ``artifact: PATH``).
    n_sink, n_recent : int or float
        Protected sinks and recent window, as for every policy.
    refresh : int
        Recompute the features and scores every ``refresh`` steps (1: at every eviction). The default, 8, leaves
        the tokens without a score inside the default recent window, which is kept anyway.
    interval : int
        The lagged schedule of every policy (see above); 1 by default.
    """

    name = "learned"
    group_reduce = "mean+max"  # what the feature tracker reads; the fused decode attention hands it too
    rowwise = True  # the tracker's state and the features are per row, the scorer per token
    reads_layer = True  # each layer's scorer; the features' key and value columns
    pooling = POOLING  # the rule its exported artifact records: logits compare within a row only, so ranks
    scorer: str | None = setting(None)
    n_sink: int | float = setting(4, ge=0, fraction=True)
    n_recent: int | float = setting(8, ge=0, fraction=True)
    refresh: int = setting(8, ge=1)
    #: built at the first update (`Decoding`); not a parameter, and a fresh copy (`resolve`) starts without it
    decoding: Decoding | None = field(default=None, init=False, repr=False, compare=False)
    #: `normalisation`, read once from the artifact's manifest (the cache asks at every eviction of every layer)
    _normalisation: str | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def obs_window(self) -> int:
        return 1 << 30  # the tracker seeds its statistics from every prefill query row

    @property
    def normalisation(self) -> str:
        """How its scores compare across heads and layers (`learnkv.allocation.normalisation_for`), from the
        artifact: ``raw`` for a scorer trained with the global objective (allocation ``global`` in its manifest:
        one scale over every layer and KV head), else ``logit`` (a softmax per head, what its ListNet loss fits)."""
        if not self.scorer:
            return "logit"
        if self._normalisation is None:
            trained = trained_allocation(read_artifact_manifest(self.scorer))
            self._normalisation = "raw" if trained == "global" else "logit"
        return self._normalisation

    def params(self) -> dict:
        return {"scorer": self.scorer, "n_sink": self.n_sink, "n_recent": self.n_recent, "refresh": self.refresh,
                "interval": self.interval}

    def resolve_defaults(self, budget: int) -> dict:
        if not self.scorer:
            raise ValueError("policy 'learned' needs a scorer artifact: --scorer PATH (train one with `python train.py`)")
        if not Path(self.scorer).exists():
            raise ValueError(f"scorer artifact {self.scorer!r} does not exist")

        read_artifact_manifest(self.scorer)  # refuses a wrong format or feature version now, not mid-decode
        return {}

    def check_model(self, model) -> None:
        """Refuse a scorer trained for another model than ``model`` (a loaded HF causal LM): its name (the id or
        folder it was loaded from; unnamed test models skip this), layer count and KV-head count."""
        cfg = model.config
        check_binding(read_artifact_manifest(self.scorer), self.scorer, model=getattr(cfg, "name_or_path", "") or None,
                      n_layers=cfg.num_hidden_layers, n_kv_heads=cached_kv_heads(cfg))

    def _loaded(self, view: LayerView) -> Decoding:
        if self.decoding is None:
            model, manifest = load_scorer(self.scorer, expect_kv_heads=view.positions.shape[1])
            # the key and value norms computed once per token, at its first read-out, and the window among spare
            # rows, one row written per decode step (`FeatureTracker`; the Triton kernel keeps the same layout)
            tracker = FeatureTracker(manifest["n_layers"], cache_norms=True, spare_rows=SPARE_ROWS)
            self.decoding = Decoding(model, tracker)
        if view.layer >= self.decoding.scorer.n_layers:
            raise ValueError(f"scorer {self.scorer!r} has {self.decoding.scorer.n_layers} layers; the model has more")
        return self.decoding

    def update(self, view: LayerView) -> None:
        run = self._loaded(view)
        run.fused = None
        if run.scorer.content_dim and view.positions.device.type == "cpu":
            mark_new_content(view)
        if _fused_step(view):
            # one launch updates the state and, where the cache scores this view next (it evicts or refreshes),
            # computes the features; `score`, called right after, takes them from here (only the latest layer's are
            # kept). At the other steps (7 of 8 at refresh 8) the launch updates the state only.
            feats = kernels.decode_features(view.attn, view.keys, view.values, view.positions, view.layer,
                                            run.tracker.n_layers, view.step, view.state, run.tracker.spare_rows,
                                            read_out=view.scored)  # fmt: skip
            if feats is not None:
                run.fused = (view.layer, view.step, view.positions, feats)
        else:
            run.tracker.update(view.attn, view.positions, view.n_new, view.step, view.state)

    def score(self, view: LayerView) -> Tensor:
        # at a refresh (``refresh > 1``) every row is scored, for the evictions until the next; else only the rows
        # that evict now
        return self._scores(view, self._fused(view), due_rows_only=self.refresh == 1)

    def score_layers(self, view: LayerView, views: Sequence[LayerView]) -> Tensor:
        """A refresh of every layer of a stacked decode step (the CPU torch path): the features of a few layers' rows
        read out at once (`READ_OUT_SLOTS`), then each layer's scorer on its own rows. Each feature is computed
        within a row and the scorer sees each layer's features in the same layout, so the scores are bit for bit
        those of one read-out per layer (tests/test_fast_paths.py); an eviction step's scores (``refresh`` 1, the
        rows due only) stay layer by layer."""
        if self.refresh == 1 or NORMS[0] not in view.state or kernels.use_triton(view.positions):
            return super().score_layers(view, views)
        run = self._loaded(views[-1])
        B, H, T = views[0].positions.shape
        per_read_out = max(1, READ_OUT_SLOTS // (B * H * T))
        scores = []
        model = run.scorer_on(view.positions.device)
        rows_of = lambda x, i: None if x is None else x[i * B : (i + 1) * B]  # noqa: E731 - layer i's rows
        for start in range(0, len(views), per_read_out):
            part = views[start : start + per_read_out]
            rows = view.of_layers(start, start + len(part))
            # the layers' unknown norms and content terms, one search and one fill for them all, into the state the
            # stacked rows share
            run.tracker.fill_norms([v.keys for v in part], [v.values for v in part], rows.state)
            content = cached_content(rows.state, part, model) if model.content_dim else None
            feats = run.tracker.features(rows.attn, None, None, rows.positions, rows.layers, rows.step, rows.state,
                                         feature_major=True)
            scores += [self._scored(v, rows_of(feats, i), rows_of(content, i)) for i, v in enumerate(part)]
        return torch.cat(scores)

    def _fused(self, view: LayerView) -> Tensor | None:
        """The features `update` computed in its fused launch for this very layer, step and cache, if any."""
        run = self._loaded(view)
        fused, run.fused = run.fused, None
        if fused is not None and fused[:2] == (view.layer, view.step) and fused[2] is view.positions:
            return fused[3]
        return None

    def _scores(self, view: LayerView, feats: Tensor | None, due_rows_only: bool = False) -> Tensor:
        """The scorer's ``[B, H, T]`` scores; with ``due_rows_only`` (scoring at an eviction), the features are
        computed for the rows that evict now only (`_features`)."""
        if feats is None:
            feats = self._features(self._loaded(view).tracker, view, _due_rows(view) if due_rows_only else None)
        return self._scored(view, feats)

    def _scored(self, view: LayerView, feats: Tensor, content: Tensor | None = None) -> Tensor:
        """The scorer's scores of one layer's view from its features ``[B, H, T, F]`` (this call's own: they are
        standardised in place) and, for a scorer with content features, its rows' content terms (``content``: from
        `cached_content`, else read here)."""
        model = self._loaded(view).scorer_on(feats.device)
        if model.content_dim and content is None:
            content = cached_content(view.state, [view], model)
        return model(feats, view.layer, view.values if model.content_dim else None, content=content, consume=True)

    @staticmethod
    def _features(tracker, view: LayerView, due: list[int] | None) -> Tensor:
        """The tracker's features ``[B, H, T, F]``, for the rows ``due`` only if given (the other rows' are zeros:
        they keep every live token whatever their scores). The features are computed within a row, so a row's are
        the same in any batch; the scorer then runs on the whole ``[B, H, T, F]`` tensor, so each row's scores are
        bit for bit those of scoring every row (a matmul's rounding can depend on its row count)."""
        if due is not None and NORMS[0] in view.state:
            tracker.fill_norms(view.keys, view.values, view.state)  # into the cache's state, not a copy of its rows
        v = view if due is None else view.select_rows(due)
        # feature by feature on the torch path (the columns written whole; the scorer's matmul reads either layout
        # with the same bits); the kernel path's scorer reads the fused launch's token-major rows, one layout for
        # one compile
        major = not kernels.use_triton(v.positions)
        feats = tracker.features(v.attn, v.keys, v.values, v.positions, v.layer, v.step, v.state, feature_major=major)
        if due is None:
            return feats
        idx = torch.tensor(due, device=feats.device)
        F = feats.shape[-1]
        # in the read-out's layout
        every_row = (feats.new_zeros(F, *view.positions.shape).permute(1, 2, 3, 0) if major
                     else feats.new_zeros(*view.positions.shape, F))
        return every_row.index_copy_(0, idx, feats)


def mark_new_content(view: LayerView) -> None:
    """`CONTENT` of the step's new slots (the last ``n_new``; every slot where the state starts) marked unknown."""
    if CONTENT not in view.state:
        view.state[CONTENT] = torch.full(view.positions.shape, float("nan"), device=view.positions.device)
    else:
        view.state[CONTENT][..., -view.n_new :] = float("nan")


def cached_content(state: dict[str, Tensor], views: Sequence[LayerView], model: Scorer) -> Tensor | None:
    """The content term of every slot of ``state``'s rows, from `CONTENT` (the unknown ones computed from the
    values first, in place: a token's once, at its first score; its value vector never changes), or None where the
    policy keeps none (not on a CPU: the scorer computes it from the values, with no host read of what is unknown).
    ``views`` are the layers whose rows ``state`` holds, layer-major (one layer's view and its own state, or the
    layers of a stacked refresh: one search and one fill serve them all). The same values as the scorer's own
    `Scorer.content_term` of every slot (tests/test_refresh.py)."""
    cached = state.get(CONTENT)
    if cached is None:
        return None
    return fill_unknown(cached, torch.isnan,
                        lambda first: stacked([model.content_term(v.values[..., first:, :], v.layer) for v in views]))


def _due_rows(view: LayerView) -> list[int] | None:
    """The rows that evict in this step (they keep fewer than their live tokens), or None if every row does: rows
    of a batch fill their budgets at different steps (different prompt lengths), so scoring at every eviction would
    otherwise cost the whole batch's features at nearly every step."""
    if view.positions.shape[0] == 1:
        return None
    due = view.due_rows()
    return None if len(due) == view.positions.shape[0] else due


def _fused_step(view: LayerView) -> bool:
    """A decode step (one new fp32 query row, state from the prefill) on the kernel path: `kernels.decode_features`.
    The prefill and multi-token steps stay on the torch tracker, as does everything on the torch path."""
    attn = view.attn
    return (
        view.keys is not None  # a view of one layer (the cache batches layers only on the torch path)
        and view.step >= 1
        and view.n_new == 1
        and attn is not None
        and attn.ndim == 5
        and attn.shape[3] == 1
        and attn.dtype == torch.float32
        and "f.acc" in view.state
        and kernels.use_triton(attn, view.keys, view.values, view.positions)
    )
