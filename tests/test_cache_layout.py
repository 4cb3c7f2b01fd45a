"""The cache's memory layout: preallocated slots (no per-step concatenation) and dead slots (``slack``).

Slack changes where evicted tokens go (they stay in place, dead, until a compaction), never which tokens are kept:
every test here compares the live tokens with a slack-free run of the same decode.
"""

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from conftest import params_for, prefill_for, random_ids, scorer_for
from learnkv import cache as cache_module, generate, kernels
from learnkv.cache import BudgetCache
from learnkv.kernels.reference import select_keep_reference
from learnkv.policies import make_policy
from learnkv.policies.base import LayerView, Policy
from learnkv import slots
from learnkv.slots import BudgetLayer

BIG = torch.iinfo(torch.long).max


def live_positions(layer) -> torch.Tensor:
    """``[B, H, held]`` the positions a layer holds, ascending, padding (-1) last; dead slots left out."""
    pos = layer.positions
    return torch.where(pos >= 0, pos, BIG).sort(dim=-1).values[..., : layer.n_slots - layer.n_dead]


def padded_batch():
    ids = random_ids(21, batch=2, seed=3)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # row 1 is a 16-token prompt, left-padded
    return ids, mask


def decode(model, policy, slack, budget=12, new_tokens=20):
    """Tokens, live positions per step and layer, dead counts per step, and the cache of a padded batch."""
    ids, mask = padded_batch()
    live, dead, caches = [], [], []

    def observe(cache):
        live.append([live_positions(layer) for layer in cache.layers])
        dead.append([layer.n_dead for layer in cache.layers])
        caches[:] = [cache]

    result = generate(model, input_ids=ids, attention_mask=mask, policy=policy, budget=budget,
                      max_new_tokens=new_tokens, policy_params=params_for(policy, 2), stop_at_eos=False,
                      observer=observe, slack=slack, **prefill_for(policy))  # fmt: skip
    return result, live, dead, caches[0]


# every policy whose scores do not depend on neighbouring slots (or, as SnapKV's pool, on live neighbours only), so
# that slack applies to it
@pytest.mark.parametrize("policy", ["h2o", "tova", "roco", "lazy", "knorm", "streaming", "learned", "oracle", "random",
                                    "snapkv"])
@pytest.mark.parametrize("slack", [1, 5])
def test_slack_keeps_the_same_tokens(tiny, policy, slack):
    base, base_live, _, _ = decode(tiny, policy, 0)
    ours, live, dead, cache = decode(tiny, policy, slack)
    assert ours.tokens.tolist() == base.tokens.tolist()
    for step, (a, b) in enumerate(zip(live, base_live)):
        for layer, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(x, y), f"step {step}, layer {layer}: slack {slack} kept other tokens"
    assert cache.slack == slack
    most_dead = max(max(d) for d in dead)
    assert most_dead <= slack
    if cache.policy.interval == 1:  # one eviction per step: dead slots pile up to the slack before a compaction
        assert most_dead == slack
    assert ours.kept_per_step == base.kept_per_step and ours.max_kept_tokens <= 12
    assert ours.peak_kv_bytes <= base.peak_kv_bytes * (12 + slack + 1) / (12 + 1)


@pytest.mark.parametrize("policy, extra", [("rkv", {}), ("paged", {"policy_params": {"block_size": 4}}),
                                           ("h2o", {"granularity": "block", "block_size": 4})])
@pytest.mark.parametrize("slack", [5, 8])  # each eviction frees 3 (R-KV's buffer at this budget) or 4 slots
def test_slack_leaves_dead_slots_only_at_the_left_where_slots_are_grouped(tiny, policy, extra, slack):
    """R-KV's max pool reads neighbouring slots and block eviction groups them: a dead slot between live ones would
    change both. There the slack leaves dead slots only at the left of every row, where padding is (up to ``slack``
    in every row), and the same tokens are kept as without it."""
    runs = {}
    for s in (0, slack):
        seen = runs[s] = []
        generate(tiny, input_ids=random_ids(30, seed=1), policy=policy, max_new_tokens=40, slack=s,
                 observer=lambda c, seen=seen: seen.append([(c.slack, layer.n_dead, live_positions(layer),
                                                             layer.positions.clone()) for layer in c.layers]),
                 **{"budget": 12, **extra})
    assert len(runs[0]) == len(runs[slack]) == 40  # the prefill and 39 decode steps
    for ours, base in zip(runs[slack], runs[0]):
        for (s, dead, live, positions), (s0, dead0, live0, _) in zip(ours, base):
            assert (s, s0, dead0) == (slack, 0, 0) and dead <= slack and torch.equal(live, live0)
            held = (positions >= 0).int()
            assert bool((held[..., 1:] >= held[..., :-1]).all())  # no dead slot after a live one
    assert max(dead for step in runs[slack] for _, dead, _, _ in step) > 0  # the slack was used


