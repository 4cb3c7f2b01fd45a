"""Chain: long chains of thought whose late answers need tokens written long before (LazyEviction's pattern).

Each held-out prompt (`learnkv.prompts`, source ``chain``; `learnkv.chains`) states four facts and 24 small
word problems, later ones using earlier answers and the facts; the model solves them in order, ending each with
``Answer k: N`` and the last with ``#### N``. With the full cache the bundled models write over 1,000 tokens
(docs/tasks-notes.md has the measurement). Per prompt, two decodes under each policy:

* a free-running greedy decode under the budget, graded:

  - ``problem_accuracy``: share of the prompt's problems answered right (the generator's gold answers);
  - ``final_accuracy``: the last problem's answer (``#### N``, else its ``Answer k:`` line) is right;
  - ``answer_agreement``: share of problems whose answer equals the full cache's (both missing counts as equal);

* a decode teacher-forced along the full cache's continuation: ``kl``, ``top1_agreement``, ``ppl_ratio``,
  ``attention_recall`` and ``agreement_length``, exactly as the ``fidelity`` task computes them (`Fidelity`).

``generated_tokens`` is the full cache's output length on the prompt (the same under every policy: it says how
long the chains are); the task pools it as a mean and as ``generated_tokens_median`` (`pool`).

Memory: the full-cache reference keeps its logits (``[N, V]`` fp32) and only the decode steps' rows of its
attention, in fp16 (``[layers, H, N, P + N]``: about 470 MB for SmolLM2 at P + N = 2,000), not ``[layers, H, L,
L]`` fp32; the teacher-forced run's attention recall is accumulated step by step (`RecallMeter`), so what each
cache kept is never stored. ``oracle`` replays the full cache's output, so its accuracy and agreement are None.
For a policy that never evicts both decodes equal the reference, so they are not rerun.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from learnkv import chains
from learnkv.decode import GenerationResult
from learnkv.eval.tasks.base import Sample, evicts, replays
from learnkv.eval.tasks.fidelity import Fidelity, FullRun
from learnkv.prompts import load_prompts

FIDELITY_METRICS = Fidelity.metrics


def grade_chain(text: str, gold: list[str], reference: list[str | None] | None = None) -> dict:
    """Grade one completion of a chain prompt.

    Parameters
    ----------
    text : str
        The completion.
    gold : list of str
        Gold answer per problem.
    reference : list of (str or None), optional
        The full cache's parsed answers, for agreement.

    Returns
    -------
    dict
        ``parsed`` (answer per problem, None where missing), ``answered``, ``correct`` (counts),
        ``final_correct`` (bool), ``agreement`` (share of problems agreeing with ``reference``, None without one).
    """
    parsed = chains.parse_answers(text, len(gold))
    right = [p is not None and float(p) == float(g) for p, g in zip(parsed, gold)]
    agreement = None
    if reference is not None:
        agreement = sum(p == r for p, r in zip(parsed, reference)) / len(gold)
    return {"parsed": parsed, "answered": sum(p is not None for p in parsed), "correct": sum(right),
            "final_correct": right[-1], "agreement": agreement}


def encode_chain(tokenizer, texts: list[str], response_prefix: str = chains.RESPONSE_PREFIX):
    """Left-padded ``(input_ids, attention_mask)`` of chain prompts: the chat template with its assistant header,
    then the start of the reply (``response_prefix``), so the model continues in the asked format."""
    if getattr(tokenizer, "chat_template", None):
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                               tokenize=False) + response_prefix for t in texts]
    else:
        texts = [f"{t}\n\n{response_prefix}" for t in texts]
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    enc = tokenizer(list(texts), return_tensors="pt", padding=True, add_special_tokens=False)
    return enc["input_ids"], enc["attention_mask"]


def generated_tokens(tokens: torch.Tensor, eos_ids) -> int:
    """Tokens one row ``[N]`` of `GenerationResult.tokens` generated: up to and including its first EOS (a batch
    pads the rows that stopped early), else all of them."""
    hits = torch.isin(tokens, torch.as_tensor(list(eos_ids), dtype=tokens.dtype)).nonzero()
    return int(hits[0, 0]) + 1 if len(hits) else int(tokens.shape[0])


@dataclass
class ChainReference:
    """The full cache's work on one chain prompt: its run for fidelity, its output and its parsed answers."""

    full: FullRun
    result: GenerationResult
    answers: list[str | None]


