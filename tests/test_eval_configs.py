"""The evaluation configs: the GPU ones (configs/eval-*.yaml) documented as not run here, the long CPU tables'
records kept in git; each loaded by evaluate.py's own ``--config`` path into a grid that validates (no model is
loaded), every key reaching its option."""

import subprocess
from pathlib import Path

import pytest
import yaml

from evaluate import parse_args, spec_of
from learnkv.eval import checkpoint
from learnkv.eval.checkpoint import PARTIAL, grid_identity
from learnkv.model import DEFAULT_MODEL
from learnkv.prompts import load_prompts
from conftest import scorer_for

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("eval-*.yaml"))


def test_there_are_gpu_configs_for_every_benchmark():
    tasks = {yaml.safe_load(p.read_text())["task"] for p in CONFIGS}
    assert {"gsm8k", "math500", "aime24", "chain"} <= tasks


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_is_documented_and_loads(path):
    text = path.read_text()
    assert text.startswith("# NOT RUN HERE: needs a GPU") and "LazyEviction" in text
    cfg = yaml.safe_load(text)
    args = parse_args(["--config", str(path)])  # unknown keys exit 2 here
    assert {k: str(getattr(args, k)) for k in cfg} == {k: str(v) for k, v in cfg.items()}
    spec = spec_of(args)
    assert [t.name for t in spec.tasks] == [cfg["task"]] and spec.batch_size == cfg["batch_size"]
    assert spec.tasks[0].max_new_tokens == cfg["max_new_tokens"] >= 4096 and spec.limit == cfg["limit"]
    assert spec.policies == cfg["policy"].split(",")
    assert spec.budgets and all(isinstance(b, float) and 0 < b <= 1 for b in spec.budgets)  # ratios, as LazyEviction


def test_command_line_wins_and_config_values_reach_the_task(tmp_path):
    cfg = tmp_path / "local.yaml"
    data = ROOT / "tests" / "data" / "gsm8k.jsonl"
    cfg.write_text(f"task: gsm8k\npolicy: [full, h2o]\nbudget: 0.5\ndata_file: {data}\nmax_new_tokens: 64\n")
    spec = spec_of(parse_args(["--config", str(cfg), "--budget", "0.25,32"]))
    assert spec.tasks[0].data_file == str(data) and spec.tasks[0].max_new_tokens == 64
    assert spec.policies == ["full", "h2o"] and spec.budgets == [0.25, 32]
    assert spec_of(parse_args(["--config", str(cfg)])).budgets == [0.5]  # a scalar where a list may go


def test_unknown_config_key_exits_with_one_line(tmp_path, capsys):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("task: chain\nbatchsize: 4\n")
    with pytest.raises(SystemExit) as e:
        parse_args(["--config", str(cfg)])
    assert e.value.code == 2 and "unknown option(s) batchsize" in capsys.readouterr().err


def test_accuracy_only_reaches_the_chain_task_and_only_it():
    spec = spec_of(parse_args(["--task", "chain,fidelity", "--policy", "full,h2o", "--accuracy-only"]))
    assert spec.tasks[0].accuracy_only and not hasattr(spec.tasks[1], "accuracy_only")
    assert not spec_of(parse_args(["--task", "chain", "--policy", "full"])).tasks[0].accuracy_only


def test_long_chain_table_config_asks_what_issue_13_asks():
    """configs/long-chain-smollm2.yaml is the long-task table of docs/long-chain.md: every policy, 25% and 50%, >= 32 held-out
    prompts of at least 1,000 decode steps, compared to the learned policy; it loads through --config."""
    path = ROOT / "configs" / "long-chain-smollm2.yaml"
    assert yaml.safe_load(path.read_text())["scorer"] == "runs/train/scorer"  # what `python train.py` exports
    args = parse_args(["--config", str(path), "--scorer", scorer_for(30, 3, DEFAULT_MODEL)])
    spec = spec_of(args)
    assert args.source == "chain" and spec.limit >= 32 and sorted(spec.budgets) == [0.25, 0.5]
    assert spec.tasks[0].max_new_tokens >= 1000 and args.compare == "learned" and args.prefill_policy == "snapkv"
    assert {"full", "streaming", "h2o", "tova", "snapkv", "roco", "knorm", "paged", "rkv", "lazy", "learned",
            "oracle"} <= set(spec.policies)


