"""R-KV against a hand-written reference of its source's formula, and its defaults and protected window."""

import math

import pytest
import torch

from conftest import random_ids
from learnkv import generate, make_policy
from learnkv.policies.base import LayerView
from learnkv.policies.rkv import redundancy

# -- the reference: plain loops over batch rows, KV heads and slots ----------------------------------------------


def softmax(xs):
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    return [x / sum(e) for x in e]


def reference_scores(q, k, pos, slots, queries, qpos, G, window, lam=0.1, kernel=7, thr=0.5, official=False):
    """``{(b, h, slot index): score}`` for every valid cached slot, by the source's recipe.

    q[b][hq][token], k[b][h][token]: vectors; pos[b][token]: position (-1 padding); slots[b]: the cached tokens in
    slot order; queries[b]: the tokens of the last `window` queries (the source's query cache). Importance: each
    query head's softmax over the keys the query sees, max over the group, renormalised over the candidates (the
    slots before the window); ``official=True`` instead takes the max of the group's logits and one softmax over
    the candidates (the source; equal when G = 1).
    """
    out = {}
    for b, cached in enumerate(slots):
        T = len(cached)
        n = T - min(window, T)
        live = [i for i in range(T) if pos[b][cached[i]] >= 0]
        cand = [i for i in range(n) if pos[b][cached[i]] >= 0]
        for h in range(len(k[b])):
            key = [k[b][h][t] for t in cached]
            # importance
            imp = [0.0] * n
            rows = 0
            for t in queries[b]:
                if qpos[b][t] < 0 or not cand:
                    continue
                seen = [i for i in live if pos[b][cached[i]] <= qpos[b][t]]
                logit = [[sum(a * c for a, c in zip(q[b][h * G + g][t], key[i])) / math.sqrt(len(key[i]))
                          for i in seen] for g in range(G)]
                if official:
                    best = {i: max(logit[g][j] for g in range(G)) for j, i in enumerate(seen)}
                    p = dict(zip(cand, softmax([best[i] for i in cand])))
                else:
                    probs = [dict(zip(seen, softmax(logit[g]))) for g in range(G)]
                    m = {i: max(pr[i] for pr in probs) for i in cand}
                    p = {i: m[i] / sum(m.values()) for i in cand}
                rows += 1
                for i in cand:
                    imp[i] += p[i]
            imp = [x / max(rows, 1) for x in imp]
            r = kernel // 2
            pooled = [max(imp[j] for j in range(max(0, i - r), min(n, i + r + 1))) for i in range(n)]
            # redundancy
            norm = [math.sqrt(sum(x * x for x in key[i])) + 1e-8 for i in range(T)]
            col = [0.0] * T
            for i in live:
                cos = {j: sum(a * c for a, c in zip(key[i], key[j])) / (norm[i] * norm[j]) for j in live}
                cos[i] = 0.0
                near = [j for j in live if cos[j] > thr]
                cos[max(near) if near else live[0]] = 0.0
                for j in live:
                    col[j] += cos[j]
            red = dict(zip(live, softmax([col[j] / len(live) for j in live])))
            score = {i: lam * pooled[i] - (1 - lam) * red[i] for i in cand}
            top = max(score.values()) if score else 0.0
            for i in live:
                out[b, h, i] = score.get(i, top)
    return out


def check(view_scores, ref):
    for (b, h, i), want in ref.items():
        assert view_scores[b, h, i].item() == pytest.approx(want, rel=1e-5, abs=1e-7), (b, h, i)


# -- a simulated cache: prefill, decode steps, evictions in between (state padded and compacted like the cache) -


