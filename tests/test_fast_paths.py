"""The CPU decode path's shortcuts against the formulations they replace, bit for bit.

Each shortcut saves tensor ops (on CPU every op costs a dispatch) or memory traffic in the decode loop, and must
give exactly what the plain formulation gives, so that the kept tokens do not change: the reference selection's
token path, the selection's kept slots listed by a cumulative sum, the reference gather of whole slots, the moved
rows' keys and values shifted in place, `exact_map`'s distinct tuples, the learned policy scoring only the
rows that evict, the cache's state buffers that need no zeroing at an append, and the learned refresh's feature
read-out (its columns laid out feature by feature, its dead slots zeroed by index).
"""

import pytest
import torch

from conftest import params_for, random_ids
from kernel_checks import one_drop_case
from learnkv.kernels import reference as ref
from learnkv import generate
import learnkv.features
from learnkv.features import FeatureTracker, group_mean_max, window_std
from learnkv.policies import make_policy
from learnkv.policies.base import LayerView, exact_map, reduce_heads


def rank_select(scores, positions, keep, n_sink, n_recent):
    """Token selection as a rank per slot (the formulation `select_keep_reference` had): every slot's rank in
    priority order, the rows' kept slots sorted after the rest, the last K taken."""
    B, H, T = scores.shape
    if isinstance(keep, int) and T <= keep:
        return torch.arange(T).expand(B, H, T).clone()
    n_kept = ref.per_row(keep, B).view(B, 1).expand(B, H).clamp(max=T)
    prio = scores.float().masked_fill(positions < 0, float("-inf"))
    prio = prio.masked_fill(ref.protected_slots(positions, n_sink, n_recent), float("inf"))
    slots = torch.arange(T).expand(B, H, T)
    rank = torch.empty_like(positions).scatter_(-1, ref.rank_prefer_recent(prio), slots.contiguous())
    kept = rank < n_kept[..., None]
    K = int(n_kept.max()) if B * H else 0
    key = torch.where(kept, T + slots, slots).sort(dim=-1).values[..., T - K :]
    return torch.where(key >= T, key - T, torch.full_like(key, -1))


@pytest.mark.parametrize("B, H, T", [(1, 1, 1), (1, 3, 17), (2, 2, 33), (4, 3, 129), (16, 3, 40)])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("per_row", [False, True])
def test_select_keep_token_path_equals_the_rank_formulation(B, H, T, ties, per_row):
    g = torch.Generator().manual_seed(B * 1000 + T)
    for trial in range(20):
        pos = torch.arange(T).expand(B, H, T).clone()
        pos[0, :, : int(torch.randint(0, T, (1,), generator=g))] = -1  # left padding
        pos[torch.rand(B, H, T, generator=g) < 0.1] = -1  # dead slots
        scores = torch.randint(0, 3, (B, H, T), generator=g).float() if ties else torch.randn(B, H, T, generator=g)
        draw = lambda: int(torch.randint(1, T + 2, (1,), generator=g))  # noqa: E731
        keep = [draw() for _ in range(B)] if per_row else draw()
        n_sink, n_recent = trial % 3, trial % 5
        expected = rank_select(scores, pos, keep, n_sink, n_recent)
        assert torch.equal(ref.select_keep_reference(scores, pos, keep, n_sink, n_recent), expected), f"trial {trial}"


@pytest.mark.parametrize("B, H, T", [(1, 1, 1), (1, 3, 17), (2, 2, 33), (4, 3, 129), (16, 3, 40)])
@pytest.mark.parametrize("kind", ["randn", "ties", "special", "over"])
@pytest.mark.parametrize("one_keep", [False, True])
def test_select_keep_one_drop_equals_the_reference(B, H, T, kind, one_keep):
    """The decode step's shortcut (`kernels.cpu.select_keep_one_drop`, one argmin instead of two sorts) keeps
    exactly the reference's slots, and `kernels.select_keep(live=...)` falls back to the reference where it cannot."""
    from learnkv import kernels
    from learnkv.kernels.cpu import select_keep_one_drop

    g = torch.Generator().manual_seed(B * 1000 + T)
    taken = 0
    for trial in range(20):
        scores, pos, keeps, lives = one_drop_case(B, H, T, g, kind)
        if kind == "over" and lives[0] < 2:
            continue
        if one_keep:  # one keep and one live count for every row, as the cache passes them when the rows agree
            keeps, lives = [keeps[0]] * B, [lives[0]] * B
            pos[:] = pos[:1]
        keep = keeps[0] if one_keep else keeps
        n_sink, n_recent = trial % 3, trial % 5
        expected = ref.select_keep_reference(scores, pos, keep, n_sink, n_recent)
        shortcut = select_keep_one_drop(scores, pos, keep, n_sink, n_recent, lives[0] if one_keep else lives)
        if shortcut is not None:
            taken += 1
            assert torch.equal(shortcut, expected), f"trial {trial}: {shortcut.tolist()} != {expected.tolist()}"
        assert torch.equal(kernels.select_keep(scores, pos, keep, n_sink, n_recent, live=lives), expected)
    if kind == "over":
        assert taken == 0
    elif kind != "special":
        assert taken >= 15, f"the shortcut decided only {taken} of 20 steps"


@pytest.mark.parametrize("B, H, T", [(1, 1, 1), (1, 3, 17), (2, 2, 33), (4, 3, 129), (16, 3, 40)])
@pytest.mark.parametrize("block", [1, 4, 16])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("per_row", [False, True])
def test_listed_selection_equals_the_reference(B, H, T, block, ties, per_row):
    """`kernels.cpu.select_keep_listed` (kept slots listed by a cumulative sum) keeps the reference's slots in the
    reference's order (which sorts every slot), tokens and blocks, rows keeping fewer than the widest included;
    where the reference refuses (a row without the blocks to drop), so does it."""
    from learnkv import kernels
    from learnkv.kernels.cpu import select_keep_listed

    g = torch.Generator().manual_seed(B * 1000 + T + block)
    compared = 0
    for trial in range(20):
        pos = torch.arange(T).expand(B, H, T).clone()
        pos[0, :, : int(torch.randint(0, T, (1,), generator=g))] = -1  # left padding
        if block == 1:
            pos[torch.rand(B, H, T, generator=g) < 0.1] = -1  # dead slots
        scores = torch.randint(0, 3, (B, H, T), generator=g).float() if ties else torch.randn(B, H, T, generator=g)
        low = 0 if block == 1 else T // 2  # a row of blocks keeps at least its trailing partial block
        draw = lambda: int(torch.randint(low, T + 2, (1,), generator=g))  # noqa: E731
        keep = [draw() for _ in range(B)] if per_row else draw()
        args = (scores, pos, keep, trial % 3, trial % 5, block)
        try:
            expected = ref.select_keep_reference(*args)
        except ValueError:
            with pytest.raises(ValueError):
                select_keep_listed(*args)
            continue
        assert torch.equal(select_keep_listed(*args), expected), f"trial {trial}"
        assert torch.equal(kernels.select_keep(*args), expected)
        compared += 1
    assert compared >= 5


