"""`python -m learnkv`: listing, bad input (one line, exit 2, no traceback), and a real generate run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from learnkv import POLICIES

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "learnkv", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=timeout)


def test_policies_lists_registry():
    out = run_cli("policies")
    assert out.returncode == 0
    assert out.stdout.split() == list(POLICIES)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--policy", "nope", "--budget", "8"], "unknown policy 'nope'"),
        (["--policy", "h2o", "--budget", "1.5"], "budget fraction must be in (0, 1]"),
        (["--policy", "h2o", "--budget", "0"], "budget must be >= 1"),
        (["--policy", "h2o"], "needs --budget"),
        (["--policy", "h2o", "--budget", "8", "--param", "oops"], "NAME=VALUE"),
        (["--policy", "h2o", "--budget", "8", "--slack", "-1"], "--slack must be >= 0"),
        (["--policy", "full", "--model", "./no/such/model"], "model path './no/such/model' does not exist"),
        (["--policy", "lazy", "--budget", "8", "--prefill-policy", "oracle"], "cannot be a prefill policy"),
        (["--policy", "lazy", "--budget", "8", "--param", "window=abc"], "parameter window must be an integer"),
    ],
)
def test_bad_input_one_line(args, message):
    out = run_cli("generate", "--prompt", "hi", *args)
    assert out.returncode == 2
    assert message in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_generate_prints_text_then_json(smollm2):
    out = run_cli("generate", "--policy", "lazy", "--budget", "48", "--max-new-tokens", "24", "--prompt",
                  "Count from one to twenty.", "--param", "window=8")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    assert summary["policy"] == "lazy" and summary["budget"] == 48
    assert summary["max_kept_tokens"] <= 48
    assert summary["peak_kv_bytes"] > 0 and summary["tokens_per_s"] > 0
    assert summary["params"]["window"] == 8
    assert len(lines) >= 2 and lines[0].strip()


@pytest.mark.slow
def test_generate_a_prompt_over_the_budget_needs_a_prefill_policy_for_lazy(smollm2):
    prompt = ["--prompt", "Count from one to twenty, then from twenty back to one, then name ten colours."]
    out = run_cli("generate", "--policy", "lazy", "--budget", "24", "--max-new-tokens", "12", *prompt)
    assert out.returncode == 2 and "observes nothing at the prefill" in out.stderr and "--prefill-policy" in out.stderr
    out = run_cli("generate", "--policy", "lazy", "--budget", "24", "--max-new-tokens", "12", *prompt,
                  "--prefill-policy", "snapkv:window=4", "--param", "window=4")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["prefill_policy"] == "snapkv" and summary["max_kept_tokens"] <= 24
