"""The one kernel switch (`LEARNKV_KERNELS`) and the decode loop on the Triton path.

On CPU, ``LEARNKV_KERNELS=triton`` runs every kernel the decode loop uses through the Triton interpreter
(`TRITON_INTERPRET=1`, set by conftest before anything imports triton), so CI checks the wiring of item 6 without a
GPU: the same tiny model decodes with the references and with the kernels, and must keep the same tokens (slot
positions per layer, per step) and generate the same tokens. Shapes are tiny: the interpreter is ~100x slower.
On a GPU run (``TRITON_INTERPRET=0``, bench/gpu_all.sh) the same decode-loop cases run compiled on CUDA tensors, and
the tests of the interpreter's switch and subprocesses are skipped.
"""

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from learnkv import kernels
from conftest import params_for, prefill_for, random_ids

pytest.importorskip("triton")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"
interpreter_only = pytest.mark.skipif(not INTERPRETED, reason="tests the interpreter's path (TRITON_INTERPRET=1)")

#: policy -> the Triton launchers its decode steps must go through (module, function)
LAUNCHERS = {
    "decode_attention": ("learnkv.kernels.decode_attn", "decode_attention"),
    "select_keep": ("learnkv.kernels.select", "select_keep"),
    "mark_one_drop": ("learnkv.kernels.select", "mark_one_drop"),
    "gather_tokens": ("learnkv.kernels.compact", "gather_tokens"),
    "update_token_state": ("learnkv.kernels.state_update", "update_token_state"),
    "scorer_mlp": ("learnkv.kernels.scorer", "scorer_mlp"),
    "block_scores": ("learnkv.kernels.block_score", "block_scores"),
    "decode_features": ("learnkv.kernels.features", "decode_features"),
}
EVICTION = ("decode_attention", "select_keep", "gather_tokens")
POLICY_CASES = [  # policy, extra generate arguments, launchers that must run
    pytest.param("h2o", {}, EVICTION + ("update_token_state",), id="h2o"),
    pytest.param("roco", {}, EVICTION + ("update_token_state",), id="roco"),
    pytest.param("lazy", {}, EVICTION + ("update_token_state",), id="lazy"),
    pytest.param("tova", {}, EVICTION, id="tova"),
    pytest.param("rkv", {}, EVICTION, id="rkv"),
    pytest.param("paged", {"policy_params": {"block_size": 4}}, EVICTION + ("block_scores",), id="paged"),
    # small protected windows: with the defaults (4 + 8) a budget of 12 is all protected and the scores never count;
    # its attention fused too (the group mean and max, `group_reduce="mean+max"`); refresh 2, so the decode steps read
    # the fused features out (every other step) and update only (the others; which steps: tests/test_refresh.py)
    pytest.param("learned", {"policy_params": {"n_sink": 1, "n_recent": 2, "refresh": 2}},
                 EVICTION + ("scorer_mlp", "decode_features"), id="learned-refresh2"),
    pytest.param("h2o", {"granularity": "block", "block_size": 4}, EVICTION + ("update_token_state",),
                 id="h2o-shared-blocks"),
    # dead slots (position -1) stay in the cache between compactions: every kernel must mask them as padding
    # (and a decode step that evicts one slot without compacting marks it dead in place: `mark_one_drop`)
    pytest.param("h2o", {"slack": 3}, EVICTION + ("update_token_state", "mark_one_drop"), id="h2o-slack"),
    pytest.param("learned", {"policy_params": {"n_sink": 1, "n_recent": 2, "refresh": 2}, "slack": 3},
                 EVICTION + ("scorer_mlp", "decode_features", "mark_one_drop"), id="learned-slack-refresh2"),
    # key norms computed by the update on the kernel path, looked up at the score on the torch path
    pytest.param("knorm", {"slack": 3}, EVICTION + ("mark_one_drop",), id="knorm-slack"),
]


