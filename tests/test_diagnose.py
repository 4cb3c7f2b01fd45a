"""The chain-failure diagnosis: the evicted share of the full cache's attention is right on cases computed by hand
(a policy that keeps everything: 0; StreamingLLM: everything outside its sinks and window), agrees with the fidelity
task's attention recall, and a constructed lost answer is found, located and explained by the lines it needed."""

import json

import pytest
import torch

from conftest import random_ids
from learnkv import generate
from learnkv.chains import FACT_LETTERS, chain_problem
from learnkv.eval import make_task
from learnkv.eval.diagnose import (answer_steps, diagnose, diagnose_prompt, evicted_attention,
                                   evicted_attention_batch, lines_of, table, token_pieces, token_spans)
from learnkv.eval.tasks.base import RunConfig, Sample
from learnkv.eval.tasks.chain import ChainRun, grade_chain
from learnkv.model import tiny_model
from learnkv.capture import step_attention


def _forced_setup(n_new=20, prompt_len=30):
    task = make_task("chain", max_new_tokens=n_new, accuracy_only=True)
    sample = Sample.from_ids(random_ids(prompt_len, seed=3)[0])
    return task, sample


def test_a_policy_that_keeps_everything_evicts_no_attention(tiny):
    task, sample = _forced_setup()
    cont = generate(tiny, input_ids=sample.input_ids, max_new_tokens=20).tokens
    for run in (RunConfig("full", {}, [None]), RunConfig("h2o", {}, [60])):  # 60 >= 30 + 20: nothing evicted
        views = evicted_attention(tiny, None, task, sample, cont, [1, 7, 19], run)
        assert sorted(views) == [1, 7, 19]
        for i, v in views.items():
            assert v.attention.shape == (2, 2, 30 + i) and not v.evicted.any()
            assert v.share_per_head().abs().max() == 0 and v.mass().sum() == 0


def test_streaming_evicts_the_attention_outside_its_sinks_and_window(tiny):
    """StreamingLLM at 12 tokens holds the 4 sinks and the 8 newest positions before the query: the evicted share is
    the full cache's attention (from a separate eager forward, group mean per KV head) on everything in between."""
    task, sample = _forced_setup()
    cont = generate(tiny, input_ids=sample.input_ids, max_new_tokens=20).tokens
    steps = [1, 5, 12, 19]
    views = evicted_attention(tiny, None, task, sample, cont, steps, RunConfig("streaming", {}, [12]))
    eager = tiny_model(seed=0, attn_implementation="eager")  # the same weights
    seq = torch.cat([sample.input_ids, cont], dim=1)
    with torch.no_grad():
        attn = eager(input_ids=seq, output_attentions=True).attentions  # per layer [1, 4 heads, L, L]
    for i in steps:
        q = 30 + i - 1
        evicted = torch.zeros(q + 1, dtype=torch.bool)
        evicted[4: q - 8] = True
        for layer in range(2):
            groups = attn[layer][0, :, q, : q + 1].reshape(2, 2, q + 1).mean(1)  # KV head j serves heads 2j, 2j+1
            expected = (groups * evicted).sum(-1) / groups.sum(-1)
            assert views[i].evicted[layer].equal(evicted.expand(2, -1))
            assert views[i].share_per_head()[layer] == pytest.approx(expected.double(), abs=1e-5)
        assert 0 < float(views[i].mass().sum()) == pytest.approx(float(views[i].share_per_head().mean()))


def test_evicted_share_is_one_minus_the_fidelity_tasks_attention_recall(tiny):
    """Averaged over every step, the evicted share is 1 - the fidelity task's attention recall of the same forced run
    (which stores the attention in fp16, hence the tolerance)."""
    task, sample = _forced_setup(n_new=16, prompt_len=24)
    fidelity = make_task("fidelity", max_new_tokens=16)
    ref = fidelity.reference(tiny, None, sample)
    metrics, _ = fidelity.run(tiny, None, sample, ref, "h2o", 20, {})
    views = evicted_attention(tiny, None, task, sample, ref.tokens, range(1, 16), RunConfig("h2o", {}, [20]))
    shares = [float(v.share_per_head().mean()) for v in views.values()]
    assert sum(shares) / len(shares) == pytest.approx(1 - metrics["attention_recall"], abs=2e-3)
    assert max(shares) > 0.05


