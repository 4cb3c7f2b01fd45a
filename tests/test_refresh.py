"""The learned policy's refresh with the key and value norms as per-token state (`FeatureTracker` with
``cache_norms``, issue 43 item 2): the same features, scores and kept slots as computing the norms from the keys at
every refresh (the code before), bit for bit.

The tracker's cached norms are computed once per token (the prefill, each decode step's new token; on the cache's
stacked decode steps, which do not show the policy one layer's keys, at the next refresh) and moved by the cache
with the slots like any state. `test_cached_norms_follow_the_slots` checks, after every step of padded batch-2
decodes (compaction and marking dead with slack, refresh 1 with its due rows, a prefill policy whose state is
dropped, one and several refreshes between evictions, lagged schedules, a decode run layer by layer, sliding-window
layers dropping tokens by age), that every live slot's cached norm is its key's and value's norm;
`test_cached_norms_in_a_padded_batch`, on a batch padded as the benchmark's chain prompts are, that each is
computed once (no padding or filler slot is left unknown, to be recomputed at every refresh).
"""

import pytest
import torch

from conftest import params_for, random_ids, scorer_for
from learnkv import generate
from learnkv.features import NORMS, SPARE_ROWS, STATE, WINDOW, FeatureTracker, group_mean_max, token_norms
from learnkv.policies import learned
from learnkv.scorer.model import Scorer

DECODES = [  # slack, refresh, prefill policy, interval (2, 3: lagged, scored on the due rows), allocation (uniform:
    # one stacked update for every layer; head: the cache runs layer by layer)
    pytest.param(0, 8, None, 1, "uniform", id="slack0-refresh8"),
    pytest.param(4, 8, None, 1, "uniform", id="slack4-refresh8"),
    pytest.param(0, 1, None, 1, "uniform", id="slack0-refresh1"),
    pytest.param(3, 1, None, 1, "uniform", id="slack3-refresh1"),
    pytest.param(4, 3, "snapkv", 1, "uniform", id="slack4-refresh3-prefill-snapkv"),
    pytest.param(0, 1, None, 2, "uniform", id="slack0-refresh1-interval2"),
    pytest.param(3, 4, None, 3, "uniform", id="slack3-refresh4-interval3"),
]
#: a decode run layer by layer: heads of a layer hold different counts, so a compaction leaves filler (dead) slots
#: in some heads, whose state is zeroed while their keys and values are another slot's
LAYER_BY_LAYER = pytest.param(3, 4, None, 3, "head", id="slack3-refresh4-interval3-head")


def before_tracker(n_layers, cache_norms=False, spare_rows=0):
    """The tracker as the learned policy built it before the norms were cached and its window had spare rows."""
    return FeatureTracker(n_layers)


