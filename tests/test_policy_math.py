"""Policy math on hand-made attention: each policy's state, scores and kept set, step by step, against plain-python
references written from the spec (/work/shared/research/algorithms.md §1 LazyEviction, §2 RoCo, §3 PagedEviction,
§5 kvpress baselines).

No model is involved. `MiniCache` drives one layer in the order `BudgetCache.observe` uses: append the step's slots,
zero-pad the policy state, `update`, then, when the layer is over the budget, `score` -> `select_keep_reference`
(down to the keep target) -> gather. The attention
comes from a hand-made matrix indexed by original positions, ``A[b, h, query_pos, key_pos]``. The references use
python floats, loops and `math`, never the code under test.
"""

import math
from types import SimpleNamespace

import pytest
import torch
from transformers.models.llama.modeling_llama import repeat_kv

from learnkv.kernels.reference import gather_tokens_reference, select_keep_reference
from learnkv.attention import learnkv_attention
from learnkv.policies import make_policy
from learnkv.policies.base import LayerView
from learnkv.policies.snapkv import SPARE_ROWS
from learnkv.sliding_rows import window_view

# -- the driver: one cache layer, by hand -----------------------------------------------------------------------


def causal_attention(B, H, N, seed, low=0.0, high=1.0, normalize=True):
    """``[B, H, N, N]`` random attention by position: query q attends to keys 0..q only."""
    g = torch.Generator().manual_seed(seed)
    a = (low + (high - low) * torch.rand(B, H, N, N, generator=g)).tril()
    return a / a.sum(-1, keepdim=True) if normalize else a


