"""Before/after timing of the cheaper R-KV redundancy and SnapKV pooling (issue 43, item 2), alternating rounds.

    python bench/scoring_ab.py
    python bench/scoring_ab.py --step      # a decode step's marking, tracker window and SnapKV window instead
    python bench/scoring_ab.py --rkv       # R-KV's redundancy: the dense [B, T, T] code against the blockwise one
    python bench/scoring_ab.py --refresh   # the learned policy's refresh of one layer: torch.std's window std or not,
                                           # and the key/value norms recomputed or cached (with the scorer in place)
    python bench/scoring_ab.py --profile   # where those two spend their time (torch.profiler, per op)
    python bench/scoring_ab.py --stacked-refresh --threads 2  # the refresh's feature read-out layer by layer, a few
                                                              # layers at a time, or all 30 at once
    python bench/scoring_ab.py --layout --threads 2  # the refresh's features stacked token by token and masked, or
                                                     # laid out feature by feature and zeroed by index
    python bench/scoring_ab.py --victims --threads 2  # a decode step's one-drop victims, and a compaction's
                                                      # zeroing of the filler slots' state
    python bench/scoring_ab.py --masks --threads 2  # the learned tracker's decode update with bool or float
                                                    # masks; a refresh's norms and content terms filled by layer or
                                                    # once for a few stacked layers; RoCo's score and
                                                    # LazyEviction's update with bool or float masks
    python bench/scoring_ab.py --rkv-model # R-KV's redundancy on SmolLM2's own keys (a batch-8 prefill; minutes)
    python bench/scoring_ab.py --rkv-event --threads 2  # the same keys, 1 and 2 rows: what a decode's eviction scores
    python bench/scoring_ab.py --refresh-model  # the learned policy's eviction time over a SmolLM2 decode (minutes)
    python bench/scoring_ab.py --refresh-model --unpadded --rounds 4  # the same on 4 unpadded 400-token prompts
    python bench/scoring_ab.py --refresh-model --same --rounds 2       # control: the code after on both sides

"Before" is the replaced code, kept verbatim in tests/test_scoring_speed.py (which proves both give the same bits);
"after" is `learnkv.policies.rkv.redundancy` and `learnkv.policies.snapkv.avg_pool`. Shapes: R-KV's redundancy at
batch 4, 3 KV heads, 900 cached keys of 64 dims (bench/profile_eviction.py's R-KV at 1k tokens), no padding; SnapKV's
pooling of batch 1, 4 and 16 x 3 heads x 516 candidates, kernel 5 (its profile's budget ~580 less the 64-token
window). Seven
rounds, the side that goes first alternating; per round after / before, median [min, max]. One thread
(``--threads N``: N).

``--layout``: one layer's refresh (`FeatureTracker.features` with the norms cached and a random-init `Scorer`
standardising in place) at batch 8 x 3 KV heads x 780 slots and 16 x 3 x 1,290 (goal 1's and goal 2's caches at
50%), ~13 dead slots a row, a tracker state after 11 decode steps: the features stacked token by token with the
dead slots masked over every feature (before) against laid out feature by feature and the dead slots zeroed by
index (after, the learned policy's read-out); the same scores bit for bit (checked).

``--step``: the per-step work of a long decode (batch 8, 3 KV heads, 790 slots; 30 layers stacked for the first two):
marking one dead slot per row (`kernels.cpu.select_keep_one_drop` + `kernels.reference.mark_dead` before, the victims'
argmin and one scatter after), the learned tracker's window shift ([240, 3, 16, 790], a temporary copy before, row by
row after; tests/test_fast_paths.py keeps the replaced code), the tracker's whole decode update with its window
shifted (before) or kept among `learnkv.features.SPARE_ROWS` spare rows (after), and SnapKV's 64-row window
update of the 30 stacked layers (an in-place shift of its 64 rows before; one row written among 64 + `SPARE_ROWS`
after, the window moving back to the top every 17 steps).

``--victims``: goal 1's per-step and per-compaction work at batch 8 x 3 KV heads x ~790 slots (30 layers stacked):
each row's one-drop victim (`kernels.cpu.one_drop_victims`; before: its code until 39f22f0, seven passes for the
protected and dead slots, an argmin and a three-pass check, `test_scoring_speed.one_drop_victims_before`; after: two
comparisons and one ``min`` for victims and check together); and one layer's compaction zeroing the state of the
filler slots (rows of budgets 762-789 keep up to 27 fewer slots than the widest) in SnapKV's 80 window rows, over
every kept slot (before) or over the leading slots that hold the fillers (after, `BudgetLayer.keep_slots`).

``--masks``: goal 1's learned policy at batch 8 x 3 KV heads x 790 slots (30 layers stacked): the tracker's decode
update (`FeatureTracker._update_decode`) with bool masks, ``where`` and ``masked_fill_`` (before: its code until
ac1fd22, `test_fast_paths.update_decode_with_bool_masks`) or float masks and ``addcmul_`` (after), on a state seeded
by a prefill and 11 decode steps, the attention peaked so that ~1 slot in 6 goes high (the same bits: that test file);
and a refresh's fill of the unknown key and value norms and content terms (the newest 8 slots of every layer, as 8
steps after the last refresh; a scorer with 64 content dims): each layer's own search and fill, with the scorer moved
to the device at each layer (before: the code until ac1fd22) against one search and fill for each read-out's
`learned.READ_OUT_SLOTS` worth of layers (after, `Learned.score_layers`); and RoCo's score of the 30 stacked layers
(rows of 8 budgets, 762-789, as goal 1's) with bool masks and ``masked_fill`` (before, its code until ac1fd22,
`test_scoring_speed.roco_score_with_bool_masks`) or float masks and maximums with +-inf (after; the same bits); and
LazyEviction's decode update of the 30 stacked layers with a bool mask and ``masked_fill_`` (before, its code until
4aac568, `test_scoring_speed.lazy_update_with_bool_mask`) or a float mask times the jump (after; the same bits). It
first prints what single ops cost on a bool and on a float mask of that shape.

``--stacked-refresh``: the refresh's feature read-out of 30 layers at batch 8, 3 KV heads, 790 slots, one
``[8, 3, 790]`` `FeatureTracker.features` call per layer (before) against a few layers' rows a call (after: the
learned policy's `Learned.score_layers`, `learnkv.policies.learned.READ_OUT_SLOTS`) and against all 30 in one
``[30 x 8, 3, 790]`` call: the same features bit for bit (checked), a tracker state after 11 decode steps with dead
slots in every fifth row, the norms cached; and the window std of each layer's 16 window rows as it was
(`test_scoring_speed.window_std_before`: a temporary per division and product) and with ``addcdiv_`` and
``addcmul_`` (`learnkv.features.window_std`, the same bits: that test file).

``--rkv`` and ``--refresh`` (issue 43 item 2, second pass), at a long decode's shapes (batch 8, SmolLM2's 3 KV heads
of 64 dims, 1,500 cached slots): R-KV's redundancy of one layer, dense (`test_scoring_speed.redundancy_dense`, the
replaced code) and blockwise (`learnkv.policies.rkv.redundancy`), with keys that have a shared direction (most rows
find a near-duplicate among the newest slots, as SmolLM2's keys do) and with independent keys (none do: the worst
case); the learned policy's refresh of one layer (`FeatureTracker.features` and a random-init `Scorer`), with the
window std by `Tensor.std` (before) and by `learnkv.features.window_std` (after); and the same refresh with the key
and value norms computed from the keys and values and the scorer's standardised copy (before: the tracker without
``cache_norms``, `test_refresh.scorer_before`) against the norms read from the tracker's state, the newest 8 slots
unknown as after 7 stacked decode steps, and the scorer standardising in place (after: the learned policy's tracker
and `Scorer.forward(consume=True)`). ``--rkv-model``: the keys R-KV
scores when it compresses a batch of 8 held-out chain prompts (~1k tokens, left-padded) after the prefill in the
bundled SmolLM2 (budget 50%), all 30 layers per round; it also prints the share of valid rows whose newest
near-duplicate is among the newest 64 slots (the blockwise search's first block). ``--rkv-event``: the same keys'
first 1 and 2 rows, all 30 layers per round, as an eviction of a decode scores them (at batch 16 the rows reach
their budgets at different steps, ~1.3 rows an eviction at goal 2's 50%): head by head with a flip and an ``argmax``
(before, its code until d68a139, `test_scoring_speed.redundancy_by_head`) against the heads folded into the batch
and each block's newest near slot by a maximum (after; the same bits, checked). ``--refresh-model``: the learned
policy (a random-init scorer bound to SmolLM2: the timing does not depend on its weights) decoding 48 tokens after 8
held-out chain prompts (~1k tokens, left-padded) in the bundled SmolLM2, budget 50%, refresh 8, slack 16: the cache's
eviction seconds over the decode steps after the prefill (`BudgetCache.eviction_s`: the tracker's updates, the
refreshes of every layer every 8 steps, the selections) with the tracker and scorer before (norms recomputed at every refresh, the scorer's standardised copy) and after;
three rounds (``--rounds N``: N) of one decode each, alternating; with ``--unpadded``, 4 prompts of 400 random
token ids (seed 0, no padding) and 40 new tokens instead; with ``--same``, both sides run the code after (an A/A
control of the measurement's noise). Each round also gives the thread's CPU time in `BudgetCache._step` (less
inflated than wall time where other processes share the cores). Each line also gives the mean of the per-round
ratios with its 95% bootstrap interval (`learnkv.eval.stats.bootstrap_ci`).
"""

