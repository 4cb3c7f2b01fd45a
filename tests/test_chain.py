"""Chain prompts and the chain task: seeded and split like every source, gold answers that follow from the
text, answer parsing, a run whose fidelity half is exactly the fidelity task's, and batches that change nothing."""

import re

import pytest
import torch

from conftest import random_ids
from learnkv.chains import FACT_SHARE, LINKED_SHARE, N_GIVEN, N_PROBLEMS, chain_problem, final_answer, parse_answers
from learnkv.eval import Sample, build_spec, evaluate, make_task
from learnkv.decode import encode_prompts
from learnkv.eval.tasks.chain import count_by_kind, grade_chain, kind_accuracy
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
    mix = load_prompts("chain", 1, seed=0, linked_share=0.35, fact_share=0.35)[0]
    assert mix.id == "chain/s0/mix0.35-0.35/0" and mix.text != a[0].text


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
        assert set(c.facts) - {None} == {0, 1, 2, 3}
        assert c.depends[2] == 1 and c.facts[2] is not None  # Problem 3 shows both look-ups in the reply prefix


def test_the_worked_solution_is_the_asked_format_and_grades_right():
    """Every problem's reference solution copies its line, writes the looked-up values into a correct calculation,
    and parses to the gold answer; the reply prefix is the first solved problems, then the next problem's header."""
    for i in range(30):
        c = chain_problem(0, i)
        problems = dict(re.findall(r"^(Problem \d+): (.*)$", c.text, re.M))
        assert parse_answers("\n".join(c.solution), N_PROBLEMS) == list(c.answers)
        for k, block in enumerate(c.solution, start=1):
            head, work, answer = block.splitlines()
            assert head == f"Problem {k}: {problems[f'Problem {k}']}" and answer == f"Answer {k}: {c.answers[k - 1]}"
            assert eval(work.removeprefix("Work: ").replace(" = ", " == ").replace("/", "//"))  # noqa: S307
            if c.depends[k - 1] is not None:  # the earlier answer is written in, not its problem number
                assert c.answers[c.depends[k - 1] - 1] in re.findall(r"\d+", work)
        assert c.given == 3 and c.reply_prefix == "\n".join(c.solution[:3]) + "\nProblem 4:"
    assert chain_problem(0, 0, n_problems=2).given == 1  # a short chain keeps a problem to solve


@pytest.mark.parametrize("linked, fact", [(LINKED_SHARE, FACT_SHARE), (0.35, 0.35), (0.0, 0.5), (0.5, 0.0)])
def test_the_mix_of_problem_kinds_follows_the_shares(linked, fact):
    """Over 200 chains (5,400 drawn problems) each kind's share of Problems 4.. is its probability to within
    0.025 (about four standard deviations); Problem 3 is always linked and uses a fact."""
    kinds = {"linked": 0, "fact": 0, "alone": 0}
    for i in range(200):
        c = chain_problem(0, i, linked_share=linked, fact_share=fact)
        assert c.depends[2] == 1 and c.facts[2] is not None
        for dep, used in zip(c.depends[3:], c.facts[3:]):
            kinds["linked" if dep is not None else "fact" if used is not None else "alone"] += 1
    total = sum(kinds.values())
    for kind, share in (("linked", linked), ("fact", fact), ("alone", 1 - linked - fact)):
        assert abs(kinds[kind] / total - share) < 0.025, (kind, kinds)


def test_bad_chain_sizes():
    with pytest.raises(ValueError, match="n_problems"):
        chain_problem(0, 0, n_problems=1)
    with pytest.raises(ValueError, match="n_facts"):
        make_task("chain", n_facts=99)
    with pytest.raises(ValueError, match="shares"):
        make_task("chain", linked_share=0.7, fact_share=0.5)
    with pytest.raises(ValueError, match="shares"):
        chain_problem(0, 0, linked_share=-0.1)


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


