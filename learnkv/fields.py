"""Typed settings: a dataclass field declares its range, and `check_fields` coerces and checks every value.

    @dataclass
    class TrainConfig:
        lr: float = setting(3e-3, gt=0)
        hidden: int = setting(32, ge=1)

`check_fields(obj)` turns each value into its field's declared type or raises a one-line ValueError naming the
setting and the value: ``"1e-3"`` (YAML 1.1 reads it as a string) becomes ``0.001``, ``"abc"`` for an int is
refused, NaN and infinity are refused for every float, and a value out of its declared range is refused with the
range. Configs (`learnkv.config`, `learnkv.traces.collect.CollectConfig`) are checked when they are loaded, and
policy hyperparameters when a policy is built (`learnkv.policies.base.Policy`), so a bad value never reaches the
code that uses it. A window given as tokens or as a share of a budget is ``int | float`` with ``fraction=True``:
an int is a token count (its range applies), a float a fraction in [0, 1].
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing


def setting(default, *, ge=None, gt=None, le=None, choices=None, fraction=False):
    """A dataclass field with a checked range: ``ge`` / ``gt`` lower bounds, ``le`` upper bound, or ``choices``.
    For a dict the range applies to its values, for a tuple to its items. ``fraction``: a float value is a fraction
    in [0, 1] (the range applies to ints). A mutable default (dict, list) is copied per instance."""
    rule = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("choices", choices)) if v is not None}
    rule["declared"] = True
    if fraction:
        rule["fraction"] = True
    if isinstance(default, (dict, list)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=rule)
    return dataclasses.field(default=default, metadata=rule)


def check_fields(obj, where: str = "", declared_only: bool = False) -> None:
    """Coerce every field of the dataclass ``obj`` (recursively) to its declared type, in place, and check its
    range; raises ValueError naming ``where + field``. ``declared_only``: only the fields declared with `setting`
    (the others are internal state, e.g. a policy's loaded future)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        if declared_only and not f.metadata.get("declared"):
            continue
        name, value = where + f.name, getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            check_fields(value, name + ".")
            continue
        value = coerce(value, hints[f.name], name)
        if isinstance(value, dict):
            items = {f"{name}.{k}": v for k, v in value.items()}
        elif isinstance(value, tuple):
            items = {f"{name}[{i}]": v for i, v in enumerate(value)}
        else:
            items = {name: value}
        for item_name, v in items.items():
            _check_range(v, f.metadata, item_name)
        setattr(obj, f.name, value)


def coerce(value, tp, name: str):
    """``value`` as type ``tp`` (bool, int, float, str, ``tuple[X, ...]``, ``dict[str, X]``, or a union of these)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        for option in args:
            try:
                return coerce(value, option, name)
            except ValueError:
                pass
        raise ValueError(f"{name} must be {' or '.join(_kind(a) for a in args)}, got {value!r}")
    if origin is tuple:
        items = list(value) if isinstance(value, (list, tuple)) else [value]
        return tuple(coerce(v, args[0], f"{name}[{i}]") for i, v in enumerate(items))
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{name} must be a mapping such as {{key: value}}, got {value!r}")
        key_tp, value_tp = args or (str, object)
        return {coerce(k, key_tp, f"{name} key"): coerce(v, value_tp, f"{name}.{k}") for k, v in value.items()}
    if tp is object:
        return value
    if tp is type(None):
        if value is None:
            return None
        raise ValueError(f"{name} must be unset, got {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, str):
            value = _number(value)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, str):
            value = _number(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value}")
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    else:
        raise TypeError(f"{name}: unsupported setting type {tp!r}")
    raise ValueError(f"{name} must be {_kind(tp)}, got {value!r}")


def _number(text: str):
    for cast in (int, float):
        try:
            return cast(text.strip())
        except ValueError:
            pass
    return text


def _kind(tp) -> str:
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string",
            type(None): "unset (none)"}.get(tp, str(tp))


def _check_range(value, rule: dict, name: str) -> None:
    if "choices" in rule and value not in rule["choices"]:
        raise ValueError(f"{name} must be one of {', '.join(map(str, rule['choices']))}, got {value!r}")
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    if rule.get("fraction") and isinstance(value, float):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be a token count or a fraction in [0, 1], got {value}")
        return
    ge, gt, le = rule.get("ge"), rule.get("gt"), rule.get("le")
    low_ok = (ge is None or value >= ge) and (gt is None or value > gt)
    if low_ok and (le is None or value <= le):
        return
    low = f"[{ge}" if ge is not None else f"({gt}" if gt is not None else None
    if low and le is not None:
        expected = f"in {low}, {le}]"
    elif low:
        expected = f">= {ge}" if ge is not None else f"> {gt}"
    else:
        expected = f"<= {le}"
    raise ValueError(f"{name} must be {expected}, got {value}")
