"""Budget allocation across layers and KV heads: scores in, per-(layer, row, KV head) keep counts and masks out.

These functions take a step's scores of every layer and decide how many slots each ``(layer, row, KV head)``
keeps and which ones; `learnkv.cache.BudgetCache` calls them (its ``allocation``; docs/allocation.md). Four modes
(`ALLOCATIONS`):

- ``uniform``: every head keeps its row's ``budget`` (learnkv's behaviour today; equal, slot for slot, to
  `kernels.reference.select_keep_reference` in token mode);
- ``head`` (Ada-KV, https://arxiv.org/abs/2407.11550; kvpress ``AdaKVPress``): a layer's ``H x budget`` slots go
  to the top scores over all its heads, after every head has kept its own top ``int(floor x budget)`` (the
  safeguard, kvpress's ``alpha_safeguard`` = 0.2);
- ``pyramid`` (PyramidKV, https://arxiv.org/abs/2406.02069; kvpress ``PyramidKVPress``): per-layer budgets falling
  linearly with depth and summing to ``n_layers x budget`` exactly (`pyramid_budgets`); every head of a layer
  keeps its layer's budget;
- ``global`` (DBTrimKV's setting; ``trimkv`` 0.1.5 ``PagedTrimKVCache``, strategy ``fixed_budget``): one pool of
  ``n_layers x H x budget`` slots per row, tokens compared across every layer and head, with the same per-head
  floor as ``head``.

Protected tokens (sinks, recent window; `kernels.reference.protected_slots`) are forced in as kvpress does: they
rank above every score (priority +inf), so they fill a head's floor first and count against the budget. Padding
and dead slots (``valid`` False) are never kept. Ties go to the more recent slot, as in `kernels.reference`, and
then, across heads, to the lower (layer, head).

The floor: in ``head`` and ``global`` a head keeps ``min(int(floor x budget), live slots)`` slots of its own
top (kvpress's ``int(n_kept * alpha_safeguard)``), and the rest of the pool, ``total - sum of floors``, goes to the
highest remaining scores of the pool. So each head keeps a prefix of its own ranking and the pool never holds more
than its total. (``PagedTrimKVCache`` with ``min_tokens_per_head`` adds the floor on top of the head's share of a
global top-k instead; both keep the total.)

Scores compared across heads or layers must share a scale (`normalise_scores`, `NORMALISATION_FOR_POOLING`):

- ``mass``: attention mass (H2O, TOVA, SnapKV, the oracle: the policies whose `Policy.pooling` is ``mean_mass``).
  Each head's scores are divided by their sum over its live slots, so every head is a distribution over what it
  holds, as the softmax attention Ada-KV ranks is at the prefill;
- ``logit``: scores defined up to a constant per head, as the learned scorer's logits are (its ListNet loss,
  `learnkv.scorer.module.listwise_loss`, fits their softmax over a row to the future-utility distribution): a
  softmax over the head's live slots, the scorer's own normalisation;
- ``rank``: scores on no shared scale (key norms, recurrence sigmoids, RoCo, R-KV, random, positions: the policies
  whose pooling is ``mean_rank``): rank percentiles within the head, the block mode's rule
  (`learnkv.pooling.rank_percentiles`). Every head's percentiles are spread alike, so ``head`` and ``global`` then
  move budget only where heads hold different numbers of live slots: close to ``uniform`` by construction;
- ``raw``: scores already on one scale across layers and heads (a scorer trained with the global objective,
  ``train.objective=global``, `learnkv.scorer.module`, whose artifact records allocation ``global``): compared as
  they are.

Shapes: L layers, B rows, H KV heads, T slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import torch
from torch import Tensor

from learnkv.kernels.reference import per_row, place_in_order, rank_prefer_recent
from learnkv.fields import check_fields, setting
from learnkv.pooling import rank_percentiles

ALLOCATIONS = ("uniform", "head", "pyramid", "global")
NORMALISATIONS = ("mass", "logit", "rank", "raw")
#: the rule for a policy's scores, from its block-mode pooling rule (`learnkv.policies.base.Policy.pooling`); the
#: learned scorer's logits take ``logit`` (see the module docstring)
NORMALISATION_FOR_POOLING = {"mean_mass": "mass", "mean_rank": "rank"}


@dataclass
class Allocation:
    """How a row's budget is shared by layers and KV heads.

    Parameters
    ----------
    mode : str
        One of `ALLOCATIONS`; ``uniform`` (the default) is learnkv's behaviour today.
    floor : float
        ``head`` and ``global``: every head keeps at least ``int(floor x budget)`` of its own top slots (or all its
        live slots if it holds fewer); 0.2 as kvpress's ``alpha_safeguard``.
    beta : float
        ``pyramid``: the shallowest-to-deepest ratio is set by the deepest layer's budget ``budget / beta``
        (raised to ``min_budget``); 20 as PyramidKV and kvpress.
    """

    mode: str = setting("uniform", choices=ALLOCATIONS)
    floor: float = setting(0.2, ge=0.0, le=1.0)
    beta: float = setting(20.0, ge=1.0)

    def __post_init__(self):
        check_fields(self, "allocation.")


def as_allocation(value) -> Allocation:
    """An `Allocation` from one (returned as is), a mode name (``"head"``) or None (``uniform``); a bad mode is a
    one-line ValueError naming the modes."""
    if value is None:
        return Allocation()
    if isinstance(value, Allocation):
        return value
    if not isinstance(value, str) or value not in ALLOCATIONS:
        raise ValueError(f"allocation must be one of {', '.join(ALLOCATIONS)}, got {value!r}")
    return Allocation(value)


def normalisation_for(policy) -> str:
    """The rule (`normalise_scores`) for a policy's scores compared across heads and layers: the policy's own
    ``normalisation`` where it says one (the learned policy, from its artifact: ``raw`` for a scorer trained with
    the global objective, else ``logit``, its logits being fitted as a softmax per head), else its block-mode
    pooling rule's (`NORMALISATION_FOR_POOLING`)."""
    return policy.normalisation or NORMALISATION_FOR_POOLING[policy.pooling]