def test_grading_skips_the_given_problems():
    """The completion starts inside Problem given + 1; only the problems after the given ones count."""
    text = (" Zoe has 5. How many?\nWork: 5 = 5\nAnswer 3: 5\n\nProblem 4: ...\nWork: 5 * 2 = 10\nAnswer: 10\n")
    assert parse_answers(text, 4, first=3) == [None, None, "5", "10"]
    g = grade_chain(text, ["1", "2", "5", "11"], reference=["7", "2", "5", "10"], given=2)
    assert g["graded"] == 2 and g["correct"] == 1 and g["answered"] == 2 and g["agreement"] == 1.0
    assert not g["final_correct"]
    assert parse_answers("Work: 2 + 2 = 4\nAnswer: 4", 3, first=2) == [None, "4", None]


def test_grading_counts_right_answers_by_kind():
    """Counts by kind are over the graded problems only; a kind the prompt lacks has no accuracy (None), not 0."""
    text = " ...\nAnswer 2: 5\nProblem 3: ...\nAnswer 3: 9\nProblem 4: ...\nAnswer 4: 1\nProblem 5:\nAnswer 5: 8\n"
    gold, kinds = ["1", "5", "9", "2", "8"], ["fact", "fact", "linked", "fact", "alone"]
    g = grade_chain(text, gold, given=1, kinds=kinds)
    assert g["right"] == [None, True, True, False, True]
    assert g["by_kind"] == {"fact": (1, 2), "linked": (1, 1), "alone": (1, 1)}
    assert kind_accuracy(g["by_kind"]) == {"fact_accuracy": 0.5, "linked_accuracy": 1.0, "alone_accuracy": 1.0}
    no_linked = grade_chain(text, gold, given=1, kinds=["fact", "fact", "alone", "fact", "alone"])["by_kind"]
    assert no_linked["linked"] == (0, 0) and kind_accuracy(no_linked)["linked_accuracy"] is None
    assert grade_chain(text, gold, given=1)["by_kind"] is None and set(kind_accuracy(None).values()) == {None}
    assert count_by_kind(g["parsed"], gold, kinds, given=4) == {"fact": (0, 0), "linked": (0, 0), "alone": (1, 1)}
    with pytest.raises(ValueError, match="problem kinds"):
        grade_chain(text, gold, kinds=kinds[:2])


def test_an_earlier_answer_cited_in_the_work_is_not_an_answer():
    text = ("Problem 2: ...\nWork: 3 + 4 = 7\nAnswer 2: 7\nProblem 3: ...\nWork: Answer 2: 8, so 8 * 2 = 16\n"
            "Answer 3: 16\nAnswer 45: 1\nAnswer 4: 5\nWork: Answer 1: 9. 9 + 1 = 10\nAnswer: 10\n")
    # the miscopied 8 does not overwrite Problem 2's answer; a citation leaves the open block (4) open, and so
    # does an answer to a problem the chain does not have
    assert parse_answers(text, 4, first=2) == [None, "7", "16", "10"]


def test_the_reply_starts_with_the_first_problems_solved(smollm2_tokenizer):
    tok = smollm2_tokenizer
    prompt = load_prompts("chain", 1, split="test")[0]
    prefix = prompt.meta["response_prefix"]
    assert prefix == chain_problem(0, int(prompt.id.rsplit("/", 1)[1])).reply_prefix and prompt.meta["given"] == 3
    ids, mask = encode_prompts(tok, [prompt.text, "short"], reply_prefixes=[prefix, "Problem 1:"])
    text = tok.decode(ids[0])
    assert text.endswith("<|im_start|>assistant\n" + prefix) and prompt.text in text
    assert tok.decode(ids[1]).endswith("assistant\nProblem 1:")
    assert mask[1].sum() < mask[0].sum() and mask[1, 0] == 0  # left padded
    with pytest.raises(ValueError, match="reply prefixes"):
        encode_prompts(tok, [prompt.text], reply_prefixes=[])


def test_fidelity_on_chain_prompts_starts_the_reply_as_the_chain_task_does(smollm2_tokenizer):
    # `--task fidelity --source chain` is the chain task's teacher-forced half without its free-running decode
    chain = make_task("chain").load(smollm2_tokenizer, 2, seed=0)
    fidelity = make_task("fidelity", source="chain").load(smollm2_tokenizer, 2, seed=0)
    assert [s.id for s in fidelity] == [s.id for s in chain]
    assert all(torch.equal(f.input_ids, c.input_ids) for f, c in zip(fidelity, chain))
    assert smollm2_tokenizer.decode(chain[0].input_ids[0]).endswith(chain[0].meta["response_prefix"])


