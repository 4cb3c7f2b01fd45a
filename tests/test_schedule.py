"""When the cache evicts, what a prefill policy does, exact ties, per-row budgets, and checked parameters.

The decode regime: a policy evicts only at a step where a row would otherwise end over its budget, and then down
to its keep target (``budget - interval + 1`` for a lagged policy). A prompt within the budget is never compressed
at the prefill; one over it is compressed by the prefill policy, or refused by a policy that observes nothing there.
"""

import pytest
import torch

from conftest import eos_token, params_for, random_ids
from learnkv.kernels.reference import select_keep_reference
from learnkv import generate
from learnkv.cache import BudgetCache
from learnkv.policies import POLICIES, make_policy
from learnkv.policies.base import LayerView, exact_map


def live_counts(cache):
    """Per layer, the live tokens of row 0 (what the budget bounds)."""
    return [layer.live[0] for layer in cache.layers]


def decode_schedule(model, policy, prompt_len, budget, new_tokens, **kw):
    """Per forward pass: live tokens of row 0 in layer 0 after the pass, and whether that pass evicted."""
    seen = []
    generate(model, input_ids=random_ids(prompt_len, seed=21), policy=policy, budget=budget,
             max_new_tokens=new_tokens, stop_at_eos=False, observer=lambda c: seen.append(live_counts(c)[0]), **kw)
    evicted = [i > 0 and n < seen[i - 1] + 1 or (i == 0 and n < prompt_len) for i, n in enumerate(seen)]
    return seen, evicted


@pytest.mark.parametrize("window", [1, 4, 7])
def test_lagged_policy_evicts_only_on_overflow(tiny, window):
    """LazyEviction with a prompt within the budget: no eviction at the prefill or while the cache fits; the first
    one when prompt + decode tokens overflow, down to budget - W + 1; then every W steps; never over the budget."""
    prompt, budget, new = 20, 28, 40
    held, evicted = decode_schedule(tiny, "lazy", prompt, budget, new, policy_params={"window": window})
    first = budget - prompt + 1  # the first step whose token would make the cache hold budget + 1
    assert held[: first] == list(range(prompt, budget + 1)), "no eviction while the cache fits"
    steps = [i for i, e in enumerate(evicted) if e]
    assert steps[0] == first
    # down to budget - W + 1, or less headroom near the end (no room is needed for steps that never come)
    assert all(held[s] == budget - min(window - 1, new - 1 - s) for s in steps), (steps, held)
    assert all(b - a == window for a, b in zip(steps, steps[1:])), steps
    assert max(held) <= budget


@pytest.mark.parametrize("policy", [p for p, cls in POLICIES.items() if cls.evicts and p not in ("lazy", "paged")])
def test_every_policy_leaves_a_prompt_that_fits_alone(tiny, policy):
    """A prompt within the budget is never compressed at the prefill; eviction starts once the decode overflows."""
    prompt, budget = 24, 30
    held, evicted = decode_schedule(tiny, policy, prompt, budget, 16, policy_params=params_for(policy, 2))
    assert held[0] == prompt and not any(evicted[: budget - prompt + 1])
    assert held[budget - prompt + 1] <= budget and max(held) <= budget


@pytest.mark.parametrize("refresh", [1, 4])
def test_learned_scores_every_refresh_steps_and_evicts_at_every_overflow(tiny, monkeypatch, refresh):
    """The learned policy keeps its full budget (it is not lagged): every step over the budget evicts to it, by
    the scores of the latest refresh (every ``refresh`` steps); a token that arrived since then is never evicted."""
    from learnkv.policies.learned import Learned

    scored = []
    real = Learned._scored  # each layer's scores, at a refresh of stacked layers too
    monkeypatch.setattr(Learned, "_scored", lambda self, view, *a, **k: scored.append((view.layer, view.step))
                        or real(self, view, *a, **k))
    prompt, budget, new = 12, 16, 30
    kept = []
    generate(tiny, input_ids=random_ids(prompt, seed=21), policy="learned", budget=budget, max_new_tokens=new,
             stop_at_eos=False, policy_params={**params_for("learned", 2), "refresh": refresh, "n_recent": 0},
             observer=lambda c: kept.append(c.layers[0].positions[0].clone()))
    held = [int((p[0] >= 0).sum()) for p in kept]
    first = budget - prompt + 1
    assert held[:first] == list(range(prompt, budget)) + [budget] and held[first:] == [budget] * (new - first)
    steps = sorted({s for layer, s in scored if layer == 0})
    if refresh == 1:  # fresh scores at each eviction, none before the cache overflows
        assert steps == list(range(first, new))
    else:
        assert steps == list(range(0, new, refresh))
        for s in range(first, new):
            last = max(r for r in steps if r <= s)
            newest_scored = int(kept[last].max())
            for h in range(kept[s].shape[0]):  # per KV head: one token out, one that the last refresh scored
                dropped = ({*kept[s - 1][h].tolist(), prompt + s - 1} - {*kept[s][h].tolist()}) - {-1}
                assert len(dropped) == 1 and max(dropped) <= newest_scored, (s, last, h, dropped)