@pytest.mark.parametrize("policy", ["h2o", "snapkv"])
def test_forced_runs_in_a_batch_evict_as_alone(tiny, policy):
    """Prompts of different lengths, continuations and budgets as rows of one forced batch: each row's evicted
    positions and shares are what it gets alone."""
    task = make_task("chain", max_new_tokens=14, accuracy_only=True)
    items = [Sample.from_ids(random_ids(n, seed=7 + n)[0]) for n in (22, 27)]
    conts = [generate(tiny, input_ids=s.input_ids, max_new_tokens=n).tokens for s, n in zip(items, (14, 11))]
    steps, budgets = [[2, 9, 13], [1, 10]], [18, 21]
    batched = evicted_attention_batch(tiny, None, task, items, conts, steps, RunConfig(policy, {}, budgets))
    for sample, cont, row, budget, views in zip(items, conts, steps, budgets, batched):
        alone = evicted_attention(tiny, None, task, sample, cont, row, RunConfig(policy, {}, [budget]))
        assert sorted(views) == row and any(v.evicted.any() for v in views.values())
        for i in row:
            assert views[i].evicted.equal(alone[i].evicted)
            assert views[i].share_per_head() == pytest.approx(alone[i].share_per_head(), abs=1e-6)


def test_steps_before_the_first_decode_step_are_refused(tiny):
    task, sample = _forced_setup()
    with pytest.raises(ValueError, match="steps must be"):
        evicted_attention(tiny, None, task, sample, torch.zeros(1, 4, dtype=torch.long), [0],
                          RunConfig("full", {}, [None]))


def test_lines_follow_the_newlines():
    assert lines_of(["a", "b\n", "c", "\nd", "e\n\n", "f"]) == [0, 0, 1, 2, 2, 4]


@pytest.mark.parametrize("text", ["Work: 7 * 6 = 42\nAnswer 5: 42\n",
                                  "Caf\u00e9 \u2603 costs 3\nAnswer 5: 417 \u00e9\n"])
def test_an_answers_characters_map_to_the_tokens_that_wrote_them(smollm2_tokenizer, text):
    """Token spans add up to the decoded text, by each token's own text (ASCII) or by prefixes (a character split
    over tokens); the tokens over an answer's characters decode to it."""
    tok = smollm2_tokenizer
    ids = tok(text, add_special_tokens=False)["input_ids"]
    spans = token_spans(tok, ids)
    assert spans[0][0] == 0 and spans[-1][1] == len(text) and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    start = text.index("Answer 5: ") + len("Answer 5: ")
    end = start + len(text[start:].split()[0])
    steps = answer_steps(spans, (start, end))
    assert tok.decode([ids[i] for i in steps]).strip() == text[start:end]


def _constructed(small):
    """A chain prompt whose "full cache" output is its gold solution up to two problems after the first fact problem,
    and whose "policy" output gets that fact problem wrong (everything else it wrote right)."""
    model, tok = small
    task = make_task("chain", max_new_tokens=2048, accuracy_only=True)
    sample = task.load(tok, 1, 0)[0]
    given, kinds = task.given(sample), task.kinds(sample)
    k = next(i for i in range(given, len(kinds)) if kinds[i] == "fact")
    solution = chain_problem(0, int(sample.id.rsplit("/", 1)[1])).solution
    full_text = "\n".join(solution[given: k + 3]).removeprefix(f"Problem {given + 1}:")  # short: a fast test
    ids = torch.tensor([tok(full_text, add_special_tokens=False)["input_ids"]])
    text = tok.decode(ids[0], skip_special_tokens=True)
    gold = task.gold(sample)
    ref = ChainRun(ids, None, None, sample.input_ids.shape[1], text=text,
                   answers=grade_chain(text, gold, given=given)["parsed"])
    wrong = str(int(gold[k]) + 1)
    policy_text = text.replace(f"Answer {k + 1}: {gold[k]}", f"Answer {k + 1}: {wrong}")
    return model, tok, task, sample, ref, policy_text, k


