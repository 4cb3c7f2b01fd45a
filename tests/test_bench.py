"""bench/decode.py runs and writes the throughput records its README and RESULTS figures come from."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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