class AnswerTokenizer:
    """Decodes token ids to chain answer lines (``Answer k: id % 7``, one per problem), so the tiny random model
    "answers" every problem and its answers change when a budget changes its tokens."""

    eos_token_id = None
    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return "\n".join(f"Answer {k}: {int(t) % 7}" for k, t in enumerate(ids[:N_ANSWERED].tolist(), start=1))

    def batch_decode(self, rows, skip_special_tokens=True):
        return [self.decode(row) for row in rows]


N_ANSWERED = 6


def samples(n=2, lengths=(30, 30), n_problems=3, seed=20):
    out = []
    for i in range(n):
        s = Sample.from_ids(random_ids(lengths[i % len(lengths)], seed=seed + i)[0], id=f"ids/{i}")
        s.meta["answers"] = [str(k % 7) for k in range(1, n_problems + 1)]
        # kinds by problem: fact, alone, then linked on the even prompts and alone on the odd ones (none linked)
        s.meta["depends"] = [1 if k >= 3 and i % 2 == 0 else None for k in range(1, n_problems + 1)]
        s.meta["facts"] = [0 if k == 1 else None for k in range(1, n_problems + 1)]
        out.append(s)
    return out


def test_chain_fidelity_is_the_fidelity_tasks(tiny):
    """The teacher-forced half of the chain task is the fidelity task's run: same metrics, same budgets."""
    spec = build_spec("full,h2o,tova", "0.5", "chain,fidelity", max_new_tokens=12)
    records = evaluate(tiny, None, spec, samples=samples())
    got = {(r["policy"], r["task"]): r for r in records}
    for policy in ("h2o", "tova"):
        chain, fidelity = got[policy, "chain"], got[policy, "fidelity"]
        assert chain["metrics"]["budget_tokens"] == fidelity["metrics"]["budget_tokens"] == 21  # ceil(.5 * (30 + 12))
        for k in FIDELITY + ("generated_tokens",):
            assert chain["per_prompt"][k] == pytest.approx(fidelity["per_prompt"][k], rel=1e-6, abs=1e-9), k
        assert chain["metrics"]["kl"] > 0 and chain["metrics"]["generated_tokens"] == 12
        assert chain["metrics"]["generated_tokens_median"] == 12
        m = chain["metrics"]
        assert m["problem_accuracy"] == 0.0 and m["answer_agreement"] == 1.0  # no tokenizer, no text: none answered
    full = got["full", "chain"]["metrics"]
    assert full["kl"] == 0.0 and full["attention_recall"] == 1.0 and full["agreement_length"] == 12
    assert all(k in full and f"{k}_ci95" in full for k in ("problem_accuracy", "final_accuracy", "answer_agreement"))


