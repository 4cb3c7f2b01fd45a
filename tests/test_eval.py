"""evaluate.py and learnkv.eval: metrics on hand-made cases, the full cache and large budgets as exact ceilings,
the agreement-length shortcut against a real free run, tasks, records and files, bad input, and the CI command."""

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import params_for, random_ids
from learnkv import POLICIES, generate, make_policy
from learnkv.settings import resolve_budget
from learnkv.eval import TASKS, Sample, Task, build_spec, evaluate, make_task, markdown_table, write_results
from learnkv.eval.report import summary_table
from learnkv.eval import metrics as M
from learnkv.eval.run import paired, run_config
from learnkv.eval.stats import bootstrap_ci, paired_difference, ratio_of_sums
from learnkv.settings import batch_groups

ROOT = Path(__file__).resolve().parents[1]
FIDELITY = ("kl", "top1_agreement", "ppl_ratio", "attention_recall", "agreement_length", "generated_tokens")
COST = ("peak_kv_bytes", "kv_share", "kept_share", "tokens_per_s", "eviction_share")
TIMING = ("tokens_per_s", "eviction_share")


def samples(n=2, length=30):
    return [Sample.from_ids(random_ids(length, seed=10 + i)[0], id=f"ids/{i}") for i in range(n)]


def by_key(records):
    return {(r["policy"], r["budget"], r["task"]): r["metrics"] for r in records}


# -- metrics on hand-made cases --------------------------------------------------------------------------------


def test_kl_of_known_distributions():
    p = torch.tensor([[0.5, 0.5], [0.9, 0.1]], dtype=torch.float64).log()
    q = torch.tensor([[0.25, 0.75], [0.9, 0.1]], dtype=torch.float64).log() + 3.0  # a shift changes nothing
    kl = M.kl_divergence(p, q)
    assert kl[0].item() == pytest.approx(0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75), abs=1e-9)
    assert kl[1].item() == pytest.approx(0.0, abs=1e-9)
    assert M.kl_divergence(q, p)[0].item() == pytest.approx(0.25 * math.log(0.5) + 0.75 * math.log(1.5), abs=1e-9)


def test_top1_and_perplexity_ratio_known_answers():
    full = torch.tensor([[0.5, 0.25, 0.25], [0.25, 0.5, 0.25], [0.1, 0.1, 0.8], [0.6, 0.3, 0.1]]).log()
    budget = torch.tensor([[0.25, 0.5, 0.25], [0.25, 0.5, 0.25], [0.1, 0.1, 0.8], [0.6, 0.3, 0.1]]).log()
    assert M.top1_agreement(full, budget) == 0.75
    targets = torch.tensor([0, 1])
    assert M.perplexity(full[:2], targets) == pytest.approx(2.0)  # both targets at p = 0.5
    assert M.perplexity(budget[:2], targets) == pytest.approx(math.sqrt(4 * 2))  # p = 0.25 then 0.5
    assert M.ppl_ratio(full[:2], budget[:2], targets) == pytest.approx(math.sqrt(8) / 2)
    with pytest.raises(ValueError, match="same shape"):
        M.kl_divergence(full, budget[:2])


def test_agreement_length_known_answers():
    assert M.agreement_length([1, 2, 3, 4], [1, 2, 5, 4]) == 2
    assert M.agreement_length([1, 2, 3], [9, 2, 3]) == 0
    assert M.agreement_length([1, 2, 3], [1, 2, 3]) == 3
    assert M.agreement_length([1, 2, 3], [1, 2]) == 2


def test_attention_recall_of_a_known_mask():
    attn = torch.tensor([[[0.1, 0.2, 0.7, 0.0], [0.4, 0.3, 0.2, 0.1]]])  # [H=1, Q=2, K=4]
    visible = torch.tensor([[[True, False, True, False], [False, True, True, True]]])
    assert M.attention_recall(attn, visible)[0].tolist() == pytest.approx([0.8, 0.6])
    assert M.attention_recall(attn, torch.ones_like(visible))[0].tolist() == pytest.approx([1.0, 1.0])
    # kept positions per query (-1 = padding, ignored) plus the query's own token
    mask = M.visible_mask([torch.tensor([[0, -1]]), torch.tensor([[1, 2]])], queries=[2, 3], n_keys=4)
    assert mask.tolist() == visible.tolist()


def test_step_recall_counts_what_was_kept_plus_the_query():
    attn = torch.tensor([[0.1, 0.2, 0.7, 0.0], [0.4, 0.3, 0.2, 0.1]])  # [H=2, K=4], the query at position 2
    kept = torch.tensor([[0, -1], [1, 3]])  # -1 = a padding or dead slot
    assert M.step_recall(attn, kept, query=2) == pytest.approx(((0.1 + 0.7) + (0.3 + 0.2 + 0.1)) / 2)


def _one_cache_recall(attention, kept, query):  # the per-layer computation the tracker ran before, one [H, K] at a time
    H, K = attention.shape
    visible = torch.zeros(H, K + 1, dtype=torch.bool)
    visible.scatter_(1, torch.where((kept >= 0) & (kept < K), kept, K), True)
    visible = visible[:, :K]
    visible[:, query] = True
    return float(M.attention_recall(attention, visible).mean())


@pytest.mark.parametrize("layers,heads,keys,slots", [(30, 3, 1700, 700), (4, 2, 33, 9), (1, 5, 8, 8)])
def test_step_recalls_of_stacked_layers_equal_each_layer_alone(layers, heads, keys, slots):
    """Every layer in one call gives, bit for bit, what each layer gives alone (fp16 attention as the reference
    stores it; kept sets with dead slots, and positions past the step's keys)."""
    g = torch.Generator().manual_seed(layers)
    attention = torch.rand(layers, heads, keys, generator=g).softmax(-1).half()
    kept = torch.randint(-1, keys + 3, (layers, heads, slots), generator=g)
    query = keys - 2
    together = M.step_recalls(attention, kept, query).tolist()
    assert together == [_one_cache_recall(attention[i], kept[i], query) for i in range(layers)]
    assert M.step_recall(attention[0], kept[0], query) == together[0]


# -- intervals over prompts -------------------------------------------------------------------------------------


def test_bootstrap_interval_of_a_known_sample():
    values = [0.0, 1.0] * 10  # mean 0.5; the sd of a resampled mean is 0.5 / sqrt(20) = 0.112
    lo, hi = bootstrap_ci(values)
    assert lo < 0.5 < hi and (hi - lo) / 2 == pytest.approx(1.96 * 0.5 / math.sqrt(20), rel=0.15)
    assert bootstrap_ci([0.3, None, 0.3]) == [0.3, 0.3] and bootstrap_ci([None]) is None
    assert bootstrap_ci(values) == bootstrap_ci(values)  # seeded


def test_paired_difference_cancels_what_prompts_share():
    base = [0.1, 0.5, 0.9, 0.3, 0.7, 0.2, 0.8, 0.4]  # prompts differ a lot ...
    better = [b - 0.01 for b in base]  # ... a policy is better by exactly 0.01 on each
    d = paired_difference(better, base)
    assert d["mean_diff"] == pytest.approx(-0.01) and d["ci95"] == pytest.approx([-0.01, -0.01])
    assert d["excludes_zero"] and d["n"] == 8
    unpaired = bootstrap_ci(better)  # the intervals of the two means overlap: only pairing separates them
    assert unpaired[0] < sum(base) / len(base) < unpaired[1]
    noise = paired_difference([b + (0.02 if i % 2 else -0.02) for i, b in enumerate(base)], base)
    assert not noise["excludes_zero"]
    assert paired_difference([None, 0.2], [0.1, None]) is None


def test_ratio_of_sums_weights_units_by_their_totals():
    # a slow unit (10 vs 5) and fast ones (1 vs 1): the totals' ratio, not the mean of the units' ratios (1.2)
    pairs = [(10.0, 5.0)] + [(1.0, 1.0)] * 4
    ratio, lo, hi = ratio_of_sums(pairs)
    assert ratio == pytest.approx(14 / 9) and lo < ratio < hi and (ratio, lo, hi) == ratio_of_sums(pairs)  # seeded
    assert ratio_of_sums([(2.0, 1.0)] * 8) == (2.0, 2.0, 2.0)
    jittered = [(1.0 + (0.1 if i % 2 else -0.1), 1.0) for i in range(40)]
    wide, narrow = ratio_of_sums(jittered[:8]), ratio_of_sums(jittered)  # more units, a narrower interval
    assert wide[2] - wide[1] > narrow[2] - narrow[1] > 0


