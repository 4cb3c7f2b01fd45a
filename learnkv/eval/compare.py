"""Pair policies across evaluations: a policy evaluated later against a table finished earlier, on their shared prompts.

    python -m learnkv compare docs/results/long-chain-smollm2/finished runs/eval-long-chain-horizon --baseline learned

At length a table costs hours per policy and budget; a new policy (another scorer, an oracle horizon) is evaluated
alone on some of the same prompts, and its paired intervals against the table's rows come from here, with no run
repeated. Each path is an evaluation's output directory (its results.json, or the finished/ one `--finished-only`
writes while it runs) or a results.json. Records are matched by prompt id (``config.prompt_ids``), so the same policy
from several files (batches finished by different runs) pools into one set of prompts; a policy that two files
give different values on one prompt (two scorers under one label, say) is refused rather than silently picked.
Only one regime is paired at a time: records of one task and budget must agree on the model and the task's options
(the continuation, its length, the prompts' source), which is what makes two values a pair; one label from two
files must also name one setup (its parameters as given, scorer path included, and its prefill policy; a window
that each batch resolves from its own budget is not a different setup). Two setups under one
label (the same policy with another prefill policy, say) pair once one file's labels are tagged: ``PATH@TAG`` reads
that file's policies as ``LABEL@TAG`` (``--baseline learned@TAG`` names one of them).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path

from learnkv.eval.run import paired
from learnkv.policies import POLICIES

#: what must agree between two records for their values on one prompt to be a pair
REGIME = ("model", "task_options")
#: what must agree between two records of one policy label for them to be one policy
SETUP = ("policy_name", "policy_params", "prefill_policy")
#: a budget no policy's windows outgrow, to read which parameters a policy derives from its budget
_PROBE_BUDGET = 1 << 16


def read_records(path: str | Path) -> list[dict]:
    """The records of one evaluation: ``path`` is its output directory (or finished/) or a results.json, or either
    as ``PATH@TAG``, whose records' policy labels become ``LABEL@TAG`` (a path that exists as written is a path)."""
    tag = None
    if not Path(path).exists() and "@" in str(path):
        path, tag = str(path).rsplit("@", 1)
        if not tag:
            raise ValueError(f"{path}@: an empty tag (PATH@TAG labels that file's policies LABEL@TAG)")
    records = _read_records(Path(path))
    if tag:
        for r in records:
            r["policy"] = f"{r['policy']}@{tag}"
    return records


def _read_records(path: Path) -> list[dict]:
    file = path / "results.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"{path}: no results.json (give an evaluation's output directory, its finished/ while it "
                         "runs, or a results.json)")
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: not a results file ({e})") from None
    records = data.get("records") if isinstance(data, dict) else None
    if not isinstance(records, list) or not all(isinstance(r, dict) and "per_prompt" in r for r in records):
        raise ValueError(f"{file}: not a results file of evaluate.py (no records with per-prompt values)")
    for r in records:
        if len(r.get("config", {}).get("prompt_ids") or []) != len(next(iter(r["per_prompt"].values()), [])):
            raise ValueError(f"{file}: record {r.get('policy')} at budget {r.get('budget')} does not name its prompts "
                             "(config.prompt_ids); it was written before evaluate.py recorded them")
    return records


def _same(a, b) -> bool:
    """Two runs' values of one metric on one prompt: equal up to batching's float rounding."""
    if a is None or b is None:
        return a is b
    return math.isclose(a, b, rel_tol=1e-3, abs_tol=1e-4)


@functools.cache
def _budget_derived(name: str | None) -> frozenset[str]:
    """The parameters of policy ``name`` whose resolved value each batch derives from its own budget: windows given
    as a fraction of it (`learnkv.fields.setting`'s ``fraction``) and the paper defaults `resolve_defaults` fills."""
    cls = POLICIES.get(name)
    if cls is None:
        return frozenset()
    keys = {f.name for f in dataclasses.fields(cls) if f.metadata.get("fraction")}
    try:
        keys |= set(cls().resolve_defaults(_PROBE_BUDGET))
    except ValueError:  # the learned policy needs its scorer to resolve; its windows are the fraction fields above
        pass
    return frozenset(keys)


def _setups_differ(a: dict, b: dict) -> list[str]:
    """The `SETUP` keys on which two records' configs name different setups of one label. Parameters compare as
    given (``policy_given``) where both records have them. Records written before evaluate.py stored them compare
    their resolved parameters less the budget-derived ones: those differ between two batches of one run at a
    fractional budget (each batch resolves its own), and a value given explicitly is in the label already."""
    differ = [k for k in SETUP if k != "policy_params" and a.get(k) != b.get(k)]
    if "policy_given" in a and "policy_given" in b:
        same = a["policy_given"] == b["policy_given"]
    else:
        derived = _budget_derived(a.get("policy_name"))
        strip = lambda params: {k: v for k, v in (params or {}).items() if k not in derived}  # noqa: E731
        same = strip(a.get("policy_params")) == strip(b.get("policy_params"))
    return differ + ([] if same else ["policy_params"])


