"""The GPU evaluation configs (configs/eval-*.yaml): documented as not run here, keys that are evaluate.py's long
option names, and values the grid validation accepts (no model is loaded)."""

from pathlib import Path

import pytest
import yaml

from evaluate import build_parser
from learnkv.eval import build_spec

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("eval-*.yaml"))
# options the evaluate.py restructuring adds (batching, local benchmark files)
PENDING_OPTIONS = {"batch_size", "data_file"}


def long_options() -> set[str]:
    return {a.dest for a in build_parser()._actions if any(s.startswith("--") for s in a.option_strings)}


def test_there_are_gpu_configs_for_every_benchmark():
    tasks = {yaml.safe_load(p.read_text())["task"] for p in CONFIGS}
    assert {"gsm8k", "math500", "aime24", "chain"} <= tasks


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_is_documented_and_valid(path):
    text = path.read_text()
    assert text.startswith("# NOT RUN HERE: needs a GPU") and "LazyEviction" in text
    cfg = yaml.safe_load(text)
    unknown = set(cfg) - long_options() - PENDING_OPTIONS
    assert not unknown, f"{path.name}: not evaluate.py options: {sorted(unknown)}"
    spec = build_spec(cfg["policy"], str(cfg["budget"]), cfg["task"], limit=cfg.get("limit"), seed=cfg["seed"],
                      max_new_tokens=cfg["max_new_tokens"], data_file=cfg.get("data_file"))
    assert all(0 < b <= 1 for b in spec.budgets)  # ratios of the final length, as LazyEviction's
    assert spec.tasks[0].max_new_tokens >= 4096