def test_blind_policy_refuses_a_prompt_over_the_budget(tiny):
    with pytest.raises(ValueError, match="observes nothing at the prefill.*prefill-policy snapkv"):
        generate(tiny, input_ids=random_ids(30), policy="lazy", budget=20, max_new_tokens=4)


def test_prefill_policy_compresses_the_prompt_then_the_decode_policy_starts_fresh(tiny, monkeypatch):
    """lazy with prefill_policy="snapkv": at the prefill, snapkv's scores choose the kept prompt tokens (down to
    lazy's keep target); lazy is not shown the prefill, and its state starts at the first decode step."""
    from learnkv.policies.lazy import LazyEviction
    from learnkv.policies.snapkv import SnapKV

    calls = []
    real_snap, real_lazy = SnapKV.score, LazyEviction.update

    def snap_score(self, view):
        s = real_snap(self, view)
        calls.append(("snapkv", view.step, view.layer, s, view.positions.clone(), view.keep))
        return s

    def lazy_update(self, view):
        if view.layer == 0:
            calls.append(("lazy", view.step, sorted(view.state)))
        return real_lazy(self, view)

    monkeypatch.setattr(SnapKV, "score", snap_score)
    monkeypatch.setattr(LazyEviction, "update", lazy_update)
    kept = []
    budget, window = 24, 6
    generate(tiny, input_ids=random_ids(40, seed=2), policy="lazy", budget=budget, max_new_tokens=12,
             policy_params={"window": window}, prefill_policy="snapkv", stop_at_eos=False,
             observer=lambda c: kept.append([layer.positions.clone() for layer in c.layers]))
    snap = [c for c in calls if c[0] == "snapkv"]
    assert {c[1] for c in snap} == {0} and len(snap) == 2  # every layer, at the prefill only
    lazy = [c for c in calls if c[0] == "lazy"]
    assert lazy[0][1] == 1 and lazy[0][2] == [], "lazy starts at the first decode step with no state"
    snapkv = make_policy("snapkv").resolve(budget)
    for _, _, layer, scores, positions, keep in snap:
        assert keep == budget - window + 1
        expected = select_keep_reference(scores, positions, keep, snapkv.n_sink, snapkv.n_recent)
        assert torch.equal(kept[0][layer], positions.gather(-1, expected))


def test_prefill_policy_is_idle_when_the_prompt_fits(tiny, monkeypatch):
    from learnkv.policies.snapkv import SnapKV

    scored = []
    monkeypatch.setattr(SnapKV, "score", lambda self, view: scored.append(view.step) or None)
    generate(tiny, input_ids=random_ids(16), policy="lazy", budget=24, max_new_tokens=20, prefill_policy="snapkv")
    assert scored == []


@pytest.mark.parametrize("prefill", ["full", "lazy", "oracle"])
def test_prefill_policy_must_decide_on_what_it_sees(tiny, prefill):
    with pytest.raises(ValueError, match="cannot be a prefill policy"):
        generate(tiny, input_ids=random_ids(30), policy="h2o", budget=20, max_new_tokens=4, prefill_policy=prefill)


# -- exact ties ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("T", [1, 7, 16, 17, 33, 64, 129])
def test_exact_map_ties_exactly_at_any_slot(T):
    """The same state at every slot index (vector body and scalar tail alike) gives bitwise-equal results."""
    delta = torch.tensor([2.0, 4.0, 8.0]).repeat(T)[:T].reshape(1, 1, T)
    m = torch.full_like(delta, 9.0)
    out = exact_map(lambda d, mm: torch.sigmoid(-(1 + d / (mm + 1e-5))), delta, m)
    for value in delta.unique():
        assert out[delta == value].unique().numel() == 1


