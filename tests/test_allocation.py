"""Budget allocation (`learnkv.allocation`): hand-checked Ada-KV cases, a plain-loop reference, invariants."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import params_for, prefill_for
from learnkv.kernels.reference import protected_slots, select_keep_reference
from learnkv.allocation import (
    ALLOCATIONS, Allocation, allocate, keep_slots, normalise_scores, pyramid_budgets, slot_totals,
)
from learnkv.pooling import rank_percentiles


def _one_layer(rows):
    """[H][T] lists -> [1, 1, H, T] float scores."""
    return torch.tensor(rows, dtype=torch.float32)[None, None]


def _mask(keep):
    return keep.int()[0, 0].tolist()


# -- Ada-KV on small cases, checked by hand -----------------------------------------------------------------

ADA_SCORES = [[0.9, 0.8, 0.7, 0.6, 0.5, 0.4],
              [0.05, 0.1, 0.02, 0.01, 0.03, 0.3]]


def test_adakv_floor_by_hand():
    # budget 3 per head, pool 2 x 3 = 6, floor int(0.34 x 3) = 1: head 1 keeps its best (slot 5, 0.3); the other 4
    # go to the best remaining of the layer (0.8, 0.7, 0.6, 0.5: head 0's slots 1-4)
    s = _one_layer(ADA_SCORES)
    ones, none = torch.ones_like(s, dtype=torch.bool), torch.zeros_like(s, dtype=torch.bool)
    counts, keep = allocate(s, ones, none, 3, Allocation("head", floor=0.34))
    assert counts.tolist() == [[[5, 1]]]
    assert _mask(keep) == [[1, 1, 1, 1, 1, 0], [0, 0, 0, 0, 0, 1]]
    # no floor: all six of head 0 beat head 1's best (0.4 > 0.3)
    counts, keep = allocate(s, ones, none, 3, Allocation("head", floor=0.0))
    assert _mask(keep) == [[1] * 6, [0] * 6]
    # floor 1.0: every head keeps its own top 3, which is uniform
    _, keep = allocate(s, ones, none, 3, Allocation("head", floor=1.0))
    assert _mask(keep) == [[1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 1]]
    _, uniform = allocate(s, ones, none, 3, Allocation("uniform"))
    assert torch.equal(keep, uniform)


def test_adakv_protected_and_padding_by_hand():
    # slot 2 protected in both heads (forced in, as kvpress's max+1 window scores: it takes the floor first), head
    # 1's slot 0 is padding. floor int(0.67 x 3) = 2: head 0 {2 (protected), 0 (0.9)}, head 1 {2 (protected),
    # 5 (0.3)}; the pool's other 6 - 4 = 2 slots: 0.8 (head 0 slot 1), 0.6 (head 0 slot 3)
    s = _one_layer(ADA_SCORES)
    valid = torch.ones_like(s, dtype=torch.bool)
    valid[0, 0, 1, 0] = False
    protected = torch.zeros_like(valid)
    protected[..., 2] = True
    counts, keep = allocate(s, valid, protected, 3, Allocation("head", floor=0.67))
    assert _mask(keep) == [[1, 1, 1, 1, 0, 0], [0, 0, 1, 0, 0, 1]]
    assert counts.tolist() == [[[4, 2]]]


def test_ties_prefer_the_newer_slot_then_the_lower_head():
    # equal scores, head 0's slot 2 is padding, pool 2 x 1 = 2 and no floor: pool order (slot 2, head 1),
    # (slot 1, head 0), (slot 1, head 1), ...
    s = torch.zeros(1, 1, 2, 3)
    valid = torch.ones_like(s, dtype=torch.bool)
    valid[0, 0, 0, 2] = False
    none = torch.zeros_like(valid)
    _, keep = allocate(s, valid, none, 1, Allocation("head", floor=0.0))
    assert _mask(keep) == [[0, 1, 0], [0, 0, 1]]
    # global: the same order runs over (layer, head), layers first
    s2 = torch.zeros(2, 1, 1, 2)
    _, keep = allocate(s2, torch.ones_like(s2, dtype=torch.bool), torch.zeros_like(s2, dtype=torch.bool), 1,
                       Allocation("global", floor=0.0))
    assert keep.int()[:, 0, 0].tolist() == [[0, 1], [0, 1]]


def _kvpress_adakv(scores, budget, alpha):
    """kvpress `AdaKVPress.compress` on ``[B, H, T]`` distinct scores, all live, nothing protected: the keep mask."""
    B, H, T = scores.shape
    s = scores.clone()
    n_safe = int(budget * alpha)
    s.scatter_(-1, torch.topk(s, n_safe, dim=-1).indices, torch.finfo(s.dtype).max)
    pruned = torch.topk(-s.reshape(B, -1), H * (T - budget), dim=1).indices
    keep = torch.ones(B, H * T, dtype=torch.bool).scatter_(1, pruned, False)
    return keep.view(B, H, T)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("alpha", [0.0, 0.2, 0.5, 1.0])
def test_head_mode_equals_kvpress_adakv(seed, alpha):
    g = torch.Generator().manual_seed(seed)
    L, B, H, T, budget = 2, 3, 4, 17, 5
    scores = torch.rand(L, B, H, T, generator=g)
    ones = torch.ones_like(scores, dtype=torch.bool)
    _, keep = allocate(scores, ones, ~ones, budget, Allocation("head", floor=alpha))
    for layer in range(L):
        assert torch.equal(keep[layer], _kvpress_adakv(scores[layer], budget, alpha))


# -- a plain-loop reference of every mode ----------------------------------------------------------------------

def reference_allocate(scores, valid, protected, budgets, allocation, min_budgets):
    """Python loops over ``[L][B][H][T]`` lists: the documented rule, written independently."""
    L, B, H, T = len(scores), len(scores[0]), len(scores[0][0]), len(scores[0][0][0])
    keep = [[[[False] * T for _ in range(H)] for _ in range(B)] for _ in range(L)]

    def prio(l, b, h, t):
        return math.inf if protected[l][b][h][t] else scores[l][b][h][t]

    def head_order(l, b, h):  # best first; ties: the newer slot
        return sorted((t for t in range(T) if valid[l][b][h][t]), key=lambda t: (-prio(l, b, h, t), -t))

    for b in range(B):
        budget = budgets[b]
        if allocation.mode in ("uniform", "pyramid"):
            per_layer = ([budget] * L if allocation.mode == "uniform"
                         else pyramid_budgets(budget, L, allocation.beta, min_budgets[b]))
            for l in range(L):
                for h in range(H):
                    for t in head_order(l, b, h)[: per_layer[l]]:
                        keep[l][b][h][t] = True
            continue
        pools = [[(l, h) for h in range(H)] for l in range(L)] if allocation.mode == "head" else \
            [[(l, h) for l in range(L) for h in range(H)]]
        floor = int(allocation.floor * budget)
        for pool in pools:
            kept = 0
            for l, h in pool:
                for t in head_order(l, b, h)[:floor]:
                    keep[l][b][h][t] = True
                    kept += 1
            rest = len(pool) * budget - kept
            cands = [(l, h, t) for l, h in pool for t in range(T)
                     if valid[l][b][h][t] and not keep[l][b][h][t]]
            cands.sort(key=lambda c: (-prio(c[0], b, c[1], c[2]), -c[2], pool.index((c[0], c[1]))))
            for l, h, t in cands[:rest]:
                keep[l][b][h][t] = True
    return keep


@st.composite
def cases(draw, mode=None):
    L, B, H, T = (draw(st.integers(1, n)) for n in (3, 3, 3, 10))
    mode = mode or draw(st.sampled_from(ALLOCATIONS))
    floor = draw(st.sampled_from([0.0, 0.2, 0.34, 0.5, 1.0]))
    tied = draw(st.booleans())  # few distinct values: exercises every tie-break
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    scores = (torch.randint(0, 3, (L, B, H, T), generator=g).float() if tied
              else torch.rand(L, B, H, T, generator=g))
    valid = torch.rand(L, B, H, T, generator=g) < draw(st.sampled_from([0.5, 0.9, 1.0]))
    budgets = [draw(st.integers(1, T + 2)) for _ in range(B)]
    # protected: at most n_prot[b] <= budget live slots per head, the first ones of a random pick
    n_prot = [draw(st.integers(0, min(b, 3))) for b in budgets]
    pick = (torch.rand(L, B, H, T, generator=g) < 0.4) & valid
    rank = pick.long().cumsum(-1)
    protected = pick & (rank <= torch.tensor(n_prot).view(1, B, 1, 1))
    min_budgets = [max(p, 1) for p in n_prot]
    return scores, valid, protected, budgets, Allocation(mode, floor=floor), min_budgets


@settings(max_examples=150, deadline=None)
@given(cases())
def test_allocate_matches_the_loop_reference(case):
    scores, valid, protected, budgets, allocation, min_budgets = case
    _, keep = allocate(scores, valid, protected, budgets, allocation, min_budgets)
    expected = reference_allocate(scores.tolist(), valid.tolist(), protected.tolist(), budgets, allocation,
                                  min_budgets)
    assert keep.tolist() == expected


@settings(max_examples=150, deadline=None)
@given(cases())
def test_allocation_invariants(case):
    scores, valid, protected, budgets, allocation, min_budgets = case
    L, B, H, T = scores.shape
    counts, keep = allocate(scores, valid, protected, budgets, allocation, min_budgets)
    assert counts.dtype == torch.int64 and counts.shape == (L, B, H)
    assert torch.equal(counts, keep.sum(-1))
    assert not (keep & ~valid).any()  # padding never kept
    assert not (protected & ~keep).any()  # protected always kept
    totals = counts.sum((0, 2))
    for b in range(B):
        assert int(totals[b]) <= L * H * budgets[b]  # the row's total budget, under every allocation
    n_valid = valid.sum(-1)
    if allocation.mode in ("head", "global"):
        floor = torch.tensor([int(allocation.floor * b) for b in budgets]).view(1, B, 1)
        assert (counts >= torch.minimum(floor, n_valid)).all()
        if allocation.mode == "head":  # a layer's pool never exceeds H x budget
            assert (counts.sum(-1) <= H * torch.tensor(budgets)).all()
    else:
        per_layer = torch.tensor([[budgets[b]] * L if allocation.mode == "uniform"
                                  else pyramid_budgets(budgets[b], L, allocation.beta, min_budgets[b])
                                  for b in range(B)]).T
        assert torch.equal(counts, torch.minimum(per_layer[..., None], n_valid))
    # each head keeps a top of its own ranking: no kept live slot scores below a dropped one
    prio = scores.masked_fill(protected, math.inf)
    low_kept = prio.masked_fill(~keep, math.inf).amin(-1)
    high_dropped = prio.masked_fill(keep | ~valid, -math.inf).amax(-1)
    assert (low_kept >= high_dropped).all()
    # a row of the batch keeps what it keeps alone
    b = B - 1
    _, alone = allocate(scores[:, b:], valid[:, b:], protected[:, b:], budgets[b:], allocation, min_budgets[b:])
    assert torch.equal(keep[:, b:], alone)
    # a pool that holds fewer live slots than its total keeps them all
    if allocation.mode == "global":
        for b in range(B):
            if int(n_valid[:, b].sum()) <= L * H * budgets[b]:
                assert torch.equal(keep[:, b], valid[:, b])


# -- uniform is today's selection ----------------------------------------------------------------------------

@settings(max_examples=100, deadline=None)
@given(st.data())
def test_uniform_equals_select_keep_reference(data):
    # the cache's layout: positions per row (left padding -1, dead slots -1), protection from positions
    L, B, H, T = (data.draw(st.integers(1, n)) for n in (3, 3, 3, 12))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    tied = data.draw(st.booleans())
    scores = torch.randint(0, 3, (L, B, H, T), generator=g).float() if tied else torch.randn(L, B, H, T, generator=g)
    positions = torch.arange(T).repeat(B, H, 1)
    positions[torch.rand(B, H, T, generator=g) < 0.2] = -1
    keep = [data.draw(st.integers(1, T)) for _ in range(B)]
    n_sink = [data.draw(st.integers(0, k)) for k in keep]
    n_recent = [data.draw(st.integers(0, k - s)) for k, s in zip(keep, n_sink)]
    valid = (positions >= 0).expand(L, B, H, T)
    protected = protected_slots(positions, n_sink, n_recent).expand(L, B, H, T)
    _, mask = allocate(scores, valid, protected, keep, Allocation("uniform"))
    for layer in range(L):
        index = select_keep_reference(scores[layer], positions, keep, n_sink, n_recent)
        expected = torch.zeros(B, H, T + 1, dtype=torch.bool).scatter_(-1, index.clamp(min=-1) % (T + 1), True)
        assert torch.equal(mask[layer], expected[..., :T] & valid[layer])


def test_uniform_equals_per_head_topk():
    g = torch.Generator().manual_seed(0)
    L, B, H, T = 3, 2, 4, 33
    scores = torch.randn(L, B, H, T, generator=g)  # distinct: torch.topk's order among ties is unspecified
    ones = torch.ones_like(scores, dtype=torch.bool)
    for budget in (1, 7, 33, 40):
        counts, keep = allocate(scores, ones, ~ones, budget, Allocation("uniform"))
        k = min(budget, T)
        expected = torch.zeros_like(ones).scatter_(-1, scores.topk(k, dim=-1).indices, True)
        assert torch.equal(keep, expected)
        assert (counts == k).all()


# -- pyramid schedule ------------------------------------------------------------------------------------------

def test_pyramid_by_hand():
    # lo = max(10 / 20, 1) = 1, hi = 2 x 10 - 1 = 19, step 6: exact 19, 13, 7, 1
    assert pyramid_budgets(10, 4) == [19, 13, 7, 1]
    # lo = 100 / 20 = 5, hi = 195, step 190 / 3: 195, 131.67, 68.33, 5 -> floors 195, 131, 68, 5 (sum 399), the
    # leftover token goes to the largest remainder (layer 1, .67)
    assert pyramid_budgets(100, 4) == [195, 132, 68, 5]
    assert pyramid_budgets(10, 1) == [10]
    # lo = 10 / 20 = 0.5, hi = 19.5: exact 19.5, 10, 0.5 -> floors 19, 10, 0 (sum 29); layers 0 and 2 tie on the
    # remainder, the shallower one gets the token
    assert pyramid_budgets(10, 3, min_budget=0) == [20, 10, 0]
    assert pyramid_budgets(4, 3, min_budget=4) == [4, 4, 4]  # the floor at the mean: flat


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 5000), st.integers(1, 80), st.floats(1.0, 100.0), st.data())
def test_pyramid_sums_exactly(budget, n_layers, beta, data):
    min_budget = data.draw(st.integers(0, budget))
    out = pyramid_budgets(budget, n_layers, beta, min_budget)
    assert len(out) == n_layers and sum(out) == n_layers * budget
    assert all(a >= b for a, b in zip(out, out[1:]))  # never rises with depth
    assert min(out) >= min_budget
    lo = max(budget / beta, min_budget)
    assert all(abs(b - (2 * budget - lo - i * (2 * budget - 2 * lo) / max(n_layers - 1, 1))) < 1 + 1e-6
               for i, b in enumerate(out)) or n_layers == 1  # within one token of the linear schedule


def test_pyramid_refuses_bad_settings():
    with pytest.raises(ValueError, match="min_budget"):
        pyramid_budgets(3, 4, min_budget=4)
    with pytest.raises(ValueError):
        pyramid_budgets(3, 0)
    with pytest.raises(ValueError, match="floor"):
        Allocation("head", floor=1.5)
    with pytest.raises(ValueError, match="mode"):
        Allocation("per-token")


def test_protected_that_cannot_fit_is_refused():
    s = torch.rand(4, 1, 1, 8)
    valid = torch.ones_like(s, dtype=torch.bool)
    protected = torch.zeros_like(valid)
    protected[..., :3] = True  # 3 per head; the deepest pyramid layer of budget 4 gets 1 unless told
    with pytest.raises(ValueError, match="protected"):
        allocate(s, valid, protected, 4, Allocation("pyramid"))
    counts, keep = allocate(s, valid, protected, 4, Allocation("pyramid"), min_budget=3)
    assert counts.sum() == 16 and keep[..., :3].all()


# -- normalisation -------------------------------------------------------------------------------------------

def test_normalise_rules():
    g = torch.Generator().manual_seed(1)
    scores = torch.rand(2, 3, 4, 9, generator=g)
    valid = torch.rand(2, 3, 4, 9, generator=g) < 0.7
    valid[..., 0] = True
    mass = normalise_scores(scores, valid, "mass")
    torch.testing.assert_close(mass.sum(-1), torch.ones(2, 3, 4))
    assert (mass[~valid] == 0).all()
    torch.testing.assert_close(mass * scores.masked_fill(~valid, 0).sum(-1, keepdim=True),
                               scores.masked_fill(~valid, 0))
    logit = normalise_scores(scores * 5 - 3, valid, "logit")
    torch.testing.assert_close(logit, normalise_scores(scores * 5, valid, "logit"))  # a shift changes nothing
    torch.testing.assert_close(logit.sum(-1), torch.ones(2, 3, 4))
    assert torch.equal(normalise_scores(scores, valid, "rank"), rank_percentiles(scores, valid))
    assert torch.equal(normalise_scores(scores, valid, "raw"), scores)
    with pytest.raises(ValueError, match="nonnegative"):
        normalise_scores(scores - 1, valid, "mass")
    with pytest.raises(ValueError, match="unknown"):
        normalise_scores(scores, valid, "zscore")
    assert not normalise_scores(scores, torch.zeros_like(valid), "logit").isnan().any()
    # a refreshing policy's unscored tokens (+inf, kept) stay above every slot; the others are still a softmax
    unscored = scores.clone()
    unscored[..., -2:] = float("inf")
    live = valid.clone()
    live[..., -2:] = True
    out = normalise_scores(unscored, live, "logit")
    assert torch.isinf(out[..., -2:]).all() and not out.isnan().any()
    torch.testing.assert_close(out[..., :-2], normalise_scores(scores[..., :-2], valid[..., :-2], "logit"))


def test_mass_rule_moves_budget_to_the_peaked_head():
    # two heads of one layer, pool 2 x 4 = 8, no floor. Raw, head 0's flat scores (1.0 each) beat all of head 1's;
    # as distributions over each head's slots head 0's are 1/8 each and head 1's two peaks (0.45) outrank them
    raw = _one_layer([[1.0] * 8, [0.9, 0.9] + [0.2 / 6] * 6])
    ones = torch.ones_like(raw, dtype=torch.bool)
    counts, _ = allocate(raw, ones, ~ones, 4, Allocation("head", floor=0.0))
    assert counts.tolist() == [[[8, 0]]]
    counts, _ = allocate(normalise_scores(raw, ones, "mass"), ones, ~ones, 4, Allocation("head", floor=0.0))
    assert counts.tolist() == [[[6, 2]]]


# -- padded buffers vs live slots ----------------------------------------------------------------------------

def test_keep_slots_and_totals():
    keep = torch.tensor([[[[1, 0, 1, 1], [0, 1, 0, 0]]],
                         [[[0, 0, 0, 1], [1, 0, 0, 1]]]], dtype=torch.bool)  # [L 2, B 1, H 2, T 4]
    slots = keep_slots(keep)
    assert slots[0].tolist() == [[[0, 2, 3], [-1, -1, 1]]]
    assert slots[1].tolist() == [[[-1, 3], [0, 3]]]
    live, padded = slot_totals(keep.sum(-1))
    assert live.tolist() == [7]  # what a paged per-head layout holds
    assert padded.tolist() == [2 * (3 + 2)]  # every head as wide as its layer's widest


# -- wired into the cache: every step of a batched decode, end to end ------------------------------------------

#: (policy, its parameters, a prefill policy): mass-rule and rank-rule scores, a lagged policy (lazy, keep target
#: below the budget) that observes nothing at the prefill and so compresses long prompts with snapkv, and the
#: oracle (the headroom under each allocation)
DECODES = [("h2o", {"n_recent": 2}, None), ("tova", {}, None), ("snapkv", {}, None), ("knorm", {}, None),
           ("streaming", {}, None), ("lazy", {}, "snapkv"), ("oracle", {"horizon": 8}, None), ("learned", {}, None)]
BUDGETS = [6, 9, 14]  # rows of different budgets; the prompts (20, 15 and 9 tokens) are over, over and within them


@pytest.fixture(scope="module")
def model3():
    from learnkv.model import tiny_model  # transformers only for the wired tests

    return tiny_model(seed=0, num_layers=3)


def _batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (3, 20), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    mask[2, :11] = 0
    return ids, mask


def _decode(model, policy, params, prefill, allocation, observer=None, max_new_tokens=14):
    from learnkv import generate  # the decode loop (transformers) only for the wired tests

    ids, mask = _batch()
    return generate(model, input_ids=ids, attention_mask=mask, policy=policy, policy_params=params,
                    prefill_policy=prefill, budget=BUDGETS, max_new_tokens=max_new_tokens, allocation=allocation,
                    observer=observer)


def _head_counts(cache):
    """``[L, B, H]`` live slots, counted from the slot positions (not from the cache's own book-keeping)."""
    return torch.stack([(layer.positions >= 0).sum(-1) for layer in cache.layers])


@pytest.mark.parametrize("mode", ALLOCATIONS)
@pytest.mark.parametrize("policy,params,prefill", DECODES, ids=[d[0] for d in DECODES])
def test_total_budget_holds_at_every_step(model3, mode, policy, params, prefill):
    if policy == "learned":  # a random-init scorer for the 3-layer model (its logits: the ``logit`` rule)
        params = {**params_for(policy, 3), "n_sink": 1, "n_recent": 2}  # windows that fit a budget of 6
        prefill = prefill_for(policy).get("prefill_policy")
    steps, books, caches = [], [], []

    def observe(cache):
        steps.append(_head_counts(cache))
        books.append(cache.kept_slots[-1] if cache.kept_slots else None)
        caches[:] = [cache]

    result = _decode(model3, policy, params, prefill, mode, observe)
    L, B, H = steps[0].shape
    budget = torch.tensor(BUDGETS)
    rows = [caches[0].row_policies] + ([caches[0].prefill_rows] if caches[0].prefill_rows else [])
    protect = [max(p.n_sink + p.n_recent for p in ps) for ps in zip(*rows)]
    layer_budget = torch.tensor([pyramid_budgets(b, L, 20.0, n) for b, n in zip(BUDGETS, protect)]).T  # [L, B]
    assert len(steps) == 14
    for counts, book in zip(steps, books):
        assert (counts.sum((0, 2)) <= L * H * budget).all()  # equal bytes: the row's total over layers and heads
        if mode == "uniform":
            assert (counts <= budget[None, :, None]).all()
        elif mode == "pyramid":
            assert (counts <= layer_budget[..., None]).all()
        elif mode == "head":
            assert (counts.sum(-1) <= H * budget[None, :]).all()
        if mode != "uniform":  # the cache's own count of live slots (what live_kv_bytes reads) is the real one
            assert book == counts.sum(-1).tolist()
    if mode == "pyramid":  # the deepest layer held fewer than the shallowest at some step
        assert any(bool((c[-1].amax(-1) < c[0].amax(-1)).any()) for c in steps)
    live = result.live_kv_bytes_rows or result.peak_kv_bytes_rows
    assert all(lv <= pk for lv, pk in zip(live, result.peak_kv_bytes_rows))


def _peaks(steps, prompts, per_head_slot):
    """Per row: the most live slots (over layers and heads) and padded slots (each layer's widest head x H) read in
    one forward pass, counted from the observed slot positions (`learnkv.decode.peak_attended`'s rule)."""
    L, B, H = steps[0].shape
    live = [L * H * n for n in prompts]
    padded = list(live)
    for c in steps[:-1]:  # what a step held, plus the next step's token in every layer and head
        for b in range(B):
            live[b] = max(live[b], int(c[:, b].sum()) + L * H)
            padded[b] = max(padded[b], H * int(c[:, b].amax(-1).sum()) + L * H)
    return [n * per_head_slot for n in live], [n * per_head_slot for n in padded]


@pytest.mark.parametrize("mode", ["head", "global"])
def test_heads_keep_different_counts_and_live_bytes_count_them(model3, mode):
    steps = []
    result = _decode(model3, "h2o", {"n_recent": 1}, None, mode, lambda c: steps.append(_head_counts(c)))
    spread = [int((c.amax(-1) - c.amin(-1)).max()) for c in steps]
    assert max(spread) > 0  # some layer's heads hold different numbers of slots: the budget moved
    if mode == "global":  # and, across layers, some layer holds more than the uniform share
        assert any(bool((c.sum(-1) > c.new_tensor(BUDGETS) * c.shape[-1]).any()) for c in steps)
    # live KV: a paged per-head layout; peak KV: learnkv's padded buffers (the widest head of a layer, per row)
    per_head_slot = 2 * model3.config.head_dim * 4  # keys + values, float32
    live, padded = _peaks(steps, [20, 15, 9], per_head_slot)
    assert result.live_kv_bytes_rows == live and result.peak_kv_bytes_rows == padded
    assert any(lv < pk for lv, pk in zip(live, padded))
    assert result.summary()["live_kv_bytes"] == sum(live) < result.summary()["peak_kv_bytes"]


@pytest.mark.parametrize("policy", ["h2o", "knorm"])
@pytest.mark.parametrize("mode", ["head", "global"])
def test_a_floor_of_the_whole_budget_is_uniform(model3, policy, mode):
    # every head keeps its own top `budget` first, leaving the pool nothing: the uniform decode, token for token
    uniform = _decode(model3, policy, {"n_recent": 2}, None, "uniform")
    floored = _decode(model3, policy, {"n_recent": 2}, None, Allocation(mode, floor=1.0))
    assert torch.equal(uniform.tokens, floored.tokens)
    assert uniform.kept_rows == floored.kept_rows
    # the floor as a grid item's key reaches the cache too; a lower one moves budget between heads
    as_item = _decode(model3, policy, {"n_recent": 2, "allocation": mode, "allocation_floor": 1.0}, None, None)
    assert as_item.kept_rows == uniform.kept_rows
    if policy == "h2o":  # (key norms go through rank percentiles, spread alike in every head: see `allocation`)
        moved = _decode(model3, policy, {"n_recent": 2, "allocation": mode, "allocation_floor": 0.0}, None, None)
        assert moved.kept_rows != uniform.kept_rows


def test_uniform_is_the_default_bit_for_bit(model3):
    default = _decode(model3, "h2o", {}, None, None)
    uniform = _decode(model3, "h2o", {}, None, "uniform")
    assert torch.equal(default.tokens, uniform.tokens) and default.kept_rows == uniform.kept_rows
    assert default.live_kv_bytes_rows is None and default.live_kv_bytes == default.peak_kv_bytes


def _hand_inputs(records):
    """From each layer's recorded positions and raw H2O scores: ``[L][B][H][T]`` scores made distributions over
    each head's live slots (the ``mass`` rule, by hand), live slots, protected slots (sinks, recent window), padded
    to the widest layer."""
    B, H = records[0][0].shape[:2]
    T = max(r[0].shape[-1] for r in records)
    scores, valid, protected = [], [], []
    for positions, raw, sinks, recents, _ in records:
        P, S = positions.tolist(), raw.tolist()
        pad = [0] * (T - len(P[0][0]))
        scores.append([]), valid.append([]), protected.append([])
        for b in range(B):
            for out in (scores, valid, protected):
                out[-1].append([])
            for h in range(H):
                live = [p >= 0 for p in P[b][h]]
                total = sum(s for s, ok in zip(S[b][h], live) if ok)
                newest = max(p for p in P[b][h])
                scores[-1][b].append([s / total if ok else 0.0 for s, ok in zip(S[b][h], live)] + pad)
                valid[-1][b].append(live + [False] * len(pad))
                protected[-1][b].append([ok and (p < sinks[b] or p > newest - recents[b])
                                         for p, ok in zip(P[b][h], live)] + [False] * len(pad))
    return scores, valid, protected


@pytest.mark.parametrize("mode", ["head", "global"])
def test_the_cache_keeps_what_the_loop_reference_keeps(model3, mode, monkeypatch):
    """End to end: at every eviction the slots the decode keeps are the plain-loop reference's (Ada-KV for
    ``head``; one pool per row for ``global``) on H2O's scores made distributions per head by hand."""
    from learnkv.cache import BudgetCache  # the cache (transformers) only for the wired tests

    # the tiny model's heads are alike, so this floor rarely binds here (it is checked by hand above and by
    # test_a_floor_of_the_whole_budget_is_uniform); the normalisation and the pools are what this checks
    allocation = Allocation(mode, floor=0.5)
    seen, checked = {}, []
    inner_evict, inner_end = BudgetCache._evict_per_head, BudgetCache.end_step

    def evict(self, layer, positions, scores, sinks, recents):
        seen[layer.layer_idx] = (positions.clone(), scores.clone(), list(sinks), list(recents), list(self._due))
        return inner_evict(self, layer, positions, scores, sinks, recents)

    def end_step(self):
        inner_end(self)
        if not seen:
            return
        records = [seen.pop(i) for i in range(len(self.layers))]
        scores, valid, protected = _hand_inputs(records)
        if mode == "head":
            expected = [reference_allocate([s], [v], [p], self.keep, allocation, None)[0]
                        for s, v, p in zip(scores, valid, protected)]
        else:
            expected = reference_allocate(scores, valid, protected, self.keep, allocation, None)
        for i, layer in enumerate(self.layers):
            before, after = records[i][0].tolist(), layer.positions.tolist()
            for b, row in enumerate(before):
                for h, slots in enumerate(row):
                    keep = expected[i][b][h] if records[i][4][b] else valid[i][b][h]  # the rows due in the layer
                    assert {p for p in after[b][h] if p >= 0} == {p for p, k in zip(slots, keep) if k}
        checked.append(self.step)

    monkeypatch.setattr(BudgetCache, "_evict_per_head", evict)
    monkeypatch.setattr(BudgetCache, "end_step", end_step)
    _decode(model3, "h2o", {"n_recent": 1}, None, allocation)
    assert len(checked) >= 10  # the prefill and (once full) every decode step evicted and was checked


# -- the setting reaches every entry point ---------------------------------------------------------------------

def test_the_setting_in_eviction_generate_and_grid_items(model3):
    from learnkv.eval.run import build_spec  # the evaluation grid only for this test
    from learnkv.settings import Eviction

    settings = Eviction("h2o", {"allocation": "head", "n_recent": 2}, budget=8)
    assert settings.allocation == "head" and settings.params == {"n_recent": 2}
    settings.check()
    floored = Eviction("h2o", {"allocation": "global", "allocation_floor": "0.1"})
    assert floored.resolved_allocation == Allocation("global", floor=0.1) and floored.params == {}
    with pytest.raises(ValueError, match=r"allocation.floor must be in \[0.0, 1.0\], got 2.0"):
        Eviction("h2o", {"allocation": "head", "allocation_floor": 2})
    spec = build_spec("h2o,h2o:allocation=head,h2o:allocation=global", [0.25], ["fidelity"], limit=2)
    assert [r.params for r in spec.runs] == [{}, {"allocation": "head"}, {"allocation": "global"}]
    # the row's parameters reach the decode's settings (`Task.eviction`), which builds the cache with them
    assert spec.tasks[0].eviction(spec.config(spec.runs[1], [8])).allocation == "head"
    steps = []
    _decode(model3, "h2o", {"allocation": "head"}, None, None, lambda c: steps.append(c.allocation.mode))
    assert set(steps) == {"head"}


@pytest.mark.parametrize("bad", ["bogus", "Head", 3])
def test_bad_allocations_are_refused_in_one_line(bad):
    from learnkv.settings import Eviction  # settings only for this test

    with pytest.raises(ValueError, match="allocation must be one of uniform, head, pyramid, global") as e:
        Eviction("h2o", budget=8, allocation=bad)
    assert "\n" not in str(e.value)


def test_token_only_allocations_refuse_blocks():
    from learnkv.eval.run import build_spec  # the evaluation grid only for this test
    from learnkv.settings import Eviction

    for mode in ("head", "pyramid", "global"):
        with pytest.raises(ValueError, match=f"allocation '{mode}' needs token eviction"):
            Eviction("h2o", budget=64, granularity="block", allocation=mode).check()
        with pytest.raises(ValueError, match="needs token eviction"):
            build_spec(f"paged:allocation={mode}", [64])
    Eviction("h2o", budget=64, granularity="block").check()  # uniform: as before


def test_cli_and_evaluate_refuse_a_bad_allocation_before_a_model_loads(capsys):
    import importlib.util
    from pathlib import Path

    from learnkv.__main__ import main  # the command line only for this test

    code = main(["generate", "--policy", "h2o", "--budget", "8", "--prompt", "hi", "--allocation", "bogus"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "allocation must be one of" in err
    code = main(["generate", "--policy", "h2o", "--budget", "8", "--prompt", "hi", "--allocation", "head",
                 "--allocation-floor", "1.5"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "allocation.floor must be in" in err
    spec = importlib.util.spec_from_file_location("_evaluate", Path(__file__).resolve().parents[1] / "evaluate.py")
    evaluate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(evaluate)
    code = evaluate.main(["--policy", "h2o:allocation=bogus", "--budget", "0.25"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "allocation must be one of" in err
