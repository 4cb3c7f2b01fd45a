"""The per-token feature list, written once: trace collection, the scorer, its export and serving read it here.

Every feature is computable online at decode time from what the cache already holds: the attention the token
received so far, its key and value, and its position. `FeatureTracker` keeps the running statistics as per-token
state (token axis last, so the cache pads and compacts it like any policy state) and `FeatureTracker.features`
turns them into a ``[B, H, T, F]`` tensor in the order of `FEATURES`.

Attention values scale like 1/T, so attention features are expressed relative to uniform attention over the
visible tokens (``a * n_visible``) and log-compressed; counts and step gaps are log1p-compressed. Change anything
here and bump `FEATURE_VERSION`: traces and exported scorers of another version are refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from learnkv.sliding_rows import appended, in_rows, push_row, window_view

FEATURE_VERSION = 1

FEATURES: tuple[str, ...] = (
    "attn",  # attention from the current query, group mean (log1p of relative-to-uniform)
    "attn_gmax",  # same, max over the query heads of the group
    "acc_sum",  # attention accumulated over every query that saw the token (H2O), log1p
    "acc_mean",  # accumulated / observations (RoCo's mean), relative-to-uniform, log1p
    "acc_std",  # std of the attention received (RoCo's robustness), relative-to-uniform, log1p
    "win_mean",  # mean over the last WINDOW steps, relative-to-uniform, log1p
    "win_max",  # max over the last WINDOW steps, relative-to-uniform, log1p
    "win_std",  # std over the last WINDOW steps, relative-to-uniform, log1p
    "since_high",  # steps since the token last got above-uniform attention, log1p
    "n_returns",  # times it came back to high attention after a gap (LazyEviction recurrence), log1p
    "mean_interval",  # mean recurrence interval, log1p
    "last_interval",  # last recurrence interval, log1p
    "max_interval",  # maximum recurrence interval (LazyEviction's MRI), log1p
    "key_norm",
    "value_norm",
    "age",  # tokens since this one, log1p
    "rel_pos",  # position / current position
    "is_sink",  # one of the first SINKS positions
    "layer",  # layer index / (layers - 1)
)
N_FEATURES = len(FEATURES)
WINDOW = 16
#: the learned policy's tracker keeps its window among WINDOW + SPARE_ROWS rows (`FeatureTracker.spare_rows`)
SPARE_ROWS = 8
SINKS = 4
#: the names of the tracker's per-token state tensors (what `FeatureTracker.update` keeps; the Triton kernel
#: `kernels.features` updates the same ones)
STATE = ("f.acc", "f.acc_sq", "f.count", "f.win", "f.last_high", "f.n_returns", "f.sum_interval", "f.last_interval", "f.max_interval")
#: the per-token constants a tracker with ``cache_norms`` keeps besides `STATE`: each token's key and value norm,
#: computed once, at the first read-out after the token entered the cache (a token's key and value never change);
#: -1 marks a slot whose norm is not known yet (the update marks its new slots so; it is not shown the keys: the
#: cache's stacked decode step has no one layer's keys)
NORMS = ("f.key_norm", "f.value_norm")
#: the attention the tracker reads: per KV head, the group mean and the group max over its query heads, on axis 2
#: of ``[B, H, 2, q, T]`` in this order (a policy's ``group_reduce = "mean+max"``; `group_mean_max` of the
#: unreduced attention)
MEAN, MAX = 0, 1


def group_mean_max(attn: Tensor, dim: int = 2) -> Tensor:
    """The unreduced attention ``[..., G, ...]`` (the query heads of each KV head on axis ``dim``) -> its group mean
    and group max on that axis (size 2, `MEAN` then `MAX`): all the tracker reads of it. The same ops the tracker
    ran on the unreduced rows, so the features are bit for bit what they were."""
    return torch.stack((attn.mean(dim=dim), attn.amax(dim=dim)), dim=dim)


@dataclass
class FeatureTracker:
    """Online per-token statistics for `FEATURES`.

    ``update`` takes the step's group-reduced attention (``attn [B, H, 2, q, T]``, the group mean and max of all
    the step's query rows: `MEAN`, `MAX`, from a policy with ``group_reduce = "mean+max"`` or `group_mean_max` of
    the unreduced rows) and a state dict; ``features`` reads them out. Prefill seeds the
    accumulated statistics; recurrence statistics start at the first decode step (as LazyEviction's do).

    With ``cache_norms`` the key and value norms are per-token state too (`NORMS`): ``update`` marks the new
    tokens' norms unknown, and ``features`` reads them, computing the unknown ones first (`fill_norms`: once per
    token, the newest few slots at a refresh), so the state is the same whether the cache runs the update layer by
    layer or for every layer at once (tests/test_cache_layout.py). The cache moves them with the slots like any state (compaction,
    padding, dead slots), so the features are bit for bit those computed from the keys at every refresh
    (tests/test_refresh.py). Without it (trace recording, the serving runtime, which keeps its own norms) the state
    is `STATE` only and ``features`` computes the norms from the keys it is given.
    """

    n_layers: int
    cache_norms: bool = False
    #: the window's ``WINDOW`` rows kept among ``WINDOW + spare_rows`` (`learnkv.sliding_rows`: a decode step writes
    #: one row instead of moving ``WINDOW``; the learned policy's, and the Triton kernel takes either layout); 0,
    #: its rows in order, is what trace recording and the serving runtime hold
    spare_rows: int = 0

    def update(self, attn: Tensor, positions: Tensor, n_new: int, step: int, state: dict[str, Tensor]) -> None:
        """Fold the step's group mean and max ``attn [B, H, 2, q, T]`` into ``state`` (with ``cache_norms``, the new
        slots' norms marked unknown: `NORMS`).

        A decode step (one new token, state already seeded) updates the state tensors in place, so a cache that
        preallocates them (`learnkv.cache.BudgetLayer`) never copies them; other steps rebind the entries."""
        _check_mean_max(attn)
        if self.cache_norms:
            self._mark_new_norms(positions, n_new, state)
        if "f.acc" in state and n_new == 1:
            self._update_decode(attn, positions, step, state, self.spare_rows)
            return
        mean_rows = attn[:, :, MEAN]  # [B, H, q, T]
        if "f.acc" not in state:
            zeros = torch.zeros(positions.shape, dtype=torch.float32, device=positions.device)
            for name in STATE:
                state[name] = zeros.clone()
            state["f.win"] = zeros[:, :, None, :].repeat(1, 1, WINDOW, 1)
        q_pos = positions[..., -n_new:]
        seen = (q_pos[..., None, :] >= positions[..., :, None]) & (q_pos[..., None, :] >= 0) & (positions[..., :, None] >= 0)
        state["f.acc"] = state["f.acc"] + mean_rows.sum(dim=2)
        state["f.acc_sq"] = state["f.acc_sq"] + (mean_rows * mean_rows).sum(dim=2)
        state["f.count"] = state["f.count"] + seen.sum(-1)
        state["f.win"] = appended(state["f.win"], mean_rows, WINDOW, self.spare_rows, step)
        if step == 0:
            return
        # recurrence: "high" = above-uniform attention over the visible tokens, from any head of the group
        n_visible = (positions >= 0).sum(-1, keepdim=True).clamp(min=1)
        high = attn[:, :, MAX, -1, :] * n_visible >= 1.0
        last = state["f.last_high"].clone()
        last[..., -n_new:] = step - 1  # a new token counts as seen the step before it arrived
        gap = step - last
        returns = high & (gap >= 2)  # came back after at least one low step
        state["f.n_returns"] = state["f.n_returns"] + returns
        state["f.sum_interval"] = state["f.sum_interval"] + torch.where(returns, gap, torch.zeros_like(gap))
        state["f.last_interval"] = torch.where(returns, gap, state["f.last_interval"])
        state["f.max_interval"] = torch.maximum(state["f.max_interval"], torch.where(high, gap, torch.zeros_like(gap)))
        state["f.last_high"] = torch.where(high, torch.full_like(last, float(step)), last)

    @staticmethod
    def _mark_new_norms(positions: Tensor, n_new: int, state: dict[str, Tensor]) -> None:
        """`NORMS` of the new tokens (the last ``n_new`` slots, where the cache appends; every slot when the state
        starts here) marked unknown (-1), in place."""
        if "f.acc" not in state or NORMS[0] not in state:  # the state starts: every slot is new
            for name in NORMS:
                state[name] = torch.full(positions.shape, -1.0, dtype=torch.float32, device=positions.device)
            return
        for name in NORMS:
            state[name][..., -n_new:] = -1.0

    def fill_norms(self, keys: Tensor | Sequence[Tensor], values: Tensor | Sequence[Tensor],
                   state: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """The cached key and value norms ``[B, H, T]`` (`NORMS`), those still unknown computed from ``keys`` and
        ``values`` and written into ``state`` in place (they are the newest slots: from the first column holding one
        to the end). ``keys`` and ``values`` may be those of several layers whose rows ``state`` stacks layer-major,
        one tensor a layer: one search for the unknown slots and one fill serve them all (`fill_unknown_norms`)."""
        return fill_unknown_norms(state[NORMS[0]], keys), fill_unknown_norms(state[NORMS[1]], values)

    @staticmethod
    def _update_decode(attn: Tensor, positions: Tensor, step: int, state: dict[str, Tensor], spare: int = 0) -> None:
        """`update` for one decode step, in place, in as few tensor ops as the arithmetic allows (on CPU every op
        costs a dispatch): the same values as the general path (``spare``: `spare_rows`).

        Its masks are float 0/1 (comparisons in place, ``ge_``), never bool: on this CPU a comparison into a bool
        tensor, a bool operand's conversion and a ``where`` or ``masked_fill_`` under a bool mask each took 3-15x a
        float op's time (bench/RESULTS.md, "The tracker's update without bool masks"). ``where(mask, a, b)`` becomes
        ``b + mask * (a - b)``, exact here because the recurrence state holds whole numbers of steps, zero or
        more and below 2**24 (steps, gaps, counts; new slots start at zero): every difference is exact, ``b + (a -
        b)`` is ``a`` and ``b + 0 * (a - b)`` is ``b`` (never -0.0), so each value is bit for bit the select's
        (tests/test_fast_paths.py keeps the code before)."""
        valid = live_mask(positions)
        m = attn[:, :, MEAN, -1, :]  # [B, H, T]
        state["f.acc"].add_(m)
        state["f.acc_sq"].addcmul_(m, m)
        state["f.count"].addcmul_(valid, valid[..., -1:])  # the query is the newest slot: it sees every live one
        win = state["f.win"] = in_rows(state["f.win"], WINDOW, spare, step - 1)
        push_row(win, m, WINDOW, spare, step)  # without spare rows, the in-place shift row by row (no temporary copy)
        if step == 0:
            return
        n_visible = valid.sum(-1, keepdim=True).clamp_(min=1)  # whole numbers, as the count of live slots
        high = torch.mul(attn[:, :, MAX, -1, :], n_visible).ge_(1.0)
        last = state["f.last_high"]
        last[..., -1] = step - 1  # a new token counts as seen the step before it arrived
        gap = step - last
        gap_high = gap * high  # the gap where high, else 0
        torch.maximum(state["f.max_interval"], gap_high, out=state["f.max_interval"])
        returns = gap_high.ge_(2)  # came back to high after at least one low step
        state["f.n_returns"].add_(returns)
        state["f.sum_interval"].addcmul_(gap, returns)
        last_interval = state["f.last_interval"]
        last_interval.addcmul_(returns, gap - last_interval)  # gap where it returns
        last.addcmul_(high, gap)  # step where high: last + (step - last)

    def features(self, attn: Tensor, keys: Tensor | None, values: Tensor | None, positions: Tensor,
                 layer: int | Sequence[int], step: int, state: dict[str, Tensor], feature_major: bool = False) -> Tensor:
        """``[B, H, T, F]`` float32 features of every cached token, in `FEATURES` order (``attn [B, H, 2, q, T]``:
        the group mean and max, as `update`'s); zeros at the dead slots (padding, evicted).

        ``layer`` is the rows' layer, or the layers of rows stacked layer-major along the batch axis (as many rows
        each): every feature is computed within a row, so a layer's rows read out with others' are bit for bit their
        own (tests/test_fast_paths.py). ``keys`` and ``values`` may be None where the state holds every slot's norms
        (`NORMS`, filled by `fill_norms`).

        With ``feature_major`` they are laid out feature by feature: the ``[B, H, T, F]`` view of an ``[F, B, H, T]``
        tensor, the same values. Each column is then written whole where the token-major layout interleaves them
        (the learned policy's refresh: its scorer's matmul reads either layout, with the same scores bit for bit,
        tests/test_fast_paths.py)."""
        _check_mean_max(attn)
        n = (positions >= 0).sum(-1, keepdim=True).clamp(min=1).float()  # visible tokens per (b, h)
        current = positions.max(dim=-1, keepdim=True).values.clamp(min=1).float()
        count = state["f.count"].clamp(min=1)
        mean = state["f.acc"] / count
        std = (state["f.acc_sq"] / count - mean * mean).clamp(min=0).sqrt()
        n_win = min(WINDOW, step + 1)
        recent = window_view(state["f.win"], WINDOW, self.spare_rows, step)[:, :, -n_win:, :]
        n_ret = state["f.n_returns"]
        if NORMS[0] in state and keys is None:
            key_norm, value_norm = state[NORMS[0]], state[NORMS[1]]  # filled by the caller
        elif NORMS[0] in state:
            key_norm, value_norm = self.fill_norms(keys, values, state)
        else:
            key_norm, value_norm = token_norms(keys), token_norms(values)
        rel = lambda x: torch.log1p(x * n)  # noqa: E731 - relative to uniform, compressed
        cols = {
            "attn": rel(attn[:, :, MEAN, -1, :]),
            "attn_gmax": rel(attn[:, :, MAX, -1, :]),
            "acc_sum": torch.log1p(state["f.acc"]),
            "acc_mean": rel(mean),
            "acc_std": rel(std),
            "win_mean": rel(recent.mean(dim=2)),
            "win_max": rel(recent.amax(dim=2)),
            "win_std": rel(window_std(recent)),
            "since_high": torch.log1p((step - state["f.last_high"]).clamp(min=0)),
            "n_returns": torch.log1p(n_ret),
            "mean_interval": torch.log1p(state["f.sum_interval"] / n_ret.clamp(min=1)),
            "last_interval": torch.log1p(state["f.last_interval"]),
            "max_interval": torch.log1p(state["f.max_interval"]),
            "key_norm": key_norm,
            "value_norm": value_norm,
            "age": torch.log1p((current - positions).clamp(min=0).float()),
            "rel_pos": positions.float() / current,
            "is_sink": ((positions >= 0) & (positions < SINKS)).float(),
            "layer": self._layer_column(layer, positions),
        }
        out = torch.stack([cols[name].float() for name in FEATURES], dim=0 if feature_major else -1)
        columns = out.view(len(FEATURES), -1) if feature_major else out.view(-1, len(FEATURES)).t()
        zero_dead_slots(columns, positions, by_index=out.device.type == "cpu")
        return out.permute(*range(1, out.ndim), 0) if feature_major else out


    def _layer_column(self, layer: int | Sequence[int], positions: Tensor) -> Tensor:
        """The ``layer`` feature ``[B, H, T]``: each row's layer / (layers - 1), for one layer or for the layers of
        rows stacked layer-major (the same float32 roundings of the same quotients)."""
        scale = max(self.n_layers - 1, 1)
        if isinstance(layer, int):
            return torch.full(positions.shape, layer / scale, dtype=torch.float32, device=positions.device)
        rows = torch.tensor([i / scale for i in layer], dtype=torch.float32, device=positions.device)
        return rows.repeat_interleave(positions.shape[0] // len(layer))[:, None, None].expand(positions.shape)


def zero_dead_slots(columns: Tensor, positions: Tensor, by_index: bool) -> None:
    """Zero, in place, the features of the dead slots (position < 0: padding, evicted) in ``columns [F, N]``, a
    view of features whose N slots run in ``positions``' order; ``by_index`` or by a mask, the same values. By index
    on a CPU: a few slots a row are dead (a cache's slack, a prompt's padding), and the mask over every feature of
    every slot cost ~7x as much (1,290 slots x 48 rows, bench/RESULTS.md); by the mask elsewhere (the index would
    cost a GPU a sync)."""
    dead = (positions < 0).flatten()
    if by_index:
        columns.index_fill_(1, dead.nonzero().squeeze(1), 0.0)
    else:
        columns.masked_fill_(dead, 0.0)


def live_mask(positions: Tensor) -> Tensor:
    """1.0 at the live slots (position >= 0), 0.0 at the dead, as float32: a comparison in place on a float copy,
    which on a CPU costs a third of one into a bool tensor (bench/RESULTS.md, "The tracker's update without bool
    masks"). Positions are exact in float32 below 2**24."""
    return torch.empty(positions.shape, dtype=torch.float32, device=positions.device).copy_(positions).ge_(0)


def _check_mean_max(attn: Tensor) -> None:
    if attn.ndim != 5 or attn.shape[2] != 2:
        raise ValueError(f"the feature tracker reads the group mean and max, attn [B, H, 2, q, T] (`group_mean_max`), "
                         f"got {tuple(attn.shape)}")


def token_norms(x: Tensor) -> Tensor:
    """``x [..., T, D]`` -> ``[..., T]``: each token's fp32 L2 norm (the ``key_norm`` and ``value_norm`` features).

    Upcast inside the reduction, not by an fp32 copy of ``x``: bf16 keys are read once (2 bytes an element, where
    the copy wrote and read 8 more; key norm's GPU score reads every key at every step), the same values as
    ``x.float().norm(dim=-1)`` bit for bit (tests/test_fast_paths.py)."""
    return torch.linalg.vector_norm(x, dim=-1, dtype=torch.float32)


def fill_unknown_norms(cached: Tensor, x: Tensor | Sequence[Tensor]) -> Tensor:
    """``cached [..., T]``, norms of ``x [..., T, D]``'s tokens cached as per-token state, -1 where still unknown
    (the newest slots, where the cache appends): those computed from ``x`` from the first column holding one to the
    end, written in place; returns ``cached``. A token's norm is the same computed alone or with others (one row's
    reduction), so the filled state equals `token_norms` of every token. ``x`` may be a sequence, the tokens of the
    blocks of rows that ``cached`` stacks along its first axis (one tensor per block: a layer's keys)."""
    blocks = [x] if isinstance(x, Tensor) else x
    return fill_unknown(cached, lambda t: t < 0,
                        lambda first: stacked([token_norms(b[..., first:, :]) for b in blocks]))


def stacked(blocks: Sequence[Tensor]) -> Tensor:
    """``blocks`` concatenated along the first axis; a lone block itself (no copy)."""
    return blocks[0] if len(blocks) == 1 else torch.cat(list(blocks))


def fill_unknown(cached: Tensor, is_unknown, compute) -> Tensor:
    """``cached [..., T]``, a per-token constant kept as state, where ``is_unknown(cached)`` marks the slots not
    computed yet (the newest, where the cache appends): ``compute(first)`` gives the values of the columns from
    ``first``, the first column holding an unknown one, to the end, and they are written in place where unknown;
    returns ``cached``."""
    unknown = is_unknown(cached).flatten(0, -2).any(0)  # [T]
    if bool(unknown.any()):
        first = int(unknown.int().argmax())
        tail = cached[..., first:]
        tail.copy_(torch.where(is_unknown(tail), compute(first), tail))
    return cached


def window_std(win: Tensor) -> Tensor:
    """``win [B, H, W, T]`` -> ``[B, H, T]``: ``win.std(dim=2, unbiased=False)``, bit for bit, in a quarter of its
    time on CPU (tests/test_scoring_speed.py).

    torch's CPU reduction folds each output's W values one by one (Welford's update in float64, then the square
    root in float64 and a cast); over a non-innermost axis it runs that fold element by element, unvectorised
    (~60% of the learned policy's feature read-out at batch 8 and 1.5k slots, bench/RESULTS.md). Here the same
    update runs on whole ``[B, H, T]`` slices, in the same order and precision. Other devices keep ``torch.std``
    (CUDA reduces in float32, in its own order)."""
    if win.device.type != "cpu" or win.dtype != torch.float32:
        return win.std(dim=2, unbiased=False)
    # each row widened to float64 (exactly) as the fold reaches it, into one buffer: a float64 copy of the whole
    # window (the learned policy's is a strided view among its spare rows) into a fresh tensor took ~11 of the
    # function's ~17 ms at 192 rows x 16 x 552 slots (bench/RESULTS.md, "The window std row by row")
    x = torch.empty(win[:, :, 0].shape, dtype=torch.float64, device=win.device)
    mean = torch.zeros_like(x)
    m2, d, e = torch.zeros_like(mean), torch.empty_like(mean), torch.empty_like(mean)
    counts = torch.arange(1, win.shape[2] + 1, dtype=torch.float64, device=win.device)
    for i in range(win.shape[2]):  # WelfordOps.reduce: delta, mean + delta / n, m2 + delta * (x - new mean)
        x.copy_(win[:, :, i])
        torch.sub(x, mean, out=d)
        mean.addcdiv_(d, counts[i])  # mean + 1 * d / n: the same division and sum, without a temporary
        torch.sub(x, mean, out=e)
        m2.addcmul_(d, e)  # m2 + 1 * d * e, rounded twice as ``m2.add_(d.mul_(e))`` (no fused multiply-add)
    return m2.div_(win.shape[2]).sqrt_().float()


def feature_index(name: str) -> int:
    """Column of a named feature; a clear error for unknown names."""
    try:
        return FEATURES.index(name)
    except ValueError:
        raise ValueError(f"unknown feature {name!r}; features (version {FEATURE_VERSION}): {', '.join(FEATURES)}") from None