@pytest.mark.parametrize("variant", ["official", "paper"])
@pytest.mark.parametrize("T", [17, 33, 65, 129])
def test_lazy_equal_state_equal_score_and_the_newest_wins_the_tie(variant, T):
    step = 10
    ts = torch.full((1, 2, T), float(step - 2))
    mri = torch.full((1, 2, T), 9.0)
    pos = torch.arange(T).expand(1, 2, T)
    view = LayerView(layer=0, step=step, keys=torch.zeros(1, 2, T, 4), values=torch.zeros(1, 2, T, 4),
                     positions=pos, n_new=1, state={"ts": ts, "mri": mri})
    scores = make_policy("lazy", variant=variant).score(view)
    assert scores.unique().numel() == 1
    kept = select_keep_reference(scores, pos, 5, 0, 0)
    assert kept.tolist() == [[list(range(T - 5, T))] * 2], "ties go to the more recent tokens"


@pytest.mark.parametrize("T", [17, 33, 65])
def test_roco_and_paged_equal_state_equal_scores(T):
    """RoCo (means of equal sums, protected infinities) and PagedEviction (equal keys and values) tie exactly."""
    pos = torch.arange(T).expand(1, 2, T)
    st = {"s1": torch.full((1, 2, T), 0.3), "s2": torch.full((1, 2, T), 0.05), "count": torch.full((1, 2, T), 7.0)}
    view = LayerView(layer=0, step=3, keys=torch.ones(1, 2, T, 5), values=torch.full((1, 2, T, 5), 0.7),
                     positions=pos, n_new=1, state=st, keep=T // 2)
    roco = make_policy("roco").resolve(T // 2 + 11).score(view)
    assert roco.isinf().sum() > 0 and roco[roco.isfinite()].unique().numel() == 1
    paged = make_policy("paged", block_size=4).resolve(T).score(view)
    assert paged.unique().numel() == 1


# -- rows of a batch with their own budgets ---------------------------------------------------------------------


@pytest.mark.parametrize("policy, kw", [("lazy", {}), ("h2o", {}), ("snapkv", {}), ("snapkv-own-windows", {}),
                                        ("learned", {}), ("rkv", {}),
                                        ("h2o", {"granularity": "block", "block_size": 4}), ("paged", {}),
                                        ("h2o", {"slack": 3})])
@pytest.mark.parametrize("lengths, budgets", [((20, 13), (22, 16)), ((13, 13), (16, 22))])
def test_rows_with_their_own_budgets_decode_as_alone(tiny, policy, kw, lengths, budgets, monkeypatch):
    """Two prompts with different budgets: each row keeps, step by step, what it keeps alone. Of different lengths
    (the second left-padded), or of one length with the narrower budget first: that row then evicts at steps where
    the wider one keeps every token, so no slot is free in every row; where slots must stay dense (R-KV,
    blocks) that eviction compacts all the same, and no row ever holds a dead slot between live ones.
    ``snapkv-own-windows``: SnapKV's default window (a quarter of the budget) differs between the rows (5 and 4).
    A lagged policy that scores a subset of rows (LazyEviction, R-KV) is scored on the due row alone at some steps."""
    own_windows = policy.endswith("-own-windows")
    policy = policy.removesuffix("-own-windows")
    subsets = []  # per scoring: whether it scored some of its view's rows only (the due rows, of every layer)
    cls = POLICIES[policy]
    real_score = BudgetCache._score

    def spy(cache, order, stats, view, keep):
        scores, rows = real_score(cache, order, stats, view, keep)
        subsets.append(rows is not None and len(rows) < view.positions.shape[0])
        return scores, rows

    monkeypatch.setattr(BudgetCache, "_score", spy)
    a, b = random_ids(lengths[0], seed=4)[0], random_ids(lengths[1], seed=5)[0]
    L = max(lengths)
    ids = torch.zeros(2, L, dtype=torch.long)
    mask = torch.zeros(2, L, dtype=torch.long)
    ids[0, L - len(a):], mask[0, L - len(a):] = a, 1
    ids[1, L - len(b):], mask[1, L - len(b):] = b, 1
    budgets = list(budgets)
    params = {**params_for(policy, 2), **({"window": 4} if policy in ("lazy", "snapkv") and not own_windows else {}),
              **({"window": 2, "buffer": 3} if policy == "rkv" else {}),
              **({"block_size": 4} if policy == "paged" else {})}

    def run(input_ids, attention_mask, budget):
        kept = []
        r = generate(tiny, input_ids=input_ids, attention_mask=attention_mask, policy=policy, budget=budget,
                     max_new_tokens=24, policy_params=params, stop_at_eos=False,
                     observer=lambda c: kept.append([layer.positions.clone() for layer in c.layers]), **kw)
        return r, kept

    batch, kept_batch = run(ids, mask, budgets)
    scored_in_batch = list(subsets)
    for row, single in ((0, a), (1, b)):
        alone, kept_alone = run(single[None], None, budgets[row])
        assert batch.tokens[row].tolist() == alone.tokens[0].tolist(), f"row {row}"
        for step, (x, y) in enumerate(zip(kept_batch, kept_alone)):
            for layer, (p, q) in enumerate(zip(x, y)):
                got = [sorted(h[h >= 0].tolist()) for h in p[row]]
                want = [sorted(h[h >= 0].tolist()) for h in q[0]]
                assert got == want, f"row {row}, step {step}, layer {layer}"
        assert batch.budgets[row] == budgets[row] and batch.kept_share(row) == pytest.approx(alone.kept_share(0))
        assert batch.peak_kv_bytes_rows[row] == alone.peak_kv_bytes_rows[0]
    lagged = make_policy(policy, **params).resolve(min(budgets)).interval > 1
    if cls.rowwise and lagged:  # scored on the due rows: the two rows' schedules differ, so some steps had one due
        assert any(scored_in_batch)
    if policy in ("rkv", "paged") or kw.get("granularity") == "block":  # dense: dead slots only at the left
        for step in kept_batch:
            for p in step:
                live = (p >= 0).int()
                assert (live[..., 1:] >= live[..., :-1]).all(), f"a dead slot between live ones: {p.tolist()}"


# -- checked parameters --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, params, message", [
    ("lazy", {"alpha": float("nan")}, "parameter alpha must be a finite number, got nan"),
    ("lazy", {"window": "abc"}, "parameter window must be an integer or unset \\(none\\), got 'abc'"),
    ("lazy", {"window": 0}, "parameter window must be >= 1, got 0"),
    ("lazy", {"window": 2.5}, "parameter window must be an integer or unset"),
    ("lazy", {"variant": "fast"}, "parameter variant must be one of official, paper, got 'fast'"),
    ("h2o", {"n_recent": 1.5}, "parameter n_recent must be a token count or a fraction in \\[0, 1\\], got 1.5"),
    ("h2o", {"n_recent": -3}, "parameter n_recent must be >= 0, got -3"),
    ("snapkv", {"kernel_size": True}, "parameter kernel_size must be an integer, got True"),
    ("roco", {"recent_ratio": float("inf")}, "parameter recent_ratio must be a finite number, got inf"),
    ("roco", {"recent_ratio": 1.5}, "parameter recent_ratio must be in \\[0.0, 1.0\\], got 1.5"),
    ("oracle", {"horizon": 0}, "parameter horizon must be >= 1, got 0"),
    ("paged", {"block_size": "sixteen"}, "parameter block_size must be an integer, got 'sixteen'"),
])
def test_bad_parameters_are_refused_when_the_policy_is_built(name, params, message):
    with pytest.raises(ValueError, match=f"policy '{name}': {message}"):
        make_policy(name, **params)


