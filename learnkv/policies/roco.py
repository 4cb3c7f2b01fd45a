"""RoCo (EasyKV): temporal attention score with a robustness (std) measure."""

from dataclasses import dataclass

import torch
from torch import Tensor

from learnkv import kernels
from learnkv.features import live_mask
from learnkv.kernels.reference import protected_or_dead_mask
from learnkv.policies.base import LayerView, Policy
from learnkv.fields import setting


@dataclass
class RoCo(Policy):
    """RoCo (Ren & Zhu, https://arxiv.org/abs/2402.06262; github.com/DRSY/EasyKV).

    Per KV head and token it keeps the sum S1 and the sum of squares S2 of the attention it received (averaged
    over the query heads of the group) and the number of queries c that saw it. To evict E tokens:

    1. the eviction scope is the ``max(budget - r, E)`` tokens with the *lowest* attention std
       ``sqrt(S2/c - (S1/c)^2)``, where ``r = int(recent_ratio * budget)`` and the protected tokens (the last 10
       and any sinks) are never in scope;
    2. within the scope, the E tokens with the lowest mean attention ``S1/c`` are evicted.

    In decode this is one token per step, as in EasyKV. Deviations, for equal KV bytes across policies: the
    budget counts the prompt too (EasyKV's decode mode never evicts the prompt and budgets generated tokens
    only), and prefill attention seeds the statistics (EasyKV's ``keep_attention=True``), because a prompt
    over the budget is compressed in one shot rather than by EasyKV's chunked sliding prefill.
    Compared across heads and layers (``allocation=head|global``) its scores are ``rank``
    (`learnkv.allocation.normalisation_for`): a mean attention within a std-selected scope is no common scale, so rank
    percentiles within the head.

    Parameters
    ----------
    recent_ratio : float
        r / budget; EasyKV hard-codes 0.3 in decode mode.
    n_recent : int
        The newest tokens never in scope; 10 in EasyKV.
    """

    name = "roco"
    needs_sq_sum = True
    per_row_fields = ("interval",)  # its scope excludes the protected tokens itself, so they are one for the batch
    rowwise = True  # each row from its own statistics and windows
    recent_ratio: float = setting(0.3, ge=0.0, le=1.0)
    n_recent: int | float = setting(10, ge=0, fraction=True)

    def update(self, view: LayerView) -> None:
        st = view.state
        if "s1" in st and view.n_new == 1 and kernels.use_triton(st["s1"], view.attn_sum):
            # a decode step on the kernel path: s1, s2 and count in one fused in-place launch (with one query,
            # the step's squared-attention sum is the square of its attention, which is what the kernel adds)
            kernels.update_token_state(view.attn_sum, None, view.positions, view.step, 1, 0.0,
                                       s1=st["s1"], s2=st["s2"], count=st["count"])  # fmt: skip
            return
        if "s1" in st and view.n_new == 1:
            # a decode step, in place (a cache that preallocates the state never copies it): its one query is the
            # newest slot, so it sees every valid slot if it is valid itself; the same values as `accumulate`. The
            # mask is float 0/1, as the feature tracker's (`FeatureTracker._update_decode`: bool masks cost more here)
            valid = live_mask(view.positions)
            st["s1"].add_(view.attn_sum)
            st["s2"].add_(view.attn_sq_sum)
            st["count"].addcmul_(valid, valid[..., -1:])
            return
        accumulate(view)

    def score(self, view: LayerView) -> Tensor:
        st = view.state
        c = st["count"].clamp(min=1)
        mean = st["s1"] / c
        std = (st["s2"] / c - mean * mean).clamp(min=0).sqrt()
        # per row: E tokens to evict, scope = max(keep - r, E) with r = int(recent_ratio * keep)
        keep = view.keep_rows()
        scope_size = [max(k - int(self.recent_ratio * k), live - k, 0) for k, live in zip(keep, view.live_tokens())]
        # float 0/1 masks, and +inf put in by a maximum with +-inf, not bool masks and ``masked_fill`` (several times
        # a float op's cost on a CPU): the same values, the statistics being finite and >= 0 (a maximum with -inf
        # leaves them, one with +inf is +inf)
        out_of_scope = protected_or_dead_mask(view.positions, self.n_sink, self.n_recent)
        beyond = out_of_scope.sub(0.5).mul_(float("inf"))  # +inf out of scope, else -inf
        std = torch.maximum(std, beyond)
        if view.victims_only:
            return victim_scores(mean, std, beyond, out_of_scope, scope_size)
        return scope_means(mean, std, out_of_scope, scope_size)