def test_decode_steps_write_into_preallocated_slots(tiny):
    """A decode step writes its token into the preallocated buffer; only a compaction moves the cache."""
    budget, slack = 12, 4
    seen = []

    def observe(cache):
        layer = cache.layers[0]
        seen.append((layer.keys.data_ptr(), layer.capacity, layer.n_dead, layer.n_slots, layer.positions.data_ptr()))

    generate(tiny, input_ids=random_ids(8, seed=2), policy="h2o", budget=budget, max_new_tokens=30, slack=slack,
             observer=observe)  # fmt: skip
    assert {cap for _, cap, _, _, _ in seen} == {budget + slack + 1}
    compactions = 0
    for (ptr, _, dead, n, pos), (ptr2, _, dead2, n2, pos2) in zip(seen, seen[1:]):
        if n2 == n + 1 or dead2 == dead + 1:  # appended (and maybe marked a slot dead): same buffer
            assert ptr2 == ptr
        else:  # compacted: the kept slots moved to the front of a fresh buffer; on a CPU the positions (and the
            # state) stay in theirs (`_state_in_place`)
            assert (dead, dead2, n2) == (slack, 0, budget) and pos2 == pos
            compactions += 1
    assert compactions == (30 - 1 - (budget - 8)) // (slack + 1)  # one per slack + 1 evictions


@pytest.mark.parametrize("policy", ["h2o", "learned", "snapkv", "rkv", "tova"])
@pytest.mark.parametrize("slack", [0, 5])
def test_compaction_in_place_keeps_the_same_cache(tiny, policy, slack, monkeypatch):
    """On a CPU a compaction at the layer's capacity gathers the positions and state into their own buffers
    through the cache's workspace (`BudgetLayer._state_in_place`), not into fresh ones: the same tokens, the same
    live slots at every step, and at the end the same keys, values, positions and policy state in every layer (a
    padded batch; learned keeps its stacked state, R-KV compacts at every eviction)."""
    in_place = []
    original = slots._gather_in_place
    monkeypatch.setattr(slots, "_gather_in_place", lambda *a: in_place.append(1) or original(*a))
    ours, live, _, cache = decode(tiny, policy, slack)
    monkeypatch.setattr(BudgetLayer, "_state_in_place", lambda self, capacity: False)
    base, base_live, _, base_cache = decode(tiny, policy, slack)
    assert in_place  # the path under test ran
    assert ours.tokens.tolist() == base.tokens.tolist()
    assert all(torch.equal(x, y) for a, b in zip(live, base_live) for x, y in zip(a, b))
    for layer, ref in zip(cache.layers, base_cache.layers):
        for x, y in ((layer.keys, ref.keys), (layer.values, ref.values), (layer.positions, ref.positions)):
            assert torch.equal(x, y)
        assert layer.state.keys() == ref.state.keys()
        for name, value in layer.state.items():  # NaN: a slot not computed yet (the learned content term)
            torch.testing.assert_close(value, ref.state[name], rtol=0, atol=0, equal_nan=True, msg=name)