def make_qk(B, Hq, H, N, D, seed):
    """Random queries, and keys of which about half are noisy copies of a few directions (near-duplicates)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, N, D, generator=g) * 1.5
    k = torch.randn(B, H, N, D, generator=g)
    centres = torch.randn(B, H, 3, D, generator=g)
    pick = torch.randint(0, 3, (B, H, N), generator=g)
    copy = torch.rand(B, H, N, generator=g) < 0.5
    dup = torch.gather(centres, 2, pick[..., None].expand(B, H, N, D)) + 0.3 * torch.randn(B, H, N, D, generator=g)
    k = torch.where(copy[..., None], dup, k) * (0.5 + torch.rand(B, H, N, 1, generator=g))
    return q, k


def rows_for(q, k, pos, cached, new, G):
    """What the attention function hands: each query head's softmax over the keys it sees, max over the group."""
    B, H = k.shape[:2]
    kc = torch.stack([k[b][:, cached[b]] for b in range(B)])  # [B, H, T, D]
    kp = torch.stack([pos[b][cached[b]] for b in range(B)])  # [B, T]
    qp = torch.stack([pos[b][new[b]] for b in range(B)])  # [B, w]
    qs = torch.stack([q[b][:, new[b]] for b in range(B)])  # [B, Hq, w, D]
    logits = qs.view(B, H, G, -1, qs.shape[-1]) @ kc[:, :, None].transpose(-1, -2) / math.sqrt(qs.shape[-1])
    ok = (kp[:, None, None, None, :] >= 0) & (kp[:, None, None, None, :] <= qp[:, None, None, :, None])
    probs = torch.softmax(logits.masked_fill(~ok, float("-inf")), dim=-1).nan_to_num(0.0)
    probs = probs * (qp >= 0)[:, None, None, :, None]
    return probs.amax(dim=2), kc, kp