# -- the full cache and large budgets are exact ceilings --------------------------------------------------------


def test_full_scores_perfectly_at_any_budget(tiny):
    spec = build_spec("full", "4,0.25,0.9,500", "fidelity", max_new_tokens=12)
    records = evaluate(tiny, None, spec, samples=samples())
    assert len(records) == 4
    for r in records:
        m = r["metrics"]
        assert m["kl"] == 0.0 and m["top1_agreement"] == 1.0 and m["attention_recall"] == 1.0
        assert m["kl_ci95"] == [0.0, 0.0] and m["n_prompts"] == 2 and r["per_prompt"]["kl"] == [0.0, 0.0]
        assert m["ppl_ratio"] == 1.0 and m["agreement_length"] == 12
        assert m["kv_share"] == 1.0 and m["kept_share"] == 1.0 and m["budget_tokens"] is None
        assert m["eviction_share"] == 0.0


@pytest.mark.parametrize("policy", list(POLICIES))
def test_budget_at_least_length_equals_full(tiny, policy):
    new = 10
    items = samples(length=24)
    scorer = params_for(policy, 2).get("scorer")
    spec = build_spec(f"full,{policy}", [24 + new], "fidelity", scorer=scorer, max_new_tokens=new)
    got = by_key(evaluate(tiny, None, spec, samples=items))
    full, ours = got["full", 34, "fidelity"], got[policy, 34, "fidelity"]
    assert ours["kl"] == pytest.approx(0.0, abs=1e-6)
    assert ours["top1_agreement"] == 1.0 and ours["attention_recall"] == pytest.approx(1.0)
    assert ours["ppl_ratio"] == pytest.approx(1.0, abs=1e-5)
    assert full["agreement_length"] == new
    assert ours["agreement_length"] == (None if policy == "oracle" else new)  # the oracle replays: not measured
    assert ours["peak_kv_bytes"] == full["peak_kv_bytes"] and ours["kv_share"] == 1.0


def test_evicting_policies_lose_fidelity_and_oracle_is_the_headroom(tiny):
    spec = build_spec("streaming,h2o,tova,knorm,oracle", "0.5", "fidelity", max_new_tokens=16)
    got = {r["policy"]: r["metrics"] for r in evaluate(tiny, None, spec, samples=samples(length=40))}
    for name in ("streaming", "h2o", "tova", "knorm"):
        m = got[name]
        assert m["kl"] > 1e-3 and m["attention_recall"] < 1.0 and m["budget_tokens"] == 28  # half of 40 + 16
        assert m["kv_share"] == pytest.approx(40 / 55)  # the peak is the 40-token prefill, before compression
        assert got["oracle"]["kl"] < m["kl"] and got["oracle"]["attention_recall"] > m["attention_recall"]
    assert got["oracle"]["agreement_length"] is None  # it replays the full-cache output


@pytest.mark.parametrize("policy,budget", [("streaming", 16), ("h2o", 14), ("tova", 12), ("snapkv", 20), ("lazy", 36),
                                           ("learned", 14)])
def test_agreement_length_equals_a_separate_free_run(tiny, policy, budget):
    """Read off the forced run, agreement length must equal what a free-running greedy budgeted decode gives."""
    new = 24
    params = params_for(policy, 2)
    spec = build_spec(policy, [budget], "fidelity", scorer=params.get("scorer"), max_new_tokens=new)
    lengths = []
    for sample in samples(n=3, length=30):
        reported = evaluate(tiny, None, spec, samples=[sample])[0]["metrics"]["agreement_length"]
        full = generate(tiny, input_ids=sample.input_ids, policy="full", max_new_tokens=new).tokens[0].tolist()
        free = generate(tiny, input_ids=sample.input_ids, policy=policy, budget=budget, max_new_tokens=new,
                        policy_params=params).tokens[0].tolist()
        assert reported == M.agreement_length(full, free)
        lengths.append(reported)
    assert min(lengths) < new  # the budget bites: the check is not vacuous


@pytest.mark.parametrize("policy", ["h2o", "learned"])
def test_block_granularity_is_what_generate_does_in_block_mode(tiny, policy):
    """--granularity block: every run evicts whole blocks shared by all layers and heads, exactly as
    `generate(granularity="block")` does, and differs from token mode (the flag is not ignored)."""
    new, budget, block = 20, 24, 8
    params = params_for(policy, 2)
    sample = samples(n=1, length=30)[0]
    task = make_task("fidelity", max_new_tokens=new, granularity="block", block_size=block)
    kept = []
    generate(tiny, input_ids=sample.input_ids, policy=policy, budget=budget, max_new_tokens=new, policy_params=params,
             granularity="block", block_size=block, observer=lambda c: kept.append([la.positions[0] for la in c.layers]))
    for per_layer in kept[1:]:
        positions = torch.stack(per_layer)  # [layers, H, T]: one decision for every layer and KV head
        assert (positions == positions[0, 0]).all()
    assert task.options()["granularity"] == "block"
    spec = lambda g: build_spec(policy, [budget], "fidelity", scorer=params.get("scorer"), max_new_tokens=new,  # noqa
                                granularity=g, block_size=block)
    got = evaluate(tiny, None, spec("block"), samples=[sample])[0]
    assert got["config"]["task_options"]["granularity"] == "block"
    if policy == "learned":  # the record names the scorer's weights, not only the folder retraining overwrites
        manifest = json.loads((Path(params["scorer"]) / "manifest.json").read_text())
        assert got["config"]["scorer"] == {"path": params["scorer"], "weights_sha256": manifest["weights_sha256"]}
        assert len(manifest["weights_sha256"]) == 64
    else:
        assert got["config"]["scorer"] is None
    assert got["config"]["task_options"]["block_size"] == block
    full = generate(tiny, input_ids=sample.input_ids, policy="full", max_new_tokens=new).tokens[0].tolist()
    free = generate(tiny, input_ids=sample.input_ids, policy=policy, budget=budget, max_new_tokens=new,
                    policy_params=params, granularity="block", block_size=block).tokens[0].tolist()
    assert got["metrics"]["agreement_length"] == M.agreement_length(full, free)
    token_mode = evaluate(tiny, None, spec("token"), samples=[sample])[0]["metrics"]
    assert token_mode["attention_recall"] != got["metrics"]["attention_recall"]


def test_budget_too_small_for_a_prompt_fails_before_any_decode(tiny, monkeypatch):
    """A fraction resolves per prompt: 25% of a 30 + 10 token run is at most 10 tokens, too few for paged's two
    protected blocks (the first prompt, 140 + 10 tokens, fits). The whole grid fails at once, naming the prompt."""
    from learnkv.eval.tasks.fidelity import Fidelity

    def no_decode(*args, **kwargs):
        raise AssertionError("decoded before the budgets were checked")

    monkeypatch.setattr(Fidelity, "reference_batch", no_decode)
    spec = build_spec("full,h2o,paged", "0.9,0.25", "fidelity", max_new_tokens=10)
    with pytest.raises(ValueError, match=r"fidelity prompt ids/1 \(30 prompt tokens\), budget 0.25 = 10 tokens, "
                                         r"policy 'paged'.*do not fit in a budget of 10 tokens"):
        evaluate(tiny, None, spec, samples=[*samples(n=1, length=140), *samples(n=2, length=30)[1:]])


def test_blind_prefill_fails_before_any_decode_or_takes_a_prefill_policy(tiny, monkeypatch):
    """lazy on prompts over the budget: refused up front; with --prefill-policy the grid runs."""
    spec = build_spec("full,lazy", "12", "fidelity", max_new_tokens=6)
    with pytest.raises(ValueError, match=r"prompt ids/0 .* policy 'lazy': policy 'lazy' observes nothing at the "
                                         r"prefill"):
        evaluate(tiny, None, spec, samples=samples(n=1))
    spec = build_spec("full,lazy", "12", "fidelity", max_new_tokens=6, prefill_policy="snapkv:window=4")
    got = evaluate(tiny, None, spec, samples=samples(n=1))
    assert got[1]["config"]["prefill_policy"] == "snapkv:window=4" and got[0]["config"]["prefill_policy"] is None
    assert got[1]["metrics"]["kl"] > 0


