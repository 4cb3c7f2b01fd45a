"""Plain-torch references of the eviction kernels. They are the spec and the CPU path.

Never edit a reference to agree with a kernel: the kernels are tested against these.

Shapes: B batch, H KV heads, T cached slots, K kept slots, D head dim.
"""

from __future__ import annotations

import torch
from torch import Tensor

from learnkv.features import NORMS, FeatureTracker, group_mean_max

#: `decode_attention_reference`'s group reductions: the mean, the max, or both (``[B, H, 2, T]``, the feature
#: tracker's input)
REDUCE = ("mean", "max", "mean+max")


def per_row(value, B: int, device=None) -> Tensor:
    """``value`` (an int, or one int per row) as an int64 ``[B, 1, 1]`` tensor, to broadcast over ``[B, H, T]``."""
    t = torch.as_tensor(value, dtype=torch.int64, device=device)
    if t.dim() == 0:
        t = t.expand(B)
    if t.shape != (B,):
        raise ValueError(f"expected one value or one per row ({B} rows), got shape {tuple(t.shape)}")
    return t.view(B, 1, 1)


def protected_slots(positions: Tensor, n_sink, n_recent) -> Tensor:
    """``[B, H, T]`` bool: attention sinks (position < n_sink) and the n_recent newest positions.

    Protection is defined on original positions, not slot indices, so it is right with left padding
    (padding and dead slots have position -1 and are never protected). ``n_sink`` and ``n_recent`` are ints, or
    one int per row (rows of a batch may have different budgets, hence different windows).
    """
    return protected_or_dead(positions, n_sink, n_recent) & (positions >= 0)


def protection_bounds(positions: Tensor, n_sink, n_recent) -> tuple[Tensor, Tensor]:
    """The positions an eviction may choose among, per row: from the first after the row's sinks (``[B, 1, 1]``,
    sinks clamped at zero) to the last before its recent window (``[B, H, 1]``, the row's newest position minus
    ``n_recent``). Slots outside, dead ones included, are `protected_or_dead`."""
    B = positions.shape[0]
    first = per_row(n_sink, B, positions.device).clamp(min=0)
    last = positions.max(dim=-1, keepdim=True).values - per_row(n_recent, B, positions.device)
    return first, last


def protected_or_dead(positions: Tensor, n_sink, n_recent) -> Tensor:
    """``protected_slots(positions, n_sink, n_recent) | (positions < 0)``, the slots an eviction never chooses among,
    in two comparisons instead of seven passes: with ``n_sink >= 0`` every dead slot is below it, and a dead slot's
    newness no longer matters. (A decode step of 30 layers x 8 rows x ~800 slots asks for it at every eviction:
    ~0.2 against ~0.8 ms on two cores.)"""
    first_unprotected, last_unprotected = protection_bounds(positions, n_sink, n_recent)
    return (positions < first_unprotected) | (positions > last_unprotected)


def protected_or_dead_mask(positions: Tensor, n_sink, n_recent) -> Tensor:
    """`protected_or_dead` as a float32 mask: 1.0 at the slots an eviction never chooses among, 0.0 elsewhere. For
    policies that combine it arithmetically (`learnkv.policies.roco`): on a CPU a bool mask's conversion, and ops
    under it, cost several times a float op (bench/RESULTS.md, "The tracker's update without bool masks"). The
    positions compare as float32, exact below 2**24."""
    first_unprotected, last_unprotected = protection_bounds(positions, n_sink, n_recent)
    at = torch.empty(positions.shape, dtype=torch.float32, device=positions.device).copy_(positions)
    sink = at.clone().lt_(first_unprotected.float())
    return torch.maximum(sink, at.gt_(last_unprotected.float()), out=sink)


def rank_prefer_recent(priority: Tensor) -> Tensor:
    """Slot indices ``[B, H, T]`` from highest to lowest priority; ties go to the more recent (higher) slot.

    A deterministic tie-break matters: many policies give exactly equal scores (LazyEviction's saturated
    sigmoids, StreamingLLM's constant scores), and `torch.topk`'s order among ties is unspecified.
    """
    T = priority.shape[-1]
    order = torch.argsort(priority.flip(-1), dim=-1, descending=True, stable=True)
    return T - 1 - order