def test_qwen_accuracy_config_asks_what_issue_39_asks():
    """configs/chain-accuracy-qwen.yaml is issue 39's accuracy table on Qwen2.5-Coder-0.5B (docs/chain-accuracy.md):
    the full cache and the six heuristics the issue names at 25% and 50%, graded free runs of the chain task on 32
    held-out prompts; it loads through --config (the learned row runs by the same config with the Qwen scorer and pools
    by prompt id)."""
    args = parse_args(["--config", str(ROOT / "configs" / "chain-accuracy-qwen.yaml")])
    spec = spec_of(args)
    assert args.model == "qwen2.5-coder-0.5b-instruct" and spec.tasks[0].name == "chain"
    assert spec.tasks[0].accuracy_only and sorted(spec.budgets) == [0.25, 0.5] and args.prefill_policy == "snapkv"
    assert spec.batch_budgets and spec.batch_size == 8
    assert {"full", "streaming", "h2o", "tova", "snapkv", "rkv", "lazy"} == set(spec.policies) and spec.limit == 32


def _without_scorer_digest(identity: dict) -> dict:
    """A grid identity with the learned scorer named by role only (the test's stand-in artifact is not the one
    `python train.py` exports, so its path and weights digest differ)."""
    runs = [{**r, "params": {k: v for k, v in r["params"].items() if k != "scorer"}} for r in identity["runs"]]
    return {**identity, "runs": runs}


def test_qwen_gsm8k_config_asks_what_issue_39_item_3_asks():
    """configs/gsm8k-accuracy-qwen.yaml: the 100 GSM8K test items shipped offline, graded by math-verify, on Qwen at
    25% and 50% of the final length, the learned policy (round-1 Qwen scorer) against the full cache and six
    heuristics, compared with learned; it loads through --config without the network."""
    args = parse_args(["--config", str(ROOT / "configs" / "gsm8k-accuracy-qwen.yaml")])
    spec = spec_of(args)
    task = spec.tasks[0]
    assert args.model == "qwen2.5-coder-0.5b-instruct" and task.name == "gsm8k" and task.source == "gsm8k"
    assert len(task.items()) == 100 == spec.limit and task.max_new_tokens == 512
    assert sorted(spec.budgets) == [0.25, 0.5] and args.prefill_policy == "snapkv" and spec.batch_budgets
    assert set(spec.policies) == {"full", "learned", "rkv", "h2o", "snapkv", "tova", "lazy", "streaming"}
    learned = next(r for r in spec.runs if r.name == "learned")
    assert learned.params["scorer"] == "docs/results/train-qwen/round-1/scorer" and spec.compare == "learned"


def test_qwen_chain_fidelity_config_is_the_accuracy_tables_subset_teacher_forced():
    """configs/chain-fidelity-qwen.yaml, issue 39's fidelity column: the accuracy table's first 8 prompts (same
    source, split, seed and chain settings), its policies, budgets, prefill compression and slack, teacher-forced
    (the fidelity task: KL along the full cache's output), compared with learned."""
    fid = parse_args(["--config", str(ROOT / "configs" / "chain-fidelity-qwen.yaml")])
    acc = parse_args(["--config", str(ROOT / "configs" / "chain-accuracy-qwen.yaml")])
    f_spec, a_spec = spec_of(fid), spec_of(acc)
    task, chain = f_spec.tasks[0], a_spec.tasks[0]
    assert task.name == "fidelity" and task.source == "chain" and task.split == "test"
    # the fidelity task loads the chain source with its default settings: the chain task's, so the same prompts
    settings = dict(n_problems=chain.n_problems, n_facts=chain.n_facts, linked_share=chain.linked_share,
                    fact_share=chain.fact_share)
    assert load_prompts("chain", n=8, seed=0, split="test") == load_prompts("chain", n=8, seed=0, split="test", **settings)
    assert task.max_new_tokens == chain.max_new_tokens and f_spec.limit == 8 and a_spec.batch_size % 8 == 0
    assert fid.model == acc.model and fid.prefill_policy == acc.prefill_policy and fid.slack == acc.slack
    assert sorted(f_spec.budgets) == sorted(a_spec.budgets) and f_spec.batch_budgets and f_spec.compare == "learned"
    assert set(f_spec.policies) == set(a_spec.policies) | {"learned"}
    assert fid.scorer == "docs/results/train-qwen/round-1/scorer"