def random_kv(B, H, N, D, seed):
    """Keys and values by position, with norms that vary a lot from token to token."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, H, N, D, generator=g) * (0.2 + 2 * torch.rand(B, H, N, 1, generator=g))
    v = torch.randn(B, H, N, D, generator=g) * (0.2 + 2 * torch.rand(B, H, N, 1, generator=g))
    return k, v


class MiniCache:
    """One layer of `BudgetCache` (no padding): feed n tokens, and the policy updates and maybe evicts."""

    def __init__(self, policy, budget, attn=None, keys=None, values=None, B=1, H=1, N=64, D=4):
        self.policy = policy.resolve(budget)
        self.budget = budget
        self.keep = self.policy.keep_target(budget)
        if keys is None:
            keys, values = random_kv(B, H, N, D, seed=123)
        self.A, self.K, self.V = attn, keys, values  # indexed by original position
        self.keys, self.values = keys[:, :, :0], values[:, :, :0]
        self.positions = torch.zeros(*keys.shape[:2], 0, dtype=torch.long)
        self.state = {}
        self.step, self.n_fed = -1, 0
        self.scores = None  # the scores of this step's eviction (None: no eviction)
        self.before = None  # positions just before that eviction

    def feed(self, n):
        """One forward pass of ``n`` new tokens (the prefill, then n=1 per decode step). Returns its LayerView."""
        self.step += 1
        new = torch.arange(self.n_fed, self.n_fed + n)
        self.n_fed += n
        B, H = self.positions.shape[:2]
        self.keys = torch.cat([self.keys, self.K[:, :, new]], dim=-2)
        self.values = torch.cat([self.values, self.V[:, :, new]], dim=-2)
        self.positions = torch.cat([self.positions, new.expand(B, H, n)], dim=-1)
        self.state = {k: torch.cat([t, t.new_zeros(*t.shape[:-1], n)], dim=-1) for k, t in self.state.items()}
        attn = attn_sum = attn_sq_sum = None
        if self.A is not None:  # the step's query rows over the cached slots: rows[b, h, i, t] = A[b, h, new[i], pos]
            rows = torch.stack([
                torch.stack([self.A[b, h][new][:, self.positions[b, h]] for h in range(H)]) for b in range(B)
            ])
            w = min(self.policy.obs_window, n)
            attn, attn_sum, attn_sq_sum = rows[:, :, -w:], rows.sum(2), (rows * rows).sum(2)
        view = LayerView(layer=0, step=self.step, keys=self.keys, values=self.values, positions=self.positions,
                         n_new=n, attn=attn, attn_sum=attn_sum, attn_sq_sum=attn_sq_sum, keep=self.keep,
                         state=self.state)
        self.policy.update(view)
        self.scores = self.before = None
        if self.positions.shape[-1] > self.budget:  # over the budget: evict down to the keep target
            self.scores, self.before = self.policy.score(view), self.positions.tolist()
            p = self.policy
            idx = select_keep_reference(self.scores, self.positions, self.keep, p.n_sink, p.n_recent,
                                        p.block_size_at(self.step))
            self.keys = gather_tokens_reference(self.keys, idx, dim=-2)
            self.values = gather_tokens_reference(self.values, idx, dim=-2)
            self.positions = gather_tokens_reference(self.positions, idx, dim=-1)
            self.state = {k: gather_tokens_reference(t, idx, dim=-1) for k, t in self.state.items()}
        return view


def feed_all(cache, T0, steps):
    """Yield (step, n_fed) after the prefill of T0 tokens and after each of `steps` decode steps."""
    for step in range(steps + 1):
        cache.feed(T0 if step == 0 else 1)
        yield step, cache.n_fed


# -- plain references -------------------------------------------------------------------------------------------


def ref_keep(scores, keep, protected=()):
    """Keep the protected positions, then the highest scores up to `keep`; ties go to the more recent position."""
    prot = [p for p in scores if p in protected]
    rest = sorted((p for p in scores if p not in protected), key=lambda p: (scores[p], p), reverse=True)
    return sorted(prot + rest[: keep - len(prot)])


def recent(cached, n_recent):
    """The n_recent newest positions (protection is by position)."""
    newest = max(cached)
    return {p for p in cached if p > newest - n_recent}


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def close(x, y, tol=1e-5):
    return abs(x - y) <= tol * (1 + abs(y))


def assert_scores(cache, b, h, expected, tol=1e-5):
    """The eviction scores of head (b, h), slot by slot, against expected[position] (positions it lists)."""
    assert expected
    got = cache.scores[b, h].tolist()
    for slot, p in enumerate(cache.before[b][h]):
        if p not in expected:  # only when a test restricts the comparison to some positions on purpose
            continue
        assert close(got[slot], expected[p], tol), f"b{b} h{h} position {p}: score {got[slot]} != {expected[p]}"


def kept_positions(cache, b, h):
    return cache.positions[b, h].tolist()


# -- 1. H2O -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1], ids=["seed0", "seed1"])
def test_h2o_accumulates_all_attention_and_protects_recent(seed):
    B, H, T0, steps, budget, n_recent = 2, 2, 10, 14, 8, 3
    A = causal_attention(B, H, T0 + steps, seed)
    a = A.tolist()
    cache = MiniCache(make_policy("h2o", n_recent=n_recent), budget, attn=A, B=B, H=H, N=T0 + steps)
    ref = [[[] for _ in range(H)] for _ in range(B)]
    protection_mattered = False
    for step, fed in feed_all(cache, T0, steps):
        for b in range(B):
            for h in range(H):
                cached = ref[b][h] + list(range(fed - (T0 if step == 0 else 1), fed))
                # every query so far (prompt queries included) at position >= p attended to p
                acc = {p: sum(a[b][h][q][p] for q in range(p, fed)) for p in cached}
                if len(cached) > budget:
                    assert_scores(cache, b, h, acc)
                    prot = recent(cached, n_recent)
                    cached = ref_keep(acc, budget, prot)
                    evicted = set(acc) - set(cached)
                    protection_mattered |= min(acc[p] for p in prot) < max(acc[p] for p in evicted)
                else:
                    assert cache.scores is None
                ref[b][h] = cached
                assert kept_positions(cache, b, h) == cached, f"step {step} b{b} h{h}"
                state = cache.state["acc"][b, h].tolist()
                assert all(close(state[i], acc[p]) for i, p in enumerate(cached)), f"acc state, step {step}"
    assert protection_mattered, "the case never needed the recent window; pick another seed"


def test_h2o_recent_window_defaults_to_half_the_budget():
    assert make_policy("h2o").resolve(10).n_recent == 5


# -- 2. TOVA ----------------------------------------------------------------------------------------------------


def test_tova_scores_last_query_averaged_over_all_kv_heads():
    B, H, T0, steps, budget = 2, 2, 12, 8, 8
    A = causal_attention(B, H, T0 + steps, seed=3)
    a = A.tolist()
    cache = MiniCache(make_policy("tova"), budget, attn=A, B=B, H=H, N=T0 + steps)
    ref = [[] for _ in range(B)]  # every head keeps the same tokens
    for step, fed in feed_all(cache, T0, steps):
        for b in range(B):
            cached = ref[b] + list(range(fed - (T0 if step == 0 else 1), fed))
            score = {p: sum(a[b][h][fed - 1][p] for h in range(H)) / H for p in cached}
            if len(cached) > budget:
                for h in range(H):
                    assert_scores(cache, b, h, score)
                assert torch.equal(cache.scores[b, 0], cache.scores[b, 1])
                cached = ref_keep(score, budget)  # no recent window, no sinks
            ref[b] = cached
            for h in range(H):
                assert kept_positions(cache, b, h) == cached, f"step {step} b{b} h{h}"


# -- 3. SnapKV --------------------------------------------------------------------------------------------------




def snapkv_row(row, window):
    """A one-row prefill view of a hand-made attention row, and a policy that has seen it."""
    T = len(row)
    policy = make_policy("snapkv", window=window).resolve(16)
    row = torch.tensor(row)
    view = LayerView(layer=0, step=0, keys=torch.zeros(1, 1, T, 2), values=torch.zeros(1, 1, T, 2),
                     positions=torch.arange(T).view(1, 1, T), n_new=T, attn=row.view(1, 1, 1, T),
                     attn_sum=row.view(1, 1, T), keep=4)
    policy.update(view)
    return policy.score(view)[0, 0].tolist()


def test_snapkv_pooling_divides_by_kernel_size_at_the_edges():
    """avg_pool1d(kernel 5, stride 1, padding 2, count_include_pad=True): zero padding counts, always / 5."""
    got = snapkv_row([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], window=1)
    assert got[:3] == pytest.approx([(1 + 2 + 3) / 5, (1 + 2 + 3 + 4) / 5, (1 + 2 + 3 + 4 + 5) / 5], abs=1e-6)


def test_snapkv_pooling_stops_at_the_window():
    """The window (slot 5) is not pooled into its neighbours: slots 3 and 4 see zero padding on their right."""
    got = snapkv_row([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], window=1)
    assert got[:5] == pytest.approx([6 / 5, 10 / 5, 15 / 5, (2 + 3 + 4 + 5) / 5, (3 + 4 + 5) / 5], abs=1e-6)


def run_snapkv(spec_edge):
    """Prefill over the budget, then decode, against the spec.

    spec_edge=False checks what the implementation and the spec agree on: the sliding window of query rows and
    the scores of every slot at least 3 slots before the window; the kept set must hold the window and the budget.
    spec_edge=True checks every non-window score and the kept set, with kvpress's pooling (keys before the window).
    """
    B, H, T0, steps, budget, window = 1, 2, 12, 2 * SPARE_ROWS + 4, 10, 3  # the window wraps to the top twice
    A = causal_attention(B, H, T0 + steps, seed=4)
    a = A.tolist()
    cache = MiniCache(make_policy("snapkv", window=window), budget, attn=A, B=B, H=H, N=T0 + steps)
    assert cache.policy.n_recent == window
    ref = [[] for _ in range(H)]
    n_evictions = 0
    for step, fed in feed_all(cache, T0, steps):
        queries = list(range(max(0, fed - window), fed))  # the last `window` queries (the oldest row dropped)
        for h in range(H):
            cached = ref[h] + list(range(fed - (T0 if step == 0 else 1), fed))
            if len(cached) > budget:
                n_evictions += 1
                prefix = cached[: len(cached) - window]  # the keys before the observation window, in slot order
                s = [sum(a[0][h][q][p] for q in queries) / len(queries) for p in prefix]
                pooled = {p: sum(s[j] for j in range(i - 2, i + 3) if 0 <= j < len(s)) / 5
                          for i, p in enumerate(prefix)}
                if spec_edge:
                    assert_scores(cache, 0, h, pooled)
                    pooled.update({p: math.inf for p in cached[len(prefix):]})
                    cached = ref_keep(pooled, budget, recent(cached, window))
                else:
                    assert_scores(cache, 0, h, {p: pooled[p] for p in prefix[: len(prefix) - 2]})
                    cached = kept_positions(cache, 0, h)
                    assert len(cached) == budget and set(cached) >= recent(queries, window)
            ref[h] = cached
            assert kept_positions(cache, 0, h) == cached, f"step {step} h{h}"
            rows = window_view(cache.state["window_attn"], window, SPARE_ROWS, step)[0, h].tolist()  # the last queries' rows
            assert len(rows) == len(queries)
            for row, q in zip(rows, queries):
                assert row == pytest.approx([a[0][h][q][p] for p in cached], abs=1e-7)
    assert n_evictions == H * (steps + 1)


def test_snapkv_window_mean_pooled_and_sliding():
    run_snapkv(spec_edge=False)


def test_snapkv_scores_and_kept_set():
    run_snapkv(spec_edge=True)


# -- 4. Key norm ------------------------------------------------------------------------------------------------


def test_knorm_scores_minus_key_l2_norm():
    B, H, T0, steps, budget = 1, 2, 10, 5, 6
    K, V = random_kv(B, H, T0 + steps, 4, seed=5)
    k = K.tolist()
    cache = MiniCache(make_policy("knorm"), budget, keys=K, values=V)
    ref = [[] for _ in range(H)]
    for step, fed in feed_all(cache, T0, steps):
        for h in range(H):
            cached = ref[h] + list(range(fed - (T0 if step == 0 else 1), fed))
            score = {p: -math.sqrt(sum(x * x for x in k[0][h][p])) for p in cached}
            if len(cached) > budget:
                assert_scores(cache, 0, h, score)
                cached = ref_keep(score, budget)
            ref[h] = cached
            assert kept_positions(cache, 0, h) == cached, f"step {step} h{h}"


# -- 5. StreamingLLM --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_sink,budget", [(2, 6), (4, 7), (0, 5)], ids=["sink2", "sink4", "nosink"])
def test_streaming_keeps_sinks_and_most_recent(n_sink, budget):
    T0, steps = 9, 6
    cache = MiniCache(make_policy("streaming", n_sink=n_sink), budget, B=2, H=2, N=T0 + steps)
    for step, fed in feed_all(cache, T0, steps):
        expected = list(range(min(n_sink, fed))) + list(range(max(n_sink, fed - (budget - n_sink)), fed))
        for b in range(2):
            for h in range(2):
                assert kept_positions(cache, b, h) == expected, f"step {step}"


# -- 6. Random --------------------------------------------------------------------------------------------------


def _random_scores(seed, positions=None, step=1, layer=0):
    positions = torch.arange(20).expand(2, 2, 20) if positions is None else positions
    view = LayerView(layer=layer, step=step, keys=torch.zeros(*positions.shape, 4),
                     values=torch.zeros(*positions.shape, 4), positions=positions, n_new=1, keep=10)
    return make_policy("random", seed=seed).resolve(10).score(view)


def test_random_is_seeded():
    s = _random_scores(7)
    assert s.shape == (2, 2, 20)
    assert torch.equal(s, _random_scores(7)), "same seed, different scores"
    assert not torch.equal(s, _random_scores(8)), "different seeds, same scores"
    kept = []
    for seed in (7, 7, 8):
        cache = MiniCache(make_policy("random", seed=seed), 10, B=1, H=2, N=40)
        for _ in feed_all(cache, 20, 12):
            pass
        kept.append(cache.positions.tolist())
    assert kept[0] == kept[1] and kept[0] != kept[2]


def test_random_draws_follow_the_token_not_its_slot():
    """A token's draw is a function of (seed, layer, step, head, position): the same wherever its slot lies (so a row
    draws as alone in a batch and under any slack), fresh at every step, and uniform."""
    positions = torch.arange(4000).expand(1, 2, 4000)

    def draw(pos, **at):
        return _random_scores(3, pos, **at)

    base = draw(positions)
    perm = torch.randperm(4000, generator=torch.Generator().manual_seed(0))
    assert torch.equal(draw(positions[..., perm]), base[..., perm])
    assert not torch.equal(draw(positions, step=2), base) and not torch.equal(draw(positions, layer=1), base)
    assert not torch.equal(base[0, 0], base[0, 1]), "heads draw alike"
    assert base.min() >= 0 and base.max() < 1
    # uniform: each tenth of [0, 1) holds ~800 of 8,000 draws (binomial sd ~27)
    counts = torch.histc(base, bins=10, min=0, max=1)
    assert (counts - 800).abs().max() < 120, counts
    # independent across steps: the correlation of two steps' draws is ~0 (sd ~0.016)
    assert abs(torch.corrcoef(torch.stack([base.flatten(), draw(positions, step=2).flatten()]))[0, 1]) < 0.06


def _random_scores_before(seed, view):
    """The random policy's scoring as it was before its hash of (seed, layer, step, head) moved to the host (every
    step of it on int64 tensors, float64 division), for one layer's view."""
    def mix(x):
        x = x & 0xFFFFFFFF
        x = ((x ^ (x >> 16)) * 0x45D9F3B) & 0xFFFFFFFF
        x = ((x ^ (x >> 16)) * 0x45D9F3B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    key = mix(mix(mix(torch.tensor(seed, dtype=torch.int64)) ^ view.layer) ^ view.step)
    heads = torch.arange(view.positions.shape[1])[None, :, None]
    return mix(mix(key ^ heads) ^ view.positions.clamp(min=0)).to(torch.float64).div(2.0**32).to(torch.float32)


@pytest.mark.parametrize("seed", [0, 7, 2**31 - 1])
@pytest.mark.parametrize("L, B, H, T", [(1, 1, 1, 1), (3, 2, 3, 50), (30, 8, 3, 300)])
def test_random_stacked_scores_are_each_layers_own(seed, L, B, H, T):
    """Of a view that stacks ``L`` layers' rows (layer-major, ``LayerView.layers``), the random policy scores every
    row as its own layer's view is scored, and both bit for bit as the scoring before the host-side hash."""
    g = torch.Generator().manual_seed(seed % 1000 + T)
    positions = torch.randint(-1, 10**6, (L * B, H, T), generator=g)
    policy = make_policy("random", seed=seed).resolve(10)
    layers = tuple(range(5, 5 + L))
    for step in (0, 1, 4093):
        stacked = policy.score(LayerView(layer=layers[0], step=step, keys=None, values=None, positions=positions,
                                         n_new=1, layers=layers if L > 1 else None))
        for i, layer in enumerate(layers):
            one = LayerView(layer=layer, step=step, keys=None, values=None, positions=positions[i * B:(i + 1) * B],
                            n_new=1)
            assert torch.equal(stacked[i * B:(i + 1) * B], policy.score(one)), f"layer {layer}, step {step}"
            assert torch.equal(policy.score(one), _random_scores_before(seed, one)), f"layer {layer}, step {step}"


def test_random_hash_in_place_is_the_hash():
    """`_mix32_` (in place, one scratch tensor) hashes every value below 2**32 as `_mix32` does, the edges included,
    and as `_mix32` hashes each value as a Python int."""
    from learnkv.policies.random import _mix32, _mix32_

    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.tensor([0, 1, 2**16 - 1, 2**16, 2**31 - 1, 2**31, 2**32 - 1]),
                   torch.randint(0, 2**32, (5000,), generator=g)]).view(-1, 1, 1).expand(-1, 2, 3).contiguous()
    expected = _mix32(x)
    assert torch.equal(_mix32_(x.clone()), expected)
    assert [_mix32(v) for v in x[:7, 0, 0].tolist()] == expected[:7, 0, 0].tolist()