def test_policy_items_with_parameters_are_rows_of_their_own(tiny):
    spec = build_spec("h2o,lazy,lazy:window=5,lazy:variant=paper:window=5", "24", "fidelity", max_new_tokens=16)
    records = evaluate(tiny, None, spec, samples=samples(n=1, length=20))
    assert [r["policy"] for r in records] == ["h2o", "lazy", "lazy:window=5", "lazy:variant=paper:window=5"]
    params = [r["config"]["policy_params"] for r in records]
    assert params[1]["window"] == 3 and params[2]["window"] == 5 and params[3]["variant"] == "paper"  # default: 24 // 8
    assert [r["config"]["policy_name"] for r in records] == ["h2o", "lazy", "lazy", "lazy"]


def test_a_record_names_its_parameters_as_given_beside_the_resolved_ones(tiny):
    spec = build_spec("full,h2o,lazy:window=5", "0.9", "fidelity", max_new_tokens=12)
    records = evaluate(tiny, None, spec, samples=samples(n=1, length=20))
    assert [r["config"]["policy_given"] for r in records] == [{}, {}, {"window": 5}]
    assert isinstance(records[1]["config"]["policy_params"]["n_recent"], int)


@pytest.mark.parametrize("policy", ["h2o", "lazy", "snapkv", "learned", "oracle", "paged:block_size=4"])
def test_batched_evaluation_equals_one_prompt_at_a_time(tiny, policy):
    """--batch-size: prompts of different lengths decode together, each with its own fraction budget, and every
    per-prompt metric is what it is alone."""
    name = policy.split(":")[0]
    items = [Sample.from_ids(random_ids(n, seed=30 + n)[0], id=f"ids/{n}") for n in (18, 25, 21)]
    spec = lambda bs: build_spec(f"full,{policy}", "0.6", "fidelity", max_new_tokens=16, batch_size=bs,  # noqa
                                 scorer=params_for(name, 2).get("scorer"))
    one, batched = (evaluate(tiny, None, spec(bs), samples=items) for bs in (1, 3))
    for a, b in zip(one, batched):
        assert a["metrics"]["budget_tokens"] == b["metrics"]["budget_tokens"]
        for metric, values in a["per_prompt"].items():
            assert b["per_prompt"][metric] == pytest.approx(values, abs=1e-4), metric
        assert a["metrics"]["kept_share"] == pytest.approx(b["metrics"]["kept_share"])


@pytest.mark.parametrize("policy", ["h2o", "lazy", "learned", "oracle", "snapkv"])
def test_slack_gives_the_same_metrics(tiny, policy):
    """--slack: dead slots compacted late change speed and peak memory, not the kept tokens, so the metrics agree to
    rounding (attention sums over masked dead slots in other places; snapkv always compacts)."""
    items = [Sample.from_ids(random_ids(n, seed=40 + n)[0], id=f"ids/{n}") for n in (18, 25)]
    spec = lambda slack: build_spec(f"full,{policy}", "0.8", "fidelity", max_new_tokens=16, batch_size=2,  # noqa
                                    slack=slack, scorer=params_for(policy, 2).get("scorer"))
    base, slack = (evaluate(tiny, None, spec(s), samples=items) for s in (0, 5))
    for a, b in zip(base, slack):
        for metric, values in a["per_prompt"].items():
            assert b["per_prompt"][metric] == pytest.approx(values, abs=1e-5), metric
    assert slack[1]["config"]["slack"] == 5 and slack[0]["config"]["slack"] is None  # the full cache never evicts


@pytest.mark.parametrize("policy", ["h2o", "lazy"])
def test_batched_evaluation_with_a_prefill_policy_resolving_per_row(tiny, policy):
    """A prefill policy whose default depends on the budget (SnapKV's window, a quarter of small budgets) splits a
    batch into rows of equal resolution, as the decode policy does; each row's metrics are what they are alone."""
    items = [Sample.from_ids(random_ids(n, seed=30 + n)[0], id=f"ids/{n}") for n in (30, 44, 38)]
    spec = lambda bs: build_spec(f"full,{policy}", "0.5", "fidelity", max_new_tokens=16, batch_size=bs,  # noqa
                                 prefill_policy="snapkv")
    one, batched = (evaluate(tiny, None, spec(bs), samples=items) for bs in (1, 3))
    finals = [s.input_ids.shape[1] + n for s, n in zip(items, one[0]["per_prompt"]["generated_tokens"])]
    windows = {make_policy("snapkv").resolve(resolve_budget(0.5, f)).window for f in finals}
    assert len(windows) > 1  # the case this test is for: one batch, rows of different prefill windows
    task, budgets = make_task("fidelity"), [resolve_budget(0.5, f) for f in finals]
    run, prefill = (build_spec(p, "0.5").runs[0] for p in (policy, "snapkv"))
    # and they decode together (SnapKV.for_batch)
    assert batch_groups(task.eviction(run_config(run, budgets, prefill)), budgets) == [[0, 1, 2]]
    for a, b in zip(one, batched):
        for metric, values in a["per_prompt"].items():
            assert b["per_prompt"][metric] == pytest.approx(values, abs=1e-4), metric


def _count_rows(spec, monkeypatch, calls: list):
    """Record (policy, prompt ids) of every decode of ``spec``'s task."""
    task = spec.tasks[0]
    real = task.run_batch

    def run_batch(model, tok, batch, refs, cfg):
        calls.append((cfg.policy, [s.id for s in batch]))
        return real(model, tok, batch, refs, cfg)
    monkeypatch.setattr(task, "run_batch", run_batch)


@pytest.mark.parametrize("policy", ["h2o", "lazy", "snapkv", "learned", "oracle", "paged:block_size=4"])
def test_budgets_batched_as_rows_equal_one_budget_at_a_time(tiny, policy, monkeypatch):
    """--batch-budgets: a policy decodes every budget of a batch of prompts as rows of one batch (prompts x budgets,
    a fraction and a token count here), each row as alone: the same per-prompt metrics, budgets and resolved
    parameters as one budget at a time; the full cache, the same at every budget, still decodes once."""
    name = policy.split(":")[0]
    items = [Sample.from_ids(random_ids(n, seed=30 + n)[0], id=f"ids/{n}") for n in (18, 25, 21)]
    spec = lambda on: build_spec(f"full,{policy}", "0.7,30", "fidelity", max_new_tokens=16, batch_size=2,  # noqa
                                 batch_budgets=on, scorer=params_for(name, 2).get("scorer"))
    together_spec, calls = spec(True), []
    _count_rows(together_spec, monkeypatch, calls)
    apart = evaluate(tiny, None, spec(False), samples=items)
    together = evaluate(tiny, None, together_spec, samples=items)
    assert calls == [("full", ["ids/18", "ids/25"]), (name, ["ids/18", "ids/25"] * 2),
                     ("full", ["ids/21"]), (name, ["ids/21"] * 2)]
    assert [(r["policy"], r["budget"]) for r in apart] == [(r["policy"], r["budget"]) for r in together]
    for a, b in zip(apart, together):
        assert a["metrics"]["budget_tokens"] == b["metrics"]["budget_tokens"]
        assert a["config"]["policy_params"] == b["config"]["policy_params"]
        assert a["metrics"]["kept_share"] == pytest.approx(b["metrics"]["kept_share"])
        for metric, values in a["per_prompt"].items():
            assert b["per_prompt"][metric] == pytest.approx(values, abs=1e-4), metric
    assert together[1]["config"]["batch_budgets"] is True and apart[1]["config"]["batch_budgets"] is False
    with pytest.raises(ValueError, match="--batch-budgets is true or false, got 'yes'"):
        build_spec("h2o", "0.5", batch_budgets="yes")