@pytest.mark.parametrize("policy", ["h2o", "snapkv", "roco", "learned", "lazy"])
@pytest.mark.parametrize("slack", [0, 3])
def test_a_compaction_zeroes_the_filler_slots_alone(tiny, policy, slack, monkeypatch):
    """Rows of different budgets keep different numbers of slots: a compaction leaves a shorter row's surplus slots
    dead at its left (the -1 entries of an ascending index) and zeroes their state over the leading slots that hold
    them (`slots._filled_prefix`), not over every kept slot: the same tokens, live slots, keys, values, positions and
    state as the fill over every kept slot."""
    real, prefixes = slots._filled_prefix, []
    monkeypatch.setattr(slots, "_filled_prefix", lambda filler: prefixes.append(real(filler)) or prefixes[-1])
    ours, live, _, cache = decode(tiny, policy, slack, budget=0.6)
    assert any(prefixes) and max(prefixes) < 8  # fillers were there, in a few leading slots
    monkeypatch.setattr(slots, "_filled_prefix", lambda filler: filler.shape[-1])  # the fill over every kept slot
    base, base_live, _, base_cache = decode(tiny, policy, slack, budget=0.6)
    assert ours.tokens.tolist() == base.tokens.tolist()
    assert all(torch.equal(x, y) for a, b in zip(live, base_live) for x, y in zip(a, b))
    for layer, ref in zip(cache.layers, base_cache.layers):
        for x, y in ((layer.keys, ref.keys), (layer.values, ref.values), (layer.positions, ref.positions)):
            assert torch.equal(x, y)
        for name, value in layer.state.items():
            torch.testing.assert_close(value, ref.state[name], rtol=0, atol=0, equal_nan=True, msg=name)


def staggered_decode(model, policy, extra):
    """A batch of four prompts of 14-21 tokens (left-padded; two unpadded, so a row that evicts can start at slot 0 as
    a wider one that does not) within budgets of their own, which the rows reach at different steps (3, 6, 5 and
    11): the tokens, every step's live positions and policy state per layer, and the cache."""
    ids = random_ids(21, batch=4, seed=11)
    mask = torch.ones_like(ids)
    for row, pad in enumerate([0, 0, 3, 7]):
        mask[row, :pad] = 0
    live, states, caches = [], [], []

    def observe(cache):
        live.append([live_positions(layer) for layer in cache.layers])
        states.append([{name: t.clone() for name, t in layer.state.items()} for layer in cache.layers])
        caches[:] = [cache]

    result = generate(model, input_ids=ids, attention_mask=mask, policy=policy, max_new_tokens=60, stop_at_eos=False,
                      observer=observe, **{"budget": [24, 27, 23, 25], **extra})  # fmt: skip
    return result, live, states, caches[0]