def _flat(tree: dict, prefix: str = "") -> dict:
    """A nested config as {"train.label": value, ...}."""
    out = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})  # {}: no leaf
    return out


def test_qwen_ablation_changes_one_setting_per_scorer():
    """configs/ablation-qwen.yaml, issue 39 item 1: each variant scorer was trained on the baseline's traces with
    exactly the one change its name says (its kept config.yaml against the baseline's, `out_dir` aside; r2 is the
    baseline's second round), and they are compared with the baseline on validation prompts, paired."""
    args = parse_args(["--config", str(ROOT / "configs" / "ablation-qwen.yaml")])
    spec = spec_of(args)
    task = spec.tasks[0]
    assert task.name == "fidelity" and task.split == "validation" and spec.compare == "learned"
    kept = ROOT / "docs" / "results" / "ablation-qwen-scorers"
    assert args.model == "qwen2.5-coder-0.5b-instruct" and ROOT / args.scorer == kept / "baseline" / "scorer"
    base = _flat(yaml.safe_load((kept / "baseline" / "config.yaml").read_text()))
    assert base["train.content"] and base["train.label"] == "future_out" and base["rounds"] == 1
    change = {"nocontent": {"train.content": False}, "attnv": {"train.label": "future_attnv"},
              "m25": {"train.membership_budget": [0.25]},
              # a second round: collected under round 1's scorer (the baseline, retrained in r2's out_dir)
              "r2": {"rounds": 2, "trace_dir": "runs/traces-qwen-round2", "collect.policy": "learned",
                     "collect.policy_params.scorer": "runs/train-qwen-r2/round-1/scorer"}}
    variants = [r.params["scorer"] for r in spec.runs if r.name == "learned" and r.label != "learned"]
    assert sorted(Path(v).parent.name for v in variants) == sorted(change)
    for v in variants:
        cfg = _flat(yaml.safe_load((ROOT / v).parent.joinpath("config.yaml").read_text()))
        differ = {k: cfg.get(k) for k in set(cfg) | set(base) if cfg.get(k) != base.get(k)}
        assert {k: x for k, x in differ.items() if k != "out_dir"} == change[Path(v).parent.name]


GLOBAL_SCORER = ROOT / "docs" / "results" / "allocation-fidelity-smollm2" / "learned" / "scorer-global"


@pytest.mark.parametrize("config, kept, changed", [
    # issue 42 point 3: one change, the prompt sources (GSM8K + chain instead of gsm_symbolic)
    ("train-global-mix-smollm2.yaml", "allocation-unseen-smollm2/scorer-global-mix", {"collect.sources"}),
    # issue 42's goal: the ablation's longer, more varied traces (docs/ablations.md) under the content gate
    ("train-global-chain-smollm2.yaml", "allocation-decode-smollm2/scorer-global-chain",
     {"collect.sources", "collect.prompts", "collect.max_new_tokens", "collect.decisions_per_prompt"}),
])
def test_a_retrained_global_scorer_changes_only_what_its_config_says(config, kept, changed):
    """The allocating scorer of the decode table (`GLOBAL_SCORER`) retrained with the changes its config's header
    names and no other, and the kept scorer is that config's output."""
    from learnkv.config import load_config, to_dict

    new = _flat(to_dict(load_config(ROOT / "configs" / config)))
    single = _flat(yaml.safe_load((GLOBAL_SCORER / "train-config.yaml").read_text()))
    differ = {k for k in set(new) | set(single) if new.get(k) != single.get(k)}
    assert differ - {"out_dir", "trace_dir", "wandb.mode"} == changed
    assert single["collect.sources"] == ["gsm_symbolic"] and new["train.objective"] == "global"
    kept_config = _flat(yaml.safe_load((ROOT / "docs" / "results" / kept / "train-config.yaml").read_text()))
    assert kept_config == new  # the kept scorer is this config's