def test_budgets_batched_as_rows_resume_only_what_is_missing(tiny, tmp_path, monkeypatch, capsys):
    """A run killed between the budgets of one batched decode (one of them written to partial.jsonl) decodes only
    the missing budget's rows again; a grid without --batch-budgets is another grid (its costs differ)."""
    from learnkv.eval.checkpoint import PARTIAL

    items = samples(n=3, length=24)
    spec = lambda on=True: build_spec("full,h2o", "0.6,0.8", "fidelity", max_new_tokens=8, batch_size=2,  # noqa
                                      batch_budgets=on)
    whole = evaluate(tiny, None, spec(), samples=items, resume_dir=tmp_path)
    lines = (tmp_path / PARTIAL).read_text().splitlines(keepends=True)
    assert json.loads(lines[0])["identity"]["batch_budgets"] is True
    assert (json.loads(lines[-1])["policy"], json.loads(lines[-1])["budget"]) == ("h2o", 0.8)
    (tmp_path / PARTIAL).write_text("".join(lines[:-1]))  # killed after h2o at 0.6 of the second batch was written
    again, calls = spec(), []
    _count_rows(again, monkeypatch, calls)
    resumed = evaluate(tiny, None, again, samples=items, resume_dir=tmp_path)
    assert calls == [("h2o", ["ids/2"])]
    for r, w in zip(resumed, whole):  # the missing row decoded alone now: as in the batch, to float rounding
        assert [r[k] for k in ("policy", "budget", "config")] == [w[k] for k in ("policy", "budget", "config")]
        for metric, values in w["per_prompt"].items():
            assert r["per_prompt"][metric] == pytest.approx(values, abs=1e-4), metric
    evaluate(tiny, None, spec(False), samples=items, resume_dir=tmp_path)
    assert "another grid (batch_budgets differ)" in capsys.readouterr().err


# -- tasks, records, files --------------------------------------------------------------------------------------


def test_records_cost_metrics_and_files(tiny, tmp_path):
    spec = build_spec("full,h2o,streaming", "0.75,40", "fidelity", max_new_tokens=8)
    records = evaluate(tiny, None, spec, samples=samples(n=2))
    assert [(r["policy"], r["budget"]) for r in records] == [
        ("full", 0.75), ("h2o", 0.75), ("streaming", 0.75), ("full", 40), ("h2o", 40), ("streaming", 40)]
    for r in records:
        assert set(r) == {"policy", "budget", "task", "metrics", "per_prompt", "config"} and r["task"] == "fidelity"
        m = r["metrics"]
        assert all(k in m and f"{k}_ci95" in m for k in FIDELITY) and all(k in m for k in COST)
        assert m["peak_kv_bytes"] > 0 and m["tokens_per_s"] > 0 and 0 <= m["eviction_share"] < 1
        assert r["config"]["n_prompts"] == 2 and r["config"]["task_options"]["max_new_tokens"] == 8
    h2o = by_key(records)["h2o", 0.75, "fidelity"]
    assert h2o["budget_tokens"] == 29 and h2o["kv_share"] == pytest.approx(30 / 37)  # ceil(.75 * 38); 29 + 1 of 37
    assert h2o["kept_share"] == pytest.approx(sum(29 / (30 + s) for s in range(8)) / 8)  # held after each pass
    pairs = paired(records, "h2o")
    assert {(p["policy"], p["budget"]) for p in pairs} == {("full", 0.75), ("streaming", 0.75), ("full", 40),
                                                            ("streaming", 40)}
    kl = next(p for p in pairs if (p["policy"], p["budget"], p["metric"]) == ("full", 0.75, "kl"))
    assert kl["mean_diff"] == pytest.approx(-h2o["kl"]) and kl["n"] == 2
    paths = write_results(records, tmp_path / "out", pairs)
    assert json.loads(paths["json"].read_text()) == json.loads(json.dumps({"records": records, "paired": pairs}))
    table = paths["table"].read_text()
    # h2o's rows: one per budget in the full table, one per budget in the headline tables
    assert table.startswith(markdown_table(records)) and table.count("\n| h2o |") == 2 + 2 and "| kl |" in table
    assert " ± " in table and "paired difference to h2o" in table
    assert len(paths["plots"]) == len(FIDELITY) + 4
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths["plots"])
    # the headline tables (what the README pastes): the chosen metrics, each row's paired difference to the baseline
    table = write_results(records, tmp_path / "headline", pairs, headline={"fidelity": ("kl", "attention_recall")})
    table = table["table"].read_text()
    assert table.endswith(summary_table(records, pairs, {"fidelity": ("kl", "attention_recall")}))
    head = table[table.index("fidelity, budget 0.75: 2 prompts"):table.index("fidelity, budget 40: 2 prompts")]
    assert "| policy | kl | attention_recall | kl − h2o | attention_recall − h2o |" in head
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in head.splitlines() if line.startswith("| ")}
    assert rows["h2o"][3:] == ["", " |"]  # the baseline has no difference to itself
    kl = next(p for p in pairs if (p["policy"], p["budget"], p["metric"]) == ("full", 0.75, "kl"))
    cell = f"{kl['mean_diff']:+.4f} [{kl['ci95'][0]:+.4f}, {kl['ci95'][1]:+.4f}]"
    assert rows["full"][3] == (f"**{cell}**" if kl["excludes_zero"] else cell)
    assert rows["full"][1] == "0.0000 ± 0.0000" and rows["h2o"][1].startswith(f"{h2o['kl']:.4f} ± ")


def _record(policy, budget, n, kl, ci):
    return {"policy": policy, "budget": budget, "task": "fidelity", "per_prompt": {"kl": [kl] * n},
            "metrics": {"kl": kl, "kl_ci95": ci, "n_prompts": n, "budget_tokens": 10.0},
            "config": {"n_prompts": n, "model": "m"}}


def test_tables_say_how_many_prompts_each_budget_has_and_mark_only_intervals_that_exclude_zero():
    """A run still going on has finished more prompts at one budget than another: the table says so per budget.
    The headline table bolds a difference exactly when its paired interval excludes zero."""
    records = [_record("a", 0.25, 16, 0.08, [0.06, 0.10]), _record("b", 0.25, 16, 0.07, [0.05, 0.09]),
               _record("a", 0.5, 8, 0.01, [0.0, 0.02]), _record("b", 0.5, 8, 0.02, [0.01, 0.03])]
    assert "(16 prompts at budget 0.25, 8 prompts at budget 0.5, model m;" in markdown_table(records)
    assert "(16 prompts, model m;" in markdown_table(records[:2])
    pairs = [{"task": "fidelity", "budget": 0.25, "policy": "b", "baseline": "a", "metric": "kl", "mean_diff": -0.01,
              "ci95": [-0.02, 0.001], "n": 16, "excludes_zero": False},
             {"task": "fidelity", "budget": 0.5, "policy": "b", "baseline": "a", "metric": "kl", "mean_diff": 0.01,
              "ci95": [0.004, 0.02], "n": 8, "excludes_zero": True}]
    table = summary_table(records, pairs)
    assert "fidelity, budget 0.25: 16 prompts, budget 10 tokens on average;" in table
    assert "| b | 0.0700 ± 0.0200 | -0.0100 [-0.0200, +0.0010] |" in table
    assert "| b | 0.0200 ± 0.0100 | **+0.0100 [+0.0040, +0.0200]** |" in table
    assert "| a | 0.0800 ± 0.0200 |  |" in table and summary_table(records, []) == ""


def test_the_bar_counts_the_tokens_of_every_decode_as_they_come(tiny, monkeypatch):
    """Evaluation's bar shows tokens decoded so far (redrawn at most every ``every_s``), counted step by step
    through `Task.on_step` in the reference and every policy's decode, and the hook is removed afterwards."""
    import io

    from tqdm import tqdm

    from learnkv.eval import run as run_module

    out = io.StringIO()
    hook = run_module.token_counter(tqdm(total=1, file=out), every_s=3600)
    for n in (2, 2, 1):
        hook(n)
    assert "tokens=" not in out.getvalue()  # not yet due
    hook(0, redraw=True)
    assert "tokens=5" in out.getvalue()
    hook(0, doing="h2o at 0.5")  # drawn at once, and kept on the later redraws
    last = out.getvalue().split("\r")[-1]
    assert "doing=h2o at 0.5" in last and "tokens=5" in last
    hook(1, redraw=True)
    last = out.getvalue().split("\r")[-1]
    assert "doing=h2o at 0.5" in last and "tokens=6" in last
    counted = []
    real = run_module.token_counter

    def recording(bar, every_s):
        inner = real(bar, every_s)
        return lambda n, **kw: (counted.append(n), inner(n, **kw))

    monkeypatch.setattr(run_module, "token_counter", recording)
    spec = build_spec("full,h2o", "0.5", "fidelity", max_new_tokens=6, batch_size=2)
    evaluate(tiny, None, spec, samples=samples(n=2, length=16))
    assert len(counted) >= 2 * 6 and sum(counted) >= 2 * 2 * 6  # the reference and h2o's forced decode, 6 steps
    assert spec.tasks[0].on_step is None


