"""Chain prompts and the chain task: seeded and split like every source, gold answers that follow from the
text, answer parsing, and a run whose fidelity half is exactly the fidelity task's."""

import re

import pytest
import torch

from conftest import random_ids
from learnkv.chains import N_PROBLEMS, chain_problem, final_answer, parse_answers
from learnkv.eval import Sample, build_spec, evaluate, make_task
from learnkv.eval.tasks.chain import encode_chain, generated_tokens, grade_chain
from learnkv.eval.tasks.fidelity import FullRun, RecallMeter, capture_attention, recall_of_run
from learnkv.prompts import load_prompts, split_of

FIDELITY = ("kl", "top1_agreement", "ppl_ratio", "attention_recall", "agreement_length")
_LINK = re.compile(r"the answer to Problem (\d+)", re.I)


def test_chain_prompts_are_seeded_and_split_by_the_hash():
    a = load_prompts("chain", 30, seed=0)
    assert [p.id for p in a[:3]] == ["chain/s0/0", "chain/s0/1", "chain/s0/2"]
    assert [p.text for p in a] == [p.text for p in load_prompts("chain", 30, seed=0)]
    assert a[0].text != load_prompts("chain", 1, seed=1)[0].text
    assert all(p.split == split_of(p.id) for p in a)
    test = load_prompts("chain", 3, seed=0, split="test")
    assert all(p.split == "test" for p in test) and {p.id for p in test} <= {p.id for p in load_prompts("chain", 200)}
    other = load_prompts("chain", 2, seed=0, n_problems=4, n_facts=2)
    assert other[0].id == "chain/s0/p4f2/0" and len(other[0].meta["answers"]) == 4


def test_gold_answers_follow_from_the_text():
    for i in range(50):
        c = chain_problem(0, i)
        assert len(c.answers) == N_PROBLEMS and all(int(a) > 0 for a in c.answers)
        problems = re.findall(r"^Problem (\d+): (.*)$", c.text, re.M)
        assert [int(k) for k, _ in problems] == list(range(1, N_PROBLEMS + 1))
        for k, (_, body) in enumerate(problems, start=1):
            links = [int(j) for j in _LINK.findall(body)]
            assert links == ([] if c.depends[k - 1] is None else [c.depends[k - 1]])
            assert all(j <= k - 2 for j in links)  # at least one problem in between
            fact = c.facts[k - 1]
            assert ("Fact " in body) == (fact is not None)
            assert fact is None or f"Fact {'ABCDEFGH'[fact]}" in body
            if "twice" in body:
                assert int(c.answers[k - 1]) == 2 * int(c.answers[links[0] - 1])
        assert sum(d is not None for d in c.depends) >= 2 and set(c.facts) - {None} == {0, 1, 2, 3}


def test_bad_chain_sizes():
    with pytest.raises(ValueError, match="n_problems"):
        chain_problem(0, 0, n_problems=1)
    with pytest.raises(ValueError, match="n_facts"):
        make_task("chain", n_facts=99)


def test_parse_answers_and_grading():
    text = ("Dan has 14 and buys 4.\nWork: 14 + 4 = 18. Answer: 18\n\nProblem 2\n**Answer 2:** 1,024\n"
            "**Problem 3:**\nAnswer 3 = 7.0\nanswer to problem 3: 4 * 2 = 8\nProblem 4\nAnswer: none\n"
            "Answer 5: 3 (from Problem 2)\n####\n#### 40\n")
    # the reply starts inside Problem 1; "Answer:" belongs to the open block; the last line for a problem wins;
    # after "=" the result, else the first number; the last "####" line with a number is the final answer
    assert parse_answers(text, 5) == ["18", "1024", "7", None, "40"]  # "answer to problem 3:" cites, not answers
    assert parse_answers(text.replace("#### 40", ""), 5)[-1] == "3"
    assert final_answer(text) == "40" and final_answer("Answer 1: 3\n####\nProblem 2") is None
    g = grade_chain(text, ["18", "1024", "8", "5", "40"], reference=["18", "1024", "7", "6", "41"])
    assert g["correct"] == 3 and g["answered"] == 4 and g["final_correct"] and g["agreement"] == 3 / 5
    assert grade_chain("", ["1", "2"], reference=[None, None])["agreement"] == 1.0


def test_the_reply_starts_in_the_asked_format():
    from transformers import AutoTokenizer

    from learnkv.chains import RESPONSE_PREFIX
    from learnkv.model import prepare_smollm2

    tok = AutoTokenizer.from_pretrained(prepare_smollm2())
    prompt = load_prompts("chain", 1, split="test")[0]
    ids, mask = encode_chain(tok, [prompt.text, "short"])
    text = tok.decode(ids[0])
    assert text.endswith("<|im_start|>assistant\n" + RESPONSE_PREFIX) and prompt.text in text
    assert mask[1].sum() < mask[0].sum() and mask[1, 0] == 0  # left padded
    assert prompt.meta["response_prefix"] == RESPONSE_PREFIX


