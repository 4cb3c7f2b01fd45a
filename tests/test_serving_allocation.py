"""Serving under a budget allocation (issue 42 point 6): which allocations the config takes and refuses, pyramid's
per-layer block budgets held at every step in the runtime and the paged simulator, and the artifact's allocation
binding."""

import math
from types import SimpleNamespace

import pytest
import torch

from conftest import random_ids
from learnkv.scorer.artifact import ArtifactError, export_scorer
from learnkv.scorer.model import Scorer
from learnkv.serving.config import merge_config, parse_config
from learnkv.serving.runtime import ServingRuntime, pyramid_block_budgets, runtime_for
from learnkv.serving.simulator import PagedSimulator
from learnkv.serving.vllm import compat


def scorer(tmp_path, allocation, n_layers=2, seed=0):
    torch.manual_seed(seed)
    return export_scorer(Scorer(n_layers), tmp_path / f"scorer-{allocation}", model="tiny", n_kv_heads=2,
                         allocation=allocation)


def test_config_takes_uniform_and_pyramid_and_refuses_the_rest_in_one_line():
    assert parse_config({"scorer": "/s", "budget": 64}).allocation == "uniform"  # the default
    assert parse_config({"scorer": "/s", "budget": 64, "allocation": "pyramid"}).allocation == "pyramid"
    assert merge_config(None, {"LEARNKV_SCORER": "/s", "LEARNKV_BUDGET": "64",
                               "LEARNKV_ALLOCATION": "pyramid"}).allocation == "pyramid"
    for value, message in [("head", "shared by a layer's KV heads"), ("global", "not built"),
                           ("layer", "must be one of uniform, pyramid"), ("", "must be one of")]:
        with pytest.raises(ValueError, match=message) as e:
            parse_config({"scorer": "/s", "budget": 64, "allocation": value})
        assert "\n" not in str(e.value)


def test_pyramid_block_budgets_never_exceed_uniform():
    for L in (1, 2, 5, 30):
        for bs in (1, 4, 16):
            for budget in range(3 * bs, 40 * bs, 7):
                blocks = pyramid_block_budgets(budget, L, bs, 1, 1)
                assert len(blocks) == L and min(blocks) >= 3  # sink, recent and one evictable block
                assert blocks == sorted(blocks, reverse=True)  # shrinking with depth
                assert sum(blocks) * bs <= L * budget  # tokens: never more than uniform's total
                assert sum(blocks) == L * (budget // bs)  # exactly the whole blocks of it
    with pytest.raises(ValueError, match="fewer than the 3 a layer needs"):
        pyramid_block_budgets(11, 4, 4, 1, 1)


def test_pyramid_layers_hold_their_budgets_at_every_step(tiny, tmp_path):
    """Two requests of different budgets, one prompt over its budget (decides at the prefill): after every step
    each layer holds at most its budget in blocks, the layers' total never exceeds uniform's, the engine's tables
    are the runtime's, sinks and the recent window stay in every layer, and finished requests leave nothing."""
    path = scorer(tmp_path, "pyramid")
    bs, L = 4, 2
    rt = ServingRuntime(path, 24, block_size=bs, allocation="pyramid")
    sim = PagedSimulator(tiny, rt, num_blocks=64)
    budgets = {"long": 24, "short": 37}
    sim.add_request("long", random_ids(40, seed=1)[0], 30, budget=budgets["long"])
    sim.add_request("short", random_ids(9, seed=2)[0], 30, budget=budgets["short"])
    layer_blocks = {rid: pyramid_block_budgets(b, L, bs, 1, 1) for rid, b in budgets.items()}
    dropped_by_one_layer = False
    while any(not r.done for r in sim.requests.values()):
        sim.step()
        for rid, req in sim.requests.items():
            if req.done:
                continue
            held = [sim.resident_blocks(rid, layer) for layer in range(L)]
            assert held == [rt.resident_blocks(rid, layer) for layer in range(L)]  # engine and runtime agree
            assert set().union(*held) == set(rt.resident_blocks(rid))  # the runtime keeps the union, no more
            assert all(len(h) <= b for h, b in zip(held, layer_blocks[rid]))  # each layer within its budget
            assert sum(map(len, held)) <= L * math.ceil(budgets[rid] / bs)  # never more than uniform's blocks
            n = req.n_tokens
            for h in held:
                assert 0 in h and (n - 1) // bs in h and max(0, n - bs) // bs in h  # sink block, recent window
            dropped_by_one_layer |= set(held[1]) < set(held[0])
    assert layer_blocks["long"][1] < layer_blocks["long"][0]
    assert dropped_by_one_layer, "no layer ever held fewer blocks than another: the test proves nothing"
    assert sim.requests["long"].held_per_step[0] == layer_blocks["long"]  # the prefill decided per layer
    assert rt.requests == {} and all(p.n_free == p.num_blocks - 1 for p in sim.pools)


def test_pyramid_refuses_an_infeasible_budget_and_the_batched_paths(tmp_path):
    path = scorer(tmp_path, "pyramid")
    with pytest.raises(ValueError, match="2 whole blocks of 8 per layer, fewer than the 3"):
        ServingRuntime(path, 23, block_size=8, allocation="pyramid")
    rt = ServingRuntime(path, 32, block_size=8, allocation="pyramid")
    with pytest.raises(ValueError, match="allocation 'uniform' only"):
        rt.observe_step(["r0"], torch.rand(2, 1, 2, 1, 4), torch.rand(2, 1, 2), torch.rand(2, 1, 2))


def test_runtime_refuses_a_scorer_trained_for_another_allocation(tmp_path):
    uniform, pyramid, glob = (scorer(tmp_path, a) for a in ("uniform", "pyramid", "global"))
    ServingRuntime(uniform, 32, block_size=8)  # uniform scorer, uniform serving: the default
    # pyramid only sizes each layer's budget: its scores are compared within a head, as a uniform scorer's are
    ServingRuntime(uniform, 32, block_size=8, allocation="pyramid")
    ServingRuntime(pyramid, 32, block_size=8)
    with pytest.raises(ArtifactError, match="trained for allocation 'global', not 'uniform'"):
        runtime_for(parse_config({"scorer": str(glob), "budget": 32, "block_size": 8}))
    with pytest.raises(ArtifactError, match="trained for allocation 'global', not 'pyramid'"):
        ServingRuntime(glob, 32, block_size=8, allocation="pyramid")
    with pytest.raises(ValueError, match="allocation 'head' is not served"):
        ServingRuntime(uniform, 32, block_size=8, allocation="head")


def test_vllm_plugin_refuses_pyramid():
    ok = SimpleNamespace(
        speculative_config=None, model_config=SimpleNamespace(use_mla=False, enforce_eager=True),
        cache_config=SimpleNamespace(cache_dtype="auto"),
        parallel_config=SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1, data_parallel_size=1),
        scheduler_config=SimpleNamespace(async_scheduling=False))
    assert compat.refusals(ok, "evict", allocation="uniform") == []
    with pytest.raises(RuntimeError, match="one block table for all of a standard decoder's layers"):
        compat.refuse(ok, "shadow", allocation="pyramid")


