"""`learnkv compare`: policies paired across evaluations by prompt id, as one evaluation pairs them."""

import json

import pytest

from learnkv.__main__ import main
from learnkv.eval.compare import compare, pool
from learnkv.eval.run import paired

IDS = ["chain/s0/12", "chain/s0/22", "chain/s0/40", "chain/s0/43", "chain/s0/56", "chain/s0/94"]
KL = {"learned": [0.05, 0.07, 0.02, 0.09, 0.04, 0.06], "h2o": [0.06, 0.06, 0.05, 0.11, 0.05, 0.08],
      "new": [0.03, 0.05, 0.02, 0.07, 0.05, 0.04]}


def record(policy, ids, budget=0.25, task_options=None, params=None, prefill="snapkv", kl=None, given=None):
    """``params``: the resolved parameters; ``given``: those as given (absent from records written before)."""
    kl = kl if kl is not None else [KL[policy][IDS.index(i)] for i in ids]
    config = {"model": "smollm2-135m-instruct", "policy_name": policy.split(":")[0], "policy_params": params or {},
              "prefill_policy": prefill,
              "task_options": task_options or {"max_new_tokens": 1536, "source": "chain", "split": "test"},
              "prompt_ids": list(ids)}
    if given is not None:
        config["policy_given"] = given
    return {"policy": policy, "budget": budget, "task": "fidelity", "metrics": {"kl": sum(kl) / len(kl)},
            "per_prompt": {"kl": kl, "attention_recall": [1 - x for x in kl], "generated_tokens": [1536] * len(ids)},
            "config": config}


def write(path, records):
    path.mkdir(parents=True, exist_ok=True)
    (path / "results.json").write_text(json.dumps({"records": records, "paired": []}))
    return path


def by_policy(pairs):
    return {(p["policy"], p["metric"]): p for p in pairs}


def test_pairs_across_files_equal_the_pairs_of_one_evaluation(tmp_path):
    one = [record(p, IDS) for p in ("learned", "h2o", "new")]
    a = write(tmp_path / "a", one[:2])
    b = write(tmp_path / "b", one[2:])
    pairs, notes = compare([a, b], "learned")
    assert notes == []
    assert by_policy(pairs) == by_policy(paired(one, "learned"))
    assert by_policy(pairs)[("new", "kl")]["mean_diff"] == pytest.approx(sum(
        n - l for n, l in zip(KL["new"], KL["learned"])) / 6)


def test_values_are_matched_by_prompt_id_not_position(tmp_path):
    shuffled = [IDS[i] for i in (4, 0, 2)]  # another run's order, and only half of the prompts
    a = write(tmp_path / "a", [record("learned", IDS)])
    b = write(tmp_path / "b", [record("new", shuffled)])
    (pair,) = [p for p in compare([a, b], "learned")[0] if p["metric"] == "kl"]
    assert pair["n"] == 3
    assert pair["mean_diff"] == pytest.approx(sum(KL["new"][i] - KL["learned"][i] for i in (4, 0, 2)) / 3)


def test_batches_of_one_policy_in_several_files_pool_into_one_set_of_prompts(tmp_path):
    # a table's first batch (finished/) and a later one, and the same policy run again on a shared prompt
    a = write(tmp_path / "a", [record("learned", IDS[:3]), record("h2o", IDS[:3])])
    b = write(tmp_path / "b", [record("learned", IDS[2:]), record("h2o", IDS[3:])])
    (pair,) = [p for p in compare([a, b], "learned")[0] if p["metric"] == "kl"]
    assert pair["n"] == 6
    assert pair["mean_diff"] == pytest.approx(sum(h - l for h, l in zip(KL["h2o"], KL["learned"])) / 6)
    (pooled,) = [r for r in pool({"a": [record("h2o", IDS[:3])], "b": [record("h2o", IDS[3:])]})]
    assert list(pooled["values"]) == IDS


def test_budgets_pair_separately_and_a_budget_without_the_baseline_is_noted(tmp_path):
    a = write(tmp_path / "a", [record("learned", IDS), record("h2o", IDS), record("h2o", IDS, budget=0.5)])
    pairs, notes = compare([a], "learned")
    assert {p["budget"] for p in pairs} == {0.25}
    assert notes == ["fidelity at budget 0.5: no learned record; its 1 policies are not paired"]


@pytest.mark.parametrize("second, message", [
    (record("h2o", IDS, kl=[0.5] * 6), "differs on prompt chain/s0/12"),  # two runs under one label
    (record("h2o", IDS, params={"scorer": "other"}), "not one policy"),
    (record("h2o", IDS, prefill=None), "not one policy"),
    (record("new", IDS, task_options={"max_new_tokens": 256, "source": "chain", "split": "test"}),
     r"different regimes \(task_options differ\)"),
])
def test_what_is_not_a_pair_is_refused(tmp_path, second, message):
    a = write(tmp_path / "a", [record("learned", IDS), record("h2o", IDS)])
    b = write(tmp_path / "b", [second])
    with pytest.raises(ValueError, match=message):
        compare([a, b], "learned")