def _strip_timing(records):
    return [{**r, "metrics": {k: v for k, v in r["metrics"].items() if k not in TIMING},
             "per_prompt": r["per_prompt"]} for r in json.loads(json.dumps(records))]


def test_a_killed_evaluation_resumes_at_its_last_finished_batch(tiny, tmp_path, monkeypatch, capsys):
    """Batches finished before a crash are read back, not decoded again; the results equal an uninterrupted run's
    (timings aside); the partial file survives a torn last line."""
    from learnkv.eval import checkpoint
    from learnkv.eval.checkpoint import PARTIAL

    items = samples(n=3, length=24)
    spec = lambda: build_spec("full,h2o,lazy,learned", "0.8,28", "fidelity", max_new_tokens=8, batch_size=2,  # noqa
                              scorer=params_for("learned", 2)["scorer"])
    whole = evaluate(tiny, None, spec(), samples=items)

    decoded = []  # (prompt id, policy) of every decode
    references = []  # prompt ids of every full-cache reference decoded

    def counting(task, crash_at=None):
        real = task.run_batch
        real_reference = task.reference_batch

        def reference_batch(model, tok, batch):
            references.extend(s.id for s in batch)
            return real_reference(model, tok, batch)
        monkeypatch.setattr(task, "reference_batch", reference_batch)

        def run_batch(model, tok, batch, refs, cfg):
            if crash_at in [(s.id, cfg.policy) for s in batch]:
                raise KeyboardInterrupt
            decoded.extend((s.id, cfg.policy) for s in batch)
            return real(model, tok, batch, refs, cfg)
        monkeypatch.setattr(task, "run_batch", run_batch)

    monkeypatch.setattr(checkpoint, "KEEP_REFERENCE_BYTES", 0)  # references as large as the long table's
    first = spec()
    counting(first.tasks[0], crash_at=("ids/2", "lazy"))  # killed in the second batch, after its full and h2o runs
    tmp_path = tmp_path / "out"  # created by evaluate
    with pytest.raises(KeyboardInterrupt):
        evaluate(tiny, None, first, samples=items, resume_dir=tmp_path)
    assert {i for i, _ in decoded} == {"ids/0", "ids/1", "ids/2"}
    # the unfinished batch's reference is kept (the finished batch's was dropped)
    assert len(list(tmp_path.glob("reference-*.safetensors"))) == 1
    with open(tmp_path / PARTIAL, "a") as f:
        f.write('{"task": "fidelity", "ids": ["ids/2"], "po')  # killed while appending
    decoded.clear()
    references.clear()
    # what it has finished so far: the first batch's records, read only, nothing decoded, the file as it was
    before = (tmp_path / PARTIAL).read_bytes()
    so_far_spec = spec()
    counting(so_far_spec.tasks[0])
    so_far = evaluate(tiny, None, so_far_spec, samples=items, resume_dir=tmp_path, finished_only=True)
    assert decoded == [] and references == [] and (tmp_path / PARTIAL).read_bytes() == before
    assert [(r["policy"], r["budget"]) for r in so_far] == [(r["policy"], r["budget"]) for r in whole]
    for r, w in zip(so_far, whole):
        assert r["config"]["prompt_ids"] == ["ids/0", "ids/1"] and r["metrics"]["n_prompts"] == 2
        assert {m: v for m, v in r["per_prompt"].items() if m not in TIMING} == {
            m: v[:2] for m, v in w["per_prompt"].items() if m not in TIMING}
    with pytest.raises(ValueError, match="another grid"):  # read only: another grid's file is not moved
        evaluate(tiny, None, build_spec("full", "0.5", "fidelity", max_new_tokens=8, batch_size=2), samples=items,
                 resume_dir=tmp_path, finished_only=True)
    with pytest.raises(ValueError, match="does not exist"):
        evaluate(tiny, None, spec(), samples=items, resume_dir=tmp_path / "none", finished_only=True)
    checkpoint.open_partial(tmp_path / "started", checkpoint.grid_identity(spec(), None))  # nothing finished yet
    with pytest.raises(ValueError, match="no batch of 2 prompts is finished yet"):
        evaluate(tiny, None, spec(), samples=items, resume_dir=tmp_path / "started", finished_only=True)
    assert (tmp_path / PARTIAL).read_bytes() == before
    again = spec()
    counting(again.tasks[0])
    resumed = evaluate(tiny, None, again, samples=items, resume_dir=tmp_path, progress=True)
    # left: h2o at the second budget, lazy and learned at both; the finished full and h2o runs are read back, and
    # so is the reference they were measured against
    assert sorted(decoded) == [("ids/2", "h2o"), *[("ids/2", "lazy")] * 2, *[("ids/2", "learned")] * 2]
    assert references == []
    assert not list(tmp_path.glob("reference-*"))  # dropped once its batch finished
    err = capsys.readouterr().err
    assert "resuming from" in err and "fidelity: 100%" in err  # the bar counts what was read back
    assert _strip_timing(resumed) == _strip_timing(whole)

    other = build_spec("full,h2o", "0.5", "fidelity", max_new_tokens=8, batch_size=2)  # another grid: start over
    evaluate(tiny, None, other, samples=items, resume_dir=tmp_path)
    err = capsys.readouterr().err
    assert "is a run of another grid (runs, budgets differ)" in err
    assert [p.name for p in tmp_path.glob("earlier-*/*")] == [PARTIAL]


def count_decodes(spec, decoded: list, references: list, monkeypatch):
    """``spec`` with its task's decodes recorded: (prompt id, policy) of every policy decode into ``decoded``, the
    prompt ids of every full-cache reference decoded into ``references``."""
    task = spec.tasks[0]
    real_run, real_reference = task.run_batch, task.reference_batch
    monkeypatch.setattr(task, "run_batch", lambda m, t, batch, refs, cfg: (
        decoded.extend((s.id, cfg.policy) for s in batch), real_run(m, t, batch, refs, cfg))[1])
    monkeypatch.setattr(task, "reference_batch", lambda m, t, batch: (
        references.extend(s.id for s in batch), real_reference(m, t, batch))[1])
    return spec


def test_a_grid_given_more_policies_resumes_and_reads_small_references_back(tiny, tmp_path, monkeypatch):
    """The same grid with more policies keeps what was finished and decodes only the new policies' runs, against
    the full-cache references it kept (small ones, as an accuracy grid's free runs); the results equal one run of
    the larger grid's (timings aside). Policies in another order are the same grid; fewer is a report, not a run."""
    from learnkv.eval import checkpoint
    from learnkv.eval.checkpoint import PARTIAL

    items = samples(n=4, length=24)
    spec = lambda policies: build_spec(policies, "0.8,28", "fidelity", max_new_tokens=8, batch_size=2)  # noqa
    out = tmp_path / "out"
    evaluate(tiny, None, spec("full,h2o"), samples=items, resume_dir=out)  # killed before its results: keep its file
    assert len(list(out.glob("reference-*.safetensors"))) == 2  # both batches' references, small: kept
    decoded, references = [], []
    bigger = count_decodes(spec("tova,full,h2o"), decoded, references, monkeypatch)
    resumed = evaluate(tiny, None, bigger, samples=items, resume_dir=out)
    assert references == [] and sorted(decoded) == sorted((f"ids/{i}", "tova") for i in range(4) for _ in range(2))
    head = json.loads((out / PARTIAL).read_text().splitlines()[0])
    assert head["identity"] == checkpoint.grid_identity(bigger, None)  # the file now names the larger grid
    whole = evaluate(tiny, None, spec("tova,full,h2o"), samples=items)
    assert _strip_timing(resumed) == _strip_timing(whole)
    checkpoint.finish(out)
    assert not list(out.glob("reference-*")) and not (out / PARTIAL).exists()  # results written: nothing kept