def test_chain_grades_the_free_run(tiny, monkeypatch):
    """Evicting policies are graded on their own free-running text; full on the reference's; oracle not at all."""
    from learnkv.eval.tasks.chain import Chain

    task = make_task("chain", max_new_tokens=8)
    sample = samples(1)[0]
    ref = task.reference(tiny, None, sample)
    assert ref.prompt_len == 30 and ref.final_length == 38 and task.final_length(sample, ref) == 38
    assert ref.attention[0].dtype == torch.float16 and ref.attention[0].shape[1] == 7  # decode rows only
    ref.answers, ref.text = ["1", "2", "9"], "Answer 1: 1\nAnswer 2: 2\n#### 9"
    decode_batch, free_runs = Chain.decode_batch, []

    def with_text(self, model, tokenizer, samples, run, **options):
        result = decode_batch(self, model, tokenizer, samples, run, **options)
        if "forced_tokens" not in options:
            free_runs.append(run.policy)
            result.texts = ["Answer 1: 1\nAnswer 2: 5\n#### 3"] * len(samples)
        return result

    monkeypatch.setattr(Chain, "decode_batch", with_text)
    metrics, result = task.run(tiny, None, sample, ref, "h2o", 20, {})
    assert metrics["problem_accuracy"] == pytest.approx(2 / 3) and metrics["final_accuracy"] == 1.0
    assert metrics["answer_agreement"] == pytest.approx(1 / 3) and metrics["kl"] > 0
    assert result.budgets == [20] and result.max_kept_tokens <= 21
    full, _ = task.run(tiny, None, sample, ref, "full", None, {})
    assert full["problem_accuracy"] == pytest.approx(2 / 3) and full["final_accuracy"] == 0.0  # the reference's text
    assert full["answer_agreement"] == 1.0 and full["kl"] == 0.0
    oracle, _ = task.run(tiny, None, sample, ref, "oracle", 20, {})
    assert oracle["problem_accuracy"] is None and oracle["answer_agreement"] is None and oracle["kl"] >= 0
    assert free_runs == ["h2o"]  # full's free run is the reference, oracle's the replayed reference


@pytest.mark.parametrize("policy", ["h2o", "lazy", "snapkv"])
def test_chain_batched_equals_one_prompt_at_a_time(tiny, policy):
    """--batch-size 2: prompts of different lengths (own fraction budgets) give every per-prompt chain metric,
    graded answers included, exactly as alone."""
    tok = AnswerTokenizer()
    items = samples(n=3, lengths=(18, 25, 21), n_problems=N_ANSWERED, seed=40)
    spec = lambda bs: build_spec(f"full,{policy}", "0.6", "chain", max_new_tokens=16, batch_size=bs)  # noqa: E731
    one, batched = (evaluate(tiny, tok, spec(bs), samples=items) for bs in (1, 2))
    for a, b in zip(one, batched):
        assert a["policy"] == b["policy"] and a["metrics"]["budget_tokens"] == b["metrics"]["budget_tokens"]
        for metric, values in a["per_prompt"].items():
            assert b["per_prompt"][metric] == pytest.approx(values, abs=1e-4), metric
        assert a["metrics"]["kept_share"] == pytest.approx(b["metrics"]["kept_share"])
    evicting = one[1]["per_prompt"]
    assert 0 < max(evicting["kl"]) and min(evicting["answer_agreement"]) < 1.0  # the budget changed answers
    assert one[0]["per_prompt"]["answer_agreement"] == [1.0] * 3


@pytest.mark.parametrize("policy", ["h2o", "lazy"])
def test_accuracy_only_grades_the_same_free_runs_without_the_forced_half(tiny, policy):
    """--accuracy-only: the same graded answers, agreement and lengths as the full chain task, per prompt, with no
    fidelity metric, no reference logits or attention kept, and one decode per policy instead of two."""
    from learnkv.eval.tasks.chain import Chain

    tok = AnswerTokenizer()
    items = samples(n=3, lengths=(18, 25, 21), n_problems=N_ANSWERED, seed=40)
    both = evaluate(tiny, tok, build_spec(f"full,{policy}", "0.6", "chain", max_new_tokens=16, batch_size=2),
                    samples=items)
    decode_batch, forced = Chain.decode_batch, []

    def counting(self, *args, **options):
        forced.append("forced_tokens" in options)
        return decode_batch(self, *args, **options)

    Chain.decode_batch = counting
    try:
        spec = build_spec(f"full,{policy}", "0.6", "chain", max_new_tokens=16, batch_size=2, accuracy_only=True)
        refs = spec.tasks[0].reference_batch(tiny, tok, items[:2])
        assert refs[0].logits is None and refs[0].attention is None and refs[0].answers
        forced.clear()
        alone = evaluate(tiny, tok, spec, samples=items)
    finally:
        Chain.decode_batch = decode_batch
    assert not any(forced) and len(forced) == 2 * 2  # batches [2, 1] x (reference, policy): full reuses the reference
    graded = ("problem_accuracy", "final_accuracy", "answer_agreement", "fact_accuracy", "linked_accuracy",
              "alone_accuracy", "generated_tokens")
    for a, b in zip(both, alone):
        assert a["policy"] == b["policy"] and a["metrics"]["budget_tokens"] == b["metrics"]["budget_tokens"]
        assert set(b["per_prompt"]) == set(graded)
        for metric in graded:
            assert b["per_prompt"][metric] == pytest.approx(a["per_prompt"][metric], abs=1e-9), metric
    assert min(alone[1]["per_prompt"]["answer_agreement"]) < 1.0  # the budget changed answers


