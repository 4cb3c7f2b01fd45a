"""Policy items on the command line: ``--param window=16`` and ``--policy "lazy,lazy:variant=paper"``.

- ``--param window=16``: `parse_value` turns ``"16"`` into 16, ``"0.5"`` into 0.5, ``"true"`` into True, else a
  string (the policy then checks it against its declared type and range, `learnkv.fields`);
- ``--policy "lazy,lazy:variant=paper,lazy:window=16:alpha=5e-4"``: `parse_policy_list` gives one ``(label, name,
  params)`` per item, the label being the item as written (how tables and results name the row).
"""

from __future__ import annotations


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
    for item in dict.fromkeys(s.replace(" ", "") for s in items):  # one label per item however it was spaced
        name, params = parse_policy(item)
        out.append((item, name, params))
    return out