def test_a_lost_fact_answer_is_found_and_its_evicted_fact_line_carries_the_share(small):
    model, tok, task, sample, ref, policy_text, k = _constructed(small)
    P, fact = sample.input_ids.shape[1], sample.meta["facts"][k]
    run = RunConfig("streaming", {}, [64])  # the facts at the top of a ~700-token prompt are long gone
    r = diagnose_prompt(model, tok, task, sample, ref, policy_text, ref.tokens[0], run, top=10**6)
    written = k + 3 - task.given(sample)  # problems the constructed output solves, all right
    assert r["lost"] == [{"problem": k + 1, "kind": "fact"}] and r["full_correct"] == written
    assert r["policy_correct"] == written - 1 and r["policy"]["fact_accuracy"] < r["full"]["fact_accuracy"]
    assert r["diverged_at"] == len(ref.tokens[0]) and r["control_problems"] == written - 1
    p = r["problems"][0]
    assert p["kind"] == "fact" and p["answer_text"] == p["gold"] == sample.meta["answers"][k]
    assert p["uses"] == {"problem": None, "fact": FACT_LETTERS[fact]}
    assert tok.decode(ref.tokens[0, p["steps"]]).strip() == p["gold"] and p["positions"][0] == P + p["steps"][0] - 1
    # every line's share adds up to the evicted share; the fact's line is in the prompt, tagged, wholly evicted in
    # every layer and head, so its share is its whole attention (from the oracle's capture of the same forward)
    assert sum(line["share"] for line in p["top_lines"]) == pytest.approx(p["evicted_share"], abs=1e-9)
    fact_lines = [line for line in p["top_lines"] if line["tag"] == "fact"]
    assert len(fact_lines) == 1 and fact_lines[0]["where"] == "prompt"
    assert fact_lines[0]["text"].startswith(f"Fact {FACT_LETTERS[fact]}:")
    assert p["needed_share"] == pytest.approx(fact_lines[0]["share"])
    attention = step_attention(model, sample.input_ids, ref.tokens, generate)
    first, last = fact_lines[0]["positions"]
    expected = sum(float(torch.stack([a[:, i - 1, first: last + 1].float().sum(-1) for a in attention]).mean())
                   for i in p["steps"]) / len(p["steps"])
    assert fact_lines[0]["share"] == pytest.approx(expected, rel=2e-2)
    assert 0 < p["evicted_share"] <= 1 and r["control_share"] is not None
    assert len(p["evicted_share_per_layer"]) == 2
    pieces = token_pieces(tok, sample.input_ids[0].tolist() + ref.tokens[0].tolist())
    assert "".join(pieces[first: last + 1]).strip() == fact_lines[0]["text"]
    # the same prompt under a policy that keeps everything: nothing evicted, nothing to show
    kept = diagnose_prompt(model, tok, task, sample, ref, policy_text, ref.tokens[0], RunConfig("full", {}, [None]))
    q = kept["problems"][0]
    assert q["evicted_share"] == 0 and q["needed_share"] == 0 and q["top_lines"] == [] and kept["control_share"] == 0


def test_only_the_first_lost_problem_unless_asked(small):
    model, tok, task, sample, ref, policy_text, k = _constructed(small)
    gold, given = task.gold(sample), task.given(sample)
    j = k + 2  # the last problem the constructed output solves
    two = policy_text.replace(f"Answer {j + 1}: {gold[j]}", f"Answer {j + 1}: {int(gold[j]) + 1}")
    run = RunConfig("streaming", {}, [64])
    first = diagnose_prompt(model, tok, task, sample, ref, two, ref.tokens[0], run)
    every = diagnose_prompt(model, tok, task, sample, ref, two, ref.tokens[0], run, all_lost=True)
    assert [p["problem"] for p in first["problems"]] == [k + 1]
    assert [p["problem"] for p in every["problems"]] == [k + 1, j + 1] and len(every["lost"]) == 2
    assert every["problems"][0]["evicted_share"] == pytest.approx(first["problems"][0]["evicted_share"], rel=1e-6)


