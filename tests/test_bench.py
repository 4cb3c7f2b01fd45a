"""bench/decode.py runs and writes the throughput records its README and RESULTS figures come from."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_decode_benchmark_batch_sizes_and_json(smollm2, tmp_path):
    out = tmp_path / "decode.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "bench/decode.py", "--policies", "full,h2o,lazy", "--batch-sizes", "1,2",
                          "--new-tokens", "6", "--budget", "96", "--threads", "1", "--repeats", "2", "--json", str(out)],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    records = json.loads(out.read_text())
    assert [(r["policy"], r["batch_size"]) for r in records] == [
        ("full", 1), ("full", 2), ("h2o", 1), ("h2o", 2), ("lazy", 1), ("lazy", 2)]
    assert all(r["tokens_per_s"] > 0 for r in records)
    assert all(r["ratio_to_batch_1"] == 1.0 for r in records if r["batch_size"] == 1)
    assert all(r["time_vs_full"] == 1.0 for r in records if r["policy"] == "full")
    assert all(r["time_vs_full"] > 0 for r in records)
    for r in records:  # two interleaved rounds: the best is reported, the cost ratio is paired round by round
        assert len(r["tokens_per_s_rounds"]) == 2 and r["tokens_per_s"] == max(r["tokens_per_s_rounds"])
        full = next(f for f in records if f["policy"] == "full" and f["batch_size"] == r["batch_size"])
        ratios = [a / b for a, b in zip(full["tokens_per_s_rounds"], r["tokens_per_s_rounds"])]
        assert r["time_vs_full_rounds"] == pytest.approx(ratios)
        assert min(ratios) <= r["time_vs_full"] <= max(ratios)
    assert "| h2o |" in res.stdout and "batch 2 / batch 1" in res.stdout and "step time relative" in res.stdout
    assert "over 2 rounds" in res.stdout


@pytest.mark.slow
def test_kvpress_parity_counts_operators_a_decode_step(smollm2):
    """`bench/kvpress_parity.py --ops` (no kvpress venv needed): each policy's torch operators a decode step once it
    evicts, from two decodes subtracted. SmolLM2's 30 layers run 7 projections each and the LM head one: 211 linear
    operators a step, whatever the policy; an evicting policy runs more operators than the full cache."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "bench/kvpress_parity.py", "--ops", "full,h2o", "--budget", "80",
                          "--top", "40"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    counts = {}
    for line in res.stdout.splitlines():
        policy, _, rest = line.partition(": ")
        if rest.endswith(tuple("0123456789")) and " operators a decode step; " in rest:
            total, _, top = rest.partition(" operators a decode step; ")
            counts[policy] = (float(total), dict(item.rsplit(" ", 1) for item in top.split(", ")))
    assert set(counts) == {"full", "h2o"}, res.stdout
    assert counts["full"][1]["linear"] == counts["h2o"][1]["linear"] == "211"
    assert counts["h2o"][0] > counts["full"][0] > 211


def saved_model(small, tmp_path) -> Path:
    """The tiny model and SmolLM2's tokenizer (``small``) saved under ``tmp_path / "tiny"``, for a benchmark's
    ``--model``."""
    model, tok = small
    model_dir = tmp_path / "tiny"
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    return model_dir


def test_page_faults_benchmark_times_both_variants_and_restores_today(small, tmp_path):
    """`bench/page_faults.py` on the tiny model with SmolLM2's tokenizer: each policy under both variants, page
    faults and ms a step in its table (the figures need the real model and an idle machine)."""
    model_dir = saved_model(small, tmp_path)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "bench/page_faults.py", "--model", str(model_dir), "--batch", "2",
                          "--budget", "40", "--new-tokens", "24", "--from-step", "4", "--rounds", "2", "--threads", "1",
                          "--policies", "h2o,learned"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [line.split(" | ") for line in res.stdout.splitlines() if line.startswith(("| 1 |", "| 2 |"))]
    assert [(r[1], r[2]) for r in rows] == [("h2o", "today"), ("h2o", "before"), ("learned", "today"),
                                            ("learned", "before"), ("h2o", "before"), ("h2o", "today"),
                                            ("learned", "before"), ("learned", "today")]
    assert all(float(r[3].replace(",", "")) >= 0 and float(r[4].rstrip(" |")) > 0 for r in rows)
    bad = subprocess.run([sys.executable, "bench/page_faults.py", "--new-tokens", "8"], capture_output=True, text=True,
                         cwd=ROOT, env=env, timeout=600)
    assert bad.returncode == 2 and "--new-tokens (8) must exceed --from-step + 1 (17)" in bad.stderr