def pool(sources: dict[str, list[dict]]) -> list[dict]:
    """One record per (task, budget, policy) over every file, its per-prompt values keyed by prompt id.

    Returns records ``{"task", "budget", "policy", "values": {prompt id: {metric: value}}, "from": {prompt id:
    file}, "setup": (its record's config, first file)}`` in order of first appearance; raises ValueError where
    one task and budget holds records of two regimes, where one label names two setups, or where two files disagree
    on a policy's value for one prompt."""
    pooled: dict[tuple, dict] = {}
    regimes: dict[tuple, tuple[dict, str]] = {}
    for source, records in sources.items():
        for r in records:
            regime = {k: r.get("config", {}).get(k) for k in REGIME}
            where = (r["task"], r["budget"])
            first = regimes.setdefault(where, (regime, source))
            if first[0] != regime:
                differ = [k for k in REGIME if first[0].get(k) != regime.get(k)]
                raise ValueError(f"{r['task']} at budget {r['budget']}: {first[1]} and {source} are runs of different "
                                 f"regimes ({', '.join(differ)} differ): their values are not pairs")
            setup = r.get("config", {})
            slot = pooled.setdefault((*where, r["policy"]), {"task": r["task"], "budget": r["budget"],
                                                             "policy": r["policy"], "values": {}, "from": {},
                                                             "setup": (setup, source)})
            differ = _setups_differ(slot["setup"][0], setup)
            if differ:
                raise ValueError(f"{r['policy']} at budget {r['budget']} is not one policy in {slot['setup'][1]} and "
                                 f"{source} ({', '.join(differ)} differ); rename one (e.g. learned:scorer=PATH)")
            for i, pid in enumerate(r["config"]["prompt_ids"]):
                row = {m: v[i] for m, v in r["per_prompt"].items()}
                if pid in slot["values"]:
                    bad = [m for m in row if m in slot["values"][pid] and not _same(row[m], slot["values"][pid][m])]
                    if bad:
                        raise ValueError(f"{r['policy']} at budget {r['budget']} differs on prompt {pid} between "
                                         f"{slot['from'][pid]} and {source} ({', '.join(bad)}): two different runs "
                                         "under one label; rename one (e.g. learned:scorer=PATH)")
                    continue
                slot["values"][pid] = row
                slot["from"][pid] = source
    return list(pooled.values())


def compare(paths: list[str | Path], baseline: str, seed: int = 0) -> tuple[list[dict], list[str]]:
    """Paired differences of every policy to ``baseline`` over the prompts both have, across ``paths``.

    Returns the pairs (as `learnkv.eval.run.paired`: policy - baseline, 95% paired-bootstrap interval, n) and notes
    (policies with no baseline at some budget, or no prompt in common with it)."""
    pooled = pool({str(p): read_records(p) for p in paths})
    if not any(r["policy"] == baseline for r in pooled):
        known = sorted({r["policy"] for r in pooled})
        raise ValueError(f"no record of baseline {baseline!r} in {', '.join(map(str, paths))}; "
                         f"policies: {', '.join(known)}")
    if all(r["policy"] == baseline for r in pooled):
        raise ValueError(f"{', '.join(map(str, paths))} hold(s) only the baseline {baseline!r}: nothing to compare it "
                         "with (add the evaluation of another policy on the same prompts)")
    pairs, notes = [], []
    for task, budget in dict.fromkeys((r["task"], r["budget"]) for r in pooled):
        group = [r for r in pooled if (r["task"], r["budget"]) == (task, budget)]
        base = next((r for r in group if r["policy"] == baseline), None)
        if base is None:
            notes.append(f"{task} at budget {budget}: no {baseline} record; its {len(group)} policies are not paired")
            continue
        ids = list(base["values"])  # the baseline's prompts, in its order
        aligned = []
        for r in group:
            shared = [pid for pid in ids if pid in r["values"]]
            if not shared:
                notes.append(f"{r['policy']} at budget {budget} shares no prompt with {baseline}")
                continue
            metrics = dict.fromkeys(m for pid in shared for m in r["values"][pid])
            aligned.append({"task": task, "budget": budget, "policy": r["policy"],
                            "per_prompt": {m: [r["values"].get(pid, {}).get(m) for pid in ids] for m in metrics}})
        pairs += paired(aligned, baseline, seed=seed)
    return pairs, notes


__all__ = ["compare", "pool", "read_records", "REGIME", "SETUP"]