def place_in_order(order: Tensor) -> Tensor:
    """Each slot's place in ``order [..., T]`` (each row a permutation of its slots, e.g. `rank_prefer_recent`'s):
    0 for the slot listed first."""
    places = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, places)


def block_layout(
    positions: Tensor, keep: Tensor, block_size: int, check: bool = True
) -> tuple[Tensor, Tensor, Tensor]:
    """Where each ``(b, h)`` row's blocks start, how many full blocks it has, and how many it keeps.

    Blocks are counted from the row's first live slot, so a row of a batch, behind its left padding or dead slots,
    is cut into the same blocks as it is alone (with ``block_size`` 1 every row starts at slot 0: a slot is a unit).
    The trailing partial block always stays; the fewest whole blocks are dropped that bring the row to at most
    ``keep [B]`` slots (counted from its first live slot).

    ``check=False`` skips the check that every row has the blocks to drop (a device-to-host sync on CUDA): a row
    without them then gets a negative ``n_kept``, and the caller must raise.

    Returns
    -------
    first, n_full, n_kept : Tensor
        ``[B, H]`` int64 each: the first slot of block 0, the full blocks, the full blocks (or slots) kept.
    """
    B, H, T = positions.shape
    keep = keep.view(B, 1).expand(B, H)
    if block_size <= 1:
        first = torch.zeros(B, H, dtype=torch.int64, device=positions.device)
        return first, torch.full_like(first, T), keep.clamp(max=T)
    valid = positions >= 0
    first = torch.where(valid.any(-1), valid.int().argmax(-1), T).long()
    span = T - first
    n_full = span // block_size
    n_drop = (span - keep).clamp(min=0).add(block_size - 1).div(block_size, rounding_mode="floor")  # ceil
    if check and bool((n_drop > n_full).any()):
        raise ValueError(f"cannot drop {int(n_drop.max())} blocks of {block_size} from {int(span.max())} slots "
                         f"(only {int(n_full.min())} full blocks)")
    return first, n_full, n_full - n_drop


def select_keep_reference(
    scores: Tensor, positions: Tensor, keep, n_sink, n_recent, block_size: int = 1
) -> Tensor:
    """Which slots to keep.

    Parameters
    ----------
    scores : Tensor
        ``[B, H, T]`` importance, higher means keep.
    positions : Tensor
        ``[B, H, T]`` int64 original positions, -1 for padding or a dead slot (those are evicted first).
    keep : int or sequence of int
        Slots to keep, one for every row or one per row. Token mode: exactly ``min(keep, T)`` slots. Block mode:
        the fewest whole blocks are dropped that bring the row to at most ``keep`` slots.
    n_sink, n_recent : int or sequence of int
        Protected sink positions and recent window (see `protected_slots`), for every row or per row.
    block_size : int
        1 for token granularity. Otherwise block j of a row is its slots ``[f + j*bs, f + (j+1)*bs)``, ``f`` its
        first live slot (`block_layout`); the trailing partial block is always kept and a block's score is the
        mean score of its non-padding slots.

    Returns
    -------
    Tensor
        ``[B, H, K]`` int64 slot indices, ``K`` the most any row keeps: each row's kept slots in ascending order
        (so kept tokens stay in original order), after ``K - k_b`` entries of -1 for a row that keeps fewer
        (``k_b``) than the widest row. A -1 entry is no slot: the caller leaves a dead slot there, at the left,
        where a left-padded row has its padding. With one ``keep`` for every row there is no -1 entry.
    """
    B, H, T = scores.shape
    if isinstance(keep, int) and T <= keep:
        return torch.arange(T, device=scores.device).expand(B, H, T).clone()
    return list_kept_reference(kept_slots_reference(scores, positions, keep, n_sink, n_recent, block_size))