@pytest.mark.parametrize("policy, extra", [
    ("paged", {"policy_params": {"block_size": 4}}), ("paged", {"budget": [40, 43, 39, 41]}),  # blocks of 16
    ("rkv", {"policy_params": {"buffer": 4, "window": 2}}),
    ("h2o", {"granularity": "block", "block_size": 4}),  # one decision for every layer, with state
    ("paged", {"policy_params": {"block_size": 4}, "slack": 6}),  # dead slots left at the left, at the same width
    ("rkv", {"policy_params": {"buffer": 4, "window": 2}, "slack": 5}),
])
@pytest.mark.parametrize("runs_in_place", [slots.RUNS_IN_PLACE, 1])  # 1: R-KV's rows gathered
def test_a_dense_compaction_moves_only_the_rows_that_evict(tiny, monkeypatch, policy, extra, runs_in_place):
    """Where slots stay dense every eviction compacts, also one only some rows make: only those rows are scored
    (`BudgetCache._score`), select (`BudgetCache._select_due_rows`) and are gathered, in place
    (`BudgetLayer._keep_moved_rows`, or on a stacked step every layer's at once, `slots.keep_moved_rows_of_layers`);
    the others are left as they are. The same tokens, live slots and state at
    every step, and at the end the same live keys and values and positions, as every row scored, selecting and
    compacted. The moved rows' keys and values shifted in place, or gathered where they would take too many runs.
    """
    real, real_linked = BudgetLayer._keep_moved_rows, cache_module.keep_moved_rows_of_layers
    moved, linked, told = [], [], []

    def spy(layer, index):
        moved.append(real(layer, index))
        return moved[-1]

    def spy_linked(layers, index, link, rows=None):  # a stacked step's layers at once
        told.append(rows is not None)  # only the rows that select compared, as the selection tells
        moved.append(real_linked(layers, index, link, rows))
        linked.append(moved[-1])
        return moved[-1]

    selected, select = [], kernels.select_keep
    gathered, gather = [], BudgetLayer._move_keys_values
    monkeypatch.setattr(slots, "RUNS_IN_PLACE", runs_in_place)
    monkeypatch.setattr(BudgetLayer, "_move_keys_values", lambda *a: gathered.append(1) or gather(*a))
    monkeypatch.setattr(BudgetLayer, "_keep_moved_rows", spy)
    monkeypatch.setattr(cache_module, "keep_moved_rows_of_layers", spy_linked)
    monkeypatch.setattr(kernels, "select_keep", lambda scores, *a, **k: selected.append(len(scores)) or select(
        scores, *a, **k))
    ours, live, states, cache = staggered_decode(tiny, policy, extra)
    assert cache.dense and sum(moved) >= 4  # the path under test ran, again and again
    assert any(linked) == (policy != "h2o")  # stacked layers at once (not where the block mode shares a decision)
    assert all(told)
    # R-KV's 4 tokens evicted along a row are up to 5 runs a head: shifted in place, or gathered past 1
    assert bool(gathered) == (policy == "rkv" and runs_in_place == 1)
    assert min(selected) < 4 or cache.shared_block  # and the due rows' selection, where each layer decides
    monkeypatch.setattr(kernels, "select_keep", select)
    monkeypatch.setattr(BudgetLayer, "_keep_moved_rows", lambda layer, index: False)
    monkeypatch.setattr(cache_module, "keep_moved_rows_of_layers", lambda layers, index, link, rows=None: False)
    # where the layers cannot move their rows at once, the due rows' index is spread to every row's, and each layer
    # compacts itself
    spread, spread_live, spread_states, _ = staggered_decode(tiny, policy, extra)
    assert spread.tokens.tolist() == ours.tokens.tolist()
    assert all(torch.equal(x, y) for a, b in zip(live, spread_live) for x, y in zip(a, b))
    assert all(torch.equal(x[name], y[name]) for a, b in zip(states, spread_states) for x, y in zip(a, b) for name in x)
    monkeypatch.setattr(LayerView, "due_rows", lambda view: list(range(view.positions.shape[0])))
    monkeypatch.setattr(BudgetCache, "_select_due_rows", staticmethod(
        lambda scores, rows, positions, keep, sinks, recents, block, live, slack=None: (select_keep_reference(
            scores, positions, keep, sinks, recents, block), None)))
    base, base_live, base_states, base_cache = staggered_decode(tiny, policy, extra)
    assert ours.tokens.tolist() == base.tokens.tolist()
    assert all(torch.equal(x, y) for a, b in zip(live, base_live) for x, y in zip(a, b))
    for step, (a, b) in enumerate(zip(states, base_states)):  # a dead slot's state too (zero, as left padding's)
        for layer, (x, y) in enumerate(zip(a, b)):
            assert x.keys() == y.keys()
            for name, value in x.items():
                assert torch.equal(value, y[name]), f"step {step}, layer {layer}: {name}"
    for layer, ref in zip(cache.layers, base_cache.layers):
        assert torch.equal(layer.positions, ref.positions)
        held = (layer.positions >= 0)[..., None]  # a dead slot's keys and values are never read
        for x, y in ((layer.keys, ref.keys), (layer.values, ref.values)):
            assert torch.equal(x * held, y * held)