def decode(model, policy, mode, monkeypatch, extra):
    """Greedy decode of a left-padded batch of two prompts; kept positions per step and layer, and the tokens."""
    from learnkv import generate

    monkeypatch.setenv("LEARNKV_KERNELS", mode)
    ids = random_ids(21, batch=2, seed=3).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # row 1 is a 16-token prompt, left-padded
    params = {**params_for(policy, len(model.model.layers)), **extra.pop("policy_params", {})}
    extra = {**prefill_for(policy), **extra}
    kept = []
    res = generate(model, input_ids=ids, attention_mask=mask, policy=policy, budget=12, max_new_tokens=7,
                   policy_params=params, stop_at_eos=False,
                   observer=lambda c: kept.append([layer.positions.clone() for layer in c.layers]), **extra)
    return kept, res.tokens


@pytest.mark.parametrize("policy, extra, launchers", POLICY_CASES)
def test_decode_loop_triton_path_keeps_what_torch_path_keeps(tiny, monkeypatch, policy, extra, launchers):
    import copy
    import importlib

    model = copy.deepcopy(tiny).to(DEVICE)  # a copy: the fixture is shared with the CPU tests

    calls = dict.fromkeys(LAUNCHERS, 0)
    read_outs = set()  # decode_features with its features read out, or the state update only
    for name, (module, fn) in LAUNCHERS.items():
        mod = importlib.import_module(module)
        real = getattr(mod, fn)

        def spy(*a, _real=real, _name=name, **k):
            calls[_name] += 1
            if _name == "decode_features":
                read_outs.add(k.get("read_out", True))
            return _real(*a, **k)

        monkeypatch.setattr(mod, fn, spy)

    kept_torch, tokens_torch = decode(model, policy, "torch", monkeypatch, dict(extra))
    assert not any(calls.values()), f"the torch path ran Triton launchers: {calls}"
    kept_triton, tokens_triton = decode(model, policy, "triton", monkeypatch, dict(extra))
    missing = [n for n in launchers if not calls[n]]
    assert not missing, f"the Triton path never ran {missing} (calls: {calls})"
    assert read_outs == ({True, False} if policy == "learned" else set()), read_outs  # read out, and update only

    assert len(kept_torch) == len(kept_triton) == 7  # the prefill and 6 decode steps give 7 tokens
    assert any(layer.shape[-1] < 21 for step in kept_torch for layer in step), "the budget never evicted anything"
    for step, (a_step, b_step) in enumerate(zip(kept_torch, kept_triton)):
        for layer, (a, b) in enumerate(zip(a_step, b_step)):
            assert torch.equal(a, b), f"step {step}, layer {layer}: kept positions differ\n{a}\n{b}"
    assert torch.equal(tokens_torch, tokens_triton)


@interpreter_only
def test_switch(monkeypatch):
    x = torch.zeros(3)
    monkeypatch.setenv("LEARNKV_KERNELS", "auto")
    assert kernels.kernel_mode() == "auto" and not kernels.use_triton(x)  # CPU tensors: the references
    monkeypatch.setenv("LEARNKV_KERNELS", "torch")
    assert not kernels.use_triton(x)
    monkeypatch.setenv("LEARNKV_KERNELS", "triton")
    assert kernels.use_triton(x)  # conftest set TRITON_INTERPRET=1
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        kernels.use_triton(x)
    monkeypatch.setenv("LEARNKV_KERNELS", "cuda")
    with pytest.raises(ValueError, match="LEARNKV_KERNELS"):
        kernels.use_triton(x)