# -- 7. RoCo ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("R, H, T", [(1, 1, 1), (3, 2, 17), (6, 3, 64)])
@pytest.mark.parametrize("sizes", ["same", "each", "some zero"])
def test_roco_scope_is_the_stable_argsorts_first(R, H, T, sizes):
    """`lowest_first` (RoCo's scope by selection) chooses in every row and head the slots a stable ascending argsort
    puts first, ties (many: few distinct values, infinities as the out-of-scope slots) to the lower slot."""
    from learnkv.policies.roco import lowest_first

    g = torch.Generator().manual_seed(R * 100 + T)
    for trial in range(20):
        values = torch.randint(0, 5, (R, H, T), generator=g).float()
        values[torch.rand(R, H, T, generator=g) < 0.2] = float("inf")
        drawn = torch.randint(0, T + 1, (R,), generator=g).tolist()
        n = {"same": [drawn[0]] * R, "each": drawn, "some zero": [0] + drawn[1:]}[sizes]
        rank = torch.argsort(values, dim=-1, stable=True)
        order = torch.empty_like(rank).scatter_(-1, rank, torch.arange(T).expand_as(rank))
        chosen = lowest_first(values, n)
        assert chosen.dtype == torch.float32
        assert torch.equal(chosen, (order < torch.tensor(n).view(-1, 1, 1)).float()), f"trial {trial}"