from __future__ import annotations

import statistics
import sys
import time
from types import SimpleNamespace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the repo root first (learnkv from this checkout); tests: the references

from test_fast_paths import update_decode_before, update_decode_with_bool_masks  # noqa: E402
from test_refresh import scorer_before  # noqa: E402
from test_scoring_speed import (avg_pool_before, near_keys, one_drop_victims_before, redundancy_before,  # noqa: E402
                                lazy_update_with_bool_mask, redundancy_by_head, redundancy_dense,
                                roco_score_with_bool_masks,
                                window_std_before)

import learnkv.features as features  # noqa: E402

from learnkv.kernels.cpu import mark_victims, one_drop_victims, select_keep_one_drop  # noqa: E402
from learnkv.eval.stats import bootstrap_ci  # noqa: E402
from learnkv.features import MEAN, NORMS, STATE, WINDOW, FeatureTracker, group_mean_max  # noqa: E402
from learnkv.features import SPARE_ROWS as FEATURE_SPARE_ROWS  # noqa: E402
from learnkv.scorer.model import Scorer  # noqa: E402
from learnkv.policies.snapkv import SPARE_ROWS, SnapKV  # noqa: E402
from learnkv.policies import learned, rkv  # noqa: E402
from learnkv.policies.base import LayerView  # noqa: E402
from learnkv.policies.lazy import LazyEviction  # noqa: E402
from learnkv.policies.roco import RoCo  # noqa: E402
from learnkv.policies.snapkv import avg_pool  # noqa: E402
from learnkv.kernels.reference import mark_dead  # noqa: E402
from learnkv.slots import _filled_prefix  # noqa: E402