def test_gc_pauses_benchmark_counts_collections_in_both_variants(small, tmp_path):
    """`bench/gc_pauses.py` on the tiny model with SmolLM2's tokenizer: each decode in a process of its own, under
    both variants in turn, with the collections of each generation during its steps and its slowest step."""
    model_dir = saved_model(small, tmp_path)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "bench/gc_pauses.py", "--model", str(model_dir), "--batch", "2", "--budget",
                          "40", "--new-tokens", "12", "--rounds", "2", "--threads", "1", "--policies", "rkv"],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "objects tracked before a decode: " in res.stdout and " ms with them frozen" in res.stdout
    rows = [line.split(" | ") for line in res.stdout.splitlines() if line.startswith(("| 1 |", "| 2 |"))]
    assert [(r[1], r[2]) for r in rows] == [("rkv", "today"), ("rkv", "before"), ("rkv", "before"), ("rkv", "today")]
    assert all(" ms)" in cell for r in rows for cell in r[3:6]) and all(float(r[6].rstrip(" |")) > 0 for r in rows)
    bad = subprocess.run([sys.executable, "bench/gc_pauses.py", "--new-tokens", "1"], capture_output=True, text=True,
                         cwd=ROOT, env=env, timeout=600)
    assert bad.returncode == 2 and "--new-tokens (1) must be at least 2" in bad.stderr


def _run_long(small, tmp_path, fractions: str, policies: str, *extra: str):
    """`bench/decode.py --long` on the tiny model saved with SmolLM2's tokenizer: batch 2 to 1,040 tokens, two
    rounds, slack 4, one thread; (the finished process, the records' path)."""
    model_dir, out = saved_model(small, tmp_path), tmp_path / "long.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "bench/decode.py", "--model", str(model_dir), "--long", "--long-settings",
                          "2:1040", "--long-fractions", fractions, "--policies", policies, *extra, "--threads", "1",
                          "--repeats", "2", "--slack", "4", "--json", str(out)],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)  # fmt: skip
    return res, out