def test_shards_decode_one_grid_together_and_the_main_run_reads_them_back(tiny, tmp_path, monkeypatch, capsys):
    """Shards 0/2 and 1/2 decode alternate batches into their own directories; shard 1/2 started after shard 0/2
    finished decodes only its own, and shard 0/2 run again decodes nothing; the run without a shard decodes nothing,
    reads both back (its results equal one uninterrupted run's, timings aside) and removes the shards' directories.
    A shard reads a reference the main directory stored instead of decoding the full cache again."""
    from learnkv.eval import checkpoint
    from learnkv.eval.checkpoint import PARTIAL

    items = samples(n=5, length=24)  # three batches of 2, 2, 1 prompts
    spec = lambda: build_spec("full,h2o", "0.8,28", "fidelity", max_new_tokens=8, batch_size=2)  # noqa
    whole = evaluate(tiny, None, spec(), samples=items)
    decoded, references = [], []

    def counted():
        return count_decodes(spec(), decoded, references, monkeypatch)

    out = tmp_path / "out"
    left = evaluate(tiny, None, counted(), samples=items, resume_dir=out, shard=(0, 2))
    assert left == [2]  # batch 2 (ids/2, ids/3) is the other shard's
    assert sorted({i for i, _ in decoded}) == ["ids/0", "ids/1", "ids/4"] and not (out / PARTIAL).exists()
    assert (out / "shard-0-of-2" / PARTIAL).is_file()
    # the main directory holds a reference of batch 2, as a killed unsharded run leaves it: shard 1/2 reads it
    checkpoint.save_references(out, checkpoint.reference_identity(None, spec().tasks[0], ["ids/2", "ids/3"]),
                               spec().tasks[0].reference_batch(tiny, None, items[2:4]))
    decoded.clear(), references.clear()
    assert evaluate(tiny, None, counted(), samples=items, resume_dir=out, shard=(1, 2)) == []
    assert sorted({i for i, _ in decoded}) == ["ids/2", "ids/3"] and references == []
    decoded.clear()
    assert evaluate(tiny, None, counted(), samples=items, resume_dir=out, shard=(0, 2)) == [] and decoded == []
    so_far = evaluate(tiny, None, spec(), samples=items, resume_dir=out, finished_only=True)
    assert _strip_timing(so_far) == _strip_timing(whole)
    resumed = evaluate(tiny, None, counted(), samples=items, resume_dir=out)
    assert decoded == [] and references == []
    assert _strip_timing(resumed) == _strip_timing(whole)
    checkpoint.finish(out)
    assert not list(out.glob("shard-*")) and not (out / PARTIAL).exists()
    with pytest.raises(ValueError, match="resume_dir"):
        evaluate(tiny, None, spec(), samples=items, shard=(1, 2))


def test_a_grid_with_its_policies_reordered_resumes_and_says_so(tmp_path):
    """The same policies in another order are the same grid's runs (each keyed by its label): they resume, and the
    note says why the identity line was rewritten instead of naming an empty list of added policies."""
    from learnkv.eval import checkpoint
    from learnkv.eval.checkpoint import PARTIAL

    spec = lambda policies: build_spec(policies, "0.5", "fidelity", max_new_tokens=8, limit=2)  # noqa: E731
    checkpoint.open_partial(tmp_path, checkpoint.grid_identity(spec("full,h2o"), None))
    finished, note = checkpoint.open_partial(tmp_path, checkpoint.grid_identity(spec("h2o,full"), None))
    assert finished == {} and note.endswith("(the same policies, in another order)")
    assert checkpoint._read(tmp_path / PARTIAL)[0] == checkpoint.grid_identity(spec("h2o,full"), None)