def test_generated_tokens_stop_at_the_first_eos():
    assert generated_tokens(torch.tensor([5, 6, 2, 2, 2]), [2]) == 3
    assert generated_tokens(torch.tensor([5, 6, 7]), [2]) == 3


def samples(n=2, length=30, n_problems=3):
    out = []
    for i in range(n):
        s = Sample.from_ids(random_ids(length, seed=20 + i)[0], id=f"ids/{i}")
        s.meta["answers"] = [str(k) for k in range(1, n_problems + 1)]
        out.append(s)
    return out


def test_row_capture_and_recall_meter_match_the_full_attention(tiny):
    from learnkv.policies.oracle import full_attention

    seq = random_ids(24, seed=3)
    full = [a[0] for a in full_attention(tiny, seq, torch.ones_like(seq))]
    rows = capture_attention(tiny, seq, first_row=10, dtype=torch.float16)
    assert [r.shape for r in rows] == [(f.shape[0], 14, 24) for f in full]
    assert all(torch.allclose(r.float(), f[:, 10:], atol=1e-3) for r, f in zip(rows, full))
    kept = [[torch.arange(0, 10 + s, 2)[None].expand(2, -1) for _ in full] for s in range(15)]
    meter = RecallMeter(rows, prompt_len=10, row_offset=10)
    for k in kept:
        meter.add(k)
    assert meter.value == pytest.approx(recall_of_run(full, kept, prompt_len=10), abs=1e-3)


def test_chain_fidelity_is_the_fidelity_tasks(tiny):
    spec = build_spec("full,h2o,tova", "0.5", "chain,fidelity", max_new_tokens=12)
    got = {(r["policy"], r["task"]): r["metrics"] for r in evaluate(tiny, None, spec, samples=samples())}
    for policy in ("h2o", "tova"):
        chain, fidelity = got[policy, "chain"], got[policy, "fidelity"]
        for k in ("kl", "top1_agreement", "ppl_ratio", "agreement_length"):
            assert chain[k] == pytest.approx(fidelity[k], rel=1e-6, abs=1e-9)
        assert chain["attention_recall"] == pytest.approx(fidelity["attention_recall"], abs=2e-3)  # fp16 rows
        assert chain["kl"] > 0 and chain["generated_tokens"] == 12
        assert chain["problem_accuracy"] == 0.0 and chain["answer_agreement"] == 1.0  # no text: nothing answered
    full = got["full", "chain"]
    assert full["kl"] == 0.0 and full["attention_recall"] == 1.0 and full["agreement_length"] == 12
    assert all(k in full for k in ("problem_accuracy", "final_accuracy", "answer_agreement", "generated_tokens"))


def test_chain_run_grades_the_free_run(tiny, monkeypatch):
    task = make_task("chain", max_new_tokens=8)
    sample = samples(1)[0]
    ref = task.reference(tiny, None, sample)
    assert ref.full.row_offset == 30 and ref.full.attention[0].dtype == torch.float16
    ref.answers = ["1", "2", "9"]
    monkeypatch.setattr(type(task), "text_of", staticmethod(lambda tok, result: "Answer 1: 1\nAnswer 2: 5\n#### 3"))
    metrics, _ = task.run(tiny, None, sample, ref, "h2o", 20, {})
    assert metrics["problem_accuracy"] == pytest.approx(2 / 3) and metrics["final_accuracy"] == 1.0
    assert metrics["answer_agreement"] == pytest.approx(1 / 3)
    oracle, _ = task.run(tiny, None, sample, ref, "oracle", 20, {})
    assert oracle["problem_accuracy"] is None and oracle["answer_agreement"] is None
    pooled = task.pool([{"generated_tokens": 1000}, {"generated_tokens": 1200}, {"generated_tokens": 5000}])
    assert pooled["generated_tokens_median"] == 1200 and pooled["generated_tokens"] == pytest.approx(2400)
    assert task.reference_length(sample, ref) == 30 + ref.full.tokens.shape[1]
    assert isinstance(ref.full, FullRun)


@pytest.mark.slow
def test_chain_on_the_real_model(smollm2):
    model, tok = smollm2
    task = make_task("chain", max_new_tokens=24)
    sample = task.load(tok, 1, 0)[0]
    assert sample.id.startswith("chain/s0/") and sample.input_ids.shape[1] > 300
    ref = task.reference(model, tok, sample)
    metrics, result = task.run(model, tok, sample, ref, "h2o", 256, {})
    assert metrics["generated_tokens"] == 24 and 0 <= metrics["kl"] and metrics["attention_recall"] <= 1.0
    assert result.budget == 256 and result.max_kept_tokens <= 257