def kept_slots_reference(
    scores: Tensor, positions: Tensor, keep, n_sink, n_recent, block_size: int = 1
) -> Tensor:
    """``[B, H, T]`` bool: the slots `select_keep_reference` keeps (same arguments), as a mask."""
    B, H, T = scores.shape
    device = scores.device
    keep_b = per_row(keep, B, device).view(B)
    valid = positions >= 0
    protected = protected_slots(positions, n_sink, n_recent)

    if block_size <= 1:
        # a row keeps its first min(keep, T) slots in priority order
        prio = scores.float().masked_fill(~valid, float("-inf")).masked_fill(protected, float("inf"))
        return place_in_order(rank_prefer_recent(prio)) < keep_b.clamp(max=T).view(B, 1, 1)

    # blocks: rank them by mean score, keep whole ones, then list the kept slots
    first, n_full, n_kept = block_layout(positions, keep_b, block_size)
    slots = torch.arange(T, device=device).expand(B, H, T)
    bs = block_size
    NB = T // bs + 1
    rel = slots - first[..., None]
    block = torch.where(rel >= 0, rel.div(bs, rounding_mode="floor"), NB)
    in_full = block < n_full[..., None]
    unit = torch.where(in_full, block, NB)  # slots of no full block go to the extra column NB
    zeros = torch.zeros(B, H, NB + 1, device=device)
    total = zeros.scatter_add(-1, unit, (scores.float() * valid).masked_fill(~in_full, 0.0))[..., :NB]
    n_valid = zeros.scatter_add(-1, unit, (valid & in_full).float())[..., :NB]
    bprot = zeros.scatter_add(-1, unit, (protected & in_full).float())[..., :NB] > 0
    bprio = (total / n_valid.clamp(min=1)).masked_fill(n_valid == 0, float("-inf")).masked_fill(bprot, float("inf"))
    order = rank_prefer_recent(bprio)
    exists = torch.arange(NB, device=device) < n_full[..., None]  # [B, H, NB]
    order = order.gather(-1, torch.argsort(~exists.gather(-1, order), dim=-1, stable=True))  # real blocks first
    kept_block = place_in_order(order) < n_kept[..., None]
    return (in_full & kept_block.gather(-1, unit.clamp(max=NB - 1))) | ((rel >= 0) & ~in_full)  # + the tail


def list_kept_reference(kept: Tensor) -> Tensor:
    """The slots ``kept [B, H, T]`` marks, as `select_keep_reference` lists them: ``[B, H, K]``, ``K`` the most any row
    keeps, each row's kept slots ascending after ``K - k_b`` entries of -1 (``k_b`` the slots it keeps)."""
    T = kept.shape[-1]
    K = int(kept.sum(-1).max()) if kept.numel() else 0
    # kept slots sort after the rest (key T + slot), so a row's last K keys are its filler then its kept slots
    slots = torch.arange(T, device=kept.device)
    key = torch.where(kept, T + slots, slots).sort(dim=-1).values[..., T - K :]
    return torch.where(key >= T, key - T, torch.full_like(key, -1))


def mark_dead(positions: Tensor, index: Tensor) -> None:
    """Set the position of every slot not in ``index [B, H, K]`` (kept slots, -1 = none) to -1, in place."""
    T = positions.shape[-1]
    slot = torch.where(index >= 0, index, T)  # -1 entries mark the extra column, dropped below
    kept = torch.zeros((*index.shape[:2], T + 1), dtype=torch.bool, device=index.device)
    positions.masked_fill_(~kept.scatter_(-1, slot, True)[..., :T], -1)  # writes through to the buffer


def mark_one_drop_reference(scores: Tensor, positions: Tensor, keep, n_sink, n_recent) -> None:
    """Mark every slot `select_keep_reference` (token granularity) drops dead (position -1), in place.

    The cache's eviction without compaction; its kernel is exact where no row drops more than one live slot (the
    decode step of a policy that evicts at each overflow), which the caller knows on the host."""
    mark_dead(positions, select_keep_reference(scores, positions, keep, n_sink, n_recent))