def test_interpreter_that_cannot_run_with_this_numpy_is_refused(monkeypatch):
    """Triton < 3.7's interpreter fails inside every kernel with a runtime loop bound under numpy >= 2.4 (seen on the
    GPU machine's triton 3.6.0): one line that says so, instead of an InterpreterError deep in a kernel."""
    import numpy
    import triton

    x = torch.zeros(3)
    monkeypatch.setenv("LEARNKV_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    verdict = functools.cache(kernels._interpreter_error.__wrapped__)  # decided once per process: a fresh cache
    monkeypatch.setattr(kernels, "_interpreter_error", verdict)
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    monkeypatch.setattr(numpy, "__version__", "2.4.6")
    with pytest.raises(RuntimeError, match=r"needs triton>=3.7 or numpy<2.4"):
        kernels.use_triton(x)
    monkeypatch.setattr(numpy, "__version__", "2.3.5")
    with pytest.raises(RuntimeError, match=r"needs triton>=3.7 or numpy<2.4"):
        kernels.use_triton(x)  # the verdict is not read again
    verdict.cache_clear()
    assert kernels.use_triton(x)
    monkeypatch.setattr(triton, "__version__", "3.7.1")
    monkeypatch.setattr(numpy, "__version__", "2.5.2")
    verdict.cache_clear()
    assert kernels.use_triton(x)


@interpreter_only
def test_benchmark_and_decode_path_import_neither_wandb_nor_datasets():
    """The GPU machine has torch, triton, transformers and lightning but no wandb or datasets: the benchmark, the
    kernels and the decode loop (every policy but `learned`, with the kernel path forced) must not import them."""
    root = Path(__file__).resolve().parents[1]
    code = (
        "import runpy, sys\n"
        "sys.argv = ['kernel_bench.py', '--help']\n"
        "try:\n"
        "    runpy.run_path('bench/kernel_bench.py', run_name='__main__')\n"
        "except SystemExit:\n"
        "    pass\n"
        "import learnkv.kernels.reference, learnkv.kernels.select, learnkv.kernels.compact\n"
        "import learnkv.kernels.decode_attn, learnkv.kernels.block_score, learnkv.kernels.state_update\n"
        "import learnkv.kernels.scorer, learnkv.kernels.features\n"
        "from learnkv import generate, POLICIES\n"
        "from learnkv.model import tiny_model\n"
        "import torch\n"
        "model = tiny_model()\n"
        "ids = torch.randint(0, 256, (1, 44))\n"
        "for name in POLICIES:\n"
        "    if name != 'learned':\n"
        "        generate(model, input_ids=ids, policy=name, budget=36, max_new_tokens=3, prefill_policy='snapkv')\n"
        "import learnkv.scorer.artifact, learnkv.features\n"
        "print(sorted({'wandb', 'datasets'} & set(sys.modules)))\n"
    )
    env = {"TRITON_INTERPRET": "1", "LEARNKV_KERNELS": "triton", "PATH": "/usr/bin:/bin"}
    res = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().splitlines()[-1] == "[]", res.stdout


@interpreter_only
def test_benchmark_triton_rows_match_their_references_in_the_interpreter():
    """`bench/kernel_bench.py` on the Triton path (the interpreter here, compiled on a GPU) runs every kernel row and
    checks it against its reference, so a GPU session does not find a broken benchmark."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "LEARNKV_KERNELS": "triton"}
    res = subprocess.run([sys.executable, "bench/kernel_bench.py", "--batches", "1", "--contexts", "80",
                          "--skip-steps"], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [line.split("|") for line in res.stdout.splitlines() if "| triton |" in line]
    kernels_run = {r[1].strip() for r in rows}
    assert {"decode_attention", "decode_attention 2 passes", "decode_attention no probs", "gather_tokens K",
            "block_scores bs=16", "update_token_state (all 6)", "scorer_mlp", "decode_features", "select_keep bs=1",
            "select_keep bs=16"} <= kernels_run, res.stdout
    assert all(r[8].strip() in ("=", "~") for r in rows), res.stdout


def _bench_script(name: str):
    """A `bench/` script loaded as a module named ``bench_<name>`` (no top-level name another import could take)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_decode_step_table_times_the_learned_policy(monkeypatch, capsys):
    """The decode-step table's learned row runs the real path with an untrained scorer of the step model's shape
    (so a GPU session can time it without a trained artifact of that shape)."""
    monkeypatch.setenv("LEARNKV_KERNELS", "torch")
    monkeypatch.setattr(sys, "argv", ["kernel_bench.py", "--skip-kernels", "--batches", "1", "--contexts", "64",
                                      "--policies", "learned", "--slacks", "0", "--steps", "2", "--layers", "1"])
    with torch.random.fork_rng():  # the script seeds the global generator
        _bench_script("kernel_bench").main()
    out = capsys.readouterr().out
    rows = [line.split("|") for line in out.splitlines() if "| learned |" in line]
    assert len(rows) == 1 and float(rows[0][8]) > 0, out


def _specialization(fn, args: dict) -> tuple[tuple, dict]:
    """(the launch's constexpr values and tensor dtypes, {integer or pointer argument: its class}) as Triton keys a
    compile: an int as 1, a multiple of 16 or neither, unless the kernel lists it in ``do_not_specialize``; a
    tensor by its address's 16-byte alignment, unless in ``do_not_specialize_on_alignment``."""
    import inspect

    import triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    no_value = set(fn.kwargs.get("do_not_specialize") or ())
    no_align = set(fn.kwargs.get("do_not_specialize_on_alignment") or ())
    fixed, classes = [], {}
    for name, param in inspect.signature(fn.fn).parameters.items():
        if name not in args:
            continue
        v = args[name]
        if param.annotation in (triton.language.constexpr, "tl.constexpr"):
            fixed.append((name, v))
        elif isinstance(v, torch.Tensor):
            fixed.append((name, v.dtype))
            classes[name] = None if name in no_align else v.data_ptr() % 16 == 0
        elif isinstance(v, int):
            classes[name] = native_specialize_impl(BaseBackend, v, False, name not in no_value, True)
    return tuple(fixed), classes


@interpreter_only
@pytest.mark.parametrize("policy, extra", [
    pytest.param("learned", {"policy_params": {"n_sink": 1, "n_recent": 2}}, id="learned"),
    pytest.param("h2o", {}, id="h2o"),
    pytest.param("tova", {}, id="tova"),
    pytest.param("knorm", {}, id="knorm"),
    pytest.param("paged", {"policy_params": {"block_size": 4}}, id="paged"),
])  # fmt: skip
def test_a_decode_never_recompiles_a_kernel(tiny, monkeypatch, policy, extra):
    """Triton compiles a kernel anew for each class of its integer arguments (`kernels.specialize`). Over a decode
    whose cache length crosses a multiple of 16 (budget 30, slack 4) and whose learned window rows cycle, no
    argument of a launch may change class while its constexprs stay put: each kernel compiles once per constexpr
    variant, never mid-decode (the H200 lease profiled such compiles: bench/RESULTS.md)."""
    import collections

    from triton.runtime.interpreter import InterpretedFunction

    from learnkv import generate

    seen = collections.defaultdict(lambda: collections.defaultdict(set))
    real_run = InterpretedFunction.run

    def recording(self, *args, grid, warmup, **kwargs):
        fixed, classes = _specialization(self, {**dict(zip(self.arg_names, args)), **kwargs})
        for name, cls in classes.items():
            seen[self.fn.__name__, fixed][name].add(cls)
        return real_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recording)
    monkeypatch.setenv("LEARNKV_KERNELS", "triton")
    params = {**params_for(policy, len(tiny.model.layers)), **extra.get("policy_params", {})}
    # the cache holds 28, 29, ... 34 slots (32 among them), compacts to 30, grows again; the window rows cycle
    generate(tiny, input_ids=random_ids(28, seed=3), policy=policy, budget=30, max_new_tokens=9, slack=4,
             policy_params=params, stop_at_eos=False, **prefill_for(policy))  # fmt: skip
    assert seen, "no kernel ran on the Triton path"
    changing = {(kernel, name): sorted(map(str, classes)) for (kernel, _), args in seen.items()
                for name, classes in args.items() if len(classes) > 1}  # fmt: skip
    assert not changing, f"arguments that change class within a decode (a compile each): {changing}"


def test_step_profiler_runs(monkeypatch, capsys):
    """`bench/profile_step.py` (what a GPU lease runs to find host time and syncs) prints each policy's step and
    its launches; on a GPU, with the kernels it would run there, no device-to-host sync in a step (the torch
    references sync: `select_keep_reference`'s per-row budget, the CPU argmin shortcut's fallback check)."""
    monkeypatch.setenv("LEARNKV_KERNELS", "auto" if torch.cuda.is_available() else "torch")
    with torch.random.fork_rng():  # the script seeds the global generator
        _bench_script("profile_step").main(["--policies", "h2o,learned", "--batch", "1", "--context", "64", "--steps",
                                            "2", "--layers", "1", "--top", "3"])  # fmt: skip
    out = capsys.readouterr().out
    assert out.count("ms per step; device-to-host syncs per step: 0.00") == 2, out
    assert out.count("launches per step:") == 2, out