@pytest.mark.parametrize("block", [1, 4])
@pytest.mark.parametrize("B, H, T", [(2, 1, 12), (5, 3, 40), (16, 2, 97)])
@pytest.mark.parametrize("interior", [False, True])
def test_due_rows_select_as_every_row(block, B, H, T, interior):
    """`BudgetCache._select_due_rows`: the rows that evict select, the others keep their live slots where they lie;
    the index of every row selecting (`kernels.reference.select_keep_reference`), with rows of any width, given every
    row's scores or the due rows' alone. A row with a dead slot among its live ones (``interior``; never in a dense
    cache) has every row select, the same index."""
    g = torch.Generator().manual_seed(B * T + block)
    for trial in range(10):
        first = torch.randint(0, T // 2, (B,), generator=g)  # each row's dead slots at its left
        first[torch.randint(0, B, (1,), generator=g)] = 0  # the widest row
        positions = (torch.arange(T) - first[:, None]).expand(H, B, T).transpose(0, 1).clone()
        positions[positions < 0] = -1
        if interior:
            positions[B - 1, :, T - 3] = -1
        live = (positions[:, 0] >= 0).sum(-1).tolist()
        due = (torch.rand(B, generator=g) < 0.4).tolist()
        due[trial % B] = True
        keep = [max(n - block - 3, 3) if d else n for n, d in zip(live, due)]
        sinks, recents = [2] * B, [1] * B
        scores = torch.rand(B, H, T, generator=g)
        expected = select_keep_reference(scores, positions, keep, sinks, recents, block)
        ours, moving = BudgetCache._select_due_rows(scores, None, positions, keep, sinks, recents, block, live)
        assert torch.equal(ours, expected) and moving is None  # every row's index
        rows = [b for b in range(B) if keep[b] < live[b]]
        # the due rows' scores alone, as `BudgetCache._score` gives them: the index of every row selecting with zero
        # scores in the others (the same index as above, but where a block selection drops a block from a row that
        # is not due: a dead slot among its live ones makes it hold more slots than it keeps)
        zeros = torch.zeros_like(scores).index_copy_(0, torch.tensor(rows), scores[rows])
        some, moving = BudgetCache._select_due_rows(scores[rows], rows, positions, keep, sinks, recents, block, live)
        assert moving is None
        assert torch.equal(some, select_keep_reference(zeros, positions, keep, sinks, recents, block))
        assert torch.equal(some, expected) or (interior and block > 1)
        # with a slack that covers the width (a stacked step that moves only the rows that change): the due rows'
        # index alone at the width, the others keeping their live slots where they lie; or every row's
        alone, moving = BudgetCache._select_due_rows(scores[rows], rows, positions, keep, sinks, recents, block, live,
                                                     slack=T)
        if moving is None:  # every row selected
            assert (interior or len(rows) == B) and torch.equal(alone, some)
        else:
            assert moving == rows
            held = torch.where(positions >= 0, torch.arange(T), -1).index_copy_(0, torch.tensor(rows), alone)
            assert torch.equal(held, F.pad(some, (T - some.shape[-1], 0), value=-1))


@pytest.mark.parametrize("B, H, K", [(1, 1, 1), (2, 3, 9), (8, 3, 64)])
def test_the_filled_prefix_covers_every_filler(B, H, K):
    """`slots._filled_prefix`: one past the last slot any row marks, wherever the marks lie; 0 for none."""
    g = torch.Generator().manual_seed(B + K)
    assert slots._filled_prefix(torch.zeros(B, H, K, dtype=torch.bool)) == 0
    for _ in range(20):
        filler = torch.rand(B, H, K, generator=g) < 0.1
        marked = filler.flatten(0, 1).any(0).nonzero().flatten().tolist()
        assert slots._filled_prefix(filler) == (marked[-1] + 1 if marked else 0)


def test_long_prompt_memory_is_given_back(tiny):
    """A prompt longer than the budget is allocated whole, then compressed into a budget-sized buffer."""
    caps = []
    generate(tiny, input_ids=random_ids(60, seed=4), policy="tova", budget=12, max_new_tokens=5, slack=2,
             observer=lambda c: caps.append(c.layers[0].capacity))
    assert caps == [12 + 2 + 1] * 5


def test_full_cache_allocates_the_whole_decode_once(tiny):
    ptrs = []
    result = generate(tiny, input_ids=random_ids(10, seed=5), policy="full", max_new_tokens=12,
                      observer=lambda c: ptrs.append((c.layers[0].keys.data_ptr(), c.layers[0].capacity)))
    assert len(set(ptrs)) == 1 and ptrs[0][1] == 10 + 11  # prompt + every decode step's token
    assert result.peak_kv_bytes == result.full_kv_bytes


def test_cache_grows_when_the_length_is_unknown(tiny):
    """Without ``last_step`` the full cache grows geometrically, keeping every slot."""
    cache = BudgetCache(1, make_policy("full"), None)
    layer = cache.layers[0]
    caps, kv = [], torch.randn(1, 2, 1, 4)
    for step in range(40):
        cache.begin_step(torch.tensor([[step]]))
        layer.update(kv + step, kv - step)
        caps.append(layer.capacity)
    assert layer.positions[0, 0].tolist() == list(range(40))
    assert torch.equal(layer.keys[0, 0, :, 0], torch.arange(40.0) + kv[0, 0, 0, 0])
    assert len(set(caps)) < 12  # amortised O(1) appends: a handful of reallocations, not one per step


@pytest.mark.parametrize("slack", [-1, 1.5, True, "4"])
def test_bad_slack_is_refused(tiny, slack):
    with pytest.raises(ValueError, match="slack must be an integer >= 0"):
        generate(tiny, input_ids=random_ids(8), policy="h2o", budget=6, max_new_tokens=2, slack=slack)


@dataclass
class InPlaceAge(Policy):
    """Test double: per-slot age, updated in place (as the Triton path updates state); scattered scores."""

    name = "inplace-age"
    needs_attention = False

    def update(self, view: LayerView) -> None:
        if "age" not in view.state:
            view.state["age"] = torch.zeros(view.positions.shape)
        elif view.step > 0:
            view.state["age"] += 1

    def score(self, view: LayerView) -> torch.Tensor:
        return (view.positions * 7919 % 13).float()


@pytest.mark.parametrize("slack", [0, 4])
def test_state_updated_in_place_stays_in_its_buffer_and_aligned(tiny, slack):
    prompt = 10
    seen = []

    def observe(cache):
        layer = cache.layers[1]
        age, pos = layer.state["age"], layer.positions
        live = pos >= 0
        expected = cache.step - (pos - prompt).clamp(min=0)
        assert torch.equal(age[live], expected[live].float()), f"state misaligned at step {cache.step}"
        seen.append((age.data_ptr(), layer.n_slots, layer.n_dead))

    generate(tiny, input_ids=random_ids(prompt, seed=6), policy=InPlaceAge(n_sink=1, n_recent=2), budget=12,
             max_new_tokens=25, slack=slack, observer=observe)  # fmt: skip
    moved = [(a, b) for a, b in zip(seen, seen[1:]) if a[0] != b[0]]
    appended = [(a, b) for a, b in zip(seen[1:], seen[2:]) if b[1] == a[1] + 1 or b[2] == a[2] + 1]
    assert appended and all(a[0] == b[0] for a, b in appended), "an append moved the state"
    assert len(moved) <= 1 + (25 - 1) // (slack + 1)  # one buffer at the first append, then only compactions


def _layer_by_layer(monkeypatch, policy: str) -> None:
    """Make ``policy`` update and evict one layer at a time, as the cache takes a policy that is not ``rowwise``."""
    cls = type(make_policy(policy, **params_for(policy, 2)))
    monkeypatch.setattr(cls, "rowwise", False)
    assert not make_policy(policy, **params_for(policy, 2)).rowwise


@pytest.mark.parametrize("policy", ["h2o", "tova", "roco", "streaming", "learned", "knorm", "snapkv", "random",
                                    "learned:refresh=1", "learned:content", "snapkv:running_sum"])
@pytest.mark.parametrize("slack, prefill", [(0, None), (4, None), (3, "snapkv")])
def test_stacked_layers_decide_as_layer_by_layer(tiny, monkeypatch, policy, slack, prefill):
    """A rowwise policy updates and evicts every layer of a decode step at once: the same tokens,
    the same live positions in every layer after every step, and the same policy state as layer by layer. On a
    padded batch of two prompts over the budget, with and without dead slots, and with a prefill policy (the
    decode policy then starts its state inside a stacked step). ``learned:refresh=1`` scores at every eviction, one
    layer at a time (it reads each layer's keys and scorer) within the stacked step; ``learned:content`` with a
    scorer that reads the values too (its content term kept per token, `learned.CONTENT`)."""
    policy, _, refresh = policy.partition(":refresh=")
    extra = {"refresh": int(refresh)} if refresh else {}
    if policy == "learned:content":
        policy, extra = "learned", {"scorer": scorer_for(2, content_dim=tiny.config.head_dim)}
    if policy == "snapkv:running_sum":
        policy, extra = "snapkv", {"running_sum": True}
    ids, mask = padded_batch()
    runs = []
    for stacked in (True, False):
        if not stacked:
            _layer_by_layer(monkeypatch, policy)
        live, states, linked = [], [], []
        link = BudgetCache._link_layers

        def spy(self, layers):
            out = link(self, layers)
            linked.append(out is not None)
            return out

        monkeypatch.setattr(BudgetCache, "_link_layers", spy)

        def observe(cache):
            live.append([live_positions(layer) for layer in cache.layers])
            states.append([{k: v.clone() for k, v in layer.state.items()} for layer in cache.layers])

        result = generate(tiny, input_ids=ids, attention_mask=mask, policy=policy, budget=12, max_new_tokens=16,
                          policy_params={**params_for(policy, 2), **extra}, stop_at_eos=False, observer=observe,
                          slack=slack, prefill_policy=prefill)  # fmt: skip
        runs.append((result, live, states, linked))
    (ours, live, states, linked), (base, base_live, base_states, base_linked) = runs
    assert linked and all(linked) and not base_linked  # every decode step stacked, none in the base run
    assert ours.tokens.tolist() == base.tokens.tolist()
    for step, (a, b, sa, sb) in enumerate(zip(live, base_live, states, base_states)):
        for layer in range(len(a)):
            assert torch.equal(a[layer], b[layer]), f"step {step}, layer {layer}: other tokens kept"
            assert sa[layer].keys() == sb[layer].keys()
            for name in sa[layer]:
                # NaN marks a content term not computed yet (the learned policy's `CONTENT`): equal where both are
                assert torch.allclose(sa[layer][name], sb[layer][name], rtol=0, atol=0, equal_nan=True), \
                    f"step {step}, layer {layer}: {name} differs"


@pytest.mark.parametrize("policy", ["h2o", "learned", "tova"])
def test_stacked_step_sum_over_one_query_row_is_a_view_of_its_rows(tiny, monkeypatch, policy):
    """A stacked decode step hands the attention sum over its one query row as a view of the stacked rows (one
    concatenation, not two of the same values): the same values as each layer's own sum."""
    cls = type(make_policy(policy, **params_for(policy, 2)))
    real, seen = cls.update, []

    def spy(self, view):
        if view.layers is not None:
            seen.append((view.attn, view.attn_sum))
        return real(self, view)

    monkeypatch.setattr(cls, "update", spy)
    ids, mask = padded_batch()
    generate(tiny, input_ids=ids, attention_mask=mask, policy=policy, budget=12, max_new_tokens=6,
             policy_params=params_for(policy, 2), stop_at_eos=False)
    assert len(seen) == 5  # every decode step stacked
    for attn, attn_sum in seen:
        assert attn_sum.data_ptr() == attn.data_ptr() and torch.equal(attn_sum, attn.select(-2, 0))


def test_roco_in_place_decode_step_counts_no_query_of_a_waiting_row():
    """RoCo's in-place decode update (a float mask) against its general update (`roco.accumulate`), bit for bit,
    where a row's new slot is dead (a row that waits this step: its query sees nothing) and where slots are dead."""
    from learnkv.policies import roco
    from learnkv.policies.base import LayerView

    g = torch.Generator().manual_seed(7)
    B, H, T = 3, 2, 40
    pos = torch.arange(T).expand(B, H, T).clone()
    pos[0, :, :9] = -1  # padding
    pos[1, :, 5::6] = -1  # evicted, awaiting a compaction
    pos[2, :, -1] = -1  # waiting
    state = {name: (torch.rand(B, H, T, generator=g) * 5).floor() for name in ("s1", "s2", "count")}
    attn = torch.rand(B, H, 1, T, generator=g) / T
    views = [LayerView(layer=0, step=4, keys=None, values=None, positions=pos, n_new=1, attn=attn,
                       attn_sum=attn[:, :, 0], attn_sq_sum=attn[:, :, 0] ** 2, keep=30,
                       state={k: v.clone() for k, v in state.items()}) for _ in range(2)]
    roco.RoCo().update(views[0])
    roco.accumulate(views[1])
    for name in state:
        assert torch.equal(views[0].state[name].view(torch.int32), views[1].state[name].view(torch.int32)), name
    assert not torch.equal(views[0].state["count"][2], state["count"][2] + (pos[2] >= 0))  # the waiting row counts none


@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize("slack, prefill", [(0, None), (4, None), (3, "snapkv")])
def test_roco_in_place_decode_steps_keep_the_state_and_slots(tiny, monkeypatch, stacked, slack, prefill):
    """RoCo's decode steps update its statistics in place: after every step of a padded batch the same tokens,
    every layer's live positions and its statistics bit for bit those of its general update at every step
    (`roco.accumulate`, new tensors each step: the code before), stacked (every layer at once) and layer by layer."""
    from learnkv.policies import roco

    if not stacked:
        _layer_by_layer(monkeypatch, "roco")
    ids, mask = padded_batch()
    runs = []
    for before in (False, True):
        if before:
            monkeypatch.setattr(roco.RoCo, "update", lambda self, view: roco.accumulate(view))
        live, states = [], []

        def observe(cache):
            live.append([live_positions(layer) for layer in cache.layers])
            states.append([{k: v.clone() for k, v in layer.state.items()} for layer in cache.layers])

        result = generate(tiny, input_ids=ids, attention_mask=mask, policy="roco", budget=12, max_new_tokens=16,
                          stop_at_eos=False, observer=observe, slack=slack, prefill_policy=prefill)
        runs.append((result.tokens.tolist(), live, states))
    (tokens, live, states), (tokens_before, live_before, states_before) = runs
    assert tokens == tokens_before and len(live) == len(live_before) == 16
    for step, (a, b, sa, sb) in enumerate(zip(live, live_before, states, states_before)):
        for layer in range(len(a)):
            assert torch.equal(a[layer], b[layer]), f"step {step}, layer {layer}: other tokens kept"
            assert sa[layer].keys() == sb[layer].keys()
            for name in sa[layer]:
                assert torch.equal(sa[layer][name], sb[layer][name]), f"step {step}, layer {layer}: {name} differs"
    assert all("s1" in layer for layer in states[-1])  # its statistics were compared


@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize("slack, prefill, allocation", [(0, None, "uniform"), (4, None, "uniform"),
                                                        (3, "snapkv", "uniform"), (4, None, "pyramid"),
                                                        (4, None, "head")])
def test_roco_victims_alone_keep_the_same_slots(tiny, monkeypatch, stacked, slack, prefill, allocation):
    """Where the cache reads one victim a row (`LayerView.victims_only`: every row over its budget by one at most,
    its scores neither kept nor compared across heads), RoCo scores that victim alone (`roco.victim_scores`): after
    every step of a padded batch, the same tokens and every layer's live positions as with its full scores, stacked
    and layer by layer, at the allocations that compare within a row (where some steps ask for the victim alone)
    and across heads (where none does)."""
    from learnkv.policies import roco

    if not stacked:
        _layer_by_layer(monkeypatch, "roco")
    ids, mask = padded_batch()
    real_score, asked = roco.RoCo.score, []

    def score(self, view):
        asked.append(view.victims_only)
        return real_score(self, view)

    monkeypatch.setattr(roco.RoCo, "score", score)
    runs = []
    for alone in (True, False):
        if not alone:
            monkeypatch.setattr(BudgetCache, "_victims_only", lambda self, layer, keep: False)
        live = []
        result = generate(tiny, input_ids=ids, attention_mask=mask, policy="roco", budget=12, max_new_tokens=16,
                          stop_at_eos=False, slack=slack, prefill_policy=prefill, allocation=allocation,
                          observer=lambda cache: live.append([live_positions(layer) for layer in cache.layers]))
        runs.append((result.tokens.tolist(), live))
    assert runs[0][0] == runs[1][0] and len(runs[0][1]) == len(runs[1][1]) == 16
    for step, (a, b) in enumerate(zip(runs[0][1], runs[1][1])):
        for layer in range(len(a)):
            assert torch.equal(a[layer], b[layer]), f"step {step}, layer {layer}: other tokens kept"
    assert any(asked) == (allocation != "head")