def gather_tokens_reference(x: Tensor, index: Tensor, dim: int, out: Tensor | None = None) -> Tensor:
    """Gather kept slots along the token axis.

    Parameters
    ----------
    x : Tensor
        ``[B, H, ...]`` with the token axis at ``dim`` (-2 for keys/values ``[B, H, T, D]``, -1 for positions and
        policy state ``[B, H, ..., T]``).
    index : Tensor
        ``[B, H, K]`` slot indices.
    out : Tensor, optional
        Shaped like ``x`` with at least ``K`` slots on the token axis and no memory shared with ``x``: the gathered
        slots are written to its first ``K`` slots, and that view is returned.
    """
    dim = dim % x.ndim
    shape = list(x.shape)
    shape[dim] = index.shape[-1]
    # an ``out`` of exactly the gathered shape, contiguous, is written directly, with no temporary (on CPU a fresh
    # buffer of a cache layer's size is fresh pages from the system, each a page fault on first write)
    direct = out is not None and list(out.shape) == shape and out.is_contiguous()
    if dim == 2 and x.is_contiguous() and x.numel():
        # keys/values [B, H, T, ...]: each slot is a contiguous row, so one index_select of whole rows (on CPU,
        # `gather` with an index expanded over D reads one index per element: 10-15x slower at B 16)
        B, H, T = x.shape[:3]
        rows = (index + torch.arange(B * H, device=index.device).view(B, H, 1) * T).reshape(-1)
        flat = x.reshape(B * H * T, -1)
        if direct:
            torch.index_select(flat, 0, rows, out=out.view(rows.shape[0], -1))
            return out
        kept = flat.index_select(0, rows).view(shape)
        return kept if out is None else out.narrow(dim, 0, kept.shape[dim]).copy_(kept)
    # index [B, H, K] -> broadcast to x's layout with K on the token axis
    idx = index.reshape(index.shape[0], index.shape[1], *([1] * (dim - 2)), index.shape[-1], *([1] * (x.ndim - dim - 1)))
    if direct:
        return torch.gather(x, dim, idx.expand(shape), out=out)
    kept = x.gather(dim, idx.expand(shape))
    if out is None:
        return kept
    return out.narrow(dim, 0, kept.shape[dim]).copy_(kept)