@pytest.mark.parametrize("M, H, C, D", [(1, 1, 4, 1), (2, 3, 40, 8), (5, 2, 300, 16)])
@pytest.mark.parametrize("kind", ["blocks", "subsets"])
def test_slot_runs_move_what_a_gather_moves(M, H, C, D, kind):
    """The moved rows' keys and values shifted in place (`kernels.cpu.slot_runs`, one memmove a run,
    `move_slot_run`) hold every kept slot a gather would put there, and leave every other slot as it was; a kept
    slot that would move left, or more runs than asked for, give none (the caller gathers)."""
    from learnkv.kernels.cpu import move_slot_run, slot_runs

    g = torch.Generator().manual_seed(M * 100 + C)
    for trial in range(20):
        n = int(torch.randint(1, C + 1, (1,), generator=g))
        first = int(torch.randint(0, n, (1,), generator=g))
        W = n - first
        slots = torch.full((M, H, W), -1)
        for m in range(M):
            for h in range(H):
                if kind == "blocks":  # a dense row: live slots at its right, a block of them evicted
                    live = int(torch.randint(0, n + 1, (1,), generator=g))
                    start = n - live + int(torch.randint(0, live + 1, (1,), generator=g))
                    size = int(torch.randint(0, n - start + 1, (1,), generator=g))
                    kept = [s for s in range(n - live, n) if not start <= s < start + size]
                else:  # any ascending subset
                    kept = sorted(torch.randperm(n, generator=g)[: int(torch.randint(0, n + 1, (1,), generator=g))])
                kept = [s for s in kept if s < n][-W:] if W else []
                if kept:
                    slots[m, h, W - len(kept) :] = torch.tensor(kept)
        buf = torch.randn(M, H, C, D, generator=g)
        runs = slot_runs(slots, first)
        assert runs is not None  # kept slots listed at a row's right never move left
        expected = buf.clone()
        held = slots >= 0
        for m, h, i in held.nonzero().tolist():
            expected[m, h, first + i] = buf[m, h, slots[m, h, i]]
        for run in runs:
            move_slot_run(buf, *run)
        moved = torch.zeros(M, H, C, dtype=torch.bool)
        moved[..., first:n] = held
        assert torch.equal(buf[moved], expected[moved]), f"trial {trial}"
        touched = torch.zeros_like(moved)
        for m, h, dest, length, _ in runs:
            touched[m, h, dest : dest + length] = True
        assert torch.equal(buf[~touched], expected[~touched])
        assert slot_runs(slots, first, most=len(runs)) == runs
        assert not runs or slot_runs(slots, first, most=len(runs) - 1) is None  # too many: the caller gathers
    assert slot_runs(torch.tensor([[[2, 3]]]), 0) is None  # slots 2, 3 to 0, 1: left
    with pytest.raises(ValueError, match="no run"):
        move_slot_run(torch.zeros(1, 1, 4, 2), 0, 0, 3, 2, 1)  # past the buffer


@pytest.mark.parametrize("shape, dim", [((2, 3, 9, 4), -2), ((1, 1, 5, 1), 2), ((3, 2, 7, 4, 2), 2),
                                        ((2, 3, 9), -1), ((2, 3, 16, 9), -1), ((0, 3, 9, 4), -2)])
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("with_out", [None, "larger", "exact"])
def test_gather_tokens_reference_equals_gather(shape, dim, layout, with_out):
    """Whole slots by one index_select of rows (keys and values) == `Tensor.gather` with an expanded index; into an
    ``out`` with more slots, or of exactly the gathered shape (written directly, no temporary)."""
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g)
    if layout == "strided":
        x = torch.randn(*shape[:-1], shape[-1] * 2, generator=g)[..., ::2]
    d = dim % x.ndim
    B, H, T = shape[0], shape[1], shape[d]
    K = T + 2  # repeats and more slots than the source, as a padded compaction index has
    index = torch.randint(0, T, (B, H, K), generator=g)
    idx = index.reshape(B, H, *([1] * (d - 2)), K, *([1] * (x.ndim - d - 1)))
    expected = x.gather(d, idx.expand(*shape[:d], K, *shape[d + 1 :]))
    extra = {None: 0, "larger": 3, "exact": 0}[with_out]
    out = torch.full((*shape[:d], K + extra, *shape[d + 1 :]), float("nan")) if with_out else None
    actual = ref.gather_tokens_reference(x, index, dim, out=out)
    assert torch.equal(actual, expected)
    if with_out:
        assert actual.data_ptr() == out.data_ptr() and out.narrow(d, K, extra).isnan().all()


def unique_dim_map(fn, *keys):
    """`exact_map` as it was: the distinct tuples by `torch.unique` over a dimension."""
    distinct, inverse = torch.unique(torch.stack([k.reshape(-1) for k in keys]), dim=1, return_inverse=True)
    return fn(*distinct)[inverse].view(keys[0].shape)


@pytest.mark.parametrize("shape", [(1,), (1, 1, 7), (2, 3, 33), (16, 3, 129), (0, 3)])
@pytest.mark.parametrize("n_keys", [1, 2, 3])
@pytest.mark.parametrize("levels", [2, 50, 5000])
def test_exact_map_equals_unique_over_a_dimension(shape, n_keys, levels):
    """Same distinct tuples in the same (lexicographic) order, so ``fn`` gets the same tensor: the same bits."""
    g = torch.Generator().manual_seed(levels + n_keys)
    keys = [torch.randint(0, levels, shape, generator=g).float() * (i + 1) for i in range(n_keys)]
    seen = []

    def fn(*cols):
        seen.append(torch.stack(cols))
        return torch.sigmoid(-(1 + cols[0] / (cols[-1] + 1e-5))) + sum(torch.exp(-c / 7) for c in cols)

    expected = unique_dim_map(fn, *keys)
    actual = exact_map(fn, *keys)
    assert torch.equal(seen[0], seen[1]), "fn saw other tuples, or in another order"
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("B, due", [(2, [1]), (3, [0, 2]), (5, [4]), (16, [0, 3, 9, 15])])
def test_learned_scores_the_due_rows_as_it_scores_every_row(B, due):
    """Scoring only the rows that evict (at every eviction: refresh=1) gives them, bit for bit, the scores of
    scoring the whole batch."""
    g = torch.Generator().manual_seed(B)
    H, G, D, T, n_layers = 2, 3, 8, 37, 2
    policy = make_policy("learned", **params_for("learned", n_layers), refresh=1).resolve(24)
    pos = torch.arange(T).expand(B, H, T).clone()
    pos[0, :, :5] = -1
    attn = torch.rand(B, H, G, 1, T, generator=g) * (pos >= 0)[:, :, None, None]
    attn = group_mean_max(attn / attn.sum(-1, keepdim=True))  # what the learned policy is handed
    state = {}
    FeatureTracker(n_layers).update(attn.expand(B, H, 2, 3, T).contiguous(), pos, 3, 0, state)
    keys, values = torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)
    live = (pos >= 0).sum(-1).amax(-1).tolist()

    def scores(keep):
        view = LayerView(layer=1, step=4, keys=keys, values=values, positions=pos, n_new=1, attn=attn, keep=keep,
                         state=state, live=live)
        with torch.no_grad():
            return policy.score(view)

    every = scores([n - 2 for n in live])
    some = scores([n - 2 if b in due else n for b, n in enumerate(live)])
    assert torch.equal(some[due], every[due])