def pyramid_budgets(budget: int, n_layers: int, beta: float = 20.0, min_budget: int = 1) -> list[int]:
    """PyramidKV's per-layer budgets (tokens per KV head), largest at layer 0, summing to ``n_layers x budget``.

    The exact budgets fall linearly from ``hi = 2 budget - lo`` at layer 0 to ``lo = max(budget / beta,
    min_budget)`` at the last layer, so their mean is ``budget`` (kvpress's ``get_layer_budget`` with its window
    folded into ``budget``). They are rounded by largest remainder, computed in exact fractions: every layer gets
    ``floor(exact)``, and the ``n_layers x budget - sum(floors)`` leftover tokens go one each to the layers with
    the largest fractional parts (ties to the shallower layer). So the sum is exact, the budgets never rise with
    depth, and none falls below ``min_budget``: 1 by default, so no layer is left with only the step's new token;
    pass the protected tokens per head, ``n_sink + n_recent``, when they are more.
    """
    if n_layers < 1 or budget < 0 or min_budget < 0:
        raise ValueError(f"need n_layers >= 1, budget >= 0, min_budget >= 0; got {n_layers}, {budget}, {min_budget}")
    if beta < 1:
        raise ValueError(f"beta must be >= 1, got {beta}")
    if min_budget > budget:
        raise ValueError(f"min_budget ({min_budget}) exceeds the mean layer budget ({budget})")
    if n_layers == 1:
        return [budget]
    lo = max(Fraction(budget) / Fraction(beta), Fraction(min_budget))
    hi = 2 * budget - lo
    step = (hi - lo) / (n_layers - 1)
    exact = [hi - layer * step for layer in range(n_layers)]
    out = [int(e) for e in exact]  # floor: every value is >= 0
    leftover = n_layers * budget - sum(out)
    by_remainder = sorted(range(n_layers), key=lambda layer: (-(exact[layer] - out[layer]), layer))
    for layer in by_remainder[:leftover]:
        out[layer] += 1
    return out


def head_budgets(allocation: Allocation, budgets, n_layers: int, n_rows: int, min_budget=1) -> Tensor:
    """``[L, B]`` int64: the tokens each KV head of a layer keeps by itself (``uniform``, ``pyramid``), or its mean
    share of the pool (``head``, ``global``). ``budgets`` and ``min_budget``: one int or one per row of ``n_rows``."""
    B = n_rows
    rows = per_row(budgets, B).view(B).tolist()
    mins = per_row(min_budget, B).view(B).tolist()
    if allocation.mode == "pyramid":
        cols = [pyramid_budgets(b, n_layers, allocation.beta, m) for b, m in zip(rows, mins)]
    else:
        cols = [[b] * n_layers for b in rows]
    return torch.tensor(cols, dtype=torch.int64).T.reshape(n_layers, B)