def decode(model, monkeypatch, slack, refresh, prefill, interval, cached, check_norms=False, vocab=256, budget=24,
           pads=(0, 7), allocation="uniform"):
    """Every layer's slot positions after every step of a left-padded decode (one row per entry of ``pads``, its
    left padding), and every feature tensor the policy computed (in order), one per layer (a read-out of several
    layers' rows, `Learned.score_layers`, split into each layer's)."""
    if not cached:
        monkeypatch.setattr(learned, "FeatureTracker", before_tracker)
    feats, slots, checked, window_rows = [], [], [], set()
    real = FeatureTracker.features

    def record(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        feats.append(out.clone())
        return out

    def observe(cache):
        slots.append([layer.positions.clone() for layer in cache.layers])
        window_rows.update(layer.state["f.win"].shape[2] for layer in cache.layers if "f.win" in layer.state)
        if not check_norms:
            return
        for layer in cache.layers:
            if NORMS[0] not in layer.state:
                continue
            live = layer.positions >= 0
            for name, x in zip(NORMS, (layer.keys, layer.values)):
                cached_norm, exact = layer.state[name], x.float().norm(dim=-1)
                known = live & (cached_norm >= 0)
                assert torch.equal(cached_norm[known], exact[known]), f"step {cache.step}: {name} left its slot"
                checked.append(int(known.sum()))

    monkeypatch.setattr(FeatureTracker, "features", record)
    ids = torch.cat([random_ids(40, seed=21 + i, vocab=vocab) for i in range(len(pads))])
    mask = torch.ones_like(ids)
    for row, pad in enumerate(pads):
        mask[row, :pad] = 0
    generate(model, input_ids=ids, attention_mask=mask, policy="learned", budget=budget, max_new_tokens=40, slack=slack,
             stop_at_eos=False, policy_params={**params_for("learned", 2), "refresh": refresh, "interval": interval},
             observer=observe, allocation=allocation, **({"prefill_policy": prefill} if prefill else {}))
    monkeypatch.undo()
    if check_norms:
        assert sum(checked) > 0
    # the learned policy's tracker keeps its window among spare rows (`learnkv.sliding_rows`); the one before did not
    assert window_rows == ({WINDOW + SPARE_ROWS} if cached else {WINDOW}), window_rows
    return slots, [layer for f in feats for layer in f.split(len(pads))]


@pytest.mark.parametrize("slack, refresh, prefill, interval, allocation", [*DECODES, LAYER_BY_LAYER])
def test_cached_norms_keep_the_same_features_and_slots(tiny, monkeypatch, slack, refresh, prefill, interval,
                                                       allocation):
    slots, feats = decode(tiny, monkeypatch, slack, refresh, prefill, interval, cached=True, allocation=allocation)
    slots_before, feats_before = decode(tiny, monkeypatch, slack, refresh, prefill, interval, cached=False,
                                        allocation=allocation)
    assert len(slots) == len(slots_before) == 40
    assert all(torch.equal(a, b) for step_a, step_b in zip(slots, slots_before) for a, b in zip(step_a, step_b))
    assert len(feats) == len(feats_before) > 0
    for i, (a, b) in enumerate(zip(feats, feats_before)):
        assert torch.equal(a, b), f"features call {i} differs"
    assert any(layer.shape[-1] < 80 for layer in slots[-1])  # it did evict


@pytest.mark.parametrize("slack, refresh, prefill, interval, allocation", [*DECODES, LAYER_BY_LAYER])
def test_cached_norms_follow_the_slots(tiny, monkeypatch, slack, refresh, prefill, interval, allocation):
    decode(tiny, monkeypatch, slack, refresh, prefill, interval, cached=True, check_norms=True, allocation=allocation)


#: a batch like the benchmark's chain prompts (`bench/scoring_ab.py --refresh-model`): every row padded differently,
#: one row shorter than the budget at the prefill (it evicts later)
PADS = (0, 7, 19, 3)


@pytest.mark.parametrize("slack, refresh", [(16, 8), (0, 8), (3, 1)])
def test_cached_norms_in_a_padded_batch(tiny, monkeypatch, slack, refresh):
    """Rows padded by 0 to 19 slots: the same features and kept slots as the code before, and the norms computed
    once per token: the prefill's every slot, then at each refresh only the slots appended since the last one (at
    most ``refresh`` columns per layer), never a padding slot again (a padding or filler slot left unknown would
    make every refresh recompute from the front)."""
    widths = []

    def counted(x):
        widths.append(x.shape[-2])
        return token_norms(x)

    monkeypatch.setattr("learnkv.features.token_norms", counted)  # until `decode` undoes its patches: this decode
    slots, feats = decode(tiny, monkeypatch, slack, refresh, None, 1, cached=True, check_norms=True, pads=PADS)
    slots_before, feats_before = decode(tiny, monkeypatch, slack, refresh, None, 1, cached=False, pads=PADS)
    assert all(torch.equal(a, b) for step_a, step_b in zip(slots, slots_before) for a, b in zip(step_a, step_b))
    assert len(feats) == len(feats_before) > 0
    assert all(torch.equal(a, b) for a, b in zip(feats, feats_before))
    n_layers = tiny.config.num_hidden_layers
    assert widths[: 2 * n_layers] == [40] * (2 * n_layers)  # the prefill: every slot of every layer, keys and values
    assert widths[2 * n_layers :] and max(widths[2 * n_layers :]) <= refresh
    assert any(layer.shape[-1] < 80 for layer in slots[-1])  # it did evict


@pytest.mark.parametrize("family", ["mistral-window", "gemma3-text"])
@pytest.mark.parametrize("slack, refresh, interval", [(0, 8, 1), (4, 3, 2)])
def test_cached_norms_through_sliding_window_drops(monkeypatch, family, slack, refresh, interval):
    """Sliding-window layers (every layer, or every other: gemma3's) drop the tokens their next query cannot see
    (`BudgetCache._drop_by_age`, the budget above the window): the cached norms follow the slots there too, and the
    features and kept slots are those of the code before."""
    from architectures import FAMILIES, VOCAB  # the tiny sliding-window decoders of the architecture matrix

    model = FAMILIES[family].build("eager")
    kw = dict(vocab=VOCAB, budget=30)
    slots, feats = decode(model, monkeypatch, slack, refresh, None, interval, cached=True, check_norms=True, **kw)
    slots_before, feats_before = decode(model, monkeypatch, slack, refresh, None, interval, cached=False, **kw)
    assert all(torch.equal(a, b) for step_a, step_b in zip(slots, slots_before) for a, b in zip(step_a, step_b))
    assert len(feats) == len(feats_before) > 0
    assert all(torch.equal(a, b) for a, b in zip(feats, feats_before))
    assert min(layer.shape[-1] for layer in slots[-1]) < 30  # a window dropped tokens


def tracker_case(g, B, H, G, T, D, pad, dtype):
    pos = torch.arange(T).expand(B, H, T).clone()
    pos[0, :, :pad] = -1
    attn = group_mean_max(torch.rand(B, H, G, T, T, generator=g).softmax(-1) * (pos >= 0)[:, :, None, None])
    keys = torch.randn(B, H, T, D, generator=g).to(dtype)
    values = torch.randn(B, H, T, D, generator=g).to(dtype)
    return pos, attn, keys, values


@pytest.mark.parametrize("refresh, interval", [(1, 1), (3, 1), (1, 2)], ids=["refresh1", "refresh3", "lagged"])
def test_the_cache_tells_the_policy_whether_it_scores_next(tiny, monkeypatch, refresh, interval):
    """`LayerView.scored`, which lets the learned policy's kernel path skip its feature read-out: True at exactly the
    steps where its `score` follows the update (refresh 1: the steps that evict, once the cache outgrows its budget;
    refresh 3: the prefill and every third step; lagged: the due steps), False at the others."""
    updates, scored_at = {}, set()
    real_update, real_score, real_layers = learned.Learned.update, learned.Learned.score, learned.Learned.score_layers

    def update(self, view):
        updates.setdefault(view.step, set()).add(view.scored)
        return real_update(self, view)

    def score(self, view):
        scored_at.add(view.step)
        return real_score(self, view)

    def score_layers(self, view, views):  # a refresh of stacked layers
        scored_at.add(view.step)
        return real_layers(self, view, views)

    monkeypatch.setattr(learned.Learned, "update", update)
    monkeypatch.setattr(learned.Learned, "score", score)
    monkeypatch.setattr(learned.Learned, "score_layers", score_layers)
    ids = random_ids(16, seed=5)  # within the budget: the first steps do not evict
    generate(tiny, input_ids=ids, attention_mask=torch.ones_like(ids), policy="learned", budget=20, max_new_tokens=12,
             stop_at_eos=False, policy_params={**params_for("learned", 2), "refresh": refresh, "interval": interval})
    assert all(len(kinds) == 1 for kinds in updates.values()), updates  # every layer of a step alike
    assert {step for step, kinds in updates.items() if True in kinds} == scored_at
    assert any(False in kinds for kinds in updates.values()), "no step went without scoring: nothing was tested"


@pytest.mark.parametrize("B, H, G, T, D", [(1, 1, 1, 2, 4), (2, 3, 3, 17, 8), (3, 2, 2, 40, 64), (8, 3, 3, 130, 64)])
@pytest.mark.parametrize("pad", [0, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("read", ["every", "alternate", "last"])
def test_tracker_features_equal_the_recomputed_norms(B, H, G, T, D, pad, dtype, read):
    """A prefill of ``T - 6`` tokens, then six decode steps, features read out after the prefill and every step,
    every other step or the last only (the unknown norms then span 1 to 7 slots), some slots dead (position -1, as
    slack leaves them): bit for bit the features of a tracker that computes the norms from the keys, and the same
    state."""
    g = torch.Generator().manual_seed(B * 1000 + T + D + pad)
    pad = min(pad, T - 1)
    pos, attn, keys, values = tracker_case(g, B, H, G, T, D, pad, dtype)
    T0 = max(T - 6, 1)
    mine, theirs = {}, {}
    cached, plain = FeatureTracker(2, cache_norms=True), FeatureTracker(2)
    cached.update(attn[..., :T0, :T0], pos[..., :T0], T0, 0, mine)
    plain.update(attn[..., :T0, :T0], pos[..., :T0], T0, 0, theirs)
    if read != "last":
        args = attn[..., :T0, :T0], keys[..., :T0, :], values[..., :T0, :], pos[..., :T0], 1, 0
        assert torch.equal(cached.features(*args, mine), plain.features(*args, theirs))
    for t in range(T0, T):
        for st in (mine, theirs):
            for n, x in st.items():  # the cache appends zero state for the new slot
                st[n] = torch.cat([x, x.new_zeros(*x.shape[:-1], 1)], dim=-1)
        p, a = pos[..., : t + 1].clone(), attn[..., t : t + 1, : t + 1]
        if t % 3 == 1:
            p[:, :, pad : pad + 1] = -1  # a slot marked dead
        k, v = keys[..., : t + 1, :], values[..., : t + 1, :]
        step = t - T0 + 1
        cached.update(a, p, 1, step, mine)
        plain.update(a, p, 1, step, theirs)
        if read == "every" or (read == "alternate" and t % 2 == 0) or t == T - 1:
            assert torch.equal(cached.features(a, k, v, p, 1, step, mine), plain.features(a, k, v, p, 1, step, theirs))
    assert set(mine) == set(STATE) | set(NORMS) and set(theirs) == set(STATE)
    for n in STATE:
        assert torch.equal(mine[n], theirs[n]), n
    assert torch.equal(mine["f.key_norm"], keys.float().norm(dim=-1))


def test_unknown_norms_are_filled_where_they_are():
    """`FeatureTracker.fill_norms` computes the unknown (-1) norms wherever they are (not only a common suffix), in
    place, and leaves the known ones."""
    g = torch.Generator().manual_seed(3)
    keys, values = torch.randn(2, 2, 9, 4, generator=g), torch.randn(2, 2, 9, 4, generator=g)
    state = {NORMS[0]: keys.norm(dim=-1), NORMS[1]: torch.full((2, 2, 9), 7.0)}
    state[NORMS[0]][0, 1, 3] = -1.0
    state[NORMS[0]][1, 0, 7:] = -1.0
    key_norm, value_norm = FeatureTracker(2, cache_norms=True).fill_norms(keys, values, state)
    assert key_norm is state[NORMS[0]] and torch.equal(key_norm, keys.norm(dim=-1))
    assert torch.equal(value_norm, torch.full((2, 2, 9), 7.0))


def test_a_tracker_without_cache_norms_keeps_its_state():
    """Trace recording and the serving runtime use the tracker without ``cache_norms``: its state is `STATE` only."""
    g = torch.Generator().manual_seed(4)
    pos, attn, keys, values = tracker_case(g, 1, 2, 2, 6, 4, 0, torch.float32)
    state = {}
    FeatureTracker(2).update(attn, pos, 6, 0, state)
    assert set(state) == set(STATE) and state["f.win"].shape[2] == WINDOW
    FeatureTracker(2, cache_norms=True).update(attn, pos, 6, 0, state)
    assert set(state) == set(STATE) | set(NORMS) and (state[NORMS[0]] == -1).all()


def scorer_before(scorer, features, layer):
    """`Scorer.forward`'s MLP with an int layer and no content gate or head bias before issue 43's in-place
    inference path (bench/scoring_ab.py --refresh times it against the new one)."""
    x = (features.float() - scorer.mean) / scorer.std
    h = torch.relu(x @ scorer.w1[layer] + scorer.b1[layer])
    return h @ scorer.w2[layer] + scorer.b2[layer]


@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 3, 41), (8, 3, 1500)])
@pytest.mark.parametrize("content", [False, True])
def test_scorer_inference_path_keeps_the_scores(shape, content):
    """`Scorer.forward` at inference (int layer, no grad), standardising in place (``consume``) or not, gives bit
    for bit the scores of the ops it replaced (training's path: standardise, matmul, add, relu), with non-trivial
    standardisation statistics and biases; ``consume`` overwrites only its own fp32 input."""
    torch.manual_seed(len(shape) + shape[-1])
    scorer = Scorer(n_layers=3, content_dim=4 if content else 0, n_heads=shape[1])
    with torch.no_grad():
        scorer.b1.normal_(0, 0.3)
        scorer.b2.normal_(0, 0.3)
        scorer.set_normalization(torch.rand(19) * 3, torch.rand(19) * 2 + 0.05)
        if content:
            scorer.wc.normal_()
    feats = torch.rand(*shape, 19) * 4
    values = torch.randn(*shape, 4)
    for layer in range(3):
        x = (feats - scorer.mean) / scorer.std
        expected = scorer_before(scorer, feats, layer)
        if content:
            expected = expected + scorer.content_term(values, layer)
        expected = expected.detach()
        with torch.no_grad():
            assert torch.equal(scorer(feats, layer, values if content else None), expected)
            mine = feats.clone()
            assert torch.equal(scorer(mine, layer, values if content else None, consume=True), expected)
            assert torch.equal(mine, x)  # standardised in place
            half = feats.bfloat16()
            scorer(half, layer, values if content else None, consume=True)
            assert torch.equal(half, feats.bfloat16())  # not fp32: not its own to overwrite