def test_a_tagged_file_pairs_one_policy_under_two_setups(tmp_path):
    """The same label under another prefill policy is refused as one policy, and pairs as two once tagged."""
    a = write(tmp_path / "a", [record("learned", IDS), record("h2o", IDS)])
    b = write(tmp_path / "b", [record("learned", IDS, prefill="learned", kl=KL["new"])])
    with pytest.raises(ValueError, match="not one policy"):
        compare([a, b], "learned")
    pairs = by_policy(compare([a, f"{b}@prefill-learned"], "learned@prefill-learned")[0])
    assert pairs[("learned", "kl")]["mean_diff"] == pytest.approx(sum(
        l - n for l, n in zip(KL["learned"], KL["new"])) / 6)
    assert pairs[("h2o", "kl")]["n"] == 6
    with pytest.raises(ValueError, match="empty tag"):
        compare([a, f"{b}@"], "learned")
    at = write(tmp_path / "x@y", [record("learned", IDS)])  # a path that exists is a path, '@' and all
    assert {p["policy"] for p in compare([at, b.parent / "a"], "learned")[0]} == {"h2o"}


def test_float_rounding_between_batchings_is_one_value(tmp_path):
    a = write(tmp_path / "a", [record("learned", IDS), record("h2o", IDS)])
    b = write(tmp_path / "b", [record("h2o", IDS, kl=[x + 1e-7 for x in KL["h2o"]])])
    assert by_policy(compare([a, b], "learned")[0]) == by_policy(compare([a], "learned")[0])


def test_bad_inputs_fail_with_one_line(tmp_path, capsys):
    a = write(tmp_path / "a", [record("learned", IDS), record("h2o", IDS)])
    (tmp_path / "torn.json").write_text('{"records": [')
    old = dict(record("h2o", IDS))
    old["config"] = {k: v for k, v in old["config"].items() if k != "prompt_ids"}
    write(tmp_path / "old", [old])
    for args, message in [
        ([str(tmp_path / "missing")], "no results.json"),
        ([str(tmp_path / "torn.json")], "not a results file"),
        ([str(tmp_path / "old")], "does not name its prompts"),
        ([str(a), "--baseline", "nope"], "no record of baseline 'nope'"),
        ([str(a), "--metric", "bleu"], "--metric bleu: not paired here"),
    ]:
        if "--baseline" not in args:
            args = [*args, "--baseline", "learned"]
        assert main(["compare", *args]) == 2
        assert message in capsys.readouterr().err


def test_cli_prints_the_paired_table_and_writes_json(tmp_path, capsys):
    a = write(tmp_path / "a", [record("learned", IDS), record("h2o", IDS)])
    b = write(tmp_path / "b", [record("new", IDS)])
    out = tmp_path / "pairs.json"
    assert main(["compare", str(a), str(b / "results.json"), "--baseline", "learned", "--metric", "kl",
                 "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "paired difference to learned (fidelity, budget 0.25" in table
    assert "| new | 6 | -0.0117 [" in table and "attention_recall" not in table
    assert {(p["policy"], p["metric"]) for p in json.loads(out.read_text())} == {
        (p, m) for p in ("h2o", "new") for m in ("kl", "attention_recall")}


def test_batches_that_resolve_their_windows_from_their_own_budgets_pool_as_one_policy(tmp_path):
    """At a fractional budget each batch resolves H2O's recent window (half its budget) from its own prompts: two
    batches of one run in two files are one policy, whether the records carry the parameters as given or (written
    before they did) only the resolved ones; a parameter that is not budget-derived still tells two setups apart."""
    old = lambda ids, **kw: record("h2o", ids, params={"n_sink": 0, "interval": 1, "block_size": 1, **kw})  # noqa
    a = write(tmp_path / "a", [record("learned", IDS), old(IDS[:3], n_recent=294)])
    b = write(tmp_path / "b", [old(IDS[3:], n_recent=314)])
    (pair,) = [p for p in compare([a, b], "learned")[0] if p["metric"] == "kl"]
    assert pair["n"] == 6
    a_given = record("h2o", IDS[:3], params={"n_recent": 294}, given={})
    assert len(pool({"a": [a_given], "b": [record("h2o", IDS[3:], params={"n_recent": 314}, given={})]})) == 1
    other = record("h2o", IDS[3:], params={"n_recent": 314}, given={"n_recent": 0.25})
    with pytest.raises(ValueError, match=r"not one policy .* \(policy_params differ\)"):
        pool({"a": [a_given], "b": [other]})
    with pytest.raises(ValueError, match=r"\(policy_params differ\)"):  # not budget-derived: two setups
        pool({"a": [old(IDS[:3], n_recent=294)], "b": [old(IDS[3:], n_recent=314, interval=4)]})
