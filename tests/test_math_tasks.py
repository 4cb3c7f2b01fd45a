"""Math benchmarks: hub loaders fail offline with one line, local files in the hub format load, math-verify
grades boxed and #### answers by equivalence, and CHAMP reads its PyPI package without importing it."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from conftest import random_ids
from learnkv.decode import GenerationResult, generate
from learnkv.eval import TASKS, Sample, build_spec, evaluate, make_task
from learnkv.eval.tasks.base import RunConfig
from learnkv.eval.tasks.math import champ_golds, gold_answer, grade_math, math_prompt, parse_completion

DATA = Path(__file__).resolve().parent / "data"
BENCHMARKS = {"gsm8k": ("openai/gsm8k", 3, "27"), "math500": ("HuggingFaceH4/MATH-500", 3, "\\frac{11}{12}"),
              "aime24": ("HuggingFaceH4/aime_2024", 2, "267")}

pytest.importorskip("math_verify")


class _Tok:
    """The least of a tokenizer `encode_prompts` needs: no chat template, one id per character."""

    chat_template = None
    pad_token = eos_token = "<pad>"
    padding_side = "left"

    def __call__(self, texts, return_tensors, padding, add_special_tokens):
        n = max(len(t) for t in texts)
        ids = torch.tensor([[0] * (n - len(t)) + [ord(c) % 256 for c in t] for t in texts])
        return {"input_ids": ids, "attention_mask": (ids >= 0).long()}


def result_of(texts: list[str], new_tokens: list[int]) -> GenerationResult:
    n = max(new_tokens)
    return GenerationResult(tokens=torch.zeros(len(texts), n, dtype=torch.long), texts=texts, policy="h2o",
                            budgets=None, params={}, prompt_lengths=[10] * len(texts), new_tokens=new_tokens,
                            kept_rows=[[[10] * len(texts)]],  # one pass, one layer: each row holds its prompt
                            peak_kv_bytes_rows=[0] * len(texts), full_kv_bytes_rows=[0] * len(texts),
                            prefill_s=0.0, decode_s=0.0, tokens_per_s=1.0)


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_hub_loader_fails_offline_with_one_line(name):
    hub_id = BENCHMARKS[name][0]
    with pytest.raises(ValueError) as e:
        make_task(name).items()
    message = str(e.value)
    assert "\n" not in message and hub_id in message and "--data-file" in message


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_local_file_in_the_hub_format(name):
    _, n, first_gold = BENCHMARKS[name]
    task = make_task(name, data_file=str(DATA / f"{name}.jsonl"))
    items = task.items()
    assert len(items) == n and items[0][2] == [first_gold] and items[0][0].startswith(f"{name}/")
    samples = task.load(_Tok(), limit=2, seed=0)
    assert [s.id for s in samples] == [i[0] for i in items[:2]] and samples[0].answer == first_gold
    assert samples[0].input_ids.shape[0] == 1 and samples[0].meta["golds"] == [first_gold]


def test_bad_local_files(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        make_task("gsm8k", data_file=str(tmp_path / "missing.jsonl")).items()
    with pytest.raises(ValueError, match="must be one of"):
        make_task("gsm8k", data_file=str(DATA / "gsm8k.txt")).items()
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text('{"problem": "1+1?", "answer": "2"}\n')
    with pytest.raises(ValueError, match="no field 'question'"):
        make_task("gsm8k", data_file=str(wrong)).items()
    with pytest.raises(ValueError, match="#### N"):
        gold_answer("no marker here", "hash")


def test_math_verify_grades_by_equivalence():
    assert math_prompt("What is 1+1?").endswith("\\boxed{}.")
    assert grade_math("so the total is \\boxed{27}.", "27")["correct"]
    assert grade_math("Step 1 ... #### 27", "27")["correct"]
    assert grade_math("The answer is $\\boxed{0.5}$", "\\frac{1}{2}")["correct"]
    assert grade_math("\\boxed{\\dfrac{11}{12}}", "\\frac{11}{12}")["correct"]
    assert grade_math("\\boxed{5\\sqrt 2}", "5\\sqrt{2}")["correct"]
    assert not grade_math("\\boxed{26}", "27")["correct"]
    assert not grade_math("I do not know.", "27")["correct"]
    assert grade_math("\\boxed{24}", ["C(4,1)", "24"])["correct"]  # any acceptable answer
    assert grade_math("So the answer is \\boxed{\\text{Yes}}", ["Yes"])["correct"]


def test_agreement_with_the_full_cache_answer():
    ref = parse_completion("\\boxed{\\frac{1}{2}}")
    assert grade_math("\\boxed{0.5}", "3", ref)["agreement"] is True
    assert grade_math("\\boxed{0.25}", "3", ref)["agreement"] is False
    assert grade_math("no answer", "3", [])["agreement"] is True  # neither has an answer
    assert grade_math("\\boxed{1}", "3")["agreement"] is None


def test_batches_grade_each_row_against_its_own_reference(monkeypatch):
    """reference_batch reads the full cache's answers and lengths per row; run_batch grades each row's own text
    against its golds and its reference, with the per-row budgets it was given."""
    task = make_task("gsm8k", data_file=str(DATA / "gsm8k.jsonl"))
    samples = task.load(_Tok(), 2, 0)
    golds = [s.answer for s in samples]
    runs = []

    def decode_batch(self, model, tokenizer, samples, run, **options):
        runs.append(run)
        if run.policy == "full":
            return result_of([f"... \\boxed{{{golds[0]}}}", "#### 12345"], [7, 11])
        return result_of([f"so \\boxed{{{golds[0]}}}.", "I do not know."], [3, 4])

    monkeypatch.setattr(type(task), "decode_batch", decode_batch)
    refs = task.reference_batch(None, None, samples)
    assert [r.new_tokens for r in refs] == [7, 11] and refs[1].parsed
    assert [task.final_length(s, r) for s, r in zip(samples, refs)] == [samples[0].input_ids.shape[1] + 7,
                                                                        samples[1].input_ids.shape[1] + 11]
    full, _ = task.run_batch(None, None, samples, refs, RunConfig("full", {}, [None, None]))
    assert full == [{"accuracy": 1.0, "answer_agreement": 1.0, "generated_tokens": 7.0},
                    {"accuracy": 0.0, "answer_agreement": 1.0, "generated_tokens": 11.0}]
    h2o, _ = task.run_batch(None, None, samples, refs, RunConfig("h2o", {}, [20, 30]))
    assert h2o == [{"accuracy": 1.0, "answer_agreement": 1.0, "generated_tokens": 7.0},
                   {"accuracy": 0.0, "answer_agreement": 0.0, "generated_tokens": 11.0}]  # no answer vs 12345
    assert runs[-1].budgets == [20, 30]
    oracle, _ = task.run_batch(None, None, samples, refs, RunConfig("oracle", {}, [20, 30]))
    assert all(m["accuracy"] is None and m["answer_agreement"] is None for m in oracle)


class BoxedTokenizer:
    """Decodes a row of token ids to ``\\boxed{N}``, N its first id: the tiny random model "answers"."""

    eos_token_id = None
    pad_token_id = 0

    def batch_decode(self, rows, skip_special_tokens=True):
        return [f"The answer is \\boxed{{{int(row[0])}}}." for row in rows]


def test_math_task_end_to_end_batched_on_the_tiny_model(tiny):
    """The runner on a math task: fraction budgets of the full cache's final length, the median generated length,
    and --batch-size 2 equal to one prompt at a time."""
    items = [Sample.from_ids(random_ids(n, seed=50 + n)[0], id=f"ids/{n}") for n in (20, 27, 23)]
    for s in items:  # gold: the full cache's own answer, except on the last prompt
        s.answer = str(int(generate(tiny, input_ids=s.input_ids, max_new_tokens=1).tokens[0, 0]))
    items[-1].answer = "-1"
    spec = lambda bs: build_spec("full,streaming", "0.5", "gsm8k", max_new_tokens=10, batch_size=bs)  # noqa: E731
    one, batched = (evaluate(tiny, BoxedTokenizer(), spec(bs), samples=items) for bs in (1, 2))
    full, streaming = one
    assert full["metrics"]["accuracy"] == pytest.approx(2 / 3) and full["metrics"]["answer_agreement"] == 1.0
    assert full["metrics"]["generated_tokens_median"] == 10 and full["metrics"]["n_prompts"] == 3
    assert streaming["metrics"]["budget_tokens"] == pytest.approx((15 + 19 + 17) / 3)  # ceil(.5 * (P + 10))
    for a, b in zip(one, batched):
        assert a["per_prompt"] == b["per_prompt"]


def test_registered_and_options_reach_the_task():
    for name in ("gsm8k", "math500", "aime24", "champ"):
        assert name in TASKS
    spec = build_spec("full,h2o", "0.5", "gsm8k,aime24", data_file=str(DATA / "gsm8k.jsonl"), max_new_tokens=64)
    assert [t.data_file for t in spec.tasks] == [str(DATA / "gsm8k.jsonl")] * 2
    assert spec.tasks[0].options()["max_new_tokens"] == 64


def test_champ_gold_answers():
    assert champ_golds("239", "239") == ["239"]
    assert champ_golds("@@C(10, 5)@@, or equivalently @@252@@", "C(10, 5), or equivalently 252") == ["C(10, 5)", "252"]
    assert champ_golds("Yes", "Yes") == ["Yes"]
    assert champ_golds("The sequence does not exist", "The sequence does not exist") == []  # not gradable
    assert champ_golds("98 values", "98 values") == []


@pytest.mark.skipif(importlib.util.find_spec("champ_dataset") is None, reason="champ-dataset not installed")
def test_champ_reads_the_package_without_importing_it():
    sys.modules.pop("champ_dataset", None)
    items = make_task("champ").items()
    assert "champ_dataset" not in sys.modules
    assert 150 <= len(items) <= 270 and all(golds for _, _, golds in items)
    assert len({pid for pid, _, _ in items}) == len(items) and items[0][0].startswith("champ/P_")


def test_champ_missing_package_names_the_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ValueError, match="pip install --no-deps champ-dataset"):
        make_task("champ").items()


def test_math_full_row_is_the_reference_decode(tiny, monkeypatch):
    """The full row is graded on the reference's own greedy decode and costed as it ran, not decoded again: the
    same grades and costs as decoding it (reuse off), one decode fewer per batch."""
    from learnkv.eval.tasks.math import MathTask

    items = [Sample.from_ids(random_ids(n, seed=50 + n)[0], id=f"ids/{n}") for n in (20, 27, 23)]
    for s in items:
        s.answer = str(int(generate(tiny, input_ids=s.input_ids, max_new_tokens=1).tokens[0, 0]))
    spec = lambda: build_spec("full,streaming", "0.5", "gsm8k", max_new_tokens=10, batch_size=2)  # noqa: E731
    decode_batch, policies = MathTask.decode_batch, []

    def counting(self, *args, **options):
        policies.append(args[3].policy)
        return decode_batch(self, *args, **options)

    monkeypatch.setattr(MathTask, "decode_batch", counting)
    reused = evaluate(tiny, BoxedTokenizer(), spec(), samples=items)
    assert policies == ["full", "streaming"] * 2
    monkeypatch.setattr(MathTask, "reference_run", lambda self, samples, refs: None)
    decoded = evaluate(tiny, BoxedTokenizer(), spec(), samples=items)
    assert policies[4:] == ["full", "full", "streaming"] * 2
    costs = ("budget_tokens", "peak_kv_bytes", "full_kv_bytes", "kv_share", "kept_share")
    for a, b in zip(reused, decoded):
        assert a["per_prompt"] == b["per_prompt"] and {k: a["metrics"][k] for k in costs} == \
            {k: b["metrics"][k] for k in costs}
    assert reused[0]["metrics"]["accuracy"] == 1.0 and reused[0]["metrics"]["tokens_per_s"] > 0


def test_gsm8k_reads_the_shipped_items_offline():
    """--source gsm8k: the 100 verbatim GSM8K test items shipped in a PyPI package, under the reasoning task's ids,
    each gold answer the number after its ####; a bad source, or a source and a data file, fail at once."""
    from learnkv.prompts import load_prompts

    task = make_task("gsm8k", source="gsm8k")
    items = task.items()
    shipped = load_prompts("gsm8k", None)
    assert len(items) == len(shipped) == 100 and [i for i, _, _ in items] == [p.id for p in shipped]
    assert items[0][0] == "gsm8k/0000" and all(q in p.text for (_, q, _), p in zip(items, shipped))
    assert all(golds == [p.answer] for (_, _, golds), p in zip(items, shipped))  # no comma, no decimal point
    assert make_task("gsm8k").source is None  # the hub, as before
    with pytest.raises(ValueError, match="source must be gsm8k"):
        make_task("gsm8k", source="gsm_symbolic")
    with pytest.raises(ValueError, match="not both"):
        make_task("gsm8k", source="gsm8k", data_file=str(DATA / "gsm8k.jsonl"))