def test_the_10_percent_round_changes_only_the_budgets_of_the_on_policy_pipeline():
    """configs/train-global-onpolicy-10-smollm2.yaml is the on-policy global pipeline with the tight states added:
    traces at 10% too and the membership loss at 10% of the pool too, nothing else; its kept scorer is that
    pipeline's round 2 (traces under round 1's scorer at `allocation=global`)."""
    from learnkv.config import load_config, to_dict

    base = _flat(to_dict(load_config(ROOT / "configs" / "train-global-onpolicy-smollm2.yaml")))
    new = _flat(to_dict(load_config(ROOT / "configs" / "train-global-onpolicy-10-smollm2.yaml")))
    differ = {k for k in set(new) | set(base) if new.get(k) != base.get(k)}
    assert differ - {"out_dir", "trace_dir"} == {"collect.budgets", "train.membership_budget"}
    assert new["collect.budgets"] == [0.1, *base["collect.budgets"]]
    assert new["train.membership_budget"] == [0.1, *base["train.membership_budget"]]
    kept = _flat(yaml.safe_load((ROOT / "docs" / "results" / "allocation-decode-smollm2" / "scorer-global-onpolicy-10"
                                 / "train-config.yaml").read_text()))
    assert kept["collect.policy"] == "learned" and kept["collect.policy_params.allocation"] == "global"
    assert {k: v for k, v in kept.items() if not k.startswith("collect.policy") and k != "trace_dir"} == \
        {k: v for k, v in new.items() if not k.startswith("collect.policy") and k != "trace_dir"}


def test_the_long_allocation_columns_at_25_and_50_percent_ask_what_point_5_asks():
    """configs/allocation-long-chain-25-50-smollm2.yaml: the 10% column's prompts, length and regime at 25% and 50%,
    the best learned row of the 10% column under `global` (the baseline) and `uniform`, the heuristics under
    `uniform`, `head` and `global`, and the oracle under both; each policy compresses its own prompt."""
    ten = spec_of(parse_args(["--config", str(ROOT / "configs" / "allocation-long-chain-smollm2.yaml")]))
    args = parse_args(["--config", str(ROOT / "configs" / "allocation-long-chain-25-50-smollm2.yaml")])
    spec = spec_of(args)
    assert args.source == "chain" and args.prefill_policy is None and list(spec.budgets) == [0.25, 0.5]
    assert spec.tasks == ten.tasks and spec.limit == ten.limit == 16 and spec.seed == ten.seed
    labels = args.policy.split(",")
    scorer = "learned:scorer=docs/results/allocation-decode-smollm2/scorer-global-chain"
    assert args.compare == f"{scorer}:allocation=global" and {args.compare, scorer} <= set(labels)
    for name in ("h2o", "snapkv"):
        assert {name, f"{name}:allocation=head", f"{name}:allocation=global"} <= set(labels)
    assert {"tova", "tova:allocation=global", "oracle", "oracle:allocation=global"} <= set(labels)


