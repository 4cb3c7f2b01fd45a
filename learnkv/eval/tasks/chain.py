"""Chain: long chains of thought whose late answers need tokens written long before (LazyEviction's pattern).

Each held-out prompt (`learnkv.prompts`, source ``chain``; `learnkv.chains`) states four facts and 30 small
word problems, later ones using earlier answers and the facts; the model's reply starts with the first three
solved (`learnkv.chains.ChainProblem.reply_prefix`) and it goes on in order, copying each problem's line, then
``Work:`` and ``Answer k: N``, and a last ``#### N``. The given problems are not graded. Measured
output lengths and accuracy with the full cache are in docs/tasks-notes.md. Per batch of prompts, under each
policy and budget:

* a free-running greedy decode under the budget, graded:

  - ``problem_accuracy``: share of the prompt's graded problems (all but the given ones) answered right (the
    generator's gold answers);
  - ``final_accuracy``: the last problem's answer (``#### N``, else its ``Answer k:`` line) is right;
  - ``answer_agreement``: share of problems whose answer equals the full cache's (both missing counts as equal);
  - ``fact_accuracy``, ``linked_accuracy``, ``alone_accuracy``: ``problem_accuracy`` among the prompt's graded
    problems of one kind (`learnkv.chains.problem_kind`: a fact only, an earlier answer, neither); None where the
    prompt has none of that kind (a prompt has about three linked ones), so a mean over prompts is over the prompts
    that have the kind, and a paired difference over those both runs have;

* a decode teacher-forced along the full cache's continuation, which is `Fidelity`'s own run: ``kl``,
  ``top1_agreement``, ``ppl_ratio``, ``attention_recall``, ``agreement_length`` and ``generated_tokens`` (the full
  cache's output length; the runner reports its mean and ``generated_tokens_median``).

A policy that never evicts (``full``) gets only the forced decode: its free run is the full cache's by
construction, so it is graded on the reference text. ``oracle`` replays the full cache's output, so it gets only
the forced decode too and its accuracy and agreement are None. The cost reported for a prompt is that of its free
run (the forced one for those two); its time covers both decodes, so ``tokens_per_s`` is about half a single
decode's rate.

``accuracy_only`` drops the teacher-forced half: the full cache's reference is its free run alone (no logits, no
attention kept), every policy is graded on its own free run, and the metrics are the graded ones above and
``generated_tokens``. It halves the decodes and the memory of the reference, which is what a large model at
thousands of tokens needs (a 152k-token vocabulary's logits alone are 9.7 GB per prompt at 16k tokens); ``oracle``,
which replays the reference's attention, is refused in that mode. The reference is then the ``full`` row's own
greedy decode, so that row is graded on it, with its recorded cost and time, and not decoded again
(`Task.reference_run`; a reference stored by an earlier version, without its `FreeRun`, decodes the row).

Memory: the full-cache reference (`Fidelity.reference_batch`) keeps each prompt's logits (``[N, V]`` fp32, 390 MB
for SmolLM2 at N = 2,000) and the decode steps' rows of its attention in fp16 (``[layers, H_kv, N - 1, P + N - 1]``);
building them holds one prompt's whole ``[layers, H_kv, L, L]`` fp32 attention for a moment (3.2 GB for SmolLM2 at
L = 3,000, twice while it is aligned by position). Measured: 4 prompts at 2,048 new tokens, ``--batch-size 4``,
peaked at 23.9 GB resident on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from learnkv import chains
from learnkv.eval.tasks.base import FreeRun, RunConfig, Sample, evicts, replays
from learnkv.eval.tasks.fidelity import Fidelity, FullRun
from learnkv.prompts import load_prompts


def grade_chain(text: str, gold: list[str], reference: list[str | None] | None = None, given: int = 0,
                kinds: list[str] | None = None) -> dict:
    """Grade one completion of a chain prompt.

    Parameters
    ----------
    text : str
        The completion (after the reply prefix, which ends with Problem ``given + 1``'s header).
    gold : list of str
        Gold answer per problem, all of them.
    reference : list of (str or None), optional
        The full cache's parsed answers, for agreement.
    given : int
        Problems solved in the reply prefix: not graded.
    kinds : list of str, optional
        Each problem's kind (`learnkv.chains.problem_kind`), for the counts by kind.

    Returns
    -------
    dict
        ``parsed`` (answer per problem, None where missing), ``right`` (per problem: whether it is right, None for
        the given ones), ``graded`` (problems graded), ``answered``, ``correct`` (counts over the graded ones),
        ``final_correct`` (bool), ``agreement`` (share of graded problems agreeing with ``reference``, None without
        one), ``by_kind`` (``{kind: (correct, graded)}`` over the graded problems, every kind of
        `learnkv.chains.KINDS`; None without ``kinds``).
    """
    parsed = chains.parse_answers(text, len(gold), first=given + 1)
    pairs = list(zip(parsed, gold))[given:]
    right = _right(parsed, gold)[given:]
    agreement = None
    if reference is not None:
        agreement = sum(p == r for p, r in zip(parsed[given:], reference[given:])) / len(pairs)
    return {"parsed": parsed, "right": [None] * given + right, "graded": len(pairs),
            "answered": sum(p is not None for p, _ in pairs), "correct": sum(right), "final_correct": right[-1],
            "agreement": agreement, "by_kind": None if kinds is None else count_by_kind(parsed, gold, kinds, given)}


def _right(parsed: list[str | None], gold: list[str]) -> list[bool]:
    return [p is not None and float(p) == float(g) for p, g in zip(parsed, gold)]


def count_by_kind(parsed: list[str | None], gold: list[str], kinds: list[str], given: int = 0) -> dict:
    """``{kind: (correct, graded)}`` over the graded problems (after the ``given`` ones), for every kind of
    `learnkv.chains.KINDS`, from the parsed answers and each problem's kind (`learnkv.chains.problem_kind`)."""
    if not len(parsed) == len(gold) == len(kinds):
        raise ValueError(f"{len(parsed)} answers, {len(gold)} gold answers and {len(kinds)} problem kinds: give one "
                         "of each per problem")
    right = _right(parsed, gold)[given:]
    return {kind: (sum(ok for ok, k in zip(right, kinds[given:]) if k == kind),
                   sum(k == kind for k in kinds[given:])) for kind in chains.KINDS}


def kind_accuracy(by_kind: dict | None) -> dict[str, float | None]:
    """``fact_accuracy``, ``linked_accuracy``, ``alone_accuracy``: the share right among a prompt's graded problems of
    that kind (`grade_chain`'s ``by_kind``); None where the prompt has none of that kind, or its kinds are unknown."""
    return {f"{kind}_accuracy": (by_kind[kind][0] / by_kind[kind][1] if by_kind and by_kind[kind][1] else None)
            for kind in chains.KINDS}


#: the per-kind accuracies (`kind_accuracy`), reported in both modes
KIND_METRICS = tuple(f"{kind}_accuracy" for kind in chains.KINDS)


@dataclass
class ChainRun(FullRun):
    """The full cache's run on one chain prompt (`FullRun`), with its text and its parsed answer per problem, and
    with ``accuracy_only`` its free run as the ``full`` row decoded it (`FreeRun`)."""

    text: str = ""
    answers: list[str | None] = field(default_factory=list)
    free_run: FreeRun | None = None


@dataclass
class Chain(Fidelity):
    """Chains of word problems on held-out (test split) prompts: accuracy, agreement and fidelity at length.

    Parameters
    ----------
    max_new_tokens : int
        Room for the whole chain: 27 problems of 40-50 tokens end near 1,100-1,300 tokens; both bundled models go on
        past the last problem rather than stop, so the cap, not EOS, ends most full-cache runs
        (docs/tasks-notes.md).
    n_problems, n_facts : int
        Problems per prompt and facts stated at its top (`learnkv.chains`).
    linked_share, fact_share : float
        Shares of linked and fact-only problems (`learnkv.chains.chain_problem`).
    accuracy_only : bool
        Grade free runs only, without the teacher-forced fidelity metrics (see the module docstring).
    """

    name = "chain"
    metrics = ("problem_accuracy", "final_accuracy", "answer_agreement") + KIND_METRICS + Fidelity.metrics
    headline = ("problem_accuracy", "final_accuracy", "answer_agreement", "kl")  # kl: where teacher-forced too
    default_limit = 4

    max_new_tokens: int = 1536
    source: str = "chain"
    n_problems: int = chains.N_PROBLEMS
    n_facts: int = chains.N_FACTS
    linked_share: float = chains.LINKED_SHARE
    fact_share: float = chains.FACT_SHARE
    accuracy_only: bool = False

    def __post_init__(self):
        self.source = "chain"  # always: --source is the fidelity task's, one set of flags serves every task
        super().__post_init__()
        chains.chain_problem(0, 0, self.n_problems, self.n_facts, self.linked_share, self.fact_share)  # validates

    def load(self, tokenizer, limit: int | None, seed: int) -> list[Sample]:
        if tokenizer is None:
            raise ValueError("the chain task needs a tokenizer (or pass token-id samples with meta['answers'])")
        prompts = load_prompts("chain", n=limit, seed=seed, split="test", n_problems=self.n_problems,
                               n_facts=self.n_facts, linked_share=self.linked_share, fact_share=self.fact_share)
        return [Sample.from_prompt(p, tokenizer) for p in prompts]

    def metric_names(self) -> tuple[str, ...]:
        if self.accuracy_only:
            return ("problem_accuracy", "final_accuracy", "answer_agreement") + KIND_METRICS + ("generated_tokens",)
        return self.metrics

    def check_policy(self, policy: str) -> None:
        if self.accuracy_only and replays(policy):
            raise ValueError(f"the chain task with accuracy_only has no teacher-forced reference for {policy!r} "
                             "to replay; drop it or the option")

    def reference_batch(self, model, tokenizer, samples: list[Sample]) -> list[ChainRun]:
        runs = [None] * len(samples)
        if self.accuracy_only:  # the full cache's free run alone
            result, runs = self.full_decode(model, tokenizer, samples)
            fulls = [FullRun(result.tokens[b: b + 1, :result.new_tokens[b]], None, None, s.input_ids.shape[1])
                     for b, s in enumerate(samples)]
        else:
            fulls = super().reference_batch(model, tokenizer, samples)
        refs = []
        for sample, full, run in zip(samples, fulls, runs):
            text = _decode(tokenizer, full.tokens[0])
            refs.append(ChainRun(full.tokens, full.logits, full.attention, full.prompt_len, text=text,
                                 answers=grade_chain(text, self.gold(sample), given=self.given(sample))["parsed"],
                                 free_run=run))
        return refs

    def reference_run(self, samples: list[Sample], refs: list[ChainRun]):
        if not self.accuracy_only or any(ref.free_run is None for ref in refs):
            return None
        return (self._graded(samples, refs, [ref.free_run.text for ref in refs], "full"),
                [ref.free_run.cost for ref in refs])

    def run_batch(self, model, tokenizer, samples: list[Sample], refs: list[ChainRun], run: RunConfig):
        if self.accuracy_only:  # every policy's own free run, graded (full's equals its reference, greedy)
            result = self.decode_batch(model, tokenizer, samples, run)
            return self._graded(samples, refs, result.texts or [""] * len(samples), run.policy), result
        metrics, result = super().run_batch(model, tokenizer, samples, refs, run)  # teacher-forced: fidelity
        if evicts(run.policy) and not replays(run.policy):
            result = self.decode_batch(model, tokenizer, samples, run)  # free-running: graded
            texts = result.texts or [""] * len(samples)
        else:
            texts = [ref.text for ref in refs]
        for row, sample, ref, text in zip(metrics, samples, refs, texts):
            row.update(self.grade(text, sample, ref, run.policy))
        return metrics, result

    def _graded(self, samples: list[Sample], refs: list[ChainRun], texts: list[str], policy: str) -> list[dict]:
        """``accuracy_only``: each prompt's metrics from its free run's text."""
        return [{**self.grade(text, sample, ref, policy), "generated_tokens": float(ref.tokens.shape[1])}
                for sample, ref, text in zip(samples, refs, texts)]

    def grade(self, text: str, sample: Sample, ref: ChainRun, policy: str) -> dict[str, float | None]:
        """Accuracy and agreement of one free-running completion (None for a policy that replays the full run)."""
        if replays(policy):
            return {"problem_accuracy": None, "final_accuracy": None, "answer_agreement": None,
                    **kind_accuracy(None)}
        g = grade_chain(text, self.gold(sample), ref.answers, given=self.given(sample), kinds=self.kinds(sample))
        return {"problem_accuracy": g["correct"] / g["graded"], "final_accuracy": float(g["final_correct"]),
                "answer_agreement": g["agreement"], **kind_accuracy(g["by_kind"])}

    @staticmethod
    def given(sample: Sample) -> int:
        """Problems the reply starts with, solved (not graded; 0 for samples built from token ids)."""
        return int(sample.meta.get("given", 0))

    @staticmethod
    def kinds(sample: Sample) -> list[str] | None:
        """Each problem's kind (`learnkv.chains.problem_kind`) from the prompt's ``depends`` and ``facts`` (None for
        samples without them: token ids)."""
        depends, facts = sample.meta.get("depends"), sample.meta.get("facts")
        if depends is None or facts is None:
            return None
        return [chains.problem_kind(d, f) for d, f in zip(depends, facts)]

    @staticmethod
    def gold(sample: Sample) -> list[str]:
        answers = sample.meta.get("answers")
        if not answers:
            raise ValueError(f"chain sample {sample.id} has no per-problem answers (meta['answers'])")
        return list(answers)


def _decode(tokenizer, tokens) -> str:
    """A row of generated ids -> text, as `learnkv.generate` decodes it ("" without a tokenizer)."""
    return "" if tokenizer is None else tokenizer.decode(tokens, skip_special_tokens=True)