@pytest.mark.parametrize("text", ["2/2", "3/2", "2", "a/b", "0/0", "-1/2", "1/2/3"])
def test_a_bad_shard_is_one_line(text, capsys, tmp_path):
    from evaluate import main

    assert main([f"--shard={text}", "--output", str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()  # refused before anything is written
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: --shard takes i/n")


def test_a_grid_given_more_prompts_decodes_only_the_added_batches(tiny, tmp_path, monkeypatch, capsys):
    """A larger --limit resumes a smaller one's partial file: its batches (keyed by prompt ids) are read back, only
    the added prompts' batches decoded; the results equal one run of the larger grid's (timings aside). A smaller
    limit after it is a report (--finished-only) on its first batches, and a larger limit with another budget is
    another grid."""
    from learnkv.eval.checkpoint import PARTIAL

    items = samples(n=4, length=24)
    spec = lambda limit, budgets="0.8,28": build_spec("full,h2o", budgets, "fidelity", max_new_tokens=8,  # noqa
                                                     batch_size=2, limit=limit)
    out = tmp_path / "out"
    evaluate(tiny, None, spec(2), samples=items, resume_dir=out)  # killed before its results: its file is kept
    decoded, references = [], []
    resumed = evaluate(tiny, None, count_decodes(spec(4), decoded, references, monkeypatch), samples=items,
                       resume_dir=out)
    assert sorted({i for i, _ in decoded}) == ["ids/2", "ids/3"] and references == ["ids/2", "ids/3"]
    assert "the grid gained prompts, --limit 2 -> 4" in capsys.readouterr().err
    assert _strip_timing(resumed) == _strip_timing(evaluate(tiny, None, spec(4), samples=items))
    first = evaluate(tiny, None, spec(2), samples=items, resume_dir=out, finished_only=True)
    assert {tuple(r["config"]["prompt_ids"]) for r in first} == {("ids/0", "ids/1")}
    evaluate(tiny, None, spec(8, "0.5"), samples=items, resume_dir=out)
    assert "is a run of another grid (budgets, limit differ)" in capsys.readouterr().err
    assert [p.name for p in out.glob("earlier-*/*")] == [PARTIAL]


def test_a_partial_file_written_before_the_resume_object_resumes(tiny, tmp_path, monkeypatch):
    """tests/data/resume-format-1 is what learnkv at 45c09ad (evaluate's resume bookkeeping inline, before
    `checkpoint.Resume`) left when killed: the grid below, killed in the second batch (ids/2) after its full and
    h2o runs at budget 0.5. It resumes: the first batch and those two runs are read back as written, the batch's
    stored reference too, and only the rest is decoded; the file is only appended to."""
    import shutil

    from learnkv.eval.checkpoint import PARTIAL

    out = tmp_path / "out"
    shutil.copytree(ROOT / "tests" / "data" / "resume-format-1", out)
    before = (out / PARTIAL).read_text()
    written = [json.loads(line) for line in before.splitlines()[1:]]
    items = [Sample.from_ids(torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(40 + k)),
                             id=f"ids/{k}") for k in range(3)]
    spec = build_spec("full,h2o,lazy", "0.5,20", "fidelity", max_new_tokens=6, batch_size=2, prefill_policy="snapkv")
    task, decoded, references = spec.tasks[0], [], []
    real_run, real_reference = task.run_batch, task.reference_batch

    def run_batch(model, tok, batch, refs, cfg):
        decoded.extend((s.id, cfg.policy) for s in batch)
        return real_run(model, tok, batch, refs, cfg)

    def reference_batch(model, tok, batch):
        references.extend(s.id for s in batch)
        return real_reference(model, tok, batch)
    monkeypatch.setattr(task, "run_batch", run_batch)
    monkeypatch.setattr(task, "reference_batch", reference_batch)
    records = evaluate(tiny, None, spec, samples=items, resume_dir=out)
    assert sorted(decoded) == [("ids/2", "h2o"), ("ids/2", "lazy"), ("ids/2", "lazy")] and references == []
    assert list(out.glob("reference-*"))  # its batch is finished, its small reference kept for added policies
    after = (out / PARTIAL).read_text()
    assert after.startswith(before) and len(after.splitlines()) == len(before.splitlines()) + 4
    by = {(r["policy"], r["budget"]): r for r in records}
    for entry in written:  # what the old code wrote is what the records hold, bit for bit
        record = by[entry["policy"], entry["budget"]]
        for i, pid in enumerate(entry["ids"]):
            k = record["config"]["prompt_ids"].index(pid)
            assert entry["metrics"][i] and all(record["per_prompt"][m][k] == v for m, v in entry["metrics"][i].items())
    assert all(r["metrics"]["n_prompts"] == 3 for r in records)


def test_finished_only_reports_each_budget_as_soon_as_a_batch_has_finished_it(tiny, tmp_path, monkeypatch,
                                                                              capsys):
    """A long grid finishes a batch's first budget hours before its second: --finished-only reports that budget
    over every batch finished at it (each record says how many prompts), and a budget no batch has finished not
    at all, with a note."""
    items = samples(n=3, length=24)
    spec = lambda: build_spec("full,h2o,lazy", "0.8,28", "fidelity", max_new_tokens=8, batch_size=2)  # noqa: E731
    whole = {(r["policy"], r["budget"]): r for r in evaluate(tiny, None, spec(), samples=items)}

    def killed_at(prompt_id: str, out):
        first = spec()
        real = first.tasks[0].run_batch

        def run_batch(model, tok, batch, refs, cfg):
            if batch[0].id == prompt_id and cfg.policy == "lazy" and 28 in cfg.budgets:
                raise KeyboardInterrupt
            return real(model, tok, batch, refs, cfg)
        monkeypatch.setattr(first.tasks[0], "run_batch", run_batch)
        with pytest.raises(KeyboardInterrupt):
            evaluate(tiny, None, first, samples=items, resume_dir=out)
        capsys.readouterr()
        return evaluate(tiny, None, spec(), samples=items, resume_dir=out, finished_only=True)

    so_far = killed_at("ids/2", tmp_path / "second")  # the second batch has its first budget, not its second
    assert [(r["policy"], r["budget"]) for r in so_far] == list(whole)
    for r in so_far:
        n = 3 if r["budget"] == 0.8 else 2
        assert r["metrics"]["n_prompts"] == n and r["config"]["prompt_ids"] == [f"ids/{i}" for i in range(n)]
        assert {m: v for m, v in r["per_prompt"].items() if m not in TIMING} == {
            m: v[:n] for m, v in whole[r["policy"], r["budget"]]["per_prompt"].items() if m not in TIMING}
    assert "no batch" not in capsys.readouterr().err

    so_far = killed_at("ids/0", tmp_path / "first")  # not one batch has its second budget yet
    assert [(r["policy"], r["budget"]) for r in so_far] == [k for k in whole if k[1] == 0.8]
    assert all(r["metrics"]["n_prompts"] == 2 for r in so_far)
    assert "no batch of prompts is finished at budget 28 yet" in capsys.readouterr().err


def test_finished_only_reports_some_policies_of_a_grid_over_the_batches_they_finished(tiny, tmp_path, monkeypatch,
                                                                                     capsys):
    """A long grid decodes a batch policy after policy: --finished-only with fewer of its policies reports those
    over every batch each of them finished (the others' unfinished runs do not hold them back); a policy the grid
    does not have is another grid."""
    items = samples(n=3, length=24)
    grid = lambda policies: build_spec(policies, "0.8", "fidelity", max_new_tokens=8, batch_size=2)  # noqa: E731
    whole = {r["policy"]: r for r in evaluate(tiny, None, grid("full,h2o,lazy"), samples=items)}
    first = grid("full,h2o,lazy")
    real = first.tasks[0].run_batch

    def run_batch(model, tok, batch, refs, cfg):
        if batch[0].id == "ids/2" and cfg.policy == "lazy":
            raise KeyboardInterrupt
        return real(model, tok, batch, refs, cfg)
    monkeypatch.setattr(first.tasks[0], "run_batch", run_batch)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        evaluate(tiny, None, first, samples=items, resume_dir=out)
    partial = out / "partial.jsonl"
    before = partial.read_bytes()
    some = evaluate(tiny, None, grid("full,h2o"), samples=items, resume_dir=out, finished_only=True)
    assert [r["policy"] for r in some] == ["full", "h2o"] and partial.read_bytes() == before
    for r in some:
        assert r["metrics"]["n_prompts"] == 3 and r["config"]["prompt_ids"] == ["ids/0", "ids/1", "ids/2"]
        assert {m: v for m, v in r["per_prompt"].items() if m not in TIMING} == {
            m: v for m, v in whole[r["policy"]]["per_prompt"].items() if m not in TIMING}
    every = evaluate(tiny, None, grid("full,h2o,lazy"), samples=items, resume_dir=out, finished_only=True)
    assert all(r["metrics"]["n_prompts"] == 2 for r in every)  # the whole grid: the batches every policy finished
    with pytest.raises(ValueError, match="another grid"):
        evaluate(tiny, None, grid("full,tova"), samples=items, resume_dir=out, finished_only=True)


def test_fidelity_validation_split_is_what_train_validates_on(smollm2_tokenizer):
    """--split validation tunes on the prompts train.py validates on, never on the test prompts results report."""
    from learnkv.config import PipelineConfig
    from learnkv.scorer.report import validation_prompts

    tok = smollm2_tokenizer
    test = make_task("fidelity").load(tok, 4, seed=0)
    val = make_task("fidelity", split="validation").load(tok, 4, seed=0)
    assert [s.id for s in val] == [p.id for p in validation_prompts(PipelineConfig(), tok, 4)]
    assert not {s.id for s in val} & {s.id for s in test}


def test_deterministic_with_seed(tiny):
    spec = build_spec("h2o,random", "0.5", "fidelity", max_new_tokens=10, seed=3)
    strip = lambda rs: [{k: v for k, v in r["metrics"].items() if k not in TIMING} for r in rs]  # noqa: E731
    a = evaluate(tiny, None, spec, samples=samples(length=40))
    b = evaluate(tiny, None, spec, samples=samples(length=40))
    assert strip(a) == strip(b)
    assert a[1]["config"]["policy_params"]["seed"] == 3  # --seed seeds the random policy too


class DigitTokenizer:
    """Decodes token ids to space-separated numbers, so the tiny model 'answers' with numbers."""

    eos_token_id = None
    pad_token_id = 0

    def batch_decode(self, tokens, skip_special_tokens=True):
        return [" ".join(str(int(t)) for t in row) for row in tokens]


def test_reasoning_grades_answers_and_agreement(tiny):
    tok = DigitTokenizer()
    items = samples(n=3, length=40)
    for s in items:  # gold = the full cache's own final number, so full scores 1.0
        s.answer = tok.batch_decode(generate(tiny, input_ids=s.input_ids, max_new_tokens=12).tokens)[0].split()[-1]
    items[0].answer = "-1"  # ... except on one prompt
    spec = build_spec("full,streaming,oracle", "10", "reasoning", max_new_tokens=12)
    got = by_key(evaluate(tiny, tok, spec, samples=items))
    assert got["full", 10, "reasoning"]["accuracy"] == pytest.approx(2 / 3)
    assert got["full", 10, "reasoning"]["answer_agreement"] == 1.0
    streaming = got["streaming", 10, "reasoning"]
    assert streaming["answer_agreement"] < 1.0 and streaming["accuracy"] <= streaming["answer_agreement"]
    assert got["oracle", 10, "reasoning"]["accuracy"] is None  # replayed: says nothing
    # the regime: the full cache's output length, mean and median, in every row (12 unless a row stops at EOS)
    for key in got:
        assert got[key]["generated_tokens"] == got[key]["generated_tokens_median"] == 12.0


def test_needle_accuracy_by_length_and_depth(tiny):
    tok = DigitTokenizer()
    items = samples(n=2, length=40)
    for i, s in enumerate(items):
        s.answer = tok.batch_decode(generate(tiny, input_ids=s.input_ids, max_new_tokens=6).tokens)[0].split()[2]
        s.meta = {"context_tokens": [64, 128][i], "depth": 0.5}
    task = make_task("needle", max_new_tokens=6, context_tokens=(64, 128), depths=(0.5,))
    assert task.metric_names() == ("accuracy", "accuracy@64", "accuracy@128", "accuracy@d0.5")
    spec = build_spec("full", "8", "needle", max_new_tokens=6, context_tokens=(64, 128), depths=(0.5,))
    m = evaluate(tiny, tok, spec, samples=items)[0]["metrics"]
    assert m["accuracy"] == 1.0 and m["accuracy@64"] == 1.0 and m["accuracy@128"] == 1.0 and m["accuracy@d0.5"] == 1.0


def test_a_task_is_one_registered_class(tiny, monkeypatch):
    from dataclasses import dataclass

    @dataclass
    class Length(Task):
        name = "length"
        metrics = ("new_tokens",)

        def run_batch(self, model, tokenizer, samples, refs, run):
            r = self.decode_batch(model, tokenizer, samples, run)
            return [{"new_tokens": float(n)} for n in r.new_tokens], r

    monkeypatch.setitem(TASKS, "length", Length)
    records = evaluate(tiny, None, build_spec("h2o", "16", "length", max_new_tokens=5), samples=samples(n=1))
    assert records[0]["task"] == "length" and records[0]["metrics"]["new_tokens"] == 5.0


# -- bad input: one line, exit 2, before the model loads ----------------------------------------------------------

BAD = [
    (["--task", "nope"], "unknown task 'nope'; known tasks: fidelity, reasoning, needle"),
    (["--budget", "1.5"], "budget fraction must be in (0, 1]"),
    (["--budget", "0"], "budget must be >= 1"),
    (["--budget", "0.25,many"], "budget must be a token count or a fraction"),
    (["--policy", "nope"], "unknown policy 'nope'"),
    (["--policy", "lazy:window=abc"], "policy 'lazy': parameter window must be an integer or unset (none)"),
    (["--policy", "h2o,lazy:windw=8"], "policy 'lazy' has no parameter windw; its parameters: "),
    (["--policy", "lazy:window"], "each ':' part takes NAME=VALUE, got 'window'"),
    (["--compare", "knorm"], "--compare 'knorm' is not one of the policies"),
    (["--prefill-policy", "lazy"], "--prefill-policy: policy 'lazy' cannot be a prefill policy"),
    (["--batch-size", "0"], "--batch-size must be a number of prompts >= 1"),
    (["--slack", "-1"], "--slack must be a number of dead slots >= 0"),
    (["--config", "no/such.yaml"], "--config 'no/such.yaml' does not exist"),
    (["--policy", "full,learned"], "policy 'learned' needs a scorer artifact: --scorer PATH"),
    (["--policy", "learned", "--scorer", "no/such/scorer"], "scorer artifact 'no/such/scorer' does not exist"),
    (["--policy", "paged", "--budget", "8"], "do not fit in a budget of 8 tokens"),
    (["--limit", "0"], "--limit must be a number of prompts >= 1"),
    (["--limit", "four"], "argument --limit: invalid int value"),
    (["--task", "reasoning", "--max-new-tokens", "0"], "max_new_tokens must be an integer >= 1"),
    (["--task", "needle", "--depths", "0.5,2"], "needle depths must be fractions in [0, 1]"),
    (["--task", "gsm8k", "--data-file", "no/such.jsonl"], "gsm8k: data file no/such.jsonl does not exist"),
    (["--task", "chain", "--max-new-tokens", "0"], "chain: max_new_tokens must be an integer >= 1"),
    (["--granularity", "page"], "argument --granularity: invalid choice: 'page'"),
    (["--split", "train"], "argument --split: invalid choice: 'train'"),
    (["--split", "all"], "fidelity split must be one of test, validation, got 'all'"),
    (["--granularity", "block", "--block-size", "0"], "block size must be an integer >= 1"),
    (["--finished-only"], "/nonexistent/out holds no running or killed evaluation (partial.jsonl) to report on"),
]


@pytest.mark.parametrize("args,message", BAD)
def test_bad_input_one_line_before_loading(args, message, monkeypatch, capsys):
    import evaluate as cli

    import learnkv.model

    def no_load(*a, **k):
        raise AssertionError("the model must not load on bad input")

    monkeypatch.setattr(learnkv.model, "load_model", no_load)
    try:
        code = cli.main([*args, "--model", "./no/such/model", "--output", "/nonexistent/out"])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err


def test_bad_input_subprocess_exit_code_and_no_traceback():
    out = subprocess.run([sys.executable, "evaluate.py", "--task", "fidelity,nope"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == ("error: unknown task 'nope'; known tasks: fidelity, reasoning, needle, chain, gsm8k, math500, "
                          "aime24, champ\n")


# -- the real model -----------------------------------------------------------------------------------------------

# the decode regime: budgets that hold these prompts (114-174 tokens), eviction while decoding
# budgets below some prompts, so the prefill policy compresses those (LazyEviction observes nothing at the prefill);
# a token policy, the lagged one and a block policy: the command's path end to end (every policy decodes the real
# model in tests/test_real_model.py)
CI_COMMAND = ["evaluate.py", "--policy", "full,h2o,lazy,paged", "--budget", "128,160",
              "--task", "fidelity", "--limit", "4", "--max-new-tokens", "64", "--batch-size", "4", "--compare", "lazy",
              "--prefill-policy", "snapkv"]


@pytest.mark.slow
def test_ci_command_writes_results_table_and_plots(tmp_path):
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, *CI_COMMAND, "--output", str(tmp_path)], capture_output=True, text=True,
                         cwd=ROOT, timeout=1800)  # a hang guard, not a speed test
    elapsed = time.perf_counter() - t0
    print(f"CI evaluate command: {elapsed:.0f} s")
    assert out.returncode == 0, out.stderr[-2000:]
    results = json.loads((tmp_path / "results.json").read_text())
    records = results["records"]
    assert len(records) == 4 * 2 and {p["baseline"] for p in results["paired"]} == {"lazy"}
    for r in records:
        assert all(k in r["metrics"] for k in FIDELITY + COST + ("full_kv_bytes",))
        assert r["config"]["n_prompts"] == 4 and r["config"]["model"] == "smollm2-135m-instruct"
        assert r["config"]["prefill_policy"] == (None if r["policy"] == "full" else "snapkv")
    full = by_key(records)["full", 128, "fidelity"]
    assert full["kl"] == 0.0 and full["top1_agreement"] == 1.0 and full["attention_recall"] == 1.0
    for policy in ("h2o", "lazy"):
        m = by_key(records)[policy, 128, "fidelity"]
        assert m["kl"] > 0 and m["attention_recall"] < 1.0 and m["kv_share"] < 1.0 and m["kept_share"] < 1.0
    assert (tmp_path / "results.md").read_text() in out.stdout
    assert len(list(tmp_path.glob("fidelity_*.png"))) == len(FIDELITY) + 4
    # into a pipe (a log file) the bar still reports, at its start and end at least
    assert "fidelity: 100%" in out.stderr and "tok_s=" in out.stderr, out.stderr[-2000:]
    # and what is under way, from before its prefill: the reference, then each policy at its budgets
    assert "doing=full-cache reference of 4 prompts" in out.stderr and "doing=lazy at 128" in out.stderr


@pytest.mark.slow
def test_reasoning_and_needle_on_the_real_model(smollm2):
    model, tok = smollm2
    spec = build_spec("full,h2o", "0.5", "reasoning,needle", limit=1, max_new_tokens=24, context_tokens=(384,),
                      depths=(0.5,))
    got = by_key(evaluate(model, tok, spec, model_name="smollm2"))
    assert got["full", 0.5, "reasoning"]["answer_agreement"] == 1.0
    assert got["full", 0.5, "reasoning"]["accuracy"] in (0.0, 1.0)
    assert got["h2o", 0.5, "reasoning"]["kept_share"] < 0.6
    needle_full, needle_h2o = got["full", 0.5, "needle"], got["h2o", 0.5, "needle"]
    assert needle_full["accuracy"] == 1.0 and needle_full["accuracy@384"] == 1.0  # SmolLM2 finds it in 384 tokens
    assert needle_h2o["accuracy"] in (0.0, 1.0) and needle_h2o["budget_tokens"] > 150


def test_stored_references_come_back_equal_or_not_at_all(tmp_path):
    """A batch's reference round-trips through its file bit for bit (tensors, learnkv dataclasses, lists, dicts,
    plain values); another identity, a damaged file or an unstorable value gives None (decode it again)."""
    from learnkv.eval.checkpoint import drop_references, load_references, save_references
    from learnkv.eval.tasks.chain import ChainRun

    torch.manual_seed(0)
    refs = [ChainRun(torch.randint(0, 9, (1, 5)), torch.randn(5, 7), [torch.randn(2, 4, 9).half()] * 2, 4,
                     text="x", answers=["3", None]),
            {"text": "y", "new_tokens": 3}]  # fmt: skip
    ident = {"model": "m", "task": "chain", "options": {"a": 1}, "ids": ["p/0", "p/1"]}
    path = save_references(tmp_path, ident, refs)
    back = load_references(tmp_path, ident)
    assert isinstance(back[0], ChainRun) and back[1] == refs[1]
    a, b = back[0], refs[0]
    assert (a.prompt_len, a.text, a.answers) == (b.prompt_len, b.text, b.answers)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logits, b.logits)
    assert all(torch.equal(x, y) and x.dtype == torch.float16 for x, y in zip(a.attention, b.attention))
    assert load_references(tmp_path, {**ident, "ids": ["p/0"]}) is None  # another batch: not this file
    path.write_bytes(path.read_bytes()[:100])  # damaged
    assert load_references(tmp_path, ident) is None
    drop_references(tmp_path, ident)
    assert not path.exists()
    assert save_references(tmp_path, ident, [{"parsed": object()}]) is None  # not storable: nothing written
    assert save_references(tmp_path, ident, [None, None]) is None and not list(tmp_path.iterdir())