def decode_attention_reference(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    key_positions: Tensor,
    query_positions: Tensor,
    scaling: float | None = None,
    reduce: str | None = "mean",
    *,
    window: int | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """One decode step of `learnkv.attention.learnkv_attention` (q = 1), in fp32, plus its attention statistic.

    Parameters
    ----------
    query : Tensor
        ``[B, Hq, 1, D]``; query head ``j * G + g`` uses KV head ``j`` (``Hq = G * H``).
    key, value : Tensor
        ``[B, H, T, D]``.
    key_positions : Tensor
        ``[B, H, T]`` int64 slot positions, -1 for padding. A key is visible iff ``0 <= key_pos <= query_pos``;
        masked scores are set to the fp32 minimum (not -inf), so a query that sees no key attends uniformly,
        as in `learnkv_attention`.
    query_positions : Tensor
        ``[B]`` int64 position of the step's token (-1 for a padding row).
    scaling : float, optional
        Score scale, ``D ** -0.5`` by default.
    reduce : str or None
        "mean", "max" or "mean+max" (both) over the G query heads of each KV head; None: the output alone.
    window : int, optional
        Sliding window: a key is visible only if also ``key_pos > query_pos - window``.
    softcap : float, optional
        Scores become ``softcap * tanh(scores / softcap)`` (before masking, as Gemma 2).
    sinks : Tensor, optional
        ``[Hq]`` sink logits: each joins its query head's softmax normaliser and is dropped (GPT-OSS), so the
        probabilities sum to less than 1.

    Returns
    -------
    tuple of Tensor
        The output ``[B, 1, Hq, D]`` in the query's dtype, and the group-reduced attention probabilities
        ``[B, H, T]`` fp32 (``[B, H, 2, T]``, mean then max, for ``reduce="mean+max"``), zero for a padding query
        row (what the cache is handed); None for ``reduce=None``.
    """
    if reduce is not None and reduce not in REDUCE:
        raise ValueError(f"reduce must be one of {REDUCE} or None, got {reduce!r}")
    B, Hq, q, D = query.shape
    H, T = key.shape[1], key.shape[2]
    if q != 1 or Hq % H:
        raise ValueError(f"query [B, G*H, 1, D] and key [B, H, T, D] expected, got {tuple(query.shape)}, {tuple(key.shape)}")
    G = Hq // H
    if scaling is None:
        scaling = D**-0.5
    scores = torch.matmul(query.float().reshape(B, H, G, D), key.float().transpose(-1, -2)) * scaling  # [B, H, G, T]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    visible = (key_positions >= 0) & (key_positions <= query_positions[:, None, None])
    if window is not None:
        visible = visible & (key_positions > query_positions[:, None, None] - window)
    scores = scores.masked_fill(~visible[:, :, None, :], torch.finfo(torch.float32).min)
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sink = sinks.float().view(1, H, G, 1).expand(B, H, G, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :T]
    out = torch.matmul(probs, value.float()).reshape(B, 1, Hq, -1).to(query.dtype)
    if reduce is None:
        return out, None
    keep_row = (query_positions >= 0).float()
    if reduce == "mean+max":
        return out, group_mean_max(probs) * keep_row[:, None, None, None]
    reduced = probs.amax(dim=2) if reduce == "max" else probs.mean(dim=2)
    return out, reduced * keep_row[:, None, None]


def block_scores_reference(keys: Tensor, values: Tensor, block_size: int) -> Tensor:
    """PagedEviction block scores: mean over each full block of ``mean_h ||V|| / max(||K||, 1e-6)``.

    Parameters
    ----------
    keys, values : Tensor
        ``[B, H, T, D]``.
    block_size : int
        Slots per block; the trailing partial block gets no score.

    Returns
    -------
    Tensor
        ``[B, T // block_size]`` fp32.
    """
    B, H, T, D = keys.shape
    n_full = T // block_size
    token = (values.float().norm(dim=-1) / keys.float().norm(dim=-1).clamp(min=1e-6)).mean(dim=1)  # [B, T]
    return token[:, : n_full * block_size].reshape(B, n_full, block_size).mean(dim=-1)


def update_token_state_reference(
    attn_mean: Tensor | None,
    attn_max: Tensor | None,
    positions: Tensor,
    step: int,
    n_new: int,
    alpha: float,
    acc: Tensor | None = None,
    s1: Tensor | None = None,
    s2: Tensor | None = None,
    count: Tensor | None = None,
    ts: Tensor | None = None,
    mri: Tensor | None = None,
) -> None:
    """One step's update of the per-token statistics that H2O, RoCo and LazyEviction keep, in place.

    It is the policies' `update` at a decode step (one query, ``n_new = 1``), on state tensors that the cache has
    already grown by the step's new (zero-filled) slots. Every state tensor is optional (None: skipped).

    Parameters
    ----------
    attn_mean : Tensor or None
        ``[B, H, T]`` fp32 attention of the step's query, mean over the query heads of each KV head (zero for a
        padding query row). Needed for acc, s1 and s2.
    attn_max : Tensor or None
        ``[B, H, T]`` the same attention, max over the group. Needed for ts and mri.
    positions : Tensor
        ``[B, H, T]`` int64 slot positions, -1 for padding; the step's queries are the last ``n_new`` slots.
    step : int
        The step t (0 = prefill).
    n_new : int
        Slots appended in this step.
    alpha : float
        LazyEviction's activation threshold (compared in fp32, as torch compares an fp32 tensor with a float).
    acc : Tensor or None
        H2O's accumulated attention: ``acc += attn_mean``.
    s1, s2, count : Tensor or None
        RoCo's sums: ``s1 += attn_mean``, ``s2 += attn_mean ** 2`` (its squared-attention sum when q = 1) and
        ``count +=`` the number of the step's valid queries that see the slot (a valid slot at or before the
        query's position).
    ts, mri : Tensor or None
        LazyEviction's last activation step and maximum recurrence interval, untouched at step 0 (the prefill
        observes nothing). The new slots start at ``ts = t - 1``; a slot with ``attn_max >= alpha`` gets
        ``ts = t``; ``mri = max(mri, ts - previous ts)``.
    """
    if acc is not None:
        acc += attn_mean
    if s1 is not None:
        s1 += attn_mean
    if s2 is not None:
        s2 += attn_mean * attn_mean
    if count is not None:
        q_pos = positions[..., None, positions.shape[-1] - n_new :]  # [B, H, 1, n_new]
        k_pos = positions[..., :, None]  # [B, H, T, 1]
        count += ((q_pos >= k_pos) & (q_pos >= 0) & (k_pos >= 0)).sum(-1)
    if (ts is None) != (mri is None):
        raise ValueError("ts and mri are updated together: give both or neither")
    if ts is not None and step > 0:
        prev = ts.clone()
        prev[..., prev.shape[-1] - n_new :] = step - 1
        new = torch.where(attn_max >= alpha, torch.full_like(prev, float(step)), prev)
        ts.copy_(new)
        torch.maximum(mri, new - prev, out=mri)


def scorer_mlp_reference(
    features: Tensor, mean: Tensor, std: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor | float
) -> Tensor:
    """The exported scorer on one layer's tokens (`learnkv.scorer.model.Scorer.forward` with an int layer).

    Parameters
    ----------
    features : Tensor
        ``[N, F]`` token features, any float dtype.
    mean, std : Tensor
        ``[F]`` standardisation statistics.
    w1, b1 : Tensor
        ``[F, Hd]`` and ``[Hd]``, the hidden layer.
    w2 : Tensor
        ``[Hd]`` output weights.
    b2 : Tensor or float
        Output bias, a scalar (0-d or one-element tensor).

    Returns
    -------
    Tensor
        ``[N]`` fp32 scores ``relu(((x - mean) / std) @ w1 + b1) @ w2 + b2``.
    """
    x = (features.float() - mean.float()) / std.float()
    h = torch.relu(x @ w1.float() + b1.float())
    b2 = b2.float().reshape(()) if isinstance(b2, Tensor) else float(b2)
    return h @ w2.float() + b2


def decode_features_reference(
    attn: Tensor,
    keys: Tensor,
    values: Tensor,
    positions: Tensor,
    layer: int,
    n_layers: int,
    step: int,
    state: dict[str, Tensor],
    spare: int = 0,
    *,
    read_out: bool = True,
) -> Tensor | None:
    """One decode step of the learned policy's feature tracker: `FeatureTracker.update` then `.features` (the
    update only, without ``read_out``).

    Parameters
    ----------
    attn : Tensor
        ``[B, H, 2, 1, T]`` fp32: the group mean and max of the step's one query row's attention (what a policy
        with ``group_reduce="mean+max"`` is handed, `learnkv.features.group_mean_max`).
    keys, values : Tensor
        ``[B, H, T, D]`` as cached.
    positions : Tensor
        ``[B, H, T]`` int64 slot positions, -1 for padding; the step's query is the last slot (``n_new = 1``).
    layer, n_layers : int
        This layer and the model's layer count.
    step : int
        The decode step (>= 1); the prefill, which creates the state, runs the tracker itself.
    state : dict[str, Tensor]
        The tracker's ``f.*`` state, updated (its entries rebound to the new tensors; ``f.win`` holds ``WINDOW``
        rows, or the window among ``WINDOW + spare`` rows as a tracker with ``spare_rows=spare`` keeps it); with the
        cached norms (`learnkv.features.NORMS`) if it holds them: the update marks the new slot's unknown, the read-out computes
        the unknown ones from their keys and values and reads the others.
    spare : int
        The tracker's `FeatureTracker.spare_rows` (`learnkv.sliding_rows`); a window held in order is laid out once.
    read_out : bool
        Whether to compute the features after the update (the learned policy needs them where it scores next).

    Returns
    -------
    Tensor or None
        ``[B, H, T, F]`` fp32 features in `learnkv.features.FEATURES` order, zero on padding slots; None without
        ``read_out`` (the new slot's cached norms, if the state holds them, are then left unknown: -1).
    """
    if attn.ndim != 5 or attn.shape[2:4] != (2, 1) or step < 1:
        raise ValueError(f"a decode step: attn [B, H, 2, 1, T] and step >= 1, got {tuple(attn.shape)}, step {step}")
    tracker = FeatureTracker(n_layers, cache_norms=NORMS[0] in state, spare_rows=spare)
    tracker.update(attn, positions, 1, step, state)
    return tracker.features(attn, keys, values, positions, layer, step, state) if read_out else None