def test_the_unseen_source_is_the_decode_tables_prompts():
    """configs/allocation-unseen-smollm2.yaml runs the mix scorer on the decode table's own gsm_symbolic prompts, a
    source it never saw (the mix has none of it)."""
    from learnkv.config import load_config

    assert "gsm_symbolic" not in load_config(ROOT / "configs" / "train-global-mix-smollm2.yaml").collect.sources
    args = parse_args(["--config", str(ROOT / "configs" / "allocation-unseen-smollm2.yaml")])
    unseen = spec_of(args)
    table = spec_of(parse_args(["--task", "fidelity", "--budget", "0.1,0.25", "--batch-budgets", "--limit", "32",
                                "--batch-size", "32", "--max-new-tokens", "256", "--policy", "h2o"]))
    assert args.source == "gsm_symbolic" and unseen.tasks == table.tasks  # the decode table's prompts
    assert unseen.budgets == table.budgets and unseen.limit == table.limit


def test_the_long_allocation_column_asks_what_issue_42_point_5_asks():
    """configs/allocation-long-chain-smollm2.yaml, issue 42 point 5's long regime: >= 16 held-out chain prompts of
    >= 1,000 decode steps at 10%, the global scorer under `global` (the baseline) and `uniform`, the heuristics under
    `uniform`, `head` and `global`, and the oracle under both; each policy compresses its own prompt."""
    args = parse_args(["--config", str(ROOT / "configs" / "allocation-long-chain-smollm2.yaml")])
    spec = spec_of(args)
    assert args.source == "chain" and spec.limit >= 16 and list(spec.budgets) == [0.1] and args.prefill_policy is None
    assert spec.tasks[0].name == "fidelity" and spec.tasks[0].max_new_tokens >= 1000
    labels = args.policy.split(",")
    scorer = "learned:scorer=docs/results/allocation-fidelity-smollm2/learned/scorer-global"
    assert args.compare == f"{scorer}:allocation=global" and {args.compare, scorer} <= set(labels)
    for name in ("h2o", "snapkv"):
        assert {name, f"{name}:allocation=head", f"{name}:allocation=global"} <= set(labels)
    assert {"roco", "tova", "rkv", "oracle", "oracle:allocation=global"} <= set(labels)


@pytest.mark.parametrize("name", ["long-chain-smollm2.yaml", "chain-accuracy-qwen.yaml", "gsm8k-accuracy-qwen.yaml",
                                  "chain-fidelity-qwen.yaml", "ablation-qwen.yaml",
                                  "allocation-unseen-smollm2.yaml", "allocation-long-chain-smollm2.yaml",
                                  "allocation-long-chain-25-50-smollm2.yaml", "allocation-qwen-chain.yaml"])
def test_a_long_table_keeps_its_records_in_git_and_they_are_a_run_of_its_config(name):
    """The long tables outlive a machine (runs/ is not kept between sessions): their configs write into docs/results/,
    whose records git keeps and whose batch references (~1 GB a prompt) it ignores. Committed records must be a run of
    the config as written: otherwise the next run sets them aside and starts the table over."""
    path = ROOT / "configs" / name
    cfg = yaml.safe_load(path.read_text())
    out = ROOT / cfg["output"]
    assert out.parent == ROOT / "docs" / "results"
    kept_out = ["reference-0123456789abcdef.safetensors", "earlier-20260101-000000/partial.jsonl",
                "finished/earlier-20260101-000000/results.json"]  # a batch's reference; what a rerun set aside
    kept_in = [PARTIAL, "results.json", "finished/results.json"]
    ignored = [subprocess.run(["git", "check-ignore", "-q", str(out / f)], cwd=ROOT).returncode
               for f in kept_out + kept_in]
    if ignored[0] != 128:  # 128: not a git checkout (an unpacked sdist): nothing to check
        assert ignored == [0] * len(kept_out) + [1] * len(kept_in)
    partial = out / PARTIAL
    if not partial.is_file():
        return
    committed, entries, _, torn = checkpoint._read(partial)  # the file's own reader: a damaged file is "damaged"
    assert committed != "damaged" and entries and not torn
    extra = ["--scorer", scorer_for(30, 3, DEFAULT_MODEL)] if "scorer" in cfg else []
    args = parse_args(["--config", str(path), *extra])
    identity = grid_identity(spec_of(args), args.model or DEFAULT_MODEL)
    assert _without_scorer_digest(committed) == _without_scorer_digest(identity)