def scope_means(mean: Tensor, std: Tensor, out_of_scope: Tensor, scope_size: list[int]) -> Tensor:
    """RoCo's scores ``[R, H, T]``: ``mean`` on each row's scope (its ``scope_size`` slots of the lowest ``std``,
    which is +inf out of scope), +inf elsewhere. ``out_of_scope``: float 0/1, 1 on the protected and dead slots."""
    in_scope = lowest_first(std, scope_size)
    in_scope.addcmul_(in_scope, out_of_scope, value=-1)  # and in scope
    return torch.maximum(mean, in_scope.sub_(0.5).mul_(float("-inf")))  # +inf where not in scope


def victim_scores(mean: Tensor, std: Tensor, beyond: Tensor, out_of_scope: Tensor, scope_size: list[int]) -> Tensor:
    """Scores whose lowest live slot in each row and head is that of `scope_means` (the victim of a step that drops
    one slot, `LayerView.victims_only`): the victim's mean there, +inf elsewhere.

    Why: the scope's selection (`lowest_first`) costs most of the score (~7 of ~10 ms a step over 30 layers x 16 rows
    x ~740 slots, 2 threads), but one victim needs none. It is the slot of the lowest mean in scope, and the slot of
    the lowest mean over every slot that may be (the first among ties, as the cache's argmin takes it) is in scope
    where the slots of its std or lower, itself and every tie included, number no more than the row's scope. Then it
    is the victim. The other rows (or a NaN or infinite mean) are scored by `scope_means`: ~1% of them (all heads of
    a row together; 1,038 of 95,520 in 200 steps of a batch-16 decode of chain prompts at 50%)."""
    lowest, slot = torch.maximum(mean, beyond).min(dim=-1, keepdim=True)
    size = torch.tensor(scope_size, device=std.device).view(-1, 1, 1)
    settled = std.le(std.gather(-1, slot)).sum(-1, keepdim=True).le(size) & lowest.isfinite()
    scores = torch.full_like(mean, float("inf")).scatter_(-1, slot, lowest)
    rows = (~settled).flatten(1).any(-1).nonzero().flatten()  # one synchronisation
    if len(rows):
        scores[rows] = scope_means(mean[rows], std[rows], out_of_scope[rows], [scope_size[r] for r in rows.tolist()])
    return scores


def accumulate(view: LayerView) -> None:
    """RoCo's statistics after any step (a prefill, several queries, the state's first step): each entry rebound."""
    st = view.state
    if "s1" not in st:
        zeros = torch.zeros(view.positions.shape, dtype=torch.float32, device=view.positions.device)
        st["s1"], st["s2"], st["count"] = zeros, zeros.clone(), zeros.clone()
    # the step's queries are its new slots: each valid query sees every valid key at or before its position
    q_pos = view.positions[..., -view.n_new :]
    k_pos = view.positions
    seen = (q_pos[..., None, :] >= k_pos[..., :, None]) & (q_pos[..., None, :] >= 0) & (k_pos[..., :, None] >= 0)
    st["s1"] = st["s1"] + view.attn_sum
    st["s2"] = st["s2"] + view.attn_sq_sum
    st["count"] = st["count"] + seen.sum(-1)


def lowest_first(values: Tensor, sizes: list[int]) -> Tensor:
    """``[R, H, T]`` float32, 1.0 at the chosen slots, else 0.0: in each row ``r`` and head, the ``sizes[r]`` lowest
    values, ties to the lower slot, i.e. the first ``sizes[r]`` of a stable ascending argsort (NaN-free ``values``).

    Why not that argsort: it sorts every row to find one threshold (29 ms of a 36 ms score over 30 layers x 8 rows x
    790 slots, one thread); a selection (``kthvalue``) finds the threshold in linear time, and the slots tied at it
    are taken in slot order by a running count, so the set is the same, bit for bit. One selection per distinct
    size (rows of different budgets: at most one per batch row). The masks are float 0/1 (their counts exact
    below 2**24): bool ones, their sum and running count cost several times more on a CPU."""
    R, H, T = values.shape
    threshold = values.new_empty(R, H, 1)
    size = torch.tensor(sizes, dtype=torch.float32, device=values.device).view(R, 1, 1)
    if len(set(sizes)) == 1 and sizes[0] > 0:  # one budget for every row: one selection, no gathered copy
        threshold = values.kthvalue(min(sizes[0], T), dim=-1, keepdim=True).values
    for k in set(sizes) if len(set(sizes)) > 1 or sizes[0] == 0 else ():
        rows = [r for r, n in enumerate(sizes) if n == k]
        index = torch.tensor(rows, device=values.device)
        if k == 0:  # nothing chosen: below every value
            threshold[index] = float("-inf")
        else:
            threshold[index] = values[index].kthvalue(min(k, T), dim=-1, keepdim=True).values
    below = values.clone().lt_(threshold)
    tied = values.clone().eq_(threshold)
    room = size - below.sum(-1, keepdim=True)  # how many of the tied slots still fit, the lower slots first
    return below.add_(tied.cumsum(-1).le_(room).mul_(tied))
