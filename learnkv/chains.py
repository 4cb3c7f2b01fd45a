"""Chains of word problems: one prompt, many small problems, later ones built on earlier answers and facts.

What LazyEviction targets: in a long chain of thought, a token written hundreds of steps ago (an earlier answer, a
condition stated at the start) becomes important again much later. Here that is built in. A prompt opens with a
few *facts* (``Fact A: each box holds 6 pens.``), then states ``n_problems`` one- or two-step word problems. Problem
k may use "the answer to Problem j" for some j well before k, and a fact from the top of the prompt, so a correct
answer late in the output needs tokens written (or read) long before. The model is told to solve them in order,
writing for each its ``Problem k: ...`` line copied from the prompt, then ``Work:`` (with any earlier answer or
fact written in as its value) and ``Answer k: N`` lines, and a last ``#### N`` line. Its reply starts with the first
`N_GIVEN` problems already solved that way (`ChainProblem.reply_prefix`): the format is shown on the chain itself,
not by an example a small model would copy.

Everything is seeded (`random.Random` of a hash of the seed and index) and integer-valued; the generator computes
every gold answer and the worked solution. Numbers stay small (answers 2-400) so a 0.5B model can do the
arithmetic: what is measured is whether it can still find the operands.

    >>> from learnkv.chains import chain_problem
    >>> p = chain_problem(seed=0, index=3)
    >>> p.answers  # gold answer per problem, in order
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass

from learnkv.answers import normalise_number

#: problems per prompt and facts stated at its top, by default (chosen by measurement: docs/tasks-notes.md)
N_PROBLEMS = 30
N_FACTS = 4
#: shares of Problems 4.. that use an earlier answer (linked) and that use only a fact (chosen by measurement:
#: `chain_problem`, docs/tasks-notes.md); the rest stand alone
LINKED_SHARE = 0.10
FACT_SHARE = 0.45
MAX_ANSWER = 400

NAMES = ("Ava", "Ben", "Chloe", "Dan", "Ema", "Finn", "Gia", "Hugo", "Ines", "Jon", "Kira", "Liam", "Mia", "Noah",
         "Omar", "Pia", "Quinn", "Rosa", "Sam", "Tara", "Uma", "Vic", "Wes", "Yara", "Zoe")
ITEMS = ("apples", "pencils", "marbles", "stickers", "books", "cookies", "stamps", "shells", "cards", "beads",
         "flowers", "coins", "eggs", "candles", "buttons")
# (fact text with {v} and {item}, the unit a problem counts, what one unit is worth, lowest and highest value)
FACTS = (
    ("Each box holds {v} {item}.", "boxes of {item}", "{item}", 3, 9),
    ("Each bag holds {v} {item}.", "bags of {item}", "{item}", 2, 8),
    ("A ticket to the fair costs {v} dollars.", "tickets to the fair", "dollars", 2, 9),
    ("Each shelf in the library has {v} books.", "shelves", "books", 3, 9),
    ("A bus has {v} seats.", "buses", "seats", 4, 9),
    ("Each tray holds {v} cupcakes.", "trays of cupcakes", "cupcakes", 3, 8),
    ("A week has 7 days.", "weeks", "days", 7, 7),
)
FACT_LETTERS = "ABCDEFGH"

INSTRUCTION = """Solve all {n} problems above in order, from Problem 1 to Problem {n}, and stop after Problem \
{n}. Some use a fact from the list and some use the answer to an earlier problem: look it up in your own earlier \
work. For every problem copy its line ("Problem k: ..."), then write two lines: Work (the calculation, with the \
numbers it needs written in) and "Answer k: N". After Problem {n}, write one last line "#### " followed by the \
answer to Problem {n}."""

#: problems solved at the start of the model's reply (`ChainProblem.reply_prefix`). Measured (docs/tasks-notes.md):
#: with a worked example inside the instruction SmolLM2 copied the example until the length cap; with no example
#: it wrote its own format and fell into a loop within a problem or two; with the first problems of its own chain
#: solved in the reply it goes on problem by problem, copying each problem's line from the prompt, and so does
#: Qwen2.5-Coder-0.5B. Three, because Problem 3 is the first that can look something up (`chain_problem`). A
#: ``Uses:`` line citing the looked-up answers and facts was tried and dropped: Qwen copied the previous problem's
#: citations and computed with them (per-problem accuracy 0.14, n = 4 prompts).
N_GIVEN = 3

# "Answer 3: ...", "**Answer:** ...", not "the answer to Problem 3: ..." (a later problem citing it)
_ANSWER_LINE = re.compile(r"\banswer\s*(\d+)?\s*\**\s*[:=]([^\n]*)", re.I)
_HEADER = re.compile(r"^\W*problem\s*(\d+)\b", re.I)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


@dataclass(frozen=True)
class ChainProblem:
    """One chain prompt.

    Attributes
    ----------
    text : str
        The user message: instruction, facts, problems.
    answers : tuple of str
        Gold answer of each problem, in order (integers as strings).
    depends : tuple of int or None
        For each problem, the (1-based) problem whose answer it uses, or None.
    facts : tuple of int or None
        For each problem, the (0-based) fact it uses, or None.
    solution : tuple of str
        Each problem solved in the asked format (`worked`): the reference chain of thought.
    given : int
        How many problems the reply starts with, solved (`N_GIVEN`, fewer on a chain shorter than that). They
        show the format and are not graded.
    reply_prefix : str
        The start of the model's reply: the ``given`` solved problems, then ``Problem {given + 1}:``.
    """

    text: str
    answers: tuple[str, ...]
    depends: tuple[int | None, ...]
    facts: tuple[int | None, ...]
    solution: tuple[str, ...]
    given: int
    reply_prefix: str


def _rng(*parts: object) -> random.Random:
    return random.Random(hashlib.sha256(":".join(map(str, ("chain",) + parts)).encode()).digest())


def _pick_facts(rng: random.Random, n_facts: int) -> list[tuple[str, str, str, int]]:
    """``n_facts`` distinct facts as (text, unit, what a unit holds, value)."""
    chosen = rng.sample(range(len(FACTS)), n_facts)
    out = []
    for i in chosen:
        text, unit, qty, lo, hi = FACTS[i]
        item = rng.choice(ITEMS)
        v = rng.randint(lo, hi)
        out.append((text.format(v=v, item=item), unit.format(item=item), qty.format(item=item), v))
    return out


def _base_problem(rng: random.Random, name: str, item: str) -> tuple[str, int, str]:
    """A problem that needs nothing earlier: one or two steps on numbers in the text; (text, answer, work)."""
    a, b = rng.randint(12, 60), rng.randint(3, 11)
    kind = rng.randrange(3)
    if kind == 0:
        return f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?", a + b, f"{a} + {b}"
    if kind == 1:
        c, had = rng.randint(2, 9), a % 20 + 2
        return (f"{name} buys {c} packs of {b} {item} each and already had {had}. How many {item} does "
                f"{name} have in total?", c * b + had, f"{c} * {b} + {had}")
    return f"{name} has {a + b} {item} and gives {b} away. How many {item} are left?", a, f"{a + b} - {b}"


def _linked_problem(rng: random.Random, name: str, item: str, j: int, prev: int,
                    fact: tuple[int, tuple[str, str, str, int]] | None) -> tuple[str, int, str]:
    """A problem on the answer to Problem ``j`` (value ``prev``), and on a fact if one is given; (text, answer,
    work)."""
    ref = f"the answer to Problem {j}"
    if fact is not None:
        k, (_, unit, qty, v) = fact
        letter = FACT_LETTERS[k]
        if prev * v <= MAX_ANSWER and rng.random() < 0.6:
            return (f"{name} gets as many {unit} as {ref}. Using Fact {letter}, how many {qty} is that?", prev * v,
                    f"{prev} * {v}")
        c = rng.randint(2, 6)
        return (f"{name} gets {c} {unit} and then {ref} more {qty}. Using Fact {letter}, how many {qty} does "
                f"{name} have in total?", c * v + prev, f"{c} * {v} + {prev}")
    options = []
    if prev + 20 <= MAX_ANSWER:
        b = rng.randint(4, 20)
        options.append((f"{name} starts with {ref} {item} and finds {b} more. How many {item} now?", prev + b,
                        f"{prev} + {b}"))
    if prev > 8:
        b = rng.randint(2, min(prev - 2, 15))
        options.append((f"{name} takes {ref} {item} and uses {b} of them. How many are left?", prev - b,
                        f"{prev} - {b}"))
    divisors = [d for d in range(2, 10) if prev % d == 0 and prev // d >= 2]
    if divisors:
        d = rng.choice(divisors)
        options.append((f"{ref.capitalize()} {item} are shared equally among {d} friends. How many does each "
                        f"friend get?", prev // d, f"{prev} / {d}"))
    if prev * 2 <= MAX_ANSWER:
        options.append((f"{name} has twice {ref} {item}. How many {item} does {name} have?", 2 * prev,
                        f"2 * {prev}"))
    return rng.choice(options)


#: the kinds of problem, as `problem_kind` names them
KINDS = ("fact", "linked", "alone")


def problem_kind(depends: int | None, fact: int | None) -> str:
    """A problem's kind from its ``depends`` and ``facts`` entries (`ChainProblem`): ``"linked"`` (it uses an earlier
    answer, maybe a fact too), ``"fact"`` (a fact only) or ``"alone"`` (neither)."""
    return "linked" if depends is not None else "fact" if fact is not None else "alone"


def worked(k: int, text: str, work: str, answer: int | str) -> str:
    """Problem ``k`` solved in the asked format: its line, the work (with any looked-up value written in) and the
    answer."""
    return f"Problem {k}: {text}\nWork: {work} = {answer}\nAnswer {k}: {answer}\n"


def chain_problem(seed: int, index: int, n_problems: int = N_PROBLEMS, n_facts: int = N_FACTS,
                  linked_share: float = LINKED_SHARE, fact_share: float = FACT_SHARE) -> ChainProblem:
    """Chain prompt number ``index`` of data seed ``seed`` (deterministic).

    Problems 1 and 2 stand alone; Problem 3 uses the answer to Problem 1 and a fact (so the reply's worked start,
    ``reply_prefix``, shows both kinds of look-up); each later one is, with probability ``linked_share``, linked (it
    uses the answer to a problem at least two before it, drawn from the first half of those, so the distance grows
    with the chain; about half of the linked ones also use a fact), with probability ``fact_share`` a fact problem (a
    count of units times the value a fact at the top of the prompt gives, by then hundreds of tokens back), else it
    stands alone. Facts not yet used go first. The mix is set by measurement (docs/tasks-notes.md):
    Qwen2.5-Coder-0.5B looks facts up at the top of the prompt two times in three but resolves "the answer to
    Problem j" about once in twenty, so at the earlier 35% linked it got 0.41 of the problems right and at 10% it
    gets 0.60, which leaves room to measure what eviction takes away.
    """
    if n_problems < 2 or n_facts < 1 or n_facts > len(FACTS):
        raise ValueError(f"a chain needs n_problems >= 2 and 1 <= n_facts <= {len(FACTS)}, got "
                         f"{n_problems} and {n_facts}")
    if not (0 <= linked_share and 0 <= fact_share and linked_share + fact_share <= 1):
        raise ValueError(f"a chain needs shares in [0, 1] summing to at most 1, got linked {linked_share} and "
                         f"fact {fact_share}")
    rng = _rng(seed, index, n_problems, n_facts)
    facts = _pick_facts(rng, n_facts)
    unused_facts = list(range(n_facts))
    rng.shuffle(unused_facts)
    names = rng.sample(NAMES, min(len(NAMES), n_problems))
    lines, answers, depends, used, solution = [], [], [], [], []
    for k in range(1, n_problems + 1):
        name, item = names[(k - 1) % len(names)], rng.choice(ITEMS)
        if k == 3:  # always linked (and with a fact): the reply prefix shows both look-ups
            kind = "linked"
        else:
            draw = rng.random()
            kind = ("alone" if k <= 2 or draw >= linked_share + fact_share
                    else "fact" if draw >= linked_share else "linked")
        if kind == "alone":
            text, value, work = _base_problem(rng, name, item)
            dep = fact_i = None
        elif kind == "fact":
            dep = None
            fact_i = unused_facts.pop() if unused_facts else rng.randrange(n_facts)
            _, unit, qty, v = facts[fact_i]
            c = rng.randint(2, 9)
            text = f"{name} gets {c} {unit}. Using Fact {FACT_LETTERS[fact_i]}, how many {qty} is that?"
            value, work = c * v, f"{c} * {v}"
        else:
            dep = rng.randint(1, max(1, (k - 1) // 2))
            fact_i = None
            if k == 3 or rng.random() < 0.5 or (unused_facts and n_problems - k < len(unused_facts)):
                fact_i = unused_facts.pop() if unused_facts else rng.randrange(n_facts)
            fact = None if fact_i is None else (fact_i, facts[fact_i])
            text, value, work = _linked_problem(rng, name, item, dep, answers[dep - 1], fact)
        if not 0 < value <= MAX_ANSWER * 4:
            raise AssertionError(f"chain generator produced {value} (seed {seed}, index {index}, problem {k})")
        lines.append(f"Problem {k}: {text}")
        solution.append(worked(k, text, work, value))
        answers.append(value)
        depends.append(dep)
        used.append(fact_i)
    fact_lines = [f"Fact {FACT_LETTERS[i]}: {text}" for i, (text, *_) in enumerate(facts)]
    body = "\n".join(["Facts:", *fact_lines, "", "Problems:", *lines, "", INSTRUCTION.format(n=n_problems)])
    given = min(N_GIVEN, n_problems - 1)
    prefix = "\n".join(solution[:given]) + f"\nProblem {given + 1}:"
    return ChainProblem(body, tuple(str(a) for a in answers), tuple(depends), tuple(used), tuple(solution), given,
                        prefix)


def parse_answers(text: str, n_problems: int, first: int = 1) -> list[str | None]:
    """Per-problem answers from a completion: the last answer line of each problem (None where missing).

    An answer line is ``Answer k: ...``, or ``Answer: ...`` inside the block that a ``Problem k`` line opens (the
    completion starts inside Problem ``first``'s block: `ChainProblem.reply_prefix` ends with its header). An
    ``Answer j: ...`` for a problem before the open block is a citation, not an answer. The
    answer is the number after the line's last ``=`` if there is one (``Answer 1: 4 * 5 = 20``), else its first
    number (``Answer 2: 15 (from Problem 1)``). The last problem's ``#### N`` overrides its answer line. Numbers are normalised as `learnkv.prompts.extract_answer` does.
    """
    return _parse(text, n_problems, first)[0]


def answer_spans(text: str, n_problems: int, first: int = 1) -> list[tuple[int, int] | None]:
    """Where `parse_answers` found each problem's answer: the ``(start, end)`` characters of its number in
    ``text`` (None where the problem has no answer)."""
    return _parse(text, n_problems, first)[1]


def _parse(text: str, n_problems: int, first: int) -> tuple[list[str | None], list[tuple[int, int] | None]]:
    out: list[str | None] = [None] * n_problems
    spans: list[tuple[int, int] | None] = [None] * n_problems
    current = first
    at = 0  # where the line starts in the text
    for segment in text.splitlines(keepends=True):
        line, start, at = (segment.splitlines() or [""])[0], at, at + len(segment)
        header = _HEADER.match(line)
        if header:
            current = int(header.group(1))
            continue
        m = _ANSWER_LINE.search(line)
        if m is None:
            continue
        k, rest = int(m.group(1) or current), m.group(2)
        if k < current:  # "Answer 2: 15" inside a later problem's work cites an answer, it does not give one
            continue
        if k > n_problems:
            continue
        current = k
        head, eq, tail = rest.rpartition("=")
        found, offset = _NUMBER.search(tail), len(head) + len(eq)
        if not found:
            found, offset = _NUMBER.search(rest), 0
        if found:
            out[k - 1] = normalise_number(found.group())
            base = start + m.start(2) + offset
            spans[k - 1] = (base + found.start(), base + found.end())
    final = _final(text)
    if final is not None:
        out[-1], spans[-1] = final
    return out, spans


def final_answer(text: str) -> str | None:
    """The number on the line of the last ``####`` that has one (None if there is none)."""
    final = _final(text)
    return None if final is None else final[0]


def _final(text: str) -> tuple[str, tuple[int, int]] | None:
    """`final_answer` and the characters of its number in ``text``."""
    ends = [0]
    for segment in text.splitlines(keepends=True):
        ends.append(ends[-1] + len(segment))
    for i, segment in reversed(list(enumerate(text.splitlines(keepends=True)))):
        line = (segment.splitlines() or [""])[0]
        head, sep, tail = line.rpartition("####")
        found = _NUMBER.search(tail) if sep else None
        if found:
            base = ends[i] + len(head) + len(sep)
            return normalise_number(found.group()), (base + found.start(), base + found.end())
    return None
