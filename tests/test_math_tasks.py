"""Math benchmarks: hub loaders fail offline with one line, local files in the hub format load, math-verify
grades boxed and #### answers by equivalence, and CHAMP reads its PyPI package without importing it."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from learnkv.decode import GenerationResult
from learnkv.eval import TASKS, build_spec, make_task
from learnkv.eval.tasks.math import MathReference, champ_golds, gold_answer, grade_math, math_prompt, parse_completion

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


def result_of(text: str, n_tokens: int = 5) -> GenerationResult:
    return GenerationResult(torch.zeros(1, n_tokens, dtype=torch.long), [text], "h2o", 8, {}, [], 0, 0, 0, 10, 0.0,
                            0.0, 1.0)


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


def test_run_grades_the_free_run_and_reuses_the_full_one(monkeypatch):
    task = make_task("gsm8k", data_file=str(DATA / "gsm8k.jsonl"))
    sample = task.load(_Tok(), 1, 0)[0]
    ref = MathReference(result_of("... \\boxed{27}", n_tokens=7), parse_completion("\\boxed{27}"))
    monkeypatch.setattr(type(task), "decode", lambda self, *a, **k: result_of("... \\boxed{30}"))
    full, result = task.run(None, None, sample, ref, "full", None, {})
    assert result is ref.result and full == {"accuracy": 1.0, "answer_agreement": 1.0, "generated_tokens": 7}
    h2o, _ = task.run(None, None, sample, ref, "h2o", 8, {})
    assert h2o == {"accuracy": 0.0, "answer_agreement": 0.0, "generated_tokens": 7}
    oracle, _ = task.run(None, None, sample, ref, "oracle", 8, {})
    assert oracle["accuracy"] is None and oracle["answer_agreement"] is None
    pooled = task.pool([full, h2o, {"accuracy": 1.0, "answer_agreement": 1.0, "generated_tokens": 100}])
    assert pooled["accuracy"] == pytest.approx(2 / 3) and pooled["generated_tokens"] == pytest.approx(38)
    assert pooled["generated_tokens_median"] == 7
    assert task.reference_length(sample, ref) == sample.input_ids.shape[1] + 7


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