COSTS = ("budget_tokens", "peak_kv_bytes", "full_kv_bytes", "kv_share", "kept_share")


def _reuse_grid(**options):
    """The issue-39 grid's shape on the tiny model: two budgets as rows of one batch, a prefill policy, slack."""
    return build_spec("full,h2o", "0.4,0.6", "chain", max_new_tokens=16, batch_size=2, accuracy_only=True,
                      prefill_policy="snapkv", slack=4, batch_budgets=True, compare="full", **options)


def _decodes(monkeypatch):
    """Record every free run `Chain.decode_batch` makes: (policy, prefill policy, its generated tokens)."""
    from learnkv.eval.tasks.chain import Chain

    decode_batch, runs = Chain.decode_batch, []

    def recording(self, model, tokenizer, samples, run, **options):
        result = decode_batch(self, model, tokenizer, samples, run, **options)
        runs.append((run.policy, run.prefill, [result.tokens[b, :n].tolist() for b, n in enumerate(result.new_tokens)]))
        return result

    monkeypatch.setattr(Chain, "decode_batch", recording)
    return runs


def test_accuracy_only_full_row_reuses_the_reference_decode(tiny, monkeypatch):
    """--accuracy-only: the full row is the reference's own greedy decode, so it is graded on it and costed as it
    ran instead of decoded again. The row decoded (reuse off) has the reference's tokens, token for token, under
    the grid's prefill policy and slack, and the row from reuse has its grades and costs exactly; only time
    differs."""
    from learnkv.eval.tasks.chain import Chain

    tok = AnswerTokenizer()
    items = samples(n=3, lengths=(18, 25, 21), n_problems=N_ANSWERED, seed=40)
    runs = _decodes(monkeypatch)
    reused = evaluate(tiny, tok, _reuse_grid(), samples=items)
    assert [policy for policy, _, _ in runs] == ["full", "h2o"] * 2  # batches [2, 1]: the reference, then h2o
    runs.clear()
    monkeypatch.setattr(Chain, "reference_run", lambda self, samples, refs: None)
    decoded = evaluate(tiny, tok, _reuse_grid(), samples=items)
    assert [policy for policy, _, _ in runs] == ["full", "full", "h2o"] * 2
    for batch in (0, 1):
        ref, row = runs[3 * batch], runs[3 * batch + 1]
        assert ref[1] is None and row[1] == ("snapkv", {}) and row[2] == ref[2]  # token for token
    assert [r["policy"] for r in reused] == [r["policy"] for r in decoded] == ["full", "h2o"] * 2
    for a, b in zip(reused, decoded):
        assert a["per_prompt"] == b["per_prompt"] and a["config"] == b["config"]  # grade for grade
        assert {k: a["metrics"][k] for k in COSTS} == {k: b["metrics"][k] for k in COSTS}
        assert a["metrics"]["tokens_per_s"] > 0
    assert min(reused[1]["per_prompt"]["answer_agreement"]) < 1.0  # h2o's budget changed answers: a real grid