def test_diagnose_runs_the_free_decodes_and_writes_a_table(small):
    """End to end on one prompt and two policies (random weights: the full cache gets nothing right, so nothing is
    lost): the records, the summary and the table are there and the result is JSON."""
    from learnkv.eval import build_spec

    model, tok = small
    spec = build_spec("full,streaming,h2o", "0.5", "chain", limit=1, max_new_tokens=12, accuracy_only=True)
    results = diagnose(model, tok, spec)
    assert [r["config"]["policy"] for r in results] == ["streaming", "h2o"]
    result = results[0]
    r = result["prompts"][0]
    assert results[1]["prompts"][0]["full_tokens"] == 12 and results[1]["prompts"][0]["id"] == r["id"]
    assert r["full_tokens"] == 12 and r["budget_tokens"] == -(-(r["prompt_tokens"] + 12) // 2)
    assert r["problems"] == [] and result["summary"]["with_lost"] == 0 and result["summary"]["n_prompts"] == 1
    assert result["summary"]["full_fact_accuracy"]["n"] == 1
    json.dumps(result)
    text = table(result)
    assert r["id"] in text and "streaming" in text


def test_cli_refuses_what_it_cannot_diagnose_before_loading_a_model(capsys):
    from learnkv.__main__ import main

    for args, what in ((["--policy", "full"], "never evicts"), (["--policy", "oracle"], "oracle"),
                       (["--policy", "h2o", "--budget", "0.25,0.5"], "one budget"),
                       (["--policy", "nope"], "unknown policy")):
        assert main(["diagnose-chain", "--budget", "0.5", *args, "--model", "/nonexistent"]) == 2
        assert what in capsys.readouterr().err


def _two_batches():
    from learnkv.eval import build_spec

    return build_spec("full,streaming", "0.5", "chain", limit=2, batch_size=1, max_new_tokens=12, accuracy_only=True)


def test_a_killed_diagnosis_resumes_from_its_finished_batches(small, tmp_path, monkeypatch):
    """Each finished batch is kept in the state directory and read back bit for bit; a batch whose records were
    lost but whose full-cache reference is stored decodes only its policy's runs, not the reference again."""
    from learnkv.eval.tasks.chain import Chain

    model, tok = small
    state = tmp_path / "state"
    first = diagnose(model, tok, _two_batches(), state_dir=state, model_name="tiny")
    stored = sorted(state.glob("diagnosed-*.json"))
    assert len(stored) == 2 and len(list(state.glob("reference-*.safetensors"))) == 2  # small: kept
    # an evaluation of the same prompts stores the same reference files, so one can be hard-linked across
    from learnkv.eval import evaluate

    evaluate(model, tok, _two_batches(), resume_dir=tmp_path / "eval", model_name="tiny")
    assert ({p.name for p in (tmp_path / "eval").glob("reference-*")}
            == {p.name for p in state.glob("reference-*")})

    def refuse(*args, **kwargs):
        raise AssertionError("decoded a batch that was stored")

    monkeypatch.setattr(Chain, "reference_batch", refuse)
    monkeypatch.setattr(Chain, "decode_batch", refuse)
    assert json.dumps(diagnose(model, tok, _two_batches(), state_dir=state, model_name="tiny")) == json.dumps(first)

    monkeypatch.undo()
    reference_batch, decode_batch = Chain.reference_batch, Chain.decode_batch
    calls = {"reference": 0, "decode": 0}

    def counted(name, method):
        def run(self, *args, **kwargs):
            calls[name] += 1
            return method(self, *args, **kwargs)
        return run

    monkeypatch.setattr(Chain, "reference_batch", counted("reference", reference_batch))
    monkeypatch.setattr(Chain, "decode_batch", counted("decode", decode_batch))
    stored[1].unlink()  # killed in the second batch: its records are gone, its reference is not
    assert json.dumps(diagnose(model, tok, _two_batches(), state_dir=state, model_name="tiny")) == json.dumps(first)
    assert calls == {"reference": 0, "decode": 1}  # the policy's free run of one batch (nothing lost: no forced run)


def test_a_stored_batch_of_another_diagnosis_is_not_read_back(small, tmp_path, monkeypatch):
    """The stored records are named by what they depend on: another policy, model or setting decodes again."""
    from learnkv.eval import build_spec
    from learnkv.eval.diagnose import batch_identity
    from learnkv.eval.tasks.chain import Chain

    model, tok = small
    state = tmp_path / "state"
    diagnose(model, tok, _two_batches(), state_dir=state, model_name="tiny")
    spec = _two_batches()
    runs = [r for r in spec.runs if r.name != "full"]
    base = batch_identity(spec, runs, "tiny", ["a"], False, 5)
    other = build_spec("full,h2o", "0.5", "chain", limit=2, batch_size=1, max_new_tokens=12, accuracy_only=True)
    assert base != batch_identity(other, [r for r in other.runs if r.name != "full"], "tiny", ["a"], False, 5)
    assert base != batch_identity(spec, runs, "other", ["a"], False, 5)
    assert base != batch_identity(spec, runs, "tiny", ["a"], True, 5)

    def refuse(*args, **kwargs):
        raise RuntimeError("decoded")

    monkeypatch.setattr(Chain, "decode_batch", refuse)
    with pytest.raises(RuntimeError, match="decoded"):
        diagnose(model, tok, _two_batches(), state_dir=state, model_name="tiny", all_lost=True)
    with pytest.raises(RuntimeError, match="decoded"):
        diagnose(model, tok, _two_batches(), state_dir=state, model_name="other")


def test_cli_writes_the_json_resumes_and_clears_its_state(small, tmp_path, capsys, monkeypatch):
    """`diagnose-chain` end to end on a saved tiny model: the JSON is written and the state directory removed; a
    state directory left by a killed run is read back (said on stderr) and gives the same JSON."""
    from learnkv.__main__ import main

    model, tok = small
    model_dir, out = tmp_path / "tiny", tmp_path / "d" / "streaming.json"
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    args = ["diagnose-chain", "--policy", "streaming", "--budget", "0.5", "--model", str(model_dir), "--limit", "2",
            "--max-new-tokens", "12", "--threads", "1", "--out", str(out)]
    assert main(args) == 0
    state = tmp_path / "d" / "streaming.partial"
    assert not state.exists() and "json: " in capsys.readouterr().out
    whole = json.loads(out.read_text())
    assert whole["results"][0]["config"]["n_prompts"] == 2

    # a killed run's state: rebuild it by diagnosing into the state directory; the CLI reads it back, decoding nothing
    from learnkv.eval import build_spec
    from learnkv.eval.tasks.chain import Chain

    spec = build_spec("full,streaming", "0.5", "chain", limit=2, batch_size=1, max_new_tokens=12, accuracy_only=True)
    diagnose(model, tok, spec, state_dir=state, model_name=str(model_dir))
    out.unlink()

    def refuse(*a, **k):
        raise AssertionError("decoded a batch that was stored")

    monkeypatch.setattr(Chain, "reference_batch", refuse)
    monkeypatch.setattr(Chain, "decode_batch", refuse)
    assert main(args) == 0
    assert "resuming from" in capsys.readouterr().err
    assert json.loads(out.read_text()) == whole and not state.exists()
    with pytest.raises(SystemExit) as exit_:
        main([*args, "--threads", "0"])
    assert exit_.value.code == 2 and "threads" in capsys.readouterr().err