@dataclass
class Chain(Fidelity):
    """Chains of word problems on held-out (test split) prompts: accuracy, agreement and fidelity at length.

    Parameters
    ----------
    max_new_tokens : int
        Room for the whole chain (the full cache stops at EOS well before it, docs/tasks-notes.md).
    n_problems, n_facts : int
        Problems per prompt and facts stated at its top (`learnkv.chains`).
    """

    name = "chain"
    metrics = ("problem_accuracy", "final_accuracy", "answer_agreement", "generated_tokens",
               "generated_tokens_median") + FIDELITY_METRICS
    default_limit = 4

    max_new_tokens: int = 2048
    source: str = "chain"
    n_problems: int = chains.N_PROBLEMS
    n_facts: int = chains.N_FACTS

    def __post_init__(self):
        super().__post_init__()
        chains.chain_problem(0, 0, self.n_problems, self.n_facts)  # validates both

    def load(self, tokenizer, limit: int | None, seed: int) -> list[Sample]:
        if tokenizer is None:
            raise ValueError("the chain task needs a tokenizer")
        prompts = load_prompts("chain", n=limit, seed=seed, split="test", n_problems=self.n_problems,
                               n_facts=self.n_facts)
        return [Sample(p.id, encode_chain(tokenizer, [p.text])[0], p.answer, dict(p.meta)) for p in prompts]

    def reference(self, model, tokenizer, sample: Sample) -> ChainReference:
        full, result = self.full_run(model, tokenizer, sample, decode_rows_only=True, dtype=torch.float16)
        return ChainReference(full, result, grade_chain(self.text_of(tokenizer, result), self.gold(sample))["parsed"])

    def run(self, model, tokenizer, sample, ref: ChainReference, policy, budget, params):
        if evicts(policy):
            free = self.decode(model, tokenizer, sample, policy, budget, params)
            fidelity, _ = self.fidelity(model, tokenizer, sample, ref.full, policy, budget, params)
        else:  # both decodes would repeat the reference exactly
            free = ref.result
            n = ref.full.tokens.shape[1]
            fidelity = {"kl": 0.0, "top1_agreement": 1.0, "ppl_ratio": 1.0, "attention_recall": 1.0,
                        "agreement_length": n}
        metrics = self.grade(self.text_of(tokenizer, free), sample, ref, policy)
        metrics["generated_tokens"] = ref.full.tokens.shape[1]
        metrics.update(fidelity)
        return metrics, free

    def grade(self, text: str, sample: Sample, ref: ChainReference, policy: str) -> dict[str, float | None]:
        """Accuracy and agreement of one free-running completion (None for a policy that replays the full run)."""
        if replays(policy):
            return {"problem_accuracy": None, "final_accuracy": None, "answer_agreement": None}
        g = grade_chain(text, self.gold(sample), ref.answers)
        return {"problem_accuracy": g["correct"] / len(g["parsed"]), "final_accuracy": float(g["final_correct"]),
                "answer_agreement": g["agreement"]}

    def pool(self, rows: list[dict]) -> dict[str, float | None]:
        pooled = super().pool(rows)
        lengths = [r["generated_tokens"] for r in rows if r.get("generated_tokens") is not None]
        pooled["generated_tokens_median"] = float(statistics.median(lengths)) if lengths else None
        return pooled

    def reference_length(self, sample: Sample, ref: ChainReference) -> int:
        """The full cache's final length, prompt plus output: what a LazyEviction-style budget ratio is of."""
        return sample.input_ids.shape[1] + ref.full.tokens.shape[1]

    @staticmethod
    def gold(sample: Sample) -> list[str]:
        answers = sample.meta.get("answers")
        if not answers:
            raise ValueError(f"chain sample {sample.id} has no per-problem answers (meta['answers'])")
        return list(answers)

    @staticmethod
    def text_of(tokenizer, result: GenerationResult) -> str:
        if result.texts is not None:
            return result.texts[0]
        return "" if tokenizer is None else tokenizer.decode(result.tokens[0], skip_special_tokens=True)