@pytest.mark.parametrize("policy", ["h2o", "lazy", "learned"])
@pytest.mark.parametrize("slack", [0, 3])
def test_state_buffers_are_zero_past_the_slots_in_use(tiny, policy, slack):
    """What lets an append write nothing into the state: every state buffer is zero past the slots in use, after
    appends, in-place updates and compactions alike."""
    checked = []

    def observe(cache):
        for layer in cache.layers:
            for name, buf in layer.state_buffers().items():
                assert not buf[..., layer.n_slots :].any(), f"step {cache.step}: {name} not zero past the slots in use"
                checked.append(name)

    generate(tiny, input_ids=random_ids(14, seed=2), policy=policy, budget=12, max_new_tokens=16, slack=slack,
             observer=observe, policy_params=params_for(policy, 2),
             **({"prefill_policy": "snapkv"} if policy == "lazy" else {}))
    assert checked


@pytest.mark.parametrize("B, H, T", [(1, 1, 1), (1, 3, 17), (2, 2, 33), (4, 3, 129), (16, 3, 40)])
def test_protected_or_dead_is_protected_or_dead(B, H, T):
    """`kernels.reference.protected_or_dead` in two comparisons, `protected_slots` from it, and its float mask
    (`protected_or_dead_mask`): the protected slots (or the dead ones) as defined, sinks and recent window comparison
    by comparison, for sinks and windows of 0, per row, and wider than a row's positions, rows with dead slots
    anywhere and rows all dead."""
    g = torch.Generator().manual_seed(B * 100 + T)
    for trial in range(12):
        _, pos, _, _ = one_drop_case(B, H, T, g, "randn")
        if trial % 4 == 3:
            pos[0] = -1  # a row with no live slot
        n_sink = [int(x) for x in torch.randint(0, 4, (B,), generator=g)] if trial % 2 else trial % 3
        n_recent = [int(x) for x in torch.randint(0, T + 3, (B,), generator=g)] if trial % 3 else trial % 5
        sinks, recents = ref.per_row(n_sink, B), ref.per_row(n_recent, B)  # the definition, pass by pass
        newest = pos.max(dim=-1, keepdim=True).values
        protected = ((pos >= 0) & (pos < sinks)) | ((pos >= 0) & (pos > newest - recents))
        assert torch.equal(ref.protected_slots(pos, n_sink, n_recent), protected), f"trial {trial}"
        assert torch.equal(ref.protected_or_dead(pos, n_sink, n_recent), protected | (pos < 0)), f"trial {trial}"
        mask = ref.protected_or_dead_mask(pos, n_sink, n_recent)
        assert mask.dtype == torch.float32 and torch.equal(mask, (protected | (pos < 0)).float()), f"trial {trial}"


@pytest.mark.parametrize("B, H, T", [(1, 1, 1), (1, 3, 17), (2, 2, 33), (4, 3, 129), (16, 3, 40)])
@pytest.mark.parametrize("kind", ["randn", "ties", "special", "over"])
@pytest.mark.parametrize("one_keep", [False, True])
def test_marking_the_victims_leaves_the_reference_slots(B, H, T, kind, one_keep):
    """A one-drop step that does not compact marks each dropping row's victim dead (`kernels.cpu.one_drop_victims`,
    `kernels.cpu.mark_victims`) instead of listing the kept slots and marking the rest: the same positions as
    `mark_dead` of the reference's kept slots, and no decision where the shortcut of the selection has none."""
    from learnkv.kernels.cpu import mark_victims, one_drop_victims, select_keep_one_drop
    from learnkv.kernels.reference import mark_dead

    g = torch.Generator().manual_seed(B * 1000 + T + 7)
    taken = 0
    for trial in range(20):
        scores, pos, keeps, lives = one_drop_case(B, H, T, g, kind)
        if kind == "over" and lives[0] < 2:
            continue
        if one_keep:
            keeps, lives = [keeps[0]] * B, [lives[0]] * B
            pos[:] = pos[:1]
        keep, live = (keeps[0], lives[0]) if one_keep else (keeps, lives)
        n_sink, n_recent = trial % 3, trial % 5
        found = one_drop_victims(scores, pos, keep, n_sink, n_recent, live)
        assert (found is None) == (select_keep_one_drop(scores, pos, keep, n_sink, n_recent, live) is None)
        if found is None:
            continue
        taken += 1
        expected = pos.clone()
        mark_dead(expected, ref.select_keep_reference(scores, pos, keep, n_sink, n_recent))
        marked = pos.clone()
        mark_victims(marked, *found)
        assert torch.equal(marked, expected), f"trial {trial}"
    if kind == "over":
        assert taken == 0
    elif kind != "special":
        assert taken >= 15, f"the shortcut decided only {taken} of 20 steps"


@pytest.mark.parametrize("policy", ["h2o", "tova", "knorm", "streaming", "learned", "random"])
@pytest.mark.parametrize("slack", [0, 4])
def test_decode_marks_the_same_slots_without_a_kept_index(tiny, monkeypatch, policy, slack):
    """The cache's one-drop marking (`BudgetCache._mark_one_drop`) leaves every layer's slot positions after every
    step of a padded batch-2 decode as selecting the kept slots and marking the rest did (the shortcut off)."""
    import learnkv.kernels.cpu

    ids = torch.cat([random_ids(30, seed=11), random_ids(30, seed=12)])
    mask = torch.ones_like(ids)
    mask[1, :5] = 0

    def run():
        seen = []
        generate(tiny, input_ids=ids, attention_mask=mask, policy=policy, budget=20, max_new_tokens=24, slack=slack,
                 stop_at_eos=False, policy_params=params_for(policy, 2), prefill_policy="snapkv",
                 observer=lambda cache: seen.append([layer.positions.clone() for layer in cache.layers]))
        return seen

    calls = []
    real = learnkv.kernels.cpu.mark_one_drop
    monkeypatch.setattr(learnkv.kernels.cpu, "mark_one_drop", lambda *a: calls.append(1) or real(*a))
    fast = run()
    monkeypatch.setattr(learnkv.kernels.cpu, "mark_one_drop", lambda *a: False)
    before = run()
    assert len(fast) == len(before) == 24
    assert all(torch.equal(a, b) for step_a, step_b in zip(fast, before) for a, b in zip(step_a, step_b))
    assert bool(calls) == (slack > 0), "slack 0 compacts at every eviction; with slack the marking must run"


