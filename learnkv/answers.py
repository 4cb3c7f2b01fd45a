"""Numeric answers: the one normalisation every grader compares with (GSM8K-style prompts in `learnkv.prompts`,
the chain task's answer lines in `learnkv.chains`)."""

from __future__ import annotations

from decimal import Decimal, InvalidOperation


def normalise_number(s: str) -> str | None:
    """``"1,234.50"`` -> ``"1234.5"``, ``"18.0"`` -> ``"18"``, ``"-0"`` -> ``"0"``; None if it is not a number."""
    s = s.replace(",", "").strip().rstrip(".")
    try:
        d = Decimal(s)
    except InvalidOperation:
        return None
    if not d.is_finite():
        return None
    text = format(d, "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text