def roco_reference_victims(stats, cached, keep, n_recent=10, recent_ratio=0.3):
    """EasyKV's rule (§2.2): scope = the lowest-std non-recent tokens, evict the lowest means inside it."""
    n_evict = len(cached) - keep
    scope_size = max(keep - int(recent_ratio * keep), n_evict)
    prot = recent(cached, n_recent)
    candidates = [p for p in cached if p not in prot]  # slot order; std ties: older first (stable)
    scope = sorted(candidates, key=lambda p: stats[p]["std"])[:scope_size]
    return sorted(scope, key=lambda p: (stats[p]["mean"], p))[:n_evict]  # mean ties: the older goes


def roco_reference_stats(a_bh, cached, fed):
    """S1, S2 and count of every cached position: the queries at positions >= p (all fed so far) saw it."""
    out = {}
    for p in cached:
        col = [a_bh[q][p] for q in range(p, fed)]
        s1, s2, c = sum(col), sum(x * x for x in col), len(col)
        mean = s1 / c
        out[p] = dict(s1=s1, s2=s2, count=c, mean=mean, std=math.sqrt(max(s2 / c - mean * mean, 0.0)))
    return out


def spiky_attention(B, H, N, seed, spikes):
    """Random causal attention where the tokens in `spikes` get one large weight (their own query), then little:
    low mean and high std, the tokens RoCo's std scope is about."""
    a = causal_attention(B, H, N, seed, normalize=False)
    for p in spikes:
        a[..., p + 1 :, p] *= 0.02
        a[..., p, p] *= 10
    return a / a.sum(-1, keepdim=True)