@pytest.mark.parametrize("kept_free_run", [True, False])
def test_resume_reuses_a_stored_reference_or_decodes_the_full_row(tiny, monkeypatch, tmp_path, kept_free_run):
    """A run killed before it stored its first row resumes from its stored reference. One that kept its free run
    (`FreeRun`) gives the full row without a decode; one stored by an earlier version, without it, loads and the
    full row is decoded as before. Either way the records equal an uninterrupted run's but for time."""
    import dataclasses

    from learnkv.eval import checkpoint

    tok = AnswerTokenizer()
    items = samples(n=3, lengths=(18, 25, 21), n_problems=N_ANSWERED, seed=40)
    whole = evaluate(tiny, tok, _reuse_grid(), samples=items)

    def killed(self, *args):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(checkpoint.Resume, "store", killed)
        with pytest.raises(KeyboardInterrupt):
            evaluate(tiny, tok, _reuse_grid(), samples=items, resume_dir=tmp_path)
    assert (tmp_path / checkpoint.PARTIAL).read_text().count("\n") == 1  # the grid's identity, no row
    identity = checkpoint.reference_identity(None, _reuse_grid().tasks[0], ["ids/0", "ids/1"])
    stored = checkpoint.load_references(tmp_path, identity)
    assert stored[0].free_run.text == tok.decode(stored[0].tokens[0]) and stored[0].free_run.cost["seconds"] > 0
    if not kept_free_run:  # what an earlier version stored
        checkpoint.save_references(tmp_path, identity, [dataclasses.replace(ref, free_run=None) for ref in stored])
        assert checkpoint.load_references(tmp_path, identity)[0].free_run is None
    runs = _decodes(monkeypatch)
    resumed = evaluate(tiny, tok, _reuse_grid(), samples=items, resume_dir=tmp_path)
    first = [] if kept_free_run else [("full", ("snapkv", {}))]  # batch 1: the full row decoded, prefill and all
    assert [(policy, prefill) for policy, prefill, _ in runs] == first + [("h2o", ("snapkv", {})), ("full", None),
                                                                          ("h2o", ("snapkv", {}))]
    for a, b in zip(whole, resumed):
        assert a["per_prompt"] == b["per_prompt"] and {k: a["metrics"][k] for k in COSTS} == \
            {k: b["metrics"][k] for k in COSTS}


@pytest.mark.parametrize("accuracy_only", [True, False])
def test_accuracy_by_kind_in_both_modes(tiny, accuracy_only):
    """fact/linked/alone accuracy per prompt: right answers of that kind over its graded problems (they add up to
    problem_accuracy), None on a prompt with none of the kind; the mean, its interval and the paired difference to
    full are over the prompts that have the kind."""
    tok = AnswerTokenizer()
    items = samples(n=3, lengths=(18, 25, 21), n_problems=N_ANSWERED, seed=40)  # prompt 1 has no linked problem
    spec = build_spec("full,h2o", "0.6", "chain", max_new_tokens=16, batch_size=2, accuracy_only=accuracy_only,
                      compare="full")
    records = evaluate(tiny, tok, spec, samples=items)
    task = spec.tasks[0]
    assert {"fact_accuracy", "linked_accuracy", "alone_accuracy"} <= set(task.metric_names())
    for r in records:
        pp = r["per_prompt"]
        for i, sample in enumerate(items):
            counts = {"fact": 1, "alone": 1 if i % 2 == 0 else 5, "linked": 4 if i % 2 == 0 else 0}
            right = sum(counts[k] * (pp[f"{k}_accuracy"][i] or 0) for k in counts)
            assert right == pytest.approx(pp["problem_accuracy"][i] * N_ANSWERED)
            assert (pp["linked_accuracy"][i] is None) == (i == 1)
        linked = [v for v in pp["linked_accuracy"] if v is not None]
        assert r["metrics"]["linked_accuracy"] == pytest.approx(sum(linked) / 2)
        assert r["metrics"]["linked_accuracy_ci95"] is not None
    h2o = next(r for r in records if r["policy"] == "h2o")
    assert max(abs(a - b) for a, b in zip(h2o["per_prompt"]["problem_accuracy"],
                                          records[0]["per_prompt"]["problem_accuracy"])) > 0  # answers changed
    from learnkv.eval.run import paired

    pairs = {p["metric"]: p for p in paired(records, "full")}
    assert pairs["linked_accuracy"]["n"] == 2 and pairs["fact_accuracy"]["n"] == 3


def test_accuracy_only_refuses_the_oracle_before_any_decode():
    with pytest.raises(ValueError, match="accuracy_only.*oracle"):
        build_spec("full,oracle", "0.5", "chain", accuracy_only=True)
    build_spec("full,oracle", "0.5", "chain,fidelity")  # the forced reference is there: fine