def simulate(B, Hq, H, D, T0, steps, pad, window, drop_at=(), seed=0, **params):
    """Yield (view, scores, reference, official reference, fresh) after the prefill and every decode step.

    ``fresh``: no eviction since the oldest observed query ran. With GQA the rows recorded before an eviction keep
    their per-head normalisers, so the reference (which recomputes over the current keys) is exact only then; the
    cache guarantees it, since it evicts at most every ``buffer >= window`` steps.
    """
    G = Hq // H
    N = T0 + steps
    q, k = make_qk(B, Hq, H, N, D, seed)
    pos = torch.tensor([[t - pad[b] if t >= pad[b] else -1 for t in range(N)] for b in range(B)])
    policy = make_policy("rkv", window=window, **params).resolve(1000)
    cached = [list(range(T0)) for _ in range(B)]
    state = {}
    gen = torch.Generator().manual_seed(seed + 1)
    for step in range(steps + 1):
        new = [list(range(max(0, T0 - window), T0)) if step == 0 else [T0 + step - 1] for _ in range(B)]
        if step:
            for b in range(B):
                cached[b].append(T0 + step - 1)
            state = {name: torch.cat([t, t.new_zeros(*t.shape[:-1], 1)], dim=-1) for name, t in state.items()}
        rows, kc, kp = rows_for(q, k, pos, cached, new, G)
        T = kp.shape[-1]
        view = LayerView(layer=0, step=step, keys=kc, values=kc, positions=kp[:, None].expand(B, H, T),
                         n_new=T0 if step == 0 else 1, attn=rows, attn_sum=rows.sum(2), state=state)
        policy.update(view)
        state = view.state
        queries = [list(range(max(0, T0 + step - window), T0 + step)) for _ in range(B)]
        args = (q.tolist(), k.tolist(), pos.tolist(), cached, queries, pos.tolist(), G, window)
        kw = dict(lam=policy.mix_lambda, kernel=policy.kernel_size, thr=policy.threshold)
        oldest = max(0, step - window + 1)  # the step of the oldest observed query
        fresh = all(d >= step or d < oldest for d in drop_at)
        ref, official = reference_scores(*args, **kw), reference_scores(*args, official=True, **kw)
        yield view, policy.score(view), ref, official, fresh
        if step in drop_at:  # some other eviction: drop a random third of the candidates, compact the state
            n = T - window
            keep = sorted(set(range(T)) - set(torch.randperm(n, generator=gen)[: n // 3].tolist()))
            cached = [[c[i] for i in keep] for c in cached]
            idx = torch.tensor(keep)
            state = {name: t[..., idx] for name, t in state.items()}


CASES = {  # B, Hq, H, D, T0, steps, pad, window, drop_at
    "mha-odd-T": (1, 2, 2, 8, 13, 8, [0], 4, (2,)),
    "mha-padded-B2-evictions": (2, 3, 3, 8, 15, 9, [4, 0], 4, (0, 1, 5)),
    "gqa2-padded-B2": (2, 4, 2, 8, 17, 12, [0, 5], 4, (3,)),
    "gqa3-evictions": (2, 6, 2, 6, 21, 14, [3, 0], 5, (0, 6)),
    "prompt-shorter-than-window": (1, 4, 1, 8, 5, 10, [0], 8, (7,)),
    "padded-row-shorter-than-window": (2, 2, 1, 8, 9, 6, [0, 4], 6, ()),
}


@pytest.mark.parametrize("case", CASES)
def test_scores_match_the_reference(case):
    B, Hq, H, D, T0, steps, pad, window, drops = CASES[case]
    checked = 0
    for view, scores, ref, official, fresh in simulate(B, Hq, H, D, T0, steps, pad, window, drops, seed=len(case)):
        assert scores.shape == view.positions.shape and scores.dtype == torch.float32
        if Hq == H:  # without GQA the per-head probabilities give exactly the source's softmax of logits
            check(scores, official)
        if Hq == H or fresh:
            check(scores, ref)
            checked += 1
    assert checked >= 5


def test_reference_exercises_near_duplicates_and_the_fallback():
    """In the matrix's prompts some keys have a near-duplicate and some have none (both branches are tested)."""
    with_near = without = 0
    for case, (B, Hq, H, D, T0, steps, *_) in CASES.items():
        _, k = make_qk(B, Hq, H, T0 + steps, D, seed=len(case))
        kn = torch.nn.functional.normalize(k[..., :T0, :], dim=-1)
        near = ((kn @ kn.transpose(-1, -2) - 2 * torch.eye(T0)) > 0.5).any(dim=-1)
        with_near += near.sum().item()
        without += (~near).sum().item()
    assert with_near > 20 and without > 20


@pytest.mark.parametrize("params", [dict(mix_lambda=0.0), dict(mix_lambda=1.0, kernel_size=3), dict(threshold=0.2)])
def test_parameters_reach_the_score(params):
    for _, scores, ref, _, fresh in simulate(2, 4, 2, 8, 15, 8, [0, 3], 4, (1,), seed=5, **params):
        if fresh:
            check(scores, ref)


# -- by hand ----------------------------------------------------------------------------------------------------


def test_redundancy_spares_the_newest_duplicate():
    """Keys e1, e1, e1, e2, e3: each copy's row zeroes its newest other copy, so the column sums are 2, 1, 0."""
    e = torch.eye(3)
    keys = torch.stack([e[0], e[0], e[0], e[1], e[2]])[None, None]
    got = redundancy(keys, torch.ones(1, 1, 5, dtype=torch.bool), 0.5)[0, 0]
    want = torch.softmax(torch.tensor([2.0, 1.0, 0.0, 0.0, 0.0]) / 5, dim=0)
    assert got.tolist() == pytest.approx(want.tolist(), abs=1e-7)


def test_redundancy_fallback_zeroes_the_first_slot():
    """No pair above the threshold: every row zeroes its entry for slot 0 (the source's argmax over zeros)."""
    keys = torch.tensor([[1.0, 0.0], [0.4, math.sqrt(1 - 0.16)]])[None, None]
    got = redundancy(keys, torch.ones(1, 1, 2, dtype=torch.bool), 0.5)[0, 0]
    assert got.tolist() == pytest.approx(torch.softmax(torch.tensor([0.0, 0.4 / 2]), dim=0).tolist(), abs=1e-7)


def test_redundancy_ignores_padding():
    g = torch.Generator().manual_seed(2)
    keys = torch.randn(1, 1, 9, 4, generator=g)
    valid = torch.tensor([[[False, False, False] + [True] * 6]])
    padded = redundancy(keys, valid, 0.5)[0, 0]
    alone = redundancy(keys[:, :, 3:], torch.ones(1, 1, 6, dtype=torch.bool), 0.5)[0, 0]
    assert padded[:3].tolist() == [0.0] * 3
    assert padded[3:].tolist() == pytest.approx(alone.tolist(), abs=1e-7)


def test_importance_is_max_pooled_over_the_candidates_only():
    """Zero keys make the redundancy uniform; one attention row 1..10, window 1: the last slot is not pooled."""
    T = 10
    row = torch.arange(1.0, T + 1)
    policy = make_policy("rkv", window=1).resolve(100)
    view = LayerView(layer=0, step=0, keys=torch.zeros(1, 1, T, 2), values=torch.zeros(1, 1, T, 2),
                     positions=torch.arange(T).view(1, 1, T), n_new=T, attn=row.view(1, 1, 1, T))
    policy.update(view)
    got = policy.score(view)[0, 0].tolist()
    a = [x / 45 for x in range(1, 10)]  # renormalised over the 9 candidates
    want = [0.1 * max(a[max(0, i - 3) : i + 4]) - 0.9 / T for i in range(9)]
    assert got[:9] == pytest.approx(want, abs=1e-7)
    assert got[9] == pytest.approx(max(want), abs=1e-7)  # the window gets the top score


# -- defaults, schedule, protection -----------------------------------------------------------------------------


@pytest.mark.parametrize("budget, window, buffer", [(2048, 8, 128), (1024, 8, 128), (96, 8, 24), (20, 5, 5), (12, 3, 3),
                                                    (1, 1, 1)])
def test_defaults_at_several_budgets(budget, window, buffer):
    p = make_policy("rkv").resolve(budget)
    assert (p.window, p.buffer, p.interval, p.n_recent, p.n_sink) == (window, buffer, buffer, window, 0)
    assert (p.mix_lambda, p.kernel_size, p.threshold) == (0.1, 7, 0.5)
    assert p.obs_window == window and p.group_reduce == "max" and p.needs_dense_slots
    assert p.keep_target(budget) == budget - buffer + 1


def test_explicit_windows_are_not_capped():
    p = make_policy("rkv", window=8, buffer=128).resolve(512)
    assert (p.window, p.interval, p.keep_target(512)) == (8, 128, 385)
    p = make_policy("rkv", window=8).resolve(20)  # the default buffer: capped at budget // 4, not below the window
    assert (p.buffer, p.keep_target(20)) == (8, 13)
    with pytest.raises(ValueError, match="do not fit in a budget of 64"):
        make_policy("rkv", window=8, buffer=128).resolve(64)


@pytest.mark.parametrize("params, message", [(dict(kernel_size=4), "kernel_size must be a positive odd"),
                                             (dict(mix_lambda=1.5), "mix_lambda must be in"),
                                             (dict(threshold=-0.1), "threshold must be in"),
                                             (dict(window=0), "window must be >= 1"),
                                             (dict(window=8, buffer=4), r"buffer \(4\) must be >= window \(8\)")])
def test_bad_parameters(params, message):
    with pytest.raises(ValueError, match=message):
        make_policy("rkv", **params).resolve(64)


def test_decode_keeps_the_window_and_stays_between_the_targets(tiny):
    """On the tiny model: never above the budget, never below the eviction target, the window always kept."""
    budget, prompt, new = 32, 30, 40
    p = make_policy("rkv").resolve(budget)
    fed = []

    def observe(cache):
        fed.append(prompt if cache.step == 0 else fed[-1] + 1)
        for layer in cache.layers:
            held = layer.positions.shape[-1]
            assert min(fed[-1], p.keep_target(budget)) <= held <= budget
            kept = set(layer.positions[0, 0].tolist())
            assert set(range(fed[-1] - p.window, fed[-1])) <= kept

    result = generate(tiny, input_ids=random_ids(prompt, seed=3), policy="rkv", budget=budget, max_new_tokens=new,
                      observer=observe)
    assert result.max_kept_tokens == budget and len(fed) == new


def test_recorder_records_rkv_as_a_teacher(tiny):
    """Trace collection can run R-KV as a teacher: its recorded scores are its scores on the full cache."""
    from learnkv.traces.record import Recorder

    rec = Recorder(n_layers=2, teachers=("rkv",), decision_steps=frozenset({6}), horizon=3)
    generate(tiny, input_ids=random_ids(40, seed=4), policy=rec, max_new_tokens=12)
    assert len(rec.rows) == 2
    for row in rec.rows:
        s = row.teachers["rkv"]
        assert s.shape == row.positions.shape and torch.isfinite(s).all()