ROCO_CASES = {  # budget, prompt, decode steps, policy parameters
    # scope = 36 - 10 = 26 of the 27 (28 at prefill) non-recent tokens; the scope itself is pinned by
    # test_roco_lowest_mean_survives_when_out_of_scope
    "easykv-defaults": (36, 38, 4, {}),
    "short-recent": (16, 18, 12, dict(n_recent=4, recent_ratio=0.5)),  # scope 8 of the 13 (14) non-recent
}


@pytest.mark.parametrize("case", ROCO_CASES)
def test_roco_statistics_and_victims(case):
    budget, T0, steps, params = ROCO_CASES[case]
    B, H = 1, 2
    A = spiky_attention(B, H, T0 + steps, seed=10, spikes=range(2, T0, 4))
    a = A.tolist()
    cache = MiniCache(make_policy("roco", **params), budget, attn=A, B=B, H=H, N=T0 + steps)
    ref = [[] for _ in range(H)]
    scope_mattered = False
    for step, fed in feed_all(cache, T0, steps):
        for h in range(H):
            cached = ref[h] + list(range(fed - (T0 if step == 0 else 1), fed))
            stats = roco_reference_stats(a[0][h], cached, fed)
            if len(cached) > budget:
                victims = roco_reference_victims(stats, cached, budget, **params)
                prot = recent(cached, params.get("n_recent", 10))
                by_mean = sorted((p for p in cached if p not in prot), key=lambda p: stats[p]["mean"])
                scope_mattered |= sorted(victims) != sorted(by_mean[: len(victims)])
                cached = [p for p in cached if p not in victims]
            ref[h] = cached
            assert kept_positions(cache, 0, h) == cached, f"step {step} h{h}"
            for name in ("s1", "s2", "count"):
                got = cache.state[name][0, h].tolist()
                want = [stats[p][name] for p in cached]
                assert got == pytest.approx(want, rel=1e-5, abs=1e-7), f"{name}, step {step} h{h}"
    if case == "short-recent":
        assert scope_mattered, "the std scope never changed a victim; pick another case"


def test_roco_count_skips_padding():
    """count = number of valid queries that saw the key (a left-padded prefill)."""
    pos = torch.tensor([-1, -1, 0, 1, 2]).view(1, 1, 5)
    attn = torch.zeros(1, 1, 1, 5)
    view = LayerView(layer=0, step=0, keys=torch.zeros(1, 1, 5, 2), values=torch.zeros(1, 1, 5, 2), positions=pos,
                     n_new=5, attn=attn, attn_sum=attn[:, :, 0], attn_sq_sum=attn[:, :, 0], keep=4)
    make_policy("roco").resolve(12).update(view)
    assert view.state["count"][0, 0].tolist() == [0, 0, 3, 2, 1]


def test_roco_lowest_mean_survives_when_out_of_scope():
    """X (position 5) has the lowest mean attention of all but the highest std: out of the eviction scope, it
    survives, and Y (position 12), the lowest mean inside the low-std scope, is evicted."""
    budget, T0 = 34, 34  # scope = 34 - int(0.3 * 34) = 24 of the 25 non-recent tokens (positions 0..24)
    N, X, Y = T0 + 1, 5, 12
    A = torch.zeros(1, 1, N, N)
    for q in range(N):
        for p in range(q + 1):
            A[0, 0, q, p] = 0.05 + 0.002 * ((7 * q + 3 * p) % 5)  # steady: small std
        A[0, 0, q, Y] = 0.04 + 0.002 * ((7 * q) % 5) if q >= Y else 0.0  # steady, lower: in scope
        A[0, 0, q, X] = (0.9 if q == X else 0.001) if q >= X else 0.0  # one spike: lowest mean, highest std
    cache = MiniCache(make_policy("roco"), budget, attn=A, N=N)
    cache.feed(T0)
    assert cache.scores is None
    cache.feed(1)  # 35 slots > 34: evict one
    stats = roco_reference_stats(A[0, 0].tolist(), list(range(N)), N)
    assert min(stats, key=lambda p: stats[p]["mean"]) == X, "premise: X has the lowest mean"
    assert max(range(25), key=lambda p: stats[p]["std"]) == X, "premise: X has the highest std"
    assert roco_reference_victims(stats, list(range(N)), budget) == [Y]
    kept = kept_positions(cache, 0, 0)
    assert X in kept, "the lowest-mean token is out of scope (high std) and must survive"
    assert Y not in kept and len(kept) == budget, "the lowest-mean token within the scope must be evicted"


# -- 8. LazyEviction --------------------------------------------------------------------------------------------