@pytest.mark.slow
def test_chain_on_the_real_model(smollm2):
    model, tok = smollm2
    task = make_task("chain", max_new_tokens=24)
    sample = task.load(tok, 1, 0)[0]
    assert sample.id.startswith("chain/s0/") and sample.input_ids.shape[1] > 300
    ref = task.reference(model, tok, sample)
    assert ref.text and len(ref.answers) == len(sample.meta["answers"])
    metrics, result = task.run(model, tok, sample, ref, "h2o", 256, {})
    assert metrics["generated_tokens"] == 24 and 0 <= metrics["kl"] and metrics["attention_recall"] <= 1.0
    assert result.budget == 256 and result.max_kept_tokens <= 257


def test_bench_counts_right_answers_by_kind():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("bench_chain", Path(__file__).parents[1] / "bench" / "chain.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    c = next(c for c in (chain_problem(0, i) for i in range(50)) if any(c.depends[c.given:]))  # one with links
    meta = {"given": c.given, "answers": c.answers, "depends": c.depends, "facts": c.facts}
    parsed = list(c.answers)
    wrong = next(k for k in range(c.given, len(c.answers)) if c.depends[k] is not None)
    parsed[wrong] = None
    counts = bench.kind_counts(meta, parsed)
    assert sum(total for _, total in counts.values()) == len(c.answers) - c.given
    assert counts["linked"][0] == counts["linked"][1] - 1
    assert counts["alone"][0] == counts["alone"][1] and counts["fact"][0] == counts["fact"][1]
    assert counts["linked"][1] == sum(d is not None for d in c.depends[c.given:])


def test_bench_room_counts_the_graded_statements_that_fit():
    """bench/chain_room.py: the graded statements (after the given ones) that fit in order beside the facts and the
    reserve, counted with the tokenizer's counter (here: words)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("bench_room", Path(__file__).parents[1] / "bench" / "chain_room.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    c = chain_problem(0, 0)
    words = lambda text: len(text.split())  # noqa: E731
    graded = [words(line) for line in c.text.splitlines() if line.startswith("Problem ")][c.given:]
    facts = sum(words(line) for line in c.text.splitlines() if line.startswith("Fact "))
    room = bench.statements_that_fit(c.text, c.given, facts + 10 + sum(graded[:5]), 10, words)
    assert room == {"facts": facts, "statements": sum(graded), "graded": N_PROBLEMS - c.given, "fit": 5}
    assert bench.statements_that_fit(c.text, c.given, 10_000, 10, words)["fit"] == N_PROBLEMS - c.given


def test_bench_copies_reports_what_the_prefill_kept_of_each_statement(small):
    """bench/chain_copies.py on a tiny random model: a budget that holds the prompt keeps every statement whole;
    StreamingLLM compressing the prompt keeps the last statements whole and the middle ones not at all."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("bench_copies",
                                                  Path(__file__).parents[1] / "bench" / "chain_copies.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    model, tok = small
    sample = make_task("chain", accuracy_only=True).load(tok, 1, 0)[0]
    P = sample.input_ids.shape[1]
    whole = bench.look(model, tok, sample.id, "streaming", {}, P + 8, "streaming", slack=0, max_new_tokens=4)
    assert [p["problem"] for p in whole["problems"]] == list(range(N_GIVEN + 1, N_PROBLEMS + 1))
    assert all(p["kept"] == 1.0 for p in whole["problems"])
    assert sum(s["problems"] for s in whole["summary"].values()) == N_PROBLEMS - N_GIVEN
    window = bench.look(model, tok, sample.id, "streaming", {}, P // 3, "streaming", slack=0, max_new_tokens=4)
    kept = {p["problem"]: p["kept"] for p in window["problems"]}
    assert kept[N_PROBLEMS] == 1.0 and kept[N_PROBLEMS // 2] == 0.0
    with pytest.raises(ValueError, match="not among"):
        bench.look(model, tok, "chain/s0/nope", "streaming", {}, P, None, max_new_tokens=4)
