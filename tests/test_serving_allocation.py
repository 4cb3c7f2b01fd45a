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
    with pytest.raises(ArtifactError, match="trained for allocation 'uniform', not 'pyramid'"):
        ServingRuntime(uniform, 32, block_size=8, allocation="pyramid")
    with pytest.raises(ArtifactError, match="trained for allocation 'pyramid', not 'uniform'"):
        ServingRuntime(pyramid, 32, block_size=8)
    with pytest.raises(ArtifactError, match="trained for allocation 'global', not 'uniform'"):
        runtime_for(parse_config({"scorer": str(glob), "budget": 32, "block_size": 8}))
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
