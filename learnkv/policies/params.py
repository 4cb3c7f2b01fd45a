"""Policy hyperparameters: declared with their range, checked when a policy is built, parsed from the command line.

A policy's hyperparameters are its dataclass fields. `param` declares one with its range (``low``/``high``,
``choices``); `check_params` runs in `Policy.__post_init__`, so every way of building a policy (`make_policy`,
`dataclasses.replace`, `Policy.resolve`, a config file) is checked in one place: the value must have the field's
type (an int where an int is declared, a finite number where a float is), lie in its range, and a string must be
one of its choices. The message names the policy, the parameter and the value, so bad input is one line.

Command-line forms, parsed here and nowhere else:

- ``--param window=16``: `parse_value` turns ``"16"`` into 16, ``"0.5"`` into 0.5, ``"true"`` into True, else a string;
- ``--policy "lazy,lazy:variant=paper,lazy:window=16:alpha=5e-4"``: `parse_policy_list` gives one ``(label, name,
  params)`` per item, the label being the item as written (how tables and results name the row).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import field
from typing import Any

_SIMPLE = (bool, int, float, str, type(None))


def param(default: Any, *, low: float | None = None, high: float | None = None, choices: tuple | None = None,
          doc: str = ""):
    """A policy hyperparameter: a dataclass field with its allowed range.

    Parameters
    ----------
    default
        The default value (it must pass the same checks).
    low, high : float, optional
        Inclusive bounds for numbers. For an ``int | float`` window, a float is a fraction of the budget and must
        lie in [0, 1]; the bounds apply to ints.
    choices : tuple, optional
        The allowed values of a string parameter.
    """
    return field(default=default, metadata={"low": low, "high": high, "choices": choices, "doc": doc})


def _allowed_types(annotation) -> tuple[type, ...] | None:
    """The simple types an annotation admits (``int | float | None`` -> (int, float, NoneType)); None if it admits
    anything else (such fields are internal state, not hyperparameters, and are not checked)."""
    if annotation in _SIMPLE:
        return (annotation,)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        return args if all(a in _SIMPLE for a in args) else None
    return None


def _describe(types_: tuple[type, ...], meta: dict) -> str:
    """What a field accepts, in words: "an integer >= 1", "a number in [0, 1]", "one of official, paper"."""
    parts = []
    if meta.get("choices"):
        return "one of " + ", ".join(map(str, meta["choices"]))
    low, high = meta.get("low"), meta.get("high")
    rng = ""
    if low is not None and high is not None:
        rng = f" in [{low}, {high}]"
    elif low is not None:
        rng = f" >= {low}"
    elif high is not None:
        rng = f" <= {high}"
    if int in types_ and float in types_:
        parts.append(f"an integer{rng} (tokens) or a fraction in [0, 1] of the budget")
    elif int in types_:
        parts.append(f"an integer{rng}")
    elif float in types_:
        parts.append(f"a finite number{rng}")
    elif bool in types_:
        parts.append("true or false")
    elif str in types_:
        parts.append("a string")
    if type(None) in types_:
        parts.append("unset (the default)")
    return " or ".join(parts)


def _check_value(value, types_: tuple[type, ...], meta: dict):
    """The value, converted (an int where only a float is declared), or raise ValueError (message: what it should be)."""
    if value is None:
        if type(None) in types_:
            return None
        raise ValueError
    if isinstance(value, bool):
        if bool in types_:
            return value
        raise ValueError
    if isinstance(value, int) and int in types_:
        low, high = meta.get("low"), meta.get("high")
        if (low is not None and value < low) or (high is not None and value > high):
            raise ValueError
        return value
    if isinstance(value, (int, float)) and float in types_:
        value = float(value)
        if not math.isfinite(value):
            raise ValueError
        low, high = meta.get("low"), meta.get("high")
        if int in types_:  # a window: a float is a fraction of the budget
            low, high = 0.0, 1.0
        if (low is not None and value < low) or (high is not None and value > high):
            raise ValueError
        return value
    if isinstance(value, str) and str in types_:
        if meta.get("choices") and value not in meta["choices"]:
            raise ValueError
        return value
    raise ValueError


def check_params(policy) -> None:
    """Check (and normalise) every simple-typed field of a policy dataclass; raise ValueError naming the bad one."""
    cls = type(policy)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        types_ = _allowed_types(hints.get(f.name))
        if types_ is None:
            continue
        value = getattr(policy, f.name)
        meta = dict(f.metadata)
        try:
            checked = _check_value(value, types_, meta)
        except ValueError:
            raise ValueError(f"policy {cls.name or cls.__name__!r}: parameter {f.name} must be "
                             f"{_describe(types_, meta)}, got {value!r}") from None
        if checked is not value:
            object.__setattr__(policy, f.name, checked)


def parse_value(text: str):
    """A command-line value: ``"16"`` -> 16, ``"0.5"`` / ``"5e-4"`` -> float, ``"true"``/``"false"`` -> bool,
    ``"none"`` -> None, anything else the string itself (the policy's checks then say whether it fits)."""
    text = text.strip()
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_params(pairs: list[str] | tuple[str, ...], what: str = "--param") -> dict:
    """``["window=16", "variant=paper"]`` -> ``{"window": 16, "variant": "paper"}``."""
    params = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{what} takes NAME=VALUE, got {pair!r}")
        params[key.strip()] = parse_value(value)
    return params


def parse_policy(item: str) -> tuple[str, dict]:
    """``"lazy:window=16:variant=paper"`` -> ``("lazy", {"window": 16, "variant": "paper"})``."""
    name, *pairs = item.strip().split(":")
    if not name.strip():
        raise ValueError(f"policy item {item!r} has no name (NAME[:key=value]...)")
    return name.strip(), parse_params(pairs, what=f"policy {item!r}: each ':' part")


def parse_policy_list(text: str | list) -> list[tuple[str, str, dict]]:
    """``"h2o,lazy:window=16"`` (or a list of such items) -> ``[(label, name, params), ...]``, duplicates dropped.

    The label is the item as written, whitespace removed: it names the row in tables, plots and results.
    """
    items = [s.strip() for s in text.split(",")] if isinstance(text, str) else [str(s).strip() for s in text]
    if not items or any(not s for s in items):
        raise ValueError(f"--policy takes a comma-separated list with no empty items, got {text!r}")
    out = []
    for item in dict.fromkeys(items):
        name, params = parse_policy(item)
        out.append((item.replace(" ", ""), name, params))
    return out