def clock(fn, n: int) -> float:
    """Mean milliseconds of ``n`` calls."""
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e3


def step_cases(g) -> list:
    """The ``--step`` cases (see the module docstring): name, before, after, calls per round."""
    L, B, H, T = 30, 8, 3, 790
    pos = torch.arange(T).expand(L * B, H, T).contiguous()
    pos[:, :, 5:20] = -1  # dead slots (slack)
    scores, keep, live = torch.rand(L * B, H, T, generator=g), [T - 16] * (L * B), [T - 15] * (L * B)

    def mark_before():
        p = pos.clone()
        mark_dead(p, select_keep_one_drop(scores, p, keep, 4, 8, live))

    def mark_after():
        p = pos.clone()
        mark_victims(p, *one_drop_victims(scores, p, keep, 4, 8, live))

    state = {n: torch.zeros(L * B, H, *((WINDOW,) if n == "f.win" else ()), T + 17)[..., :T] for n in STATE}
    attn = group_mean_max(torch.rand(L * B, H, 3, 1, T, generator=g) / T)  # the tracker's input
    tracker = FeatureTracker(L)
    spare_state = dict(state, **{"f.win": torch.zeros(L * B, H, WINDOW + FEATURE_SPARE_ROWS, T + 17)[..., :T]})
    tracker_step = [5]

    def tracker_spare():
        tracker_step[0] += 1
        tracker._update_decode(attn, pos, tracker_step[0], spare_state, FEATURE_SPARE_ROWS)

    # SnapKV's window state of the stacked layers, as the cache's buffer views: 64 rows shifted in place every step
    # (before: the code of commit cb04402) or 64 of 64 + SPARE_ROWS rows, one row written per step (after)
    shifted = torch.rand(L * B, H, 64, T + 17, generator=g)[..., :T]
    spare = torch.rand(L * B, H, 64 + SPARE_ROWS, T + 17, generator=g)[..., :T]
    rows = torch.rand(L * B, H, 1, T, generator=g)
    policy, step = SnapKV(window=64), [1]

    def snapkv_before():
        for j in range(shifted.shape[2] - 1):
            shifted[:, :, j] = shifted[:, :, j + 1]
        shifted[:, :, -1] = rows[:, :, 0]

    def snapkv_after():
        step[0] += 1
        policy.update(SimpleNamespace(attn=rows, state={"window_attn": spare}, step=step[0]))

    return [(f"mark one dead slot per row [{L * B}, {H}, {T}]", mark_before, mark_after, 3),
            (f"tracker window shift [{L * B}, {H}, {WINDOW}, {T}]", lambda: update_decode_before(attn, pos, 5, state),
             lambda: tracker._update_decode(attn, pos, 5, state), 3),
            (f"tracker update, window among {FEATURE_SPARE_ROWS} spare rows [{L * B}, {H}, {WINDOW}, {T}]",
             lambda: tracker._update_decode(attn, pos, 5, state), tracker_spare, 3),
            (f"snapkv window update [{L * B}, {H}, 64, {T}]", snapkv_before, snapkv_after, 3)]