def learned_decode_slots(model, ids, mask, params, slack, max_new_tokens):
    """Every step's ``[(positions, kept scores)]`` per layer of a learned decode at budget 20 (SnapKV prefills)."""
    from learnkv.cache import _REFRESHED

    clone = lambda t: None if t is None else t.clone()  # noqa: E731 - no scores before the first refresh
    seen = []
    generate(model, input_ids=ids, attention_mask=mask, policy="learned", budget=20, max_new_tokens=max_new_tokens,
             slack=slack, stop_at_eos=False, policy_params=params, prefill_policy="snapkv",
             observer=lambda cache: seen.append([(layer.positions.clone(), clone(layer.state.get(_REFRESHED)))
                                                 for layer in cache.layers]))
    return seen


def assert_same_slots_and_scores(ours, before):
    """Every step's and layer's ``(positions, kept scores)`` (None before a first refresh) equal, bit for bit."""
    for step_a, step_b in zip(ours, before):
        for (pos_a, scores_a), (pos_b, scores_b) in zip(step_a, step_b):
            assert torch.equal(pos_a, pos_b)
            assert (scores_a is None) == (scores_b is None)
            if scores_a is not None:
                assert torch.equal(scores_a.view(torch.int32), scores_b.view(torch.int32))


@pytest.mark.parametrize("slack", [0, 4])
@pytest.mark.parametrize("refresh", [1, 8])
def test_learned_keeps_the_same_slots_with_its_feature_major_read_out(tiny, monkeypatch, slack, refresh):
    """The learned policy's refresh reads its features out feature by feature, the dead slots zeroed by index: every
    layer's slot positions after every step of a padded batch-2 decode, and the scores it keeps, as with the
    token-major stack and the mask it had before (both shortcuts off)."""
    from learnkv.features import zero_dead_slots

    ids = torch.cat([random_ids(30, seed=21), random_ids(30, seed=22)])
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    params = {**params_for("learned", 2), "refresh": refresh}
    masked = lambda cols, pos, by_index: zero_dead_slots(cols, pos, by_index=False)  # noqa: E731

    def run():
        return learned_decode_slots(tiny, ids, mask, params, slack, 24)

    calls = []
    real = FeatureTracker.features
    monkeypatch.setattr(FeatureTracker, "features", lambda *a, **k: calls.append(k) or real(*a, **k))
    fast = run()
    monkeypatch.setattr(FeatureTracker, "features", lambda *a, feature_major=False: real(*a))
    monkeypatch.setattr(learnkv.features, "zero_dead_slots", masked)
    before = run()
    assert len(fast) == len(before) == 24
    assert_same_slots_and_scores(fast, before)
    assert calls and all(k.get("feature_major") for k in calls), "the read-out must have run feature-major"