def test_decode_benchmark_long_mode(small, tmp_path):
    """`--long` on a tiny random model with SmolLM2's tokenizer (fast; the real figures need the real model):
    every policy at every fraction against the full cache, paired by round, records in JSON."""
    res, out = _run_long(small, tmp_path, "0.25,0.5", "full,h2o,snapkv,oracle")
    assert res.returncode == 0, res.stderr[-2000:]
    records = json.loads(out.read_text())
    # the oracle is left out (it replays a full-cache pass); full once, the others at each fraction
    assert [(r["policy"], r["fraction"]) for r in records] == [
        ("full", None), ("h2o", 0.25), ("h2o", 0.5), ("snapkv", 0.25), ("snapkv", 0.5)]
    for r in records:
        assert r["mode"] == "long" and r["batch_size"] == 2 and r["final_length"] == 1040 and r["slack"] == 4
        assert len(r["prompt_tokens"]) == 2 and r["new_tokens"] == 1040 - int(sum(r["prompt_tokens"]) / 2)
        rates, full = r["decode_tokens_per_s_rounds"], records[0]["decode_tokens_per_s_rounds"]
        assert len(rates) == 2 and r["decode_tokens_per_s"] == max(rates)
        assert r["speed_vs_full_rounds"] == pytest.approx([a / b for a, b in zip(rates, full)])
        assert min(r["speed_vs_full_rounds"]) <= r["speed_vs_full"] <= max(r["speed_vs_full_rounds"])
        assert all(0 <= e < 1 for e in r["eviction_share_rounds"])
        if r["policy"] == "full":
            assert r["speed_vs_full"] == 1.0 and r["budgets"] is None
        else:
            finals = [n + r["new_tokens"] for n in r["prompt_tokens"]]
            assert r["budgets"] == [-(-int(r["fraction"] * 1000) * f // 1000) for f in finals]
            assert r["eviction_share"] > 0
    assert "| 2 | " in res.stdout and "| snapkv | 25% (" in res.stdout and "[min, max] over 2 rounds" in res.stdout


def _turns():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import turns
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return turns


def test_turns_alternate_and_time_each_decode_alone():
    """`bench/turns.py`: decodes take turns one step each, in order (a log of who ran shows no overlap), all in the
    calling thread (one OpenMP team: a thread per decode made every torch op wait for sleeping workers), each one's
    times are its own spans (a slow neighbour's sleep is not in them), a job that ends early leaves the others going,
    and an error in one is raised once all have ended."""
    import threading

    turns = _turns()
    log, threads = [], set()

    def job(name, steps, pause):
        def run():
            time.sleep(pause)  # its prefill
            yield 1
            for _ in range(steps):
                log.append(name + "+")
                threads.add(threading.get_ident())
                time.sleep(pause)
                log.append(name + "-")
                yield 1
            return name
        return run

    out = turns.take_turns([job("a", 4, 0.002), job("b", 2, 0.02), job("c", 4, 0.002)])
    assert [o.result for o in out] == ["a", "b", "c"]
    assert log == ["a+", "a-", "b+", "b-", "c+", "c-"] * 2 + ["a+", "a-", "c+", "c-"] * 2
    assert threads == {threading.get_ident()}
    assert [len(o.step_s) for o in out] == [4, 2, 4]
    assert max(out[0].step_s) < 0.015 and min(out[1].step_s) >= 0.02, "a step's time holds another decode's"
    assert out[0].decode_s == pytest.approx(sum(out[0].step_s)) and out[1].prefill_s >= 0.02

    def failing():
        yield 1
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        turns.take_turns([job("a", 3, 0.0), failing])
    assert log[-2:] == ["a+", "a-"] and log.count("a+") == 4 + 3, "the other decode did not go on to its end"
    ratio, low, high = turns.block_ratio_interval([2.0] * 64, [1.0] * 64)
    assert ratio == low == high == 2.0


def test_turns_pause_the_heap_trims():
    """`bench/turns.py` runs the decodes under `learnkv.memory.paused_trims`: no decode's look at its growth hands
    the heap back while they take turns (each would see the others' growth), and the trims work again after."""
    from learnkv import memory

    turns, found = _turns(), []

    def looks():  # a decode's look at its growth (by more than -1 bytes: it would trim), at its prefill and a step
        found.append(memory.HeapTrim(limit=-1)())
        yield 1
        found.append(memory.HeapTrim(limit=-1)())
        yield 1

    turns.take_turns([looks, looks])
    assert found == [False] * 4, "a decode handed the heap back while others took turns"
    assert memory._TRIM is None or memory.HeapTrim(limit=-1)(), "the trims stay paused after the turns"


def test_turns_stop_every_decode_when_interrupted():
    """Ctrl-C (or SIGTERM taken as it) while decodes take turns: the interrupt reaches the caller, every decode's
    generator is closed (its cleanup runs), and none runs on."""
    import signal
    import threading

    turns = _turns()
    steps, closed = [], []

    def endless():
        try:
            while True:
                time.sleep(0.005)
                steps.append(1)
                yield 1
        finally:
            closed.append(1)

    sigint = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT))
    try:
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            turns.take_turns([endless, endless, endless])
    finally:
        timer.join()
        signal.signal(signal.SIGINT, sigint)
    assert steps and len(closed) == 3
    n = len(steps)
    time.sleep(0.05)
    assert len(steps) == n, "a decode ran on after the interrupt"