def victims_cases(g) -> list:
    """The ``--victims`` cases (see the module docstring): name, before, after, calls per round."""
    L, B, H, T = 30, 8, 3, 790
    pos = torch.arange(T).expand(L * B, H, T).contiguous() + 240
    pos[:, :, 5:20] = -1  # dead slots (slack)
    scores, keep, live = torch.rand(L * B, H, T, generator=g), [T - 16] * (L * B), [T - 15] * (L * B)
    sinks, recents = [4] * (L * B), [64] * (L * B)
    state = torch.rand(B, H, 64 + SPARE_ROWS, T, generator=g)
    fillers = torch.zeros(B, H, T, dtype=torch.bool)
    for b in range(B):  # row b keeps 27 * b // 7 fewer slots than the widest: its fillers lead its index
        fillers[b, :, : 27 * b // (B - 1)] = True

    def zero_before():  # the compaction's test for fillers, then its fill over every kept slot
        if bool(fillers.any()):
            state.masked_fill_(fillers[:, :, None, :], 0)

    def zero_after():  # the leading slots that hold them (`BudgetLayer.keep_slots`), then the fill over those
        F = _filled_prefix(fillers)
        if F:
            state[..., :F].masked_fill_(fillers[:, :, None, :F], 0)

    return [(f"one-drop victims [{L * B}, {H}, {T}]",
             lambda: one_drop_victims_before(scores, pos, keep, sinks, recents, live),
             lambda: one_drop_victims(scores, pos, keep, sinks, recents, live), 5),
            (f"filler state zeroed [{B}, {H}, {64 + SPARE_ROWS}, {T}], {_filled_prefix(fillers)} leading slots",
             zero_before, zero_after, 5)]


LONG = (8, 3, 1500, 64)  # batch, KV heads, cached slots, head dim: SmolLM2 at ~1.5k tokens, batch 8


def rkv_cases(g) -> list:
    """The ``--rkv`` cases: R-KV's redundancy of one layer, dense and blockwise, two kinds of keys."""
    B, H, T, D = LONG
    valid = torch.ones(B, H, T, dtype=torch.bool)
    cases = []
    for shared, what in ((2.0, "a shared direction"), (0.0, "independent keys")):
        keys = near_keys(B, H, T, D, g, shared)
        cases.append((f"rkv redundancy {list(LONG)}, {what}", lambda k=keys: redundancy_dense(k, valid, 0.5),
                      lambda k=keys: rkv.redundancy(k, valid, 0.5), 1))
    return cases


def model_keys_cases(event: bool = False) -> list:
    """The ``--rkv-model`` case: R-KV's redundancy of every layer as it compresses SmolLM2's prefill; with ``event``
    (``--rkv-event``) the cases of 1 and 2 of those rows, by head against folded."""
    from learnkv import generate, load_model  # the model only in this mode (transformers: seconds to import)
    from learnkv.decode import encode_prompts
    from learnkv.prompts import load_prompts

    model, tok = load_model("smollm2-135m-instruct")
    ids, mask = encode_prompts(tok, [x.text for x in load_prompts("chain", n=8, split="test")])
    seen, fast = [], rkv.redundancy

    def record(keys, valid, threshold):
        seen.append((keys.clone(), valid.clone(), threshold))
        return fast(keys, valid, threshold)

    rkv.redundancy = record
    try:
        generate(model, input_ids=ids, attention_mask=mask, policy="rkv", budget=0.5, max_new_tokens=1,
                 stop_at_eos=False)
    finally:
        rkv.redundancy = fast
    first = newest = 0
    for keys, valid, threshold in seen:
        k = keys.float()
        k = k / (k.norm(dim=-1, keepdim=True) + 1e-8)
        cos = k @ k[..., -64:, :].transpose(-1, -2)  # every row against the newest 64 slots
        cos[..., -64:, :].diagonal(dim1=-2, dim2=-1).zero_()
        hit = (cos.masked_fill(~valid[..., None, -64:], 0.0) > threshold).any(dim=-1)
        first, newest = first + int((hit & valid).sum()), newest + int(valid.sum())
    lengths = mask.sum(-1).tolist()
    print(f"SmolLM2, batch {len(lengths)} of prompts of {min(lengths)}-{max(lengths)} tokens, {len(seen)} layers: "
          f"{first / newest:.1%} of valid rows have a near-duplicate among the newest 64 slots")

    def every_layer(fn, rows=None):
        return lambda: [fn(keys[:rows], valid[:rows], threshold) for keys, valid, threshold in seen]

    shape = list(seen[0][0].shape)
    if event:
        cases = []
        for rows in (1, 2):
            for keys, valid, threshold in seen:
                assert torch.equal(rkv.redundancy(keys[:rows], valid[:rows], threshold).view(torch.int32),
                                   redundancy_by_head(keys[:rows], valid[:rows], threshold).view(torch.int32))
            cases.append((f"rkv redundancy of {rows} row(s) of SmolLM2's {len(seen)} layers {[rows, *shape[1:]]}: by "
                          "head (before), heads folded (after)", every_layer(redundancy_by_head, rows),
                          every_layer(rkv.redundancy, rows), 3))
        return cases
    return [(f"rkv redundancy of SmolLM2's {len(seen)} layers {shape}", every_layer(redundancy_dense),
             every_layer(rkv.redundancy), 1)]


def refresh_model_rounds(rounds: int = 3, unpadded: bool = False, same: bool = False) -> None:
    """``--refresh-model`` (see the module docstring); ``unpadded``: 4 prompts of 400 random tokens, 40 new; ``same``:
    both sides run the code after (a control: what the measurement gives where there is no difference)."""
    # only this mode exports a scorer and loads the model (transformers: seconds to import)
    import tempfile

    from test_refresh import before_tracker

    from learnkv import generate, load_model
    from learnkv.cache import BudgetCache
    from learnkv.decode import encode_prompts
    from learnkv.policies import learned
    from learnkv.prompts import load_prompts
    from learnkv.scorer.artifact import cached_kv_heads, export_scorer

    model, tok = load_model("smollm2-135m-instruct")
    if unpadded:  # every row the same length: no padding slot in any layer
        ids = torch.randint(0, model.config.vocab_size, (4, 400), generator=torch.Generator().manual_seed(0))
        mask, new_tokens = torch.ones_like(ids), 40
    else:
        ids, mask = encode_prompts(tok, [x.text for x in load_prompts("chain", n=8, split="test")])
        new_tokens = 48
    torch.manual_seed(0)
    scorer = export_scorer(Scorer(model.config.num_hidden_layers), tempfile.mkdtemp() + "/scorer",
                           model=model.config.name_or_path, n_kv_heads=cached_kv_heads(model.config))
    fast_mlp, step = Scorer._mlp, BudgetCache._step

    def run(before: bool) -> tuple[float, float]:
        """The cache's eviction milliseconds over the decode steps (from the first decode step's observer call, after
        the prefill's compression, to the last): wall time (`BudgetCache.eviction_s`) and this thread's CPU time in
        `BudgetCache._step` (where a stacked decode step's update, refresh and eviction run)."""
        seen, cpu, depth = [], [0.0], [0]

        def timed(self, *args):
            depth[0] += 1  # a step whose layers cannot be stacked calls itself per layer: count the outer call once
            t0 = time.thread_time()
            try:
                return step(self, *args)
            finally:
                depth[0] -= 1
                if not depth[0]:
                    cpu[0] += time.thread_time() - t0

        if before and not same:
            learned.FeatureTracker = before_tracker
            Scorer._mlp = lambda self, f, layer, consume=False: scorer_before(self, f, layer)
        BudgetCache._step = timed
        try:
            generate(model, input_ids=ids, attention_mask=mask, policy="learned", budget=0.5,
                     max_new_tokens=new_tokens, stop_at_eos=False, slack=16,
                     policy_params={"scorer": str(scorer), "refresh": 8},
                     observer=lambda cache: seen.append((cache.eviction_s, cpu[0])))
        finally:
            learned.FeatureTracker, Scorer._mlp, BudgetCache._step = FeatureTracker, fast_mlp, step
        steps.append(len(seen) - 1)
        return (seen[-1][0] - seen[0][0]) * 1e3, (seen[-1][1] - seen[0][1]) * 1e3

    lengths = mask.sum(-1).tolist()
    wall, cpu_ms, steps = [], [], []  # per round: (before, after)
    for i in range(rounds):
        if i % 2 == 0:  # the side that goes first alternates
            a = run(True)
            b = run(False)
        else:
            b = run(False)
            a = run(True)
        wall.append((a[0], b[0]))
        cpu_ms.append((a[1], b[1]))
        print(f"round {i}: eviction over {steps[-1]} decode steps before {a[0]:.0f} ms, after {b[0]:.0f} ms; CPU time "
              f"before {a[1]:.0f} ms, after {b[1]:.0f} ms", flush=True)
    for what, pairs in (("eviction", wall), ("eviction CPU time", cpu_ms)):
        ratio = [b / a for a, b in pairs]
        lo, hi = bootstrap_ci(ratio)
        print(f"{'A/A control (both sides after): ' if same else ''}learned {what} over {steps[-1]} decode steps of SmolLM2, batch {len(lengths)}, prompts "
              f"{min(lengths)}-{max(lengths)} tokens, {'no padding, ' if unpadded else ''}{new_tokens} new, budget 50%, "
              f"refresh 8: before {statistics.median(a for a, _ in pairs):.0f} ms, after "
              f"{statistics.median(b for _, b in pairs):.0f} ms, after / before {statistics.median(ratio):.2f} "
              f"[{min(ratio):.2f}, {max(ratio):.2f}] over {rounds} rounds; mean {statistics.mean(ratio):.3f} "
              f"[{lo:.3f}, {hi:.3f}] 95%")


def refresh_inputs(g) -> tuple:
    """A learned refresh's inputs for one layer at `LONG`: the tracker's state mid-decode, a one-row attention, keys,
    values, positions; and the tracker and a random-init scorer."""
    B, H, T, D = LONG
    state = {n: torch.rand(B, H, T, generator=g) for n in STATE}
    state["f.win"] = torch.rand(B, H, WINDOW, T, generator=g) / T
    attn = group_mean_max(torch.rand(B, H, 3, 1, T, generator=g) / T)
    keys, values = torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)
    pos = torch.arange(T).expand(B, H, T).clone()
    pos[:, :, 5:20] = -1  # dead slots (slack)
    return attn, keys, values, pos, state, FeatureTracker(30), Scorer(30)