def lazy_score(delta, m, variant):
    """§1.4 with Δ = t - TS and m = MRI."""
    if variant == "official":  # 2σ(-(1 + Δ/(m+1e-5))) + [m > 0]·2σ(1 - m)
        return 2 * sigmoid(-(1 + delta / (m + 1e-5))) + (2 * sigmoid(1 - m) if m > 0 else 0.0)
    # paper v3: H1 = 2σ(-Δ/m); H2 = 2σ(-1/(m - 1)); I = H1 + H2 if m != 0 else H1
    if m == 0:  # Δ/0 with Δ >= 1 (a never-activated token at a decode step): H1 -> 2σ(-inf) = 0
        assert delta > 0
        return 0.0
    h2 = 0.0 if m == 1 else 2 * sigmoid(-1 / (m - 1))  # m = 1: -1/0 -> -inf, H2 = 0 (MRI is an integer >= 1)
    return 2 * sigmoid(-delta / m) + h2


class LazyReference:
    """TS / MRI of §1.2 for one head, by position."""

    def __init__(self, prompt):
        self.ts = {p: 0 for p in prompt}  # prompt tokens start at TS = 0, MRI = 0
        self.mri = {p: 0 for p in prompt}

    def decode_step(self, t, new_pos, row, alpha):
        """row[p]: the new query's attention to position p."""
        self.ts[new_pos], self.mri[new_pos] = t - 1, 0  # a new token starts at TS = t - 1
        prev = dict(self.ts)
        for p in self.ts:
            if row[p] >= alpha:  # activated
                self.ts[p] = t
            self.mri[p] = max(self.mri[p], self.ts[p] - prev[p])

    def drop_all_but(self, kept):
        self.ts = {p: self.ts[p] for p in kept}
        self.mri = {p: self.mri[p] for p in kept}


def test_lazy_recurrence_by_hand():
    """A hand-traced TS/MRI table (alpha = 0.25; attention equal to alpha counts as activated)."""
    rows = {  # step -> the new query's attention over positions 0..T-1
        1: [0.5, 0.1, 0.25],  # p0, p2 activate: TS=1, MRI=1 (p2 is new: TS starts at 0)
        2: [0.1, 0.1, 0.1, 0.1],  # nothing; p3 new: TS=1
        3: [0.9, 0.1, 0.1, 0.1, 0.1],  # p0 again: TS=3, MRI=max(1, 3-1)=2; p4 new: TS=2
        4: [0.1, 0.6, 0.1, 0.1, 0.1, 0.3],  # p1 first time: TS=4, MRI=4; p5 new, activated: TS=4, MRI=1
    }
    N = 6
    A = torch.zeros(1, 1, N, N)
    for t, row in rows.items():
        A[0, 0, 1 + t, : len(row)] = torch.tensor(row)
    cache = MiniCache(make_policy("lazy", window=2, alpha=0.25), 40, attn=A, N=N)
    cache.feed(2)
    assert cache.state["ts"].tolist() == [[[0, 0]]] and cache.state["mri"].tolist() == [[[0, 0]]]
    for _ in range(4):
        view = cache.feed(1)
    assert cache.state["ts"][0, 0].tolist() == [3, 4, 1, 1, 2, 4]
    assert cache.state["mri"][0, 0].tolist() == [2, 4, 1, 0, 0, 1]
    for variant in ("official", "paper"):
        policy = make_policy("lazy", window=2, alpha=0.25, variant=variant).resolve(40)
        got = policy.score(view)[0, 0].tolist()
        want = [lazy_score(4 - ts, m, variant) for ts, m in zip([3, 4, 1, 1, 2, 4], [2, 4, 1, 0, 0, 1])]
        assert got == pytest.approx(want, abs=1e-4), variant


@pytest.mark.parametrize("variant", ["official", "paper"])
@pytest.mark.parametrize("seed", [0, 1], ids=["seed0", "seed1"])
def test_lazy_state_scores_and_lagged_eviction(variant, seed):
    B, H, T0, steps, budget, W, alpha = 2, 2, 6, 20, 12, 3, 0.125
    A = causal_attention(B, H, T0 + steps, seed=20 + seed, high=0.25, normalize=False)  # about half activate
    a = A.tolist()
    cache = MiniCache(make_policy("lazy", window=W, alpha=alpha, variant=variant), budget, attn=A, B=B, H=H,
                      N=T0 + steps)
    keep = budget - W + 1  # lagged: on overflow, down to budget - W + 1 (so every W steps once full)
    refs = [[LazyReference(range(T0)) for _ in range(H)] for _ in range(B)]
    n_evictions = 0
    for t, fed in feed_all(cache, T0, steps):
        for b in range(B):
            for h in range(H):
                ref = refs[b][h]
                if t > 0:
                    ref.decode_step(t, fed - 1, a[b][h][fed - 1], alpha)
                cached = sorted(ref.ts)
                if len(cached) > budget:
                    n_evictions += 1
                    score = {p: lazy_score(t - ref.ts[p], ref.mri[p], variant) for p in cached}
                    assert_scores(cache, b, h, score, tol=1e-4)
                    ref.drop_all_but(ref_keep(score, keep, recent(cached, W)))
                else:
                    assert cache.scores is None
                cached = sorted(ref.ts)
                assert kept_positions(cache, b, h) == cached, f"step {t} b{b} h{h}"
                assert cache.state["ts"][b, h].tolist() == [ref.ts[p] for p in cached], f"TS, step {t}"
                assert cache.state["mri"][b, h].tolist() == [ref.mri[p] for p in cached], f"MRI, step {t}"
    assert n_evictions >= 4 * B * H