def test_decode_benchmark_long_mode_in_turns(small, tmp_path):
    """`--long --interleave`: each round's decodes of a setting take turns with a full-cache decode; each speed is
    divided by its turn-mate's, the records hold the pooled ratio, its block interval and the extra milliseconds a
    step costs, the table prints them."""
    res, out = _run_long(small, tmp_path, "0.5", "full,h2o,knorm,snapkv:running_sum=true", "--interleave")
    assert res.returncode == 0, res.stderr[-2000:]
    records = json.loads(out.read_text())
    assert [r["policy"] for r in records] == ["full", "h2o", "knorm", "snapkv:running_sum=true"]
    kept = [json.loads(line) for line in Path(str(out) + ".decodes.jsonl").read_text().splitlines()]
    assert kept[0]["identity"]["interleave"] is True and len(kept) == 1 + 8
    for r in records:
        entries = [e["result"] for e in kept[1:] if e["key"][3] == r["policy"]]
        assert len(entries) == 2 and all(len(e["step_s"]) == r["new_tokens"] - 1 for e in entries)
        assert r["speed_vs_full_rounds"] == pytest.approx(
            [e["decode_tokens_per_s"] / e["paired_full_decode_tokens_per_s"] for e in entries])
        low, high = r["speed_vs_full_pooled_ci95"]
        assert low <= r["speed_vs_full_pooled"] <= high
        # the same pooled steps: a step that costs more than its turn-mate's is a ratio below 1
        assert (r["step_ms_over_full"] > 0) == (r["speed_vs_full_pooled"] < 1)
        if r["policy"] == "full":
            assert r["speed_vs_full_pooled"] == 1.0 and r["step_ms_over_full"] == 0.0
    assert "pooled [95%]" in res.stdout and "ms/step over full" in res.stdout and "| knorm | 50% (" in res.stdout
    # two policies of the same turns paired with each other, step by step
    pair = subprocess.run([sys.executable, "bench/decode.py", "--pair", "knorm,snapkv:running_sum=true", "--json",
                           str(out), "--from-step", "3"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert pair.returncode == 0, pair.stderr[-2000:]
    lines = pair.stdout.splitlines()
    assert len(lines) == 6 and lines[0].startswith("round 1, batch 2 to 1040, decode steps 3-")
    knorm = next(e["result"] for e in kept[1:] if e["key"][3] == "knorm" and e["key"][0] == 0)
    steps = knorm["step_s"][3:]
    assert f"knorm 50% / full {sum(knorm['paired_full_step_s'][3:]) / sum(steps):.3f}x" in lines[1]
    missing = subprocess.run([sys.executable, "bench/decode.py", "--pair", "knorm,rkv", "--json", str(out)],
                             capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert missing.returncode != 0 and "no round" in missing.stderr


def test_decode_benchmark_by_residue(tmp_path):
    """`--by-residue N`: per kept decode in turns (not the full cache's own), the median of its step time minus its
    turn-mate full cache's, by step index modulo N, from `--from-step`."""
    full = [0.100 + 0.001 * s for s in range(6)]
    extra = [9.0, 9.0, 9.0, 0.0, 0.002, 0.050]  # the first three left out by --from-step 3; a spike at residue 2
    other = [f + e for f, e in zip(full, extra)]
    out = tmp_path / "turns.json"
    kept = [{"identity": {"interleave": True}},
            {"key": [0, 8, 1536, "full", None], "result": {"step_s": full, "paired_full_step_s": full}},
            {"key": [0, 8, 1536, "h2o", 0.5], "result": {"step_s": other, "paired_full_step_s": full}},
            {"key": [0, 8, 1536, "h2o", 0.25], "result": {"step_s": full, "paired_full_step_s": full}}]
    Path(str(out) + ".decodes.jsonl").write_text("".join(json.dumps(e) + "\n" for e in kept))
    res = subprocess.run([sys.executable, "bench/decode.py", "--by-residue", "3", "--from-step", "3", "--json",
                          str(out)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    # each fraction of a policy its own row (a run of two fractions kept only the last one's before)
    assert [line for line in res.stdout.splitlines() if line.startswith("| 1 ")] == [
        "| 1 | h2o 50% | +0 | +2 | +50 |", "| 1 | h2o 25% | +0 | +0 | +0 |"]
    res = subprocess.run([sys.executable, "bench/decode.py", "--pair", "full,h2o", "--json", str(out)],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.returncode == 0 and "h2o 50% / full speed" in res.stdout and "h2o 25% / full speed" in res.stdout
    res = subprocess.run([sys.executable, "bench/decode.py", "--by-residue", "3", "--from-step", "5", "--json",
                          str(out)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert [line for line in res.stdout.splitlines() if line.startswith("| 1 ")][0] == "| 1 | h2o 50% | - | - | +50 |"
    for mode in (["--by-residue", "3"], ["--pair", "full,h2o"]):  # a negative start would slice from the end
        res = subprocess.run([sys.executable, "bench/decode.py", *mode, "--from-step", "-1", "--json", str(out)],
                             capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert res.returncode == 2 and "--from-step: must be >= 0, got -1" in res.stderr, res.stderr[-2000:]
    res = subprocess.run([sys.executable, "bench/decode.py", "--by-residue", "0", "--json", str(out)],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.returncode == 2 and "--by-residue: must be >= 1, got 0" in res.stderr, res.stderr[-2000:]
    empty = tmp_path / "none.json"
    Path(str(empty) + ".decodes.jsonl").write_text("".join(json.dumps(e) + "\n" for e in kept[:2]))
    res = subprocess.run([sys.executable, "bench/decode.py", "--by-residue", "3", "--json", str(empty)],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.returncode != 0 and "no decode in turns" in res.stderr


def test_decode_benchmark_policy_items_carry_settings():
    """`bench/decode.py --long` takes ``NAME:key=value`` items: the settings reach `generate`, the learned policy's
    scorer is added; the other modes refuse them in one line."""
    import argparse

    bench = _bench_decode()
    args = argparse.Namespace(scorer="runs/x")
    assert bench.long_params("snapkv:running_sum=true:window=8", args) == {"running_sum": True, "window": 8}
    assert bench.long_params("learned:refresh=16", args) == {"refresh": 16, "scorer": "runs/x"}
    assert bench.long_params("h2o", args) == {}
    assert bench.long_key(0, 8, 1536, "learned:refresh=16", 0.5, "abc")[-1] == "abc"
    res = subprocess.run([sys.executable, "bench/decode.py", "--policies", "snapkv:running_sum=true",
                          "--batch-sizes", "1", "--model", "no-such-model"], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode != 0 and res.stderr.strip().splitlines()[-1] == (
        "error: policy settings (NAME:key=value) are taken by --long only")


def _bench_decode():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_decode", ROOT / "bench" / "decode.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGTERM"])
def test_decode_benchmark_long_mode_resumes(small, tmp_path, monkeypatch, signal_name):
    """A killed `--long` run keeps every finished decode; the same command decodes only the rest and writes the
    records with the kept decodes' figures as they were; a rerun with another policy decodes only that one; a run
    under another setting does not read them back. Killed by Ctrl-C or by SIGTERM (a scheduler's, `timeout`'s)."""
    import signal

    model = small[0]
    model_dir, out = saved_model(small, tmp_path), tmp_path / "long.json"
    bench = _bench_decode()
    calls = []
    real = bench.generate

    def counting(*a, **k):
        calls.append(k["policy"])
        if len(calls) == 5 and kill:
            os.kill(os.getpid(), getattr(signal, signal_name))
        return real(*a, **k)

    monkeypatch.setattr(bench, "generate", counting)
    # Ctrl-C as in a terminal: a job started in the background (`nohup ... &`, as CI may be) inherits SIGINT ignored
    sigint = signal.signal(signal.SIGINT, signal.default_int_handler)
    argv = ["--model", str(model_dir), "--long", "--long-settings", "2:1040", "--long-fractions", "0.5",
            "--policies", "full,h2o", "--threads", "1", "--repeats", "2", "--slack", "4", "--json", str(out)]
    threads = torch.get_num_threads()
    try:
        kill = True
        how = "terminated .SIGTERM." if signal_name == "SIGTERM" else "interrupted"
        with pytest.raises(SystemExit, match=f"{how}: 3 finished decodes kept"):
            bench.main(argv)  # the warm-up, round 1's full and h2o, round 2's full; killed in round 2's h2o
        state = Path(str(out) + ".decodes.jsonl")
        assert len(state.read_text().splitlines()) == 1 + 3 and not out.exists()
        kept = bench.read_long_state(state, json.loads(state.read_text().splitlines()[0])["identity"])
        with state.open("a") as f:
            f.write('{"key": [1, 2, 1040, "h2o"')  # a torn line: killed while writing
        kill, calls[:] = False, []
        bench.main(argv)
        assert calls == ["full", "h2o"]  # the warm-up and the one lost decode
        assert len(state.read_text().splitlines()) == 1 + 4  # kept beside the records
        records = json.loads(out.read_text())
        full, h2o = records
        assert full["decode_tokens_per_s_rounds"] == [kept[0, 2, 1040, "full", None]["decode_tokens_per_s"],
                                                      kept[1, 2, 1040, "full", None]["decode_tokens_per_s"]]
        assert h2o["decode_tokens_per_s_rounds"][0] == kept[0, 2, 1040, "h2o", 0.5]["decode_tokens_per_s"]
        assert len(h2o["timed_at_rounds"]) == 2 and all(h2o["timed_at_rounds"])
        calls[:] = []
        bench.main([*argv[:8], "full,h2o,knorm", *argv[9:]])  # one more policy: only its two rounds decode
        assert calls == ["full", "knorm", "knorm"]
        assert [r["policy"] for r in json.loads(out.read_text())] == ["full", "h2o", "knorm"]
        assert json.loads(out.read_text())[:2] == records
        # the learned policy joins decodes timed without a scorer; its scorer is in its keys, not the file's identity
        from conftest import scorer_for

        scorer = scorer_for(2, n_kv_heads=model.config.num_key_value_heads, model=str(model_dir))
        calls[:] = []
        bench.main([*argv[:8], "full,h2o,learned", *argv[9:], "--scorer", scorer])
        assert calls == ["full", "learned", "learned"]
        digest = bench.scorer_identity(scorer)["weights_sha256"]
        learned = bench.read_long_state(state, bench.long_identity(model, bench.parse_args(argv)))
        assert (0, 2, 1040, "learned", 0.5, digest) in learned
        # a file of the first format (the scorer in its identity line) keeps its learned decodes under that scorer
        lines = state.read_text().splitlines()
        first = [json.dumps({"identity": {**json.loads(lines[0])["identity"], "scorer": {"path": scorer,
                                                                                          "weights_sha256": digest}}})]
        for line in lines[1:]:
            entry = json.loads(line)
            first.append(json.dumps({**entry, "key": entry["key"][:5]}))
        state.write_text("\n".join(first) + "\n")
        assert bench.read_long_state(state, bench.long_identity(model, bench.parse_args(argv))) == learned
        # another setting (slack) does not read back what was timed under this one
        state.write_text(json.dumps({"identity": bench.long_identity(model, bench.parse_args(argv))}) + "\n")
        with pytest.raises(SystemExit, match="another setting .*slack"):
            bench.main([*argv[:-4], "--slack", "8", "--json", str(out)])
    finally:
        torch.set_num_threads(threads)
        signal.signal(signal.SIGINT, sigint)


def test_gpu_on_paper_counts():
    """bench/gpu_on_paper.py's model: Qwen2.5-7B's published 6.53B non-embedding parameters plus the untied LM head
    (0.545B) read per step, 57,344 bytes of K/V per token, and the radix select's passes as the launcher sets them."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu_on_paper as paper
    finally:
        sys.path.remove(str(ROOT / "bench"))
    pytest.importorskip("triton")
    from learnkv.kernels import select

    m = paper.Model()
    assert m.weight_bytes() / 2 == pytest.approx(6.53e9 + 152064 * 3584, rel=2e-3)
    assert m.layers * m.kv_heads * m.kv_slot_bytes() == 57344
    for slots in (1, 2, 600, 4104, 16392, 65536):
        idx_bits = max(slots - 1, 0).bit_length()
        passes = -(-(32 + idx_bits) // select.RADIX_BITS)
        assert paper.select_bytes(slots) == 4 + 16 + 8 + 8 * (passes + 1) + 8
    from learnkv.kernels.decode_attn import one_pass

    G, kv = m.q_heads // m.kv_heads, m.kv_slot_bytes()
    assert one_pass(G, m.head_dim, m.bytes, "mean")  # the schedule the paper counts is the launcher's for this model
    full = paper.step_bytes("full", m, 8, 32768, None, 16)
    flash = paper.step_bytes("full (FlashDecoding)", m, 8, 32768, None, 16)
    assert full["attention"] == pytest.approx(flash["attention"] * (kv + 8) / kv)  # K, V and positions read once
    half = paper.step_bytes("h2o", m, 8, 32768, 0.5, 16)  # + the raw scores written and read, the group mean written
    assert half["attention"] == pytest.approx(m.layers * 8 * m.kv_heads * (16384 + 8) * (kv + 8 + 8 * G + 4))
    from learnkv import features

    assert (paper.WINDOW, paper.SPARE_ROWS) == (features.WINDOW, features.SPARE_ROWS)  # the learned window's rows
    from learnkv.policies import make_policy

    assert paper.REFRESH == make_policy("learned").refresh  # the learned policy's default refresh


def test_omp_teams_benchmark_prints_both_sides():
    """`bench/omp_teams.py` (why bench/turns.py keeps one thread) runs end to end: both timings and their ratio."""
    res = subprocess.run([sys.executable, "bench/omp_teams.py", "--shape", "4,64", "--ops", "20", "--rounds", "2",
                          "--threads", "1"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "us an op, beside an idle team" in res.stdout and "; beside / alone " in res.stdout


def test_profile_eviction_timers(small, tmp_path):
    """`bench/profile_eviction.py --timers` on the tiny model: the eviction path's functions timed per eviction,
    without the profiler; the wrapped functions are the real ones again afterwards."""
    import importlib.util

    from learnkv.cache import BudgetCache

    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "bench/profile_eviction.py", "--model", str(saved_model(small, tmp_path)),
                          "--policies", "paged", "--batch", "2", "--new-tokens", "40", "--fraction", "0.9",
                          "--timers"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    rows = {line.split(" | ")[0].strip("|` "): line.split(" | ")[1:] for line in res.stdout.splitlines()
            if line.startswith("| `")}
    assert {"_step", "_evict", "_select_due_rows", "select_keep", "_keep_slots"} <= rows.keys()
    assert int(rows["_evict"][0]) > 0 and float(rows["_evict"][2].rstrip(" |")) > 0
    spec = importlib.util.spec_from_file_location("bench_profile", ROOT / "bench" / "profile_eviction.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    before = [vars(owner)[name] for owner, name in module.TIMED]
    with module.timers() as spent:
        BudgetCache._select_due_rows(torch.rand(1, 1, 4), None, torch.arange(4).view(1, 1, 4), [2], [0], [0], 1, [4])
    assert {name: len(calls) for name, calls in spent.items()} == {"_select_due_rows": 1, "select_keep": 1}
    assert [vars(owner)[name] for owner, name in module.TIMED] == before


def test_profile_eviction_bytes_counts_every_decode_step(small, tmp_path):
    """`bench/profile_eviction.py --bytes` on the tiny model: every decode step's ops counted (each reads every
    linear layer's weights), the eviction path's apart (none for the full cache), and the cache's step restored."""
    import importlib.util

    from learnkv.cache import BudgetCache

    model, tok = small
    spec = importlib.util.spec_from_file_location("bench_profile", ROOT / "bench" / "profile_eviction.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ids = torch.randint(0, 200, (2, 40), generator=torch.Generator().manual_seed(0))
    weights = sum(m.weight.numel() * 4 for m in model.modules() if isinstance(m, torch.nn.Linear))
    real_step = BudgetCache._step
    for policy, evicts in (("full", False), ("h2o", True)):
        run = dict(input_ids=ids, attention_mask=torch.ones_like(ids), policy=policy, budget=24, max_new_tokens=12,
                   stop_at_eos=False, slack=2)  # fmt: skip
        r, steps, by_op = module.decode_traffic(model, run)
        assert steps == 11 and len(r.tokens[0]) == 12
        assert weights * steps <= by_op["model"]["mm"].read < 1.1 * weights * steps
        assert by_op["model"]["mm"].flops >= 2 * 2 * weights // 4 * steps  # two rows, 2 FLOPs a weight
        assert bool(by_op["eviction"]) == evicts and BudgetCache._step is real_step
        if evicts:
            assert sum(t.read + t.written for t in by_op["eviction"].values()) > 0
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "bench/profile_eviction.py", "--model", str(saved_model(small, tmp_path)),
                          "--policies", "full,h2o", "--batch", "2", "--new-tokens", "12", "--budget", "24", "--bytes"],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ")[1:] for line in res.stdout.splitlines()
            if line.startswith("| full") or line.startswith("| h2o")}  # fmt: skip
    assert rows["full"][4] == "0" and float(rows["h2o"][4]) > 0 and float(rows["h2o"][7].replace(",", "")) > 0
    assert rows["full"][8] == "1.000 |" and float(rows["h2o"][8].rstrip(" |")) > 0  # the full cache's bytes / these
    assert "GB/s" in res.stdout