def test_pyramid_layer_statistics_count_only_the_tokens_it_holds(tmp_path):
    """Under pyramid the runtime keeps the union of the layers' tokens; a layer's features must still be those of a
    layer that holds only its own tokens. Reference: one `FeatureTracker` per layer over that layer's tokens alone,
    compacted by the runtime's own per-layer decisions, as the decode loop's cache holds a layer."""
    from learnkv.features import FeatureTracker, group_mean_max  # only this test builds a reference tracker

    L, H, D, bs, n = 2, 2, 4, 4, 30
    rt = ServingRuntime(scorer(tmp_path, "pyramid"), 24, block_size=bs, allocation="pyramid")  # 9 and 3 blocks
    tracker = FeatureTracker(L)
    gen = torch.Generator().manual_seed(0)
    ref = []  # per layer: positions [1, H, T], tracker state, key and value norms [1, H, T], latest attention

    def drop(decision):
        for layer, blocks in enumerate(decision.layer_blocks):
            pos, state, kn, vn, last = ref[layer]
            keep = ~torch.isin(pos[0, 0] // bs, torch.tensor(blocks, dtype=torch.long))
            ref[layer] = [pos[..., keep], {k: t[..., keep] for k, t in state.items()}, kn[..., keep], vn[..., keep],
                          last[..., keep]]

    rt.add_request("r")
    rt.begin_step("r", n)
    for layer in range(L):
        future = torch.ones(n, n).triu(1).bool()
        attn = torch.softmax(torch.rand(H, 1, n, n, generator=gen).masked_fill(future, -1e9), -1)
        k, v = torch.rand(H, n, D, generator=gen), torch.rand(H, n, D, generator=gen)
        rt.observe("r", layer, attn, k, v)
        pos, state = torch.arange(n)[None, None].expand(1, H, n), {}
        pair = group_mean_max(attn[None])  # [1, H, 2, n, n]: what the tracker reads
        tracker.update(pair, pos, n, 0, state)
        ref.append([pos, state, k.norm(dim=-1)[None], v.norm(dim=-1)[None], pair[:, :, :, -1:]])
    drop(rt.decide(["r"])[0])
    compared = 0
    for step in range(1, 30):
        rt.begin_step("r", 1)
        for layer in range(L):
            pos, state, kn, vn, _ = ref[layer]
            T = pos.shape[-1] + 1
            attn = torch.softmax(torch.rand(H, 1, 1, T, generator=gen) * 4, -1)
            k, v = torch.rand(H, 1, D, generator=gen), torch.rand(H, 1, D, generator=gen)
            rt.observe("r", layer, attn, k, v)
            state = {name: torch.cat([t, t.new_zeros(*t.shape[:-1], 1)], -1) for name, t in state.items()}
            pos = torch.cat([pos, torch.full((1, H, 1), n + step - 1)], -1)
            pair = group_mean_max(attn[None])
            tracker.update(pair, pos, 1, step, state)
            kn, vn = torch.cat([kn, k.norm(dim=-1)[None]], -1), torch.cat([vn, v.norm(dim=-1)[None]], -1)
            ref[layer] = [pos, state, kn, vn, pair]
        rt.batch.fold()  # what `decide` does first: compare what it scores, before it compacts
        positions, state, last, own_step = rt.batch.extract("r")
        kn, vn = state.pop("norm.k"), state.pop("norm.v")
        feats = tracker.features(last, kn[..., None], vn[..., None], positions, 0, own_step, state)
        for layer in range(L):
            held = positions[layer, 0] >= 0
            pos, rstate, rkn, rvn, rlast = ref[layer]
            assert positions[layer, 0, held].tolist() == pos[0, 0].tolist()
            expected = tracker.features(rlast, rkn[..., None], rvn[..., None], pos, 0, step, rstate)[0]
            torch.testing.assert_close(feats[layer][:, held], expected)
            compared += int((~held).any())
        drop(rt.decide(["r"])[0])
    assert compared, "no layer ever dropped a token another layer holds: the test proves nothing"