@pytest.mark.parametrize("variant", ["official", "paper"])
def test_lazy_keeps_recurring_token_and_drops_one_shot_token(variant):
    """LazyEviction keeps a token that recurs at its measured interval and drops one that never recurs.

    A (position 0) gets high attention at steps 1, 4, 7, 10 (every 3 steps: MRI 3); B (position 1) once, at step
    3 (MRI 3 too). At the first eviction (step 12) both are old and outside the recent window; A is not attended
    at that step (so this is not TOVA's rule), B is more recent than A (so not a tie-break). A must stay, B go.
    Positions 2-4 are never attended (score 0) and 5-11 are attended at every step (MRI 1).
    """
    W, budget, T0, steps = 4, 15, 4, 12  # keep = 15 - 3 = 12; step 12 holds 16 slots: 4 go, 12..15 protected
    N = T0 + steps
    high, low = 0.3, 1e-5  # around the default alpha = 1e-4
    A = torch.full((1, 1, N, N), low).tril()
    for t in range(1, steps + 1):
        q = T0 + t - 1  # the query of decode step t
        A[0, 0, q, 0] = high if t in (1, 4, 7, 10) else low
        A[0, 0, q, 1] = high if t == 3 else low
        A[0, 0, q, 5 : q + 1] = high
    cache = MiniCache(make_policy("lazy", window=W, variant=variant), budget, attn=A, N=N)
    assert cache.keep == 12 and cache.policy.alpha == 1e-4
    for t, _ in feed_all(cache, T0, steps):
        assert (cache.scores is None) == (t != 12), "the first eviction is at step 12"
    assert cache.before[0][0][:2] == [0, 1]
    ts, mri = cache.state["ts"][0, 0].tolist(), cache.state["mri"][0, 0].tolist()
    assert (ts[0], mri[0]) == (10, 3), "A: last activated at step 10, recurrence interval 3"
    s = cache.scores[0, 0].tolist()
    assert s[0] > s[1], f"score A {s[0]} <= score B {s[1]}"
    assert s[0] == pytest.approx(lazy_score(2, 3, variant), abs=1e-4)
    assert s[1] == pytest.approx(lazy_score(9, 3, variant), abs=1e-4)
    assert kept_positions(cache, 0, 0) == [0] + list(range(5, 16)), "A kept; B and the unattended 2-4 dropped"


# -- 9. PagedEviction -------------------------------------------------------------------------------------------