@pytest.mark.parametrize("slack", [0, 4])
@pytest.mark.parametrize("read_out_slots", [1, 250, 10**9], ids=["one-layer", "two-layers", "every-layer"])
@pytest.mark.parametrize("content", [0, 16], ids=["plain", "content"])
def test_learned_refresh_of_stacked_layers_keeps_the_same_slots_and_scores(monkeypatch, slack, read_out_slots,
                                                                           content):
    """A refresh of the cache's stacked layers reads the features of a few layers' rows at once
    (`Learned.score_layers`, `READ_OUT_SLOTS`): every layer's slot positions after every step of a padded batch-2
    decode of a 5-layer model (refresh 4), and every score it keeps, as with one read-out and scorer per layer (the
    code before: `Policy.score_layers`), read-outs of one, two (and a last of one) or every layer."""
    from learnkv.model import tiny_model
    from learnkv.policies import learned
    from learnkv.policies.base import Policy

    model = tiny_model(seed=3, num_layers=5)
    ids = torch.cat([random_ids(30, seed=31), random_ids(30, seed=32)])
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    params = {**params_for("learned", 5, content_dim=content), "refresh": 4}

    def run():
        return learned_decode_slots(model, ids, mask, params, slack, 24)

    read_outs = []  # layers per feature read-out
    real = FeatureTracker.features
    monkeypatch.setattr(FeatureTracker, "features", lambda self, attn, *a, **k: read_outs.append(attn.shape[0] // 2)
                        or real(self, attn, *a, **k))
    monkeypatch.setattr(learned, "READ_OUT_SLOTS", read_out_slots)
    stacked = run()
    read_outs = sorted(set(read_outs))
    monkeypatch.setattr(learned.Learned, "score_layers", Policy.score_layers)
    before = run()
    assert len(stacked) == len(before) == 24
    assert_same_slots_and_scores(stacked, before)
    per_read_out = {"one-layer": {1}, "two-layers": {1, 2}, "every-layer": {1, 5}}  # 1: the prefill, layer by layer
    assert set(read_outs) == per_read_out[{1: "one-layer", 250: "two-layers"}.get(read_out_slots, "every-layer")]


@pytest.mark.parametrize("L, B, H, T", [(1, 2, 3, 17), (3, 8, 3, 1500), (5, 1, 3, 270), (2, 16, 3, 1290)])
@pytest.mark.parametrize("threads", [1, 2])
def test_features_of_stacked_layers_are_each_layers_own(L, B, H, T, threads):
    """`FeatureTracker.features` of the rows of ``L`` layers stacked layer-major (their layers as a list, the norms
    read from the state): each layer's rows bit for bit the features of that layer read out alone (its layer as an
    int, its norms from its keys), at one and two threads (the stacked ops split over threads where one layer's did
    not), dead slots included."""
    from learnkv.features import NORMS, SPARE_ROWS, STATE, WINDOW, token_norms

    g = torch.Generator().manual_seed(L * 1000 + T)
    tracker = FeatureTracker(30, cache_norms=True, spare_rows=SPARE_ROWS)
    state = {name: torch.rand(L * B, H, T, generator=g) * 3 for name in STATE if name != "f.win"}
    state["f.count"] = (state["f.count"] * 300).floor() + 1
    state["f.win"] = torch.rand(L * B, H, WINDOW + SPARE_ROWS, T, generator=g) ** 4 / T
    keys, values = torch.randn(L * B, H, T, 8, generator=g), torch.randn(L * B, H, T, 8, generator=g)
    state.update(zip(NORMS, (token_norms(keys), token_norms(values))))
    pos = torch.arange(T).expand(L * B, H, T).clone()
    pos[:, :, 3::7] = -1
    pos[0, :, : T // 2] = -1
    attn = group_mean_max(torch.rand(L * B, H, 3, 1, T, generator=g) / T)
    layers = [4 + 3 * i for i in range(L)]
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        stacked = tracker.features(attn, None, None, pos, layers, 40, state, feature_major=True)
        for i, layer in enumerate(layers):
            rows = slice(i * B, (i + 1) * B)
            alone = tracker.features(attn[rows], keys[rows], values[rows], pos[rows], layer, 40,
                                     {name: t[rows] for name, t in state.items()}, feature_major=True)
            assert torch.equal(stacked[rows].view(torch.int32), alone.view(torch.int32)), f"layer {layer}"
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("L, B, H, T, D", [(1, 2, 3, 17, 8), (3, 8, 3, 790, 64), (6, 16, 3, 1290, 64)])
def test_norms_filled_for_stacked_layers_are_each_layers_own(L, B, H, T, D):
    """`fill_unknown_norms` of several layers' rows stacked layer-major, one search and one fill (the learned
    policy's refresh of stacked layers): every layer's norms bit for bit those of a fill of that layer alone, and of
    `token_norms` of every token, where the layers' unknown slots start at different columns (a layer's compaction
    moves its newest slots)."""
    from learnkv.features import fill_unknown_norms, token_norms

    g = torch.Generator().manual_seed(L * 100 + T)
    keys = [torch.randn(B, H, T, D, generator=g) for _ in range(L)]
    known = torch.cat([token_norms(k) for k in keys])
    cached = known.clone()
    for i in range(L):  # layer i's newest 1 + 3i slots unknown, and in one row a few more
        cached[i * B : (i + 1) * B, :, T - min(1 + 3 * i, T) :] = -1.0
        cached[i * B, 0, T - min(5 + 3 * i, T) :] = -1.0
    alone = cached.clone()
    for i in range(L):
        fill_unknown_norms(alone[i * B : (i + 1) * B], keys[i])
    fill_unknown_norms(cached, keys)
    assert torch.equal(cached.view(torch.int32), alone.view(torch.int32))
    assert torch.equal(cached.view(torch.int32), known.view(torch.int32))


def update_decode_before(attn, positions, step, state):
    """`FeatureTracker._update_decode` before the window's row-by-row shift (commit 27bd051): the same update, with
    the window shifted through a temporary copy, as it was."""
    win, scratch = state["f.win"], state["f.win"].clone()
    FeatureTracker._update_decode(attn, positions, step, {**state, "f.win": scratch})
    win[:, :, :-1] = win[:, :, 1:].clone()
    win[:, :, -1] = attn[:, :, 0, -1, :]


@pytest.mark.parametrize("B, H, G, T", [(1, 1, 1, 1), (2, 3, 3, 17), (4, 2, 2, 130)])
def test_tracker_decode_update_equals_the_replaced_shift(B, H, G, T):
    """The tracker's decode update shifts its window row by row (no temporary copy): every state entry bit for bit
    as the replaced code, over several steps, on a view of a larger buffer as the cache hands it."""
    from learnkv.features import STATE, WINDOW

    g = torch.Generator().manual_seed(B * 100 + T)
    pos = torch.arange(T).expand(B, H, T).clone()
    pos[0, :, : T // 3] = -1
    ours = {}
    for name in STATE:
        shape = (B, H, WINDOW, T + 5) if name == "f.win" else (B, H, T + 5)
        ours[name] = (torch.rand(*shape, generator=g) * 3).floor()[..., :T]  # views with room, like the cache's
    theirs = {k: v.clone() for k, v in ours.items()}
    tracker = FeatureTracker(n_layers=2)
    for step in range(1, 6):
        attn = group_mean_max(torch.rand(B, H, G, 1, T, generator=g) / T)
        tracker._update_decode(attn, pos, step, ours)
        update_decode_before(attn, pos, step, theirs)
        for name in STATE:
            assert torch.equal(ours[name], theirs[name]), f"step {step}: {name}"


def update_decode_with_bool_masks(attn, positions, step, state, spare=0):
    """`FeatureTracker._update_decode` before its float masks (commit ac1fd22), verbatim (docstring aside)."""
    from learnkv.features import MAX, MEAN, WINDOW
    from learnkv.sliding_rows import in_rows, push_row

    valid = positions >= 0
    m = attn[:, :, MEAN, -1, :]  # [B, H, T]
    state["f.acc"].add_(m)
    state["f.acc_sq"].addcmul_(m, m)
    state["f.count"].add_(valid & valid[..., -1:])  # the query is the newest slot: it sees every live one
    win = state["f.win"] = in_rows(state["f.win"], WINDOW, spare, step - 1)
    push_row(win, m, WINDOW, spare, step)  # without spare rows, the in-place shift row by row (no temporary copy)
    if step == 0:
        return
    n_visible = valid.sum(-1, keepdim=True).clamp(min=1)
    high = attn[:, :, MAX, -1, :] * n_visible >= 1.0
    last = state["f.last_high"]
    last[..., -1] = step - 1  # a new token counts as seen the step before it arrived
    gap = step - last
    returns = high & (gap >= 2)  # came back after at least one low step
    state["f.n_returns"].add_(returns)
    state["f.sum_interval"].add_(gap * returns)
    torch.where(returns, gap, state["f.last_interval"], out=state["f.last_interval"])
    torch.maximum(state["f.max_interval"], gap * high, out=state["f.max_interval"])
    last.masked_fill_(high, float(step))


@pytest.mark.parametrize("B, H, G, T", [(1, 1, 1, 6), (2, 3, 3, 17), (3, 2, 2, 130), (8, 3, 3, 790)])
@pytest.mark.parametrize("spare", [0, 8])
@pytest.mark.parametrize("threads", [1, 2])
def test_tracker_decode_update_equals_the_bool_masks(B, H, G, T, spare, threads):
    """The tracker's decode update with float masks: every state entry bit for bit the replaced code's (bool masks,
    ``where``, ``masked_fill_``) after each of 40 decode steps, on state as the cache holds it: seeded by a prefill
    of a left-padded batch, a zero slot appended at each step, slots marked dead mid-decode, and a compaction (each
    row's live slots gathered to the right, zero filler slots before them), a row whose new slot is dead at some
    steps, at one and two threads. The attention
    is peaked, so tokens go high, low and return (every recurrence entry changes)."""
    from learnkv.features import SPARE_ROWS, STATE

    assert spare in (0, SPARE_ROWS)
    g = torch.Generator().manual_seed(B * 1000 + T + spare)
    pos = torch.arange(T).expand(B, H, T).clone()
    pos[0, :, : T // 3] = -1  # left padding
    scores = torch.randn(B, H, G, T, T, generator=g) * 3
    tracker, ours = FeatureTracker(n_layers=2, spare_rows=spare), {}
    tracker.update(group_mean_max(scores.masked_fill(pos[:, :, None, None, :] < 0, -1e9).softmax(-1)), pos, T, 0, ours)
    theirs = {name: t.clone() for name, t in ours.items()}
    old, dead_seen = torch.get_num_threads(), False
    torch.set_num_threads(threads)
    try:
        for step in range(1, 41):
            pos = torch.cat([pos, pos.amax(-1, keepdim=True) + 1], -1)
            for state in (ours, theirs):  # the step's new slot, zero state
                for name, t in state.items():
                    state[name] = torch.cat([t, t.new_zeros(*t.shape[:-1], 1)], -1)
            if step % 7 == 0:  # a row that waits this step: its new slot is dead, and no slot counts the query
                pos[-1, :, -1] = -1
            if step % 9 == 0:  # some of the older slots evicted: marked dead, their state left as it is
                pos[..., 1 : pos.shape[-1] - 4][torch.rand(B, H, pos.shape[-1] - 5, generator=g) < 0.2] = -1
            if step % 13 == 0:  # a compaction: each row's live slots to the right, zero filler slots before them
                K = int((pos >= 0).sum(-1).max())
                index = (pos >= 0).float().add(torch.linspace(0, 0.5, pos.shape[-1])).argsort(-1)[..., -K:]
                filler = torch.gather(pos, -1, index) < 0
                for state in (ours, theirs):
                    for name, t in state.items():
                        rows = index[:, :, None].expand(B, H, t.shape[2], K) if t.ndim == 4 else index
                        mask = filler[:, :, None].expand_as(rows) if t.ndim == 4 else filler
                        state[name] = torch.gather(t, -1, rows).masked_fill(mask, 0.0)
                pos = torch.gather(pos, -1, index).masked_fill(filler, -1)
            peaked = torch.randn(B, H, G, 1, pos.shape[-1], generator=g) * 3
            attn = group_mean_max(peaked.masked_fill(pos[:, :, None, None, :] < 0, float("-inf")).softmax(-1))
            tracker._update_decode(attn, pos, step, ours, spare)
            update_decode_with_bool_masks(attn, pos, step, theirs, spare)
            dead_seen |= bool((pos[..., T // 2 :] < 0).any())
            for name in STATE:
                assert torch.equal(ours[name].view(torch.int32), theirs[name].view(torch.int32)), f"step {step}: {name}"
    finally:
        torch.set_num_threads(old)
    assert (ours["f.n_returns"] > 0).any() and (ours["f.last_high"] == 40).any() and dead_seen


@pytest.mark.parametrize("slack", [0, 4])
def test_learned_decode_with_float_masks_keeps_the_same_slots_and_scores(monkeypatch, slack):
    """The learned policy's decode with the tracker's float-mask update: every layer's slot positions after every
    step of a padded batch-2 decode of a 5-layer model (refresh 4), and every score it keeps, as with the bool masks
    before (`update_decode_with_bool_masks`)."""
    from learnkv.model import tiny_model

    model = tiny_model(seed=5, num_layers=5)
    ids = torch.cat([random_ids(30, seed=51), random_ids(30, seed=52)])
    mask = torch.ones_like(ids)
    mask[0, :7] = 0
    params = {**params_for("learned", 5), "refresh": 4}

    def run():
        return learned_decode_slots(model, ids, mask, params, slack, 40)

    fast = run()
    monkeypatch.setattr(FeatureTracker, "_update_decode", staticmethod(update_decode_with_bool_masks))
    before = run()
    assert len(fast) == len(before) == 40
    assert_same_slots_and_scores(fast, before)
    assert any(pos.shape[-1] < 60 + 40 for pos, _ in fast[-1])  # it did evict


@pytest.mark.parametrize("B, H, G, T", [(1, 1, 1, 1), (2, 3, 3, 17), (3, 2, 2, 130), (16, 3, 3, 64)])
@pytest.mark.parametrize("dead", ["none", "padding", "marked"])
def test_feature_major_features_are_the_token_major_values(monkeypatch, B, H, G, T, dead):
    """`FeatureTracker.features` laid out feature by feature: the same ``[B, H, T, F]`` values bit for bit, as a view
    of an ``[F, B, H, T]`` tensor; both the values of the stack of every column with a mask over the dead slots
    (the formulation before the fill by index), on a state seeded by a prefill and grown by decode steps."""
    from learnkv.features import FEATURES, STATE

    g = torch.Generator().manual_seed(B * 1000 + T)
    pos = torch.arange(T).expand(B, H, T).clone()
    if dead == "padding":
        pos[0, :, : max(T // 2, 1)] = -1
    attn = group_mean_max(torch.rand(B, H, G, T, T, generator=g).softmax(-1))
    keys, values = torch.randn(B, H, T, 8, generator=g), torch.randn(B, H, T, 8, generator=g)
    tracker, state = FeatureTracker(n_layers=3), {}
    T0 = max(T - 4, 1)
    tracker.update(attn[..., :T0, :T0], pos[..., :T0], T0, 0, state)
    for t in range(T0, T):
        for name, x in state.items():
            state[name] = torch.cat([x, x.new_zeros(*x.shape[:-1], 1)], dim=-1)
        tracker.update(attn[..., t : t + 1, : t + 1], pos[..., : t + 1], 1, t - T0 + 1, state)
    if dead == "marked":
        pos[:, :, T // 3 :: 3] = -1  # slots marked dead after the tracker saw them: their state is not zero
    args = attn[..., -1:, :], keys, values, pos, 1, T - T0, state
    plain, major = tracker.features(*args), tracker.features(*args, feature_major=True)
    assert major.shape == plain.shape == (B, H, T, len(FEATURES))
    assert major.permute(3, 0, 1, 2).is_contiguous() and plain.is_contiguous()
    assert torch.equal(major.view(torch.int32), plain.view(torch.int32))
    monkeypatch.setattr(learnkv.features, "zero_dead_slots", lambda *a, **k: None)  # the columns as stacked
    masked = tracker.features(*args).masked_fill_(~(pos >= 0)[..., None], 0.0)  # the mask used before
    assert torch.equal(plain.view(torch.int32), masked.view(torch.int32))
    if dead != "none":
        assert (plain[pos < 0] == 0).all() and bool((pos < 0).any())
    assert set(state) == set(STATE)


@pytest.mark.parametrize("F, N", [(1, 1), (19, 7), (19, 61920), (4, 300)])
@pytest.mark.parametrize("dead", [0.0, 0.01, 0.5, 1.0])
def test_zero_dead_slots_by_index_is_the_mask(F, N, dead):
    """Zeroing the dead slots' features by their index (the CPU's way) and by the mask (elsewhere): the same bits,
    in a feature-major and a token-major view of the columns."""
    from learnkv.features import zero_dead_slots

    g = torch.Generator().manual_seed(F * N + int(dead * 100))
    pos = torch.arange(N).masked_fill(torch.rand(N, generator=g) < dead, -1)
    cols = torch.randn(F, N, generator=g)
    want = cols.masked_fill(~(pos >= 0), 0.0)
    for by_index in (True, False):
        major, minor = cols.clone(), cols.t().contiguous()
        zero_dead_slots(major, pos, by_index)
        zero_dead_slots(minor.t(), pos, by_index)
        assert torch.equal(major.view(torch.int32), want.view(torch.int32))
        assert torch.equal(minor.t().view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("B, H, T", [(1, 1, 1), (3, 2, 1), (1, 3, 7), (2, 3, 33), (8, 3, 780), (16, 3, 1290)])
@pytest.mark.parametrize("hidden", [16, 32])
@pytest.mark.parametrize("threads", [1, 2])
def test_scorer_scores_either_feature_layout_bit_for_bit(B, H, T, hidden, threads):
    """The scorer's inference on features laid out feature by feature (the learned policy's refresh) and token by
    token (traces, serving): the same scores bit for bit, one thread or two (the matmul reads the transposed layout
    as it reads the other)."""
    from learnkv.scorer.model import Scorer

    g = torch.Generator().manual_seed(B * 100 + T + hidden)
    scorer = Scorer(3, hidden=hidden)
    with torch.no_grad():
        for p in scorer.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
        scorer.set_normalization(torch.rand(19, generator=g), torch.rand(19, generator=g) + 0.5)
    feats = torch.randn(19, B, H, T, generator=g) * 3
    feats[:, :, :, ::5] = 0.0
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            plain = scorer(feats.permute(1, 2, 3, 0).clone(memory_format=torch.contiguous_format), 1, consume=True)
            major = scorer(feats.clone().permute(1, 2, 3, 0), 1, consume=True)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(major.view(torch.int32), plain.view(torch.int32))


@pytest.mark.parametrize("B, H, W, T", [(1, 1, 1, 1), (2, 3, 2, 17), (1, 3, 5, 130), (8, 3, 16, 300), (3, 1, 16, 1)])
@pytest.mark.parametrize("kind", ["attention", "wide", "zeros"])
@pytest.mark.parametrize("threads", [1, 2])
def test_window_std_equals_torch_std(B, H, W, T, kind, threads):
    """The learned policy's `win_std` feature (`learnkv.features.window_std`): ``torch.std``'s own arithmetic on
    whole slices, bit for bit, at one and two threads (the reduction must not be split across threads)."""
    g = torch.Generator().manual_seed(B * 100 + W * 10 + T)
    win = torch.rand(B, H, W, T, generator=g) ** 4 / max(T, 1)  # attention-like: small, many near zero
    if kind == "wide":
        win = win * 10.0 ** torch.randint(-30, 30, (B, H, W, T), generator=g)
    elif kind == "zeros":
        win[..., ::2] = 0.0
        win[..., 1::3] = -0.0  # Welford starts from +0.0: a signed zero must come out as torch.std's does
        win[:, :, : W // 2, 1::4] = win[:, :, -1:, 1::4]  # repeated values: a zero variance
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got, want = window_std(win), win.std(dim=2, unbiased=False)
    finally:
        torch.set_num_threads(old)
    assert got.shape == want.shape and torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("policy, budget", [("full", None), ("h2o", 20), ("paged", 20), ("snapkv", 48)])
@pytest.mark.parametrize("batch", [1, 2])
def test_decode_steps_skip_a_mask_that_excludes_nothing(tiny, monkeypatch, policy, budget, batch):
    """A decode step over a layer whose every slot is live (`BudgetCache.every_slot_live`: no dead, padding or
    ragged-head slot) and whose every row's query is a token (`BudgetCache.every_query_a_token`) skips the attention
    mask, and one over dead or padding slots masks them alone (no causal comparison: the query comes after every cached
    position); every step's logits are bit for bit those of the causal mask built from the positions; batch 2 is
    left-padded (its padding slots keep the mask until an eviction compacts them away), PagedEviction evicts whole
    blocks (its heads may hold different counts) and a budget of 48 holds the whole decode (the mask skipped
    throughout)."""
    import learnkv.attention
    import learnkv.decode

    ids = torch.cat([random_ids(30, seed=11), random_ids(30, seed=12)])[:batch]
    mask = torch.ones_like(ids)
    if batch == 2:
        mask[1, :5] = 0
    kw = {} if budget is None else dict(budget=budget, slack=4, prefill_policy="snapkv")
    if policy == "paged":
        kw["policy_params"] = {"block_size": 4, "n_sink": 4}

    def run():
        logits, real = [], learnkv.decode.call_model
        monkeypatch.setattr(learnkv.decode, "call_model", lambda *a: logits.append(real(*a)) or logits[-1])
        generate(tiny, input_ids=ids, attention_mask=mask, policy=policy, max_new_tokens=16, stop_at_eos=False, **kw)
        monkeypatch.setattr(learnkv.decode, "call_model", real)
        return logits

    skipped, real = [], learnkv.attention._every_slot_visible
    monkeypatch.setattr(learnkv.attention, "_every_slot_visible", lambda *a: skipped.append(real(*a)) or skipped[-1])
    fast = run()
    monkeypatch.setattr(learnkv.attention, "_queries_are_tokens", lambda *a: False)  # the causal mask at every step
    masked = run()
    assert len(fast) == len(masked) == 16
    assert all(torch.equal(a, b) for a, b in zip(fast, masked))
    if batch == 1:
        assert any(skipped), "without padding some step must skip the mask"
    if policy == "h2o":  # slack 4: dead slots between compactions, masked alone
        assert not all(skipped)
    if policy in ("full", "snapkv"):  # a cache that never evicts in the decode: dead slots never, padding always
        assert all(skipped) if batch == 1 else not any(skipped)


def matmul_attention(query, key, value, scaling):
    """The attention as `learnkv.attention` computed it with `torch.matmul` on 4D views (before 9d2a269): causal
    by index, the probabilities in fp32."""
    B, Hq, q, D = query.shape
    H, T, Dv = key.shape[1], key.shape[2], value.shape[-1]
    G = Hq // H
    scores = (torch.matmul(query.reshape(B, H, G * q, D), key.transpose(-1, -2)) * scaling).view(B, H, G, q, T)
    allowed = torch.ones(q, T, dtype=torch.bool).tril(T - q)
    probs = torch.softmax(scores.masked_fill(~allowed, torch.finfo(scores.dtype).min), dim=-1, dtype=torch.float32)
    out = torch.matmul(probs.to(query.dtype).view(B, H, G * q, T), value)
    return out.view(B, Hq, q, Dv).transpose(1, 2).contiguous()


@pytest.mark.parametrize("B, H, G, q, T, D", [(1, 3, 3, 1, 1, 64), (1, 3, 3, 1, 257, 64), (2, 2, 1, 1, 40, 16),
                                              (4, 1, 7, 5, 33, 32), (3, 2, 4, 17, 17, 8), (8, 3, 3, 1, 790, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "slots"])
def test_attention_bmm_equals_the_matmul_formulation(B, H, G, q, T, D, dtype, layout):
    """`learnkv_attention` multiplies through `torch.bmm` on folded views; the output is bit for bit what
    `torch.matmul` on the 4D views gave, for keys and values that are the first T slots of a larger buffer (the
    cache's layout) or contiguous, GQA groups of 1-7, one query or several."""
    from learnkv.attention import learnkv_attention

    g = torch.Generator().manual_seed(B * 1000 + T)
    query = torch.randn(B, H * G, q, D, generator=g).to(dtype)
    C = T + (9 if layout == "slots" else 0)
    key = torch.randn(B, H, C, D, generator=g).to(dtype)[:, :, :T]
    value = torch.randn(B, H, C, D, generator=g).to(dtype)[:, :, :T]
    module = torch.nn.Module()
    module.layer_idx = 0
    out, _ = learnkv_attention(module, query, key, value, None, scaling=D**-0.5)
    assert torch.equal(out, matmul_attention(query, key, value, D**-0.5))


@pytest.mark.parametrize("cache_from", [0, None])
@pytest.mark.parametrize("slack, prefill, batch, interval", [(0, None, 1, 1), (4, "snapkv", 2, 1), (3, None, 2, 1),
                                                             (0, None, 2, 5), (4, "snapkv", 2, 3)])
def test_knorm_cached_norms_keep_what_every_keys_norm_kept(tiny, monkeypatch, slack, prefill, batch, interval,
                                                           cache_from):
    """Key-norm keeps each key's norm as state, computed once: every layer's slots after every step and the tokens
    are those of scoring every key's norm at every eviction (the code before), stacked or lagged, padded, with a
    prefill policy handing over; looked up at every size (``CACHE_FROM`` 0) or at the default threshold."""
    import learnkv.policies.knorm as knorm
    from learnkv.policies.knorm import KeyNorm

    if cache_from is not None:
        monkeypatch.setattr(knorm, "CACHE_FROM", cache_from)

    ids = torch.cat([random_ids(30, seed=11), random_ids(30, seed=12)])[:batch]
    mask = torch.ones_like(ids)
    mask[-1, :5] = 0

    def run():
        seen = []
        r = generate(tiny, input_ids=ids, attention_mask=mask, policy="knorm", budget=14, max_new_tokens=20,
                     slack=slack, stop_at_eos=False, policy_params={"interval": interval}, prefill_policy=prefill,
                     observer=lambda cache: seen.append([layer.positions.clone() for layer in cache.layers]))
        return r.tokens, seen

    cached = run()
    monkeypatch.setattr(KeyNorm, "update", lambda self, view: None)
    monkeypatch.setattr(KeyNorm, "score", lambda self, view: -view.keys.float().norm(dim=-1))
    before = run()
    assert torch.equal(cached[0], before[0])
    assert len(cached[1]) == len(before[1]) == 20  # the prefill and 19 decode steps
    assert all(torch.equal(a, b) for step_a, step_b in zip(cached[1], before[1]) for a, b in zip(step_a, step_b))


@pytest.mark.parametrize("slack, prefill, budget, block", [(0, None, 14, 4), (4, "snapkv", 14, 4), (3, None, 16, 1),
                                                          (0, "snapkv", [12, 19], 4), (5, None, [24, 20], 4)])
def test_paged_cached_ratios_keep_what_every_tokens_ratio_kept(tiny, monkeypatch, slack, prefill, budget, block):
    """PagedEviction keeps each slot's ||V|| / ||K|| as state, computed by the update that appends it: every layer's
    slots after every step and the tokens are those of computing every slot's ratio at every eviction (the code
    before), padded, with a prefill policy handing over, with rows reaching their budgets at different steps."""
    from learnkv.policies.paged import RATIO, PagedEviction

    ids = torch.cat([random_ids(30, seed=11), random_ids(30, seed=12)])
    mask = torch.ones_like(ids)
    mask[-1, :5] = 0

    def run():
        seen = []
        r = generate(tiny, input_ids=ids, attention_mask=mask, policy="paged", budget=budget, max_new_tokens=24,
                     slack=slack, stop_at_eos=False, policy_params={"block_size": block}, prefill_policy=prefill,
                     observer=lambda cache: seen.append([(layer.positions.clone(), RATIO in layer.state)
                                                         for layer in cache.layers]))
        return r.tokens, seen

    cached = run()
    assert all(held for step in cached[1][1:] for _, held in step)  # the state was there at every decode step
    monkeypatch.setattr(PagedEviction, "update", lambda self, view: None)
    monkeypatch.setattr(PagedEviction, "score", lambda self, view: reduce_heads(
        view.values.float().norm(dim=-1) / view.keys.float().norm(dim=-1).clamp(min=1e-6)))
    before = run()
    assert torch.equal(cached[0], before[0])
    assert len(cached[1]) == len(before[1]) == 24  # the prefill and 23 decode steps
    assert all(torch.equal(a, b) for step_a, step_b in zip(cached[1], before[1])
               for (a, _), (b, _) in zip(step_a, step_b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(2, 3, 17, 64), (8, 3, 800, 64), (4, 8, 300, 128)])
def test_token_norms_upcast_in_the_reduction_as_after_a_copy(dtype, shape):
    """`learnkv.features.token_norms` upcasts inside the reduction (no fp32 copy of the keys): the norms of the
    fp32 copy it replaced, bit for bit, contiguous or not."""
    from learnkv.features import token_norms

    x = (torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))) * 3).to(dtype)
    for view in (x, x.transpose(-1, -2).contiguous().transpose(-1, -2)):
        assert torch.equal(token_norms(view), view.float().norm(dim=-1))