def torch_std(win):
    return win.std(dim=2, unbiased=False)


def refresh_cases(g) -> list:
    """The ``--refresh`` case: one layer's features and scores, the window std by `Tensor.std` or `window_std`."""
    attn, keys, values, pos, state, tracker, scorer = refresh_inputs(g)
    fast = features.window_std

    def refresh(std):
        features.window_std = std
        try:
            with torch.no_grad():
                return scorer(tracker.features(attn, keys, values, pos, 3, 100, state), 3)
        finally:
            features.window_std = fast

    assert torch.equal(refresh(torch_std), refresh(fast))
    cached, cached_state = FeatureTracker(30, cache_norms=True), dict(state)
    for name, x in zip(NORMS, (keys, values)):
        cached_state[name] = x.norm(dim=-1)

    def norms_before():
        with torch.no_grad():
            return scorer_before(scorer, tracker.features(attn, keys, values, pos, 3, 100, state), 3)

    def norms_after():
        for name in NORMS:
            cached_state[name][..., -8:] = -1.0  # the tokens of the 7 stacked steps since the last refresh and this one
        with torch.no_grad():
            return scorer(cached.features(attn, keys, values, pos, 3, 100, cached_state), 3, consume=True)

    assert torch.equal(norms_before(), norms_after())
    return [(f"learned refresh of one layer {list(LONG[:3])}", lambda: refresh(torch_std), lambda: refresh(fast), 3),
            (f"learned refresh of one layer {list(LONG[:3])}, norms cached, scorer in place", norms_before,
             norms_after, 3)]