def test_paged_token_drop_at_prefill_then_whole_blocks():
    B, H, D, T0, steps, budget, bs = 1, 2, 3, 14, 14, 12, 4
    K, V = random_kv(B, H, T0 + steps, D, seed=30)
    k, v = K.tolist(), V.tolist()

    def norm(x):
        return math.sqrt(sum(y * y for y in x))

    S = [sum(norm(v[0][h][p]) / norm(k[0][h][p]) for h in range(H)) / H for p in range(T0 + steps)]
    cache = MiniCache(make_policy("paged", block_size=bs), budget, keys=K, values=V)
    assert cache.policy.n_sink == bs and cache.policy.block_size_at(0) == 1 and cache.policy.block_size_at(1) == bs
    ref = []
    block_evictions = 0
    for step, fed in feed_all(cache, T0, steps):
        cached = ref + list(range(fed - (T0 if step == 0 else 1), fed))
        if len(cached) > budget:
            for h in range(H):  # token score ||V||/||K|| averaged over the KV heads: the same for every head
                assert_scores(cache, 0, h, {p: S[p] for p in cached})
            if step == 0:  # token level: drop the lowest S, never the first block (positions < bs)
                cached = ref_keep({p: S[p] for p in cached}, budget, set(range(bs)))
            else:  # whole blocks of slots [j*bs, (j+1)*bs); block 0 and the partial tail are kept
                blocks = [cached[j * bs : (j + 1) * bs] for j in range(len(cached) // bs)]
                n_drop = -(-(len(cached) - budget) // bs)
                bscore = {j: sum(S[p] for p in blk) / bs for j, blk in enumerate(blocks) if j > 0}
                dropped = sorted(bscore, key=lambda j: (bscore[j], j))[:n_drop]
                evicted = [p for j in dropped for p in blocks[j]]
                assert len(evicted) == bs * n_drop and cached[-1] not in evicted
                cached = [p for p in cached if p not in evicted]
                block_evictions += 1
        ref = cached
        for h in range(H):
            assert kept_positions(cache, 0, h) == cached, f"step {step} h{h}"
        assert cached[:bs] == list(range(bs)), "block 0 is a sink"
        assert budget - bs + 1 <= len(cached) <= budget
    assert block_evictions >= 3


def test_paged_prefill_drops_single_tokens():
    """At step 0 the prompt is cut to exactly the budget, token by token (not a multiple of the block size)."""
    K, V = random_kv(1, 2, 16, 3, seed=31)
    cache = MiniCache(make_policy("paged", block_size=4), 12, keys=K, values=V)
    cache.feed(15)
    assert cache.positions.shape[-1] == 12 and cache.positions[0, 0].tolist()[:4] == [0, 1, 2, 3]
    assert torch.equal(cache.positions[0, 0], cache.positions[0, 1]), "every KV head frees the same tokens"


# -- 10. GQA reduction in the attention function ----------------------------------------------------------------


class RecordingCache:
    """Stand-in for BudgetCache: the positions the attention reads, and what it hands to `observe`."""

    def __init__(self, policy, key_positions, query_positions):
        self.policy, self.key_positions, self.step_positions = policy, key_positions, query_positions
        self.calls = []

    def layer_positions(self, layer_idx):
        return self.key_positions

    def observe(self, layer_idx, attn=None, attn_sum=None, attn_sq_sum=None):
        self.calls.append(dict(layer=layer_idx, attn=attn, attn_sum=attn_sum, attn_sq_sum=attn_sq_sum))


GQA_CASES = {  # key positions [B][T], query positions [B][q]
    "prefill": ([[0, 1, 2, 3, 4, 5], [-1, -1, 0, 1, 2, 3]], [[0, 1, 2, 3, 4, 5], [-1, -1, 0, 1, 2, 3]]),
    "decode-after-eviction": ([[0, 1, 4, 5, 7, 8, 9], [-1, 0, 2, 3, 4, 6, 8]], [[9], [8]]),
}
GQA_POLICIES = {
    "h2o": dict(),
    "tova": dict(),
    "snapkv": dict(window=4),
    "roco": dict(),
    "lazy": dict(window=2),
    "rkv": dict(window=4),
}


def reference_probs(q, k, key_pos, query_pos):
    """probs[b][hq][i][t]: softmax(q.k / sqrt(D)) per query head over the keys the query may see (python)."""
    B, Hq, nq, D = len(q), len(q[0]), len(q[0][0]), len(q[0][0][0])
    H, T = len(k[0]), len(k[0][0])
    G = Hq // H
    out = [[[[0.0] * T for _ in range(nq)] for _ in range(Hq)] for _ in range(B)]
    for b in range(B):
        for hq in range(Hq):
            j = hq // G  # query heads j*G .. j*G+G-1 use KV head j
            for i in range(nq):
                qp = query_pos[b][i]
                ok = [t for t in range(T) if 0 <= key_pos[b][t] <= qp]
                logits = {t: sum(q[b][hq][i][d] * k[b][j][t][d] for d in range(D)) / math.sqrt(D) for t in ok}
                if not ok:
                    continue
                mx = max(logits.values())
                z = sum(math.exp(x - mx) for x in logits.values())
                for t in ok:
                    out[b][hq][i][t] = math.exp(logits[t] - mx) / z
    return out


@pytest.mark.parametrize("case", GQA_CASES)
@pytest.mark.parametrize("name", GQA_POLICIES)
def test_attention_hands_group_reduced_statistics(name, case):
    key_pos, query_pos = GQA_CASES[case]
    B, Hq, H, D, T, nq = 2, 4, 2, 8, len(key_pos[0]), len(query_pos[0])
    G = Hq // H
    gen = torch.Generator().manual_seed(40)
    q, k, v = (torch.randn(B, n, m, D, generator=gen) for n, m in ((Hq, nq), (H, T), (H, T)))
    policy = make_policy(name, **GQA_POLICIES[name]).resolve(32)
    cache = RecordingCache(policy, torch.tensor(key_pos)[:, None, :].expand(B, H, T), torch.tensor(query_pos))
    out, _ = learnkv_attention(SimpleNamespace(layer_idx=3), q, k, v, None, learnkv_cache=cache)

    probs = reference_probs(q.tolist(), k.tolist(), key_pos, query_pos)
    reduce = max if policy.group_reduce == "max" else (lambda xs: sum(xs) / len(xs))
    assert policy.group_reduce == ("max" if name in ("lazy", "rkv") else "mean")
    r = [[[[reduce([probs[b][j * G + g][i][t] for g in range(G)]) if query_pos[b][i] >= 0 else 0.0 for t in range(T)]
           for i in range(nq)] for j in range(H)] for b in range(B)]
    w = min(policy.obs_window, nq)
    (call,) = cache.calls
    assert call["layer"] == 3
    assert call["attn"].shape == (B, H, w, T)
    for b in range(B):
        for j in range(H):
            for wi, i in enumerate(range(nq - w, nq)):
                assert call["attn"][b, j, wi].tolist() == pytest.approx(r[b][j][i], abs=1e-6)
            col_sum = [sum(r[b][j][i][t] for i in range(nq)) for t in range(T)]
            assert call["attn_sum"][b, j].tolist() == pytest.approx(col_sum, abs=1e-6)
            if policy.needs_sq_sum:
                sq = [sum(r[b][j][i][t] ** 2 for i in range(nq)) for t in range(T)]
                assert call["attn_sq_sum"][b, j].tolist() == pytest.approx(sq, abs=1e-6)
            else:
                assert call["attn_sq_sum"] is None

    # the attention output equals eager attention (repeat_kv + masked softmax) on every non-padding query
    kp, qp = torch.tensor(key_pos)[:, None, None, :], torch.tensor(query_pos)[:, None, :, None]
    logits = q @ repeat_kv(k, G).transpose(-1, -2) / math.sqrt(D)
    logits = logits.masked_fill(~((kp >= 0) & (kp <= qp)), float("-inf"))
    eager = (torch.softmax(logits, dim=-1).nan_to_num() @ repeat_kv(v, G)).transpose(1, 2)  # [B, q, Hq, D]
    valid = torch.tensor(query_pos) >= 0
    assert out.shape == (B, nq, Hq, D)
    torch.testing.assert_close(out[valid], eager[valid], atol=1e-5, rtol=1e-5)


def test_attention_hands_nothing_to_attention_free_policies():
    q, k, v = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    cache = RecordingCache(make_policy("knorm").resolve(8), torch.arange(5).expand(1, 2, 5), torch.tensor([[4]]))
    learnkv_attention(SimpleNamespace(layer_idx=0), q, k, v, None, learnkv_cache=cache)
    assert cache.calls == [dict(layer=0, attn=None, attn_sum=None, attn_sq_sum=None)]