def normalise_scores(scores: Tensor, valid: Tensor, rule: str) -> Tensor:
    """``[..., T]`` scores on one scale across heads and layers (the rules: the module docstring).

    Returns float32 of the same shape; entries of non-live slots are 0 (``raw``: unchanged).
    """
    if rule == "raw":
        return scores.float()
    if rule == "rank":
        return rank_percentiles(scores, valid)
    if rule == "mass":
        x = scores.float().masked_fill(~valid, 0.0)
        if bool((x < 0).any()):
            raise ValueError("the 'mass' rule needs nonnegative scores (attention mass); use 'rank' for these")
        return x / x.sum(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    if rule == "logit":
        x = scores.float().masked_fill(~valid, float("-inf"))
        # +inf is the cache's "keep" (a refreshing policy's tokens not scored yet): it stays above every score, and
        # the softmax runs over the scored slots (with it inside, every slot of the head would be NaN, then 0)
        kept = x == float("inf")
        out = torch.softmax(x.masked_fill(kept, float("-inf")), dim=-1).nan_to_num(0.0)  # no live slot: NaN
        return out.masked_fill(kept, float("inf"))
    raise ValueError(f"unknown normalisation {rule!r}; rules: {', '.join(NORMALISATIONS)}")


def allocate(scores: Tensor, valid: Tensor, protected: Tensor, budgets, allocation: Allocation,
             min_budget=1) -> tuple[Tensor, Tensor]:
    """Which slots every ``(layer, row, KV head)`` keeps under ``allocation``.

    Parameters
    ----------
    scores : Tensor
        ``[L, B, H, T]`` float, higher means keep; on one scale across the heads (``head``) or layers and heads
        (``global``) that are compared (`normalise_scores`).
    valid : Tensor
        ``[L, B, H, T]`` bool, live slots (False: padding or a dead slot, never kept).
    protected : Tensor
        ``[L, B, H, T]`` bool, sinks and recent window, always kept (`kernels.reference.protected_slots`).
    budgets : int or sequence of int
        Tokens per layer and KV head, for every row or one per row: row ``b``'s total is ``L x H x budgets[b]``.
    allocation : Allocation
        The mode and its settings.
    min_budget : int or sequence of int
        ``pyramid``: the least a layer's budget may be (`pyramid_budgets`; default 1), for every row or one per row.

    Returns
    -------
    counts : Tensor
        ``[L, B, H]`` int64 slots kept.
    keep : Tensor
        ``[L, B, H, T]`` bool, the kept slots (``keep.sum(-1) == counts``).

    Raises ValueError when a head's (``uniform``, ``pyramid``) or a pool's protected slots exceed what it may keep.
    """
    if scores.dim() != 4 or valid.shape != scores.shape or protected.shape != scores.shape:
        raise ValueError(f"scores, valid and protected must be [L, B, H, T] alike, got {tuple(scores.shape)}, "
                         f"{tuple(valid.shape)}, {tuple(protected.shape)}")
    L, B, H, T = scores.shape
    device = scores.device
    per_head = head_budgets(allocation, budgets, L, B, min_budget).to(device)  # [L, B]
    if bool((per_head < 0).any()):
        raise ValueError(f"budgets must be >= 0, got {budgets}")
    valid = valid.bool()
    protected = protected.bool() & valid
    # the reference kernel's priority: padding last, protected first
    prio = scores.float().masked_fill(~valid, float("-inf")).masked_fill(protected, float("inf"))

    if allocation.mode in ("uniform", "pyramid"):
        quota = per_head[:, :, None].expand(L, B, H)
        _check_protected(protected.sum(-1), quota, "head")
        keep = (_ranks(prio) < quota[..., None]) & valid
        return keep.sum(-1), keep

    budget = per_head[0]  # [B]: head and global share one budget per row over every layer
    if allocation.mode == "head":  # one pool per (layer, row), of its H heads
        pooled = [x.reshape(L * B, H, T) for x in (prio, valid, protected)]
        total, floor = (H * per_head).reshape(L * B), _floor_tokens(budget, allocation.floor).repeat(L)
    else:  # "global": one pool per row, of its L x H heads
        pooled = [x.transpose(0, 1).reshape(B, L * H, T) for x in (prio, valid, protected)]
        total, floor = L * H * budget, _floor_tokens(budget, allocation.floor)
    _check_protected(pooled[2].sum((-2, -1)), total, "pool")
    keep = _pool_keep(pooled[0], pooled[1], total, floor)
    keep = keep.reshape(L, B, H, T) if allocation.mode == "head" else keep.reshape(B, L, H, T).transpose(0, 1)
    return keep.sum(-1), keep


def _floor_tokens(budget: Tensor, floor: float) -> Tensor:
    """``int(floor x budget)`` per row, as kvpress's ``int(n_kept * alpha_safeguard)``."""
    return torch.tensor([int(floor * b) for b in budget.tolist()], dtype=torch.int64, device=budget.device)


def _check_protected(n_protected: Tensor, quota: Tensor, what: str) -> None:
    over = n_protected > quota
    if bool(over.any()):
        raise ValueError(f"a {what} holds {int(n_protected[over].max())} protected slots but may keep "
                         f"{int(quota[over].min())}: lower the sink and recent windows or raise the budget "
                         "(pyramid: pass them as min_budget)")


def _ranks(prio: Tensor) -> Tensor:
    """Each slot's place in its head's order (0 = kept first), with the reference kernel's tie-break."""
    return place_in_order(rank_prefer_recent(prio))


def _pool_keep(prio: Tensor, valid: Tensor, total: Tensor, floor: Tensor) -> Tensor:
    """``[P, G, T]`` keep mask: every head of pool ``p`` keeps its top ``floor[p]`` live slots, then the pool's
    remaining ``total[p] - floors`` slots go to the highest remaining priorities of any of its ``G`` heads.

    Pool order: priority, then the more recent slot, then the lower head, so that within a head it is the head's
    own order (`_ranks`) and each head keeps a prefix of it.
    """
    P, G, T = prio.shape
    n_floor = torch.minimum(floor[:, None], valid.sum(-1))  # [P, G]
    in_floor = (_ranks(prio) < n_floor[..., None]) & valid
    rest = total - n_floor.sum(-1)  # [P], >= 0 because floor <= the mean share
    # flatten slot-major from the newest slot, head-minor: a stable sort then breaks ties as documented
    flat = prio.flip(-1).transpose(1, 2).reshape(P, T * G)
    candidate = (valid & ~in_floor).flip(-1).transpose(1, 2).reshape(P, T * G)
    order = torch.argsort(flat, dim=-1, descending=True, stable=True)
    cand_sorted = candidate.gather(-1, order)
    chosen_sorted = cand_sorted & (cand_sorted.long().cumsum(-1) <= rest[:, None])
    chosen = torch.zeros_like(candidate).scatter_(-1, order, chosen_sorted)
    return in_floor | chosen.view(P, T, G).transpose(1, 2).flip(-1)


def keep_slots(keep: Tensor) -> list[Tensor]:
    """Per layer, the kept slots as `kernels.select_keep` lists them: ``[B, H, K_l]`` int64, ascending, after -1
    entries in a head that keeps fewer than ``K_l``, the widest head of the layer (the padded buffer's width)."""
    L, B, H, T = keep.shape
    slots = torch.arange(T, device=keep.device)
    out = []
    for layer in keep:
        K = int(layer.sum(-1).max()) if layer.numel() else 0
        key = torch.where(layer, T + slots, slots).sort(dim=-1).values[..., T - K:]
        out.append(torch.where(key >= T, key - T, torch.full_like(key, -1)))
    return out


def slot_totals(counts: Tensor) -> tuple[Tensor, Tensor]:
    """Per row, ``[B]`` int64 each: the live slots (what a paged per-head layout holds) and the slots a padded
    buffer allocates (every head of a layer as wide as the layer's widest head over the batch), summed over
    layers and heads. Times the bytes of one slot of one head (keys + values) gives the two KV sizes."""
    L, B, H = counts.shape
    live = counts.sum((0, 2))
    widest = counts.amax((1, 2)) if counts.numel() else counts.new_zeros(L)
    return live, (H * widest.sum()).expand(B).clone()