def stacked_refresh_cases(g) -> list:
    """The ``--stacked-refresh`` case: 30 layers' feature read-out, layer by layer or in one stacked call."""
    L, (B, H, T, D) = 30, (8, 3, 790, 64)
    tracker = FeatureTracker(L, cache_norms=True, spare_rows=FEATURE_SPARE_ROWS)
    pos = torch.arange(T).expand(L * B, H, T).clone()
    pos[::5, :, :17] = -1
    state = {}
    tracker.update(group_mean_max(torch.rand(L * B, H, 3, 8, T, generator=g).softmax(-1)), pos, 8, 0, state)
    for step in range(1, 12):
        attn = torch.rand(L * B, H, 3, 1, T, generator=g) ** 4
        attn = group_mean_max(attn / attn.sum(-1, keepdim=True))
        tracker.update(attn, pos, 1, step, state)
    keys, values = torch.randn(L * B, H, T, D, generator=g), torch.randn(L * B, H, T, D, generator=g)
    tracker.fill_norms(keys, values, state)
    rows = [slice(layer * B, (layer + 1) * B) for layer in range(L)]

    def by_layer():
        return torch.cat([tracker.features(attn[r], keys[r], values[r], pos[r], layer, step,
                                           {n: t[r] for n, t in state.items()}, feature_major=True)
                          for layer, r in enumerate(rows)])

    def stacked(per_read_out):  # the learned policy's `score_layers`: the norms filled, the layers as a list
        return torch.cat([tracker.features(attn[a * B : b * B], None, None, pos[a * B : b * B], list(range(a, b)),
                                           step, {n: t[a * B : b * B] for n, t in state.items()}, feature_major=True)
                          for a, b in ((a, min(a + per_read_out, L)) for a in range(0, L, per_read_out))])

    win = state["f.win"]  # [L * B, H, WINDOW + spare, T]: the window std, one layer's rows a call

    def std_of(fn):
        return lambda: [fn(win[r][:, :, :WINDOW]) for r in rows]

    few = max(1, learned.READ_OUT_SLOTS // (B * H * T))
    one = by_layer()
    for k in (few, L):
        assert torch.equal(stacked(k).view(torch.int32), one.view(torch.int32)), f"{k} layers a read-out differ"
    return [(f"learned feature read-out of {L} layers {[B, H, T]}: by layer (before), {few} layers at a time (after)",
             by_layer, lambda: stacked(few), 2),
            (f"learned feature read-out of {L} layers {[B, H, T]}: by layer (before), all at once (after)", by_layer,
             lambda: stacked(L), 2),
            (f"window std of {L} layers {[B, H, WINDOW, T]} by layer: separate ops (before), addcdiv_ and addcmul_ "
             "(after)", std_of(window_std_before), std_of(features.window_std), 2)]


def mask_primitives(g) -> None:
    """``--masks``' first table: what one op costs on a bool mask and on a float 0/1 mask, over the tracker's
    stacked ``[240, 3, 790]`` (goal 1's 30 layers x batch 8), a mask ~1 slot in 6 true; median of 50 calls each."""
    shape = (240, 3, 790)
    x, pos = torch.rand(*shape, generator=g) * 1.2, torch.arange(790).expand(*shape).contiguous()
    mask_bool = torch.rand(*shape, generator=g) < 1 / 6
    mask_float, y, inf = mask_bool.float(), x.clone(), torch.tensor(float("inf"))
    ops = [("x >= 1.0 (a bool tensor)", lambda: x >= 1.0), ("positions >= 0 (int64, a bool tensor)", lambda: pos >= 0),
           ("y.copy_(x).ge_(1.0) (float 0/1 in place, with the copy)", lambda: y.copy_(x).ge_(1.0)),
           ("y.copy_(x) (the copy alone)", lambda: y.copy_(x)), ("mask_bool.float()", lambda: mask_bool.float()),
           ("y.add_(mask_bool)", lambda: y.add_(mask_bool)), ("y.add_(mask_float)", lambda: y.add_(mask_float)),
           ("y.addcmul_(mask_float, x)", lambda: y.addcmul_(mask_float, x)),
           ("y.masked_fill_(mask_bool, 7.0)", lambda: y.masked_fill_(mask_bool, 7.0)),
           ("torch.where(mask_bool, inf, y, out=y)", lambda: torch.where(mask_bool, inf, y, out=y))]
    print(f"| op on {list(shape)} | us (median of 50) |\n|---|---|")
    for name, fn in ops:
        fn()
        times = []
        for _ in range(50):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        print(f"| {name} | {statistics.median(times) * 1e6:.0f} |")


def masks_cases(g) -> list:
    """The ``--masks`` cases: the tracker's decode update with bool or float masks; a refresh's fills of norms and
    content terms by layer or for a few stacked layers at once; RoCo's score and LazyEviction's decode update with
    bool masks (the replaced code) or float ones."""
    L, (B, H, T, D) = 30, (8, 3, 790, 64)
    pos = torch.arange(T).expand(L * B, H, T).clone()
    pos[::5, :, :17] = -1
    tracker, state = FeatureTracker(L, spare_rows=FEATURE_SPARE_ROWS), {}

    def peaked():  # ~1 slot in 6 above uniform attention
        return group_mean_max((torch.randn(L * B, H, 3, 1, T, generator=g) * 2).softmax(-1))

    tracker.update(group_mean_max(torch.rand(L * B, H, 3, 8, T, generator=g).softmax(-1)), pos, 8, 0, state)
    for step in range(1, 12):
        tracker.update(peaked(), pos, 1, step, state)
    attn, sides = peaked(), {"before": dict(state), "after": dict(state)}
    for side in sides.values():
        side.update({n: t.clone() for n, t in side.items()})
    steps = {"before": 11, "after": 11}

    def update(side, fn):
        def call():
            steps[side] += 1
            fn(attn, pos, steps[side], sides[side], FEATURE_SPARE_ROWS)
        return call

    keys, values = torch.randn(L * B, H, T, D, generator=g), torch.randn(L * B, H, T, D, generator=g)
    scorer = Scorer(L, content_dim=D, n_heads=H)
    with torch.no_grad():
        scorer.wc.normal_(generator=g)
    cached = {**{n: features.token_norms(x) for n, x in zip(NORMS, (keys, values))},
              learned.CONTENT: torch.full(pos.shape, float("nan"))}
    per_read_out = max(1, learned.READ_OUT_SLOTS // (B * H * T))
    rows = [slice(layer * B, (layer + 1) * B) for layer in range(L)]

    def unknown_newest():  # the tokens of the 8 steps since the last refresh
        for name in NORMS:
            cached[name][..., -8:] = -1.0
        cached[learned.CONTENT][..., -8:] = float("nan")

    def layer_views(a, b):
        return [SimpleNamespace(values=values[r], layer=i) for i, r in zip(range(a, b), rows[a:b])]

    def fills_by_layer():
        unknown_newest()
        with torch.no_grad():
            for i, r in enumerate(rows):
                scorer.to(keys.device)  # as `_scored` did at every layer
                features.fill_unknown_norms(cached[NORMS[0]][r], keys[r])
                features.fill_unknown_norms(cached[NORMS[1]][r], values[r])
                learned.cached_content({learned.CONTENT: cached[learned.CONTENT][r]}, layer_views(i, i + 1), scorer)

    def fills_stacked():
        unknown_newest()
        with torch.no_grad():
            for a in range(0, L, per_read_out):
                b = min(a + per_read_out, L)
                r = slice(a * B, b * B)
                features.fill_unknown_norms(cached[NORMS[0]][r], [keys[q] for q in rows[a:b]])
                features.fill_unknown_norms(cached[NORMS[1]][r], [values[q] for q in rows[a:b]])
                learned.cached_content({learned.CONTENT: cached[learned.CONTENT][r]}, layer_views(a, b), scorer)

    fills_by_layer()
    once = {n: t.clone() for n, t in cached.items()}
    fills_stacked()
    assert all(torch.equal(once[n].view(torch.int32), cached[n].view(torch.int32)) for n in once)
    roco_state = {"count": (torch.rand(L * B, H, T, generator=g) * 500).floor() + 1}
    roco_state["s1"] = torch.rand(L * B, H, T, generator=g) * roco_state["count"] / T
    roco_state["s2"] = roco_state["s1"] ** 2 / roco_state["count"] + torch.rand(L * B, H, T, generator=g) / T
    budgets = [762 + 4 * (i % B) for i in range(L * B)]  # goal 1's rows: a budget each (762-789)
    roco_view = LayerView(layer=0, step=100, keys=None, values=None, positions=pos, n_new=1, attn=None, attn_sum=None,
                          attn_sq_sum=None, keep=budgets, state=roco_state)
    roco_policy = RoCo()
    assert torch.equal(roco_policy.score(roco_view), roco_score_with_bool_masks(roco_policy, roco_view))
    lazy_policy, lazy_states, lazy_steps = LazyEviction(), {"before": {}, "after": {}}, {"before": 11, "after": 11}
    for side in lazy_states.values():
        side.update(ts=(torch.rand(L * B, H, T, generator=g) * 10).floor(), mri=(torch.rand(L * B, H, T, generator=g) * 3).floor())

    def lazy_update(side, fn):
        def call():
            lazy_steps[side] += 1
            fn(lazy_policy, LayerView(layer=0, step=lazy_steps[side], keys=None, values=None, positions=pos, n_new=1,
                                      attn=attn[:, :, MEAN, -1:, :], attn_sum=None, attn_sq_sum=None, keep=T,
                                      state=lazy_states[side]))
        return call

    return [(f"tracker decode update [{L * B}, {H}, {T}]: bool masks (before), float masks (after)",
             update("before", update_decode_with_bool_masks), update("after", FeatureTracker._update_decode), 3),
            (f"norms and content terms of {L} layers {[B, H, T]}, 8 new slots: by layer (before), {per_read_out} "
             "layers a fill (after)", fills_by_layer, fills_stacked, 3),
            (f"RoCo score [{L * B}, {H}, {T}], {B} row budgets: bool masks (before), float masks (after)",
             lambda: roco_score_with_bool_masks(roco_policy, roco_view), lambda: roco_policy.score(roco_view), 3),
            (f"LazyEviction decode update [{L * B}, {H}, {T}]: bool mask and masked_fill_ (before), float mask "
             "(after)", lazy_update("before", lazy_update_with_bool_mask), lazy_update("after", LazyEviction.update),
             10)]


def layout_cases(g) -> list:
    """The ``--layout`` cases: one layer's refresh (features and scores) with the columns stacked token by token and
    the dead slots masked (before) or laid out feature by feature and zeroed by index (after)."""
    cases = []
    for B, H, T in ((8, 3, 780), (16, 3, 1290)):
        tracker, scorer = FeatureTracker(30, cache_norms=True, spare_rows=FEATURE_SPARE_ROWS), Scorer(30)
        pos = torch.arange(T).expand(B, H, T).clone()
        pos[:, :, 5::97] = -1  # ~13 dead slots a row, as the cache's slack 16 leaves them
        state = {}
        tracker.update(group_mean_max(torch.rand(B, H, 3, 8, T, generator=g).softmax(-1)), pos, 8, 0, state)
        for step in range(1, 12):
            attn = torch.rand(B, H, 3, 1, T, generator=g) ** 4
            attn = group_mean_max(attn / attn.sum(-1, keepdim=True))
            tracker.update(attn, pos, 1, step, state)
        keys, values = torch.randn(B, H, T, 64, generator=g), torch.randn(B, H, T, 64, generator=g)
        tracker.fill_norms(keys, values, state)
        args = attn, keys, values, pos, 3, step, state

        def before(args=args, tracker=tracker, scorer=scorer):
            fill = features.zero_dead_slots
            features.zero_dead_slots = lambda cols, pos, by_index: fill(cols, pos, by_index=False)
            try:
                with torch.no_grad():
                    return scorer(tracker.features(*args), 3, consume=True)
            finally:
                features.zero_dead_slots = fill

        def after(args=args, tracker=tracker, scorer=scorer):
            with torch.no_grad():
                return scorer(tracker.features(*args, feature_major=True), 3, consume=True)

        assert torch.equal(before().view(torch.int32), after().view(torch.int32))
        cases.append((f"learned refresh of one layer {[B, H, T]}: token-major + mask (before), feature-major + "
                      "index (after)", before, after, 10))
    return cases


def profile(g) -> None:
    """``--profile``: the ops R-KV's redundancy (dense, blockwise) and the learned refresh spend their time in."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile  # only this mode profiles

    B, H, T, D = LONG
    keys, valid = near_keys(B, H, T, D, g, 2.0), torch.ones(B, H, T, dtype=torch.bool)
    attn, k, v, pos, state, tracker, scorer = refresh_inputs(g)

    def refresh():
        with torch.no_grad():
            f = tracker.features(attn, k, v, pos, 3, 100, state)
            with torch.profiler.record_function("Scorer.forward"):
                return scorer(f, 3)

    def refresh_before():
        features.window_std = torch_std
        try:
            return refresh()
        finally:
            features.window_std = window_std

    cached, cached_state = FeatureTracker(30, cache_norms=True), dict(state)
    for name, x in zip(NORMS, (k, v)):
        cached_state[name] = x.norm(dim=-1)

    def refresh_cached():
        for name in NORMS:
            cached_state[name][..., -8:] = -1.0  # as `refresh_cases`' "after"
        with torch.no_grad():
            f = cached.features(attn, k, v, pos, 3, 100, cached_state)
            with torch.profiler.record_function("Scorer.forward"):
                return scorer(f, 3, consume=True)

    window_std = features.window_std
    for name, fn in (("rkv redundancy, dense", lambda: redundancy_dense(keys, valid, 0.5)),
                     ("rkv redundancy, blockwise", lambda: rkv.redundancy(keys, valid, 0.5)),
                     ("learned refresh, Tensor.std", refresh_before), ("learned refresh, window_std", refresh),
                     ("learned refresh, norms cached, scorer in place", refresh_cached)):
        fn()
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                fn()
        ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        total = sum(e.self_cpu_time_total for e in ops)
        scope = [e.cpu_time_total for e in ops if e.key == "Scorer.forward"]
        split = f", of which the scorer {scope[0] / 3e3:.1f} ms" if scope else ""
        print(f"\n{name} {list(LONG)}: {total / 3e3:.1f} ms per call (self time, 3 calls){split}")
        for e in [e for e in ops if e.key != "Scorer.forward"][:8]:
            print(f"  {e.key:28s} {e.self_cpu_time_total / 3e3:7.2f} ms  {e.self_cpu_time_total / total:4.0%}  "
                  f"{e.count // 3} calls")


def main() -> None:
    args = sys.argv[1:]
    torch.set_num_threads(int(args[args.index("--threads") + 1]) if "--threads" in args else 1)
    g = torch.Generator().manual_seed(0)
    if "--layout" in args:
        run(layout_cases(g))
        return
    if "--masks" in args:
        mask_primitives(g)
        run(masks_cases(g))
        return
    if "--victims" in args:
        run(victims_cases(g))
        return
    if "--profile" in args:
        profile(g)
        return
    if "--rkv-model" in args or "--rkv-event" in args:
        run(model_keys_cases(event="--rkv-event" in args))
        return
    if "--refresh-model" in args:
        rounds = int(args[args.index("--rounds") + 1]) if "--rounds" in args else 3
        refresh_model_rounds(rounds, unpadded="--unpadded" in args, same="--same" in args)
        return
    if "--stacked-refresh" in args:
        run(stacked_refresh_cases(g))
        return
    if "--step" in args or "--rkv" in args or "--refresh" in args:
        run([*(step_cases(g) if "--step" in args else []), *(rkv_cases(g) if "--rkv" in args else []),
             *(refresh_cases(g) if "--refresh" in args else [])])
        return
    keys, valid = torch.randn(4, 3, 900, 64, generator=g), torch.ones(4, 3, 900, dtype=torch.bool)
    cases = [("rkv redundancy [4, 3, 900, 64]", lambda: redundancy_before(keys, valid, 0.5),
              lambda: rkv.redundancy(keys, valid, 0.5), 2)]
    for B in (1, 4, 16):  # batch 1: fewer than 4 rows, `avg_pool` makes the pooling call itself
        x = torch.rand(B, 3, 516, generator=g)
        cases.append((f"snapkv pooling [{B}, 3, 516], kernel 5", lambda x=x: avg_pool_before(x, 5),
                      lambda x=x: avg_pool(x, 5), 200))
    run(cases)


def run(cases: list) -> None:
    for name, old, new, n in cases:
        old(), new()  # warm-up
        rounds = []
        for i in range(7):
            if i % 2 == 0:
                a = clock(old, n)
                b = clock(new, n)
            else:
                b = clock(new, n)
                a = clock(old, n)
            rounds.append((a, b))
        ratio = [b / a for a, b in rounds]
        lo, hi = bootstrap_ci(ratio)
        print(f"{name}: before {statistics.median(a for a, _ in rounds):.2f} ms, after "
              f"{statistics.median(b for _, b in rounds):.2f} ms, after / before {statistics.median(ratio):.2f} "
              f"[{min(ratio):.2f}, {max(ratio):.2f}] over {len(rounds)} rounds; mean {statistics.mean(ratio):.3f} "
              f"[{lo:.3f}, {hi:.3f}] 95%")


if __name__ == "__main__":
    main()