def test_every_default_passes_its_own_checks():
    for name in POLICIES:
        policy = make_policy(name)
        if policy.evicts and name != "learned":
            policy.resolve(64)


def test_parameters_are_coerced_to_their_declared_type():
    assert make_policy("lazy", alpha=0).alpha == 0.0 and isinstance(make_policy("lazy", alpha=0).alpha, float)
    assert make_policy("lazy", window="16").window == 16 and make_policy("lazy", alpha="5e-4").alpha == 5e-4


def test_a_row_that_stops_early_is_accounted_up_to_its_own_end(tiny):
    """Per-row cost: a row that hits EOS while the batch decodes on reports its own peak and full-cache bytes."""
    ids = random_ids(12, batch=2, seed=8)
    free = generate(tiny, input_ids=ids, max_new_tokens=20, stop_at_eos=False)
    eos = int(free.tokens[1, 3])  # row 1 emits this token at step 3
    with eos_token(tiny, eos):
        full = generate(tiny, input_ids=ids, max_new_tokens=20)
    stop = free.tokens[1].tolist().index(eos) + 1
    assert full.new_tokens[1] == stop and full.new_tokens[0] > stop
    assert full.peak_kv_bytes_rows == full.full_kv_bytes_rows  # the full cache peaks at its own final length
    assert full.kept_share(1) == 1.0