@pytest.mark.parametrize("slack, refresh, prefill, interval, allocation", DECODES)
def test_cached_content_keeps_the_same_scores_and_slots(tiny, monkeypatch, slack, refresh, prefill, interval,
                                                        allocation):
    """A scorer with content features keeps each token's content term as state (`learned.CONTENT`, computed at its
    first score): every score the scorer gives and every layer's slots after every step of a padded decode are bit
    for bit those of the scorer's content term of every slot at every score (the code before), and after every step
    each live slot's cached term is its value vector's. (Not `LAYER_BY_LAYER`: there a filler slot's score, never
    kept, is its zeroed cached term's, where the code before computed it from the values the slot was filled with.)"""
    scorer = scorer_for(2, content_dim=tiny.config.head_dim)
    runs = []
    for cached in (True, False):
        if not cached:
            monkeypatch.setattr(learned, "cached_content", lambda *args: None)
        scores, slots, checked = [], [], []
        real = Scorer.forward

        def record(self, *args, **kwargs):
            out = real(self, *args, **kwargs)
            scores.append(out.clone())
            return out

        def observe(cache):
            slots.append([layer.positions.clone() for layer in cache.layers])
            for i, layer in enumerate(cache.layers):
                if learned.CONTENT in layer.state:
                    known = (layer.positions >= 0) & ~layer.state[learned.CONTENT].isnan()
                    model = cache.policy.decoding.scorer
                    exact = model.content_term(layer.values, i)
                    assert torch.equal(layer.state[learned.CONTENT][known], exact[known]), f"step {cache.step}"
                    checked.append(int(known.sum()))

        monkeypatch.setattr(Scorer, "forward", record)
        ids = torch.cat([random_ids(40, seed=21 + i, vocab=256) for i in range(2)])
        mask = torch.ones_like(ids)
        mask[1, :7] = 0
        with torch.no_grad():
            generate(tiny, input_ids=ids, attention_mask=mask, policy="learned", budget=24, max_new_tokens=40,
                     slack=slack, stop_at_eos=False, observer=observe, allocation=allocation,
                     policy_params={"scorer": scorer, "refresh": refresh, "interval": interval},
                     **({"prefill_policy": prefill} if prefill else {}))  # fmt: skip
        monkeypatch.undo()
        runs.append((scores, slots, sum(checked)))
    (scores, slots, checked), (scores_before, slots_before, checked_before) = runs
    assert checked > 0 and checked_before == 0  # the code before keeps no content term
    assert len(scores) == len(scores_before) > 0
    assert all(torch.equal(a, b) for a, b in zip(scores, scores_before))
    assert all(torch.equal(a, b) for step_a, step_b in zip(slots, slots_before) for a, b in zip(step_a, step_b))
