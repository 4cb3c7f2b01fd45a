"""Evaluation records -> results.json, a markdown table per task, and one PNG per task and metric.

Knows the record layout (`learnkv.eval.run.evaluate`) and nothing about models or policies. Every task metric is
shown as ``mean ± half-width`` of its 95% interval over prompts; with a baseline (``--compare``), a second table
lists each policy's paired difference to it and marks the differences whose interval excludes zero. Plots use
matplotlib's Agg backend (no display needed): metric vs budget, one line per policy, the interval as error bars.

An output directory is checked before the first decode (`prepare_output`), and a rerun into it never overwrites an
earlier run's results: `write_results` moves them into ``earlier-<time>/`` first.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Sequence
from pathlib import Path

from learnkv.atomic import ensure_dir, write_json_atomic

#: cost columns shown after each task's own metrics
COST_COLUMNS = ("kv_share", "kept_share", "peak_kv_bytes", "live_kv_bytes", "tokens_per_s", "eviction_share")
PLOTTED_COST = ("kv_share", "kept_share", "tokens_per_s", "eviction_share")
#: the ceiling and the headroom reference stand apart from the colour cycle
#: the learned scorer is the line people look for
REFERENCE_STYLE = {"full": {"color": "black", "linestyle": "--"}, "oracle": {"color": "dimgray", "linestyle": ":"},
                   "learned": {"color": "crimson", "linestyle": "-", "linewidth": 2.5}}
#: the other policies' colours: matplotlib's cycle without its red (C3, too close to learned) and gray (C7, which
#: reads as the oracle); past eight policies the colours repeat with dash-dot lines
PALETTE = tuple(f"C{i}" for i in range(10) if i not in (3, 7))


def policy_styles(policies) -> dict[str, dict]:
    """Line colour and style of each policy, the same in every plot of a task (the references stand apart)."""
    others = [p for p in policies if p not in REFERENCE_STYLE]
    styles = {p: {"color": PALETTE[i % len(PALETTE)], "linestyle": "-" if i < len(PALETTE) else "-."}
              for i, p in enumerate(others)}
    return {p: REFERENCE_STYLE.get(p) or styles[p] for p in policies}


def _fmt(metric: str, value, sign: str = "") -> str:
    """A metric's value at the precision its differences need (``sign="+"`` for a difference)."""
    if value is None:
        return "—"
    if metric in ("peak_kv_bytes", "live_kv_bytes"):
        return f"{value / 2**20:{sign}.2f}"
    if metric in ("tokens_per_s", "agreement_length", "budget_tokens", "generated_tokens"):
        return f"{value:{sign}.1f}"
    if metric in ("kl", "attention_recall"):  # long-run differences between policies are ~1e-3
        return f"{value:{sign}.4f}"
    return f"{value:{sign}.3f}"


def _header(metric: str) -> str:
    return {"peak_kv_bytes": "peak KV (MiB)", "live_kv_bytes": "live KV (MiB)",
            "tokens_per_s": "tokens/s"}.get(metric, metric)


def _metric_columns(records: list[dict]) -> list[str]:
    """A task's per-prompt metrics in the order its record lists them (no intervals, counts or cost)."""
    return [k for k in records[0]["per_prompt"] if k in records[0]["metrics"]]


def _with_interval(metric: str, metrics: dict) -> str:
    """``0.0123 ± 0.0040``: the mean and the half-width of its 95% interval (just the mean without one)."""
    value, ci = metrics.get(metric), metrics.get(f"{metric}_ci95")
    if value is None or not ci:
        return _fmt(metric, value)
    return f"{_fmt(metric, value)} ± {_fmt(metric, (ci[1] - ci[0]) / 2)}"


def _prompt_counts(rows: list[dict]) -> str:
    """``16 prompts``, or per budget where a run still going on has finished more prompts at one budget."""
    counts = {r["budget"]: r["config"]["n_prompts"] for r in rows}
    if len(set(counts.values())) == 1:
        return f"{next(iter(counts.values()))} prompts"
    return ", ".join(f"{n} prompts at budget {b}" for b, n in counts.items())


def markdown_table(records: list[dict], columns: list[str] | None = None) -> str:
    """One markdown table per task: a row per budget and policy (in run order), the task's metrics, then cost.

    ``columns`` picks the task metrics to show (default: all of them)."""
    out = []
    for task in dict.fromkeys(r["task"] for r in records):
        rows = [r for r in records if r["task"] == task]
        task_cols = [c for c in (columns or _metric_columns(rows)) if c in rows[0]["metrics"]]
        out.append(f"task: {task} ({_prompt_counts(rows)}, model {rows[0]['config']['model']}; mean ± half-width of "
                   "the 95% bootstrap interval over prompts)\n")
        out.append("| policy | budget | budget tokens | " + " | ".join(map(_header, task_cols + list(COST_COLUMNS)))
                   + " |")
        out.append("|---|---|---|" + "---|" * (len(task_cols) + len(COST_COLUMNS)))
        order = {b: i for i, b in enumerate(dict.fromkeys(r["budget"] for r in rows))}
        for r in sorted(rows, key=lambda r: order[r["budget"]]):  # stable: policies keep their order
            m = r["metrics"]
            cells = [r["policy"], str(r["budget"]), _fmt("budget_tokens", m.get("budget_tokens"))]
            cells += [_with_interval(c, m) for c in task_cols] + [_fmt(c, m.get(c)) for c in COST_COLUMNS]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name.replace("@", "_at_"))


def plot(records: list[dict], out_dir: str | Path) -> list[Path]:
    """``<task>_<metric>.png`` per task and metric (the task's metrics, then kv_share, kept_share, tokens/s, eviction
    share):
    metric vs budget, one line per policy. Budgets all fractions or all token counts share a numeric axis; a mix
    is drawn in the given order."""
    # matplotlib (~0.9 s, Agg backend set first) only when a plot is written
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    paths = []
    for task in dict.fromkeys(r["task"] for r in records):
        rows = [r for r in records if r["task"] == task]
        budgets = list(dict.fromkeys(r["budget"] for r in rows))
        numeric = len({type(b) for b in budgets}) == 1
        xs = {b: (b if numeric else i) for i, b in enumerate(budgets)}
        unit = ("fraction of the full length" if isinstance(budgets[0], float) else "tokens") if numeric else "as given"
        styles = policy_styles(list(dict.fromkeys(r["policy"] for r in rows)))
        for metric in _metric_columns(rows) + list(PLOTTED_COST):
            fig, ax = plt.subplots(figsize=(6, 4))
            for policy, style in styles.items():
                pts = sorted((xs[r["budget"]], r["metrics"].get(metric), r["metrics"].get(f"{metric}_ci95"))
                             for r in rows if r["policy"] == policy and r["metrics"].get(metric) is not None)
                if pts:
                    x, y = [p[0] for p in pts], [p[1] for p in pts]
                    err = [[max(v - ci[0], 0) if ci else 0 for _, v, ci in pts],
                           [max(ci[1] - v, 0) if ci else 0 for _, v, ci in pts]]
                    ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=policy, **style)
            if not numeric:
                ax.set_xticks(range(len(budgets)), [str(b) for b in budgets])
            ax.set_xlabel(f"budget ({unit})")
            ax.set_ylabel(metric)
            ax.set_title(f"{task}: {metric} ({rows[0]['config']['model']})")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, ncol=2)
            fig.tight_layout()
            path = out_dir / f"{_slug(task)}_{_slug(metric)}.png"
            fig.savefig(path, dpi=100)
            plt.close(fig)
            paths.append(path)
    return paths


def _difference(metric: str, pair: dict, sign: str = "") -> str:
    """``-0.0034 [-0.0084, +0.0018]``: a paired difference and its 95% interval, at the metric's precision."""
    lo, hi = (_fmt(metric, x, sign) for x in pair["ci95"])
    return f"{_fmt(metric, pair['mean_diff'], sign)} [{lo}, {hi}]"


def paired_table(pairs: list[dict], metrics: Sequence[str] | None = None) -> str:
    """One markdown table per task and budget: each policy's mean difference to the baseline in each metric, with
    its 95% paired interval; ``*`` marks an interval that excludes zero."""
    if not pairs:
        return ""
    out = []
    for task, budget in dict.fromkeys((p["task"], p["budget"]) for p in pairs):
        rows = [p for p in pairs if (p["task"], p["budget"]) == (task, budget)]
        cols = [m for m in dict.fromkeys(p["metric"] for p in rows) if metrics is None or m in metrics]
        out.append(f"paired difference to {rows[0]['baseline']} ({task}, budget {budget}; policy − baseline, 95% "
                   "paired-bootstrap interval; * = excludes zero)\n")
        out.append("| policy | n | " + " | ".join(cols) + " |")
        out.append("|---|---|" + "---|" * len(cols))
        for policy in dict.fromkeys(p["policy"] for p in rows):
            cells, n = [], "—"
            for c in cols:
                d = next((p for p in rows if p["policy"] == policy and p["metric"] == c), None)
                if d is None:
                    cells.append("—")
                    continue
                n = str(d["n"])
                cells.append(_difference(c, d) + ("*" if d["excludes_zero"] else ""))
            out.append(f"| {policy} | {n} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"



def summary_table(records: list[dict], pairs: list[dict], metrics: dict[str, Sequence[str]] | None = None) -> str:
    """The headline tables, one per task and budget: each policy's mean ± half-width of its 95% interval in the
    task's headline ``metrics`` (``{task: [metric, ...]}``; default: all of them), then its paired difference to the
    baseline in each with the 95% paired interval, **bold** where that interval excludes zero. What the README's
    result tables are (pasted as printed)."""
    if not pairs:
        return ""
    out = []
    for task, budget in dict.fromkeys((p["task"], p["budget"]) for p in pairs):
        rows = [r for r in records if (r["task"], r["budget"]) == (task, budget)]
        diffs = [p for p in pairs if (p["task"], p["budget"]) == (task, budget)]
        if not rows:
            continue
        cols = [c for c in (metrics or {}).get(task) or _metric_columns(rows) if c in rows[0]["metrics"]]
        baseline, m0 = diffs[0]["baseline"], rows[0]["metrics"]
        regime = f"{m0['n_prompts']} prompts"
        if m0.get("budget_tokens") is not None:
            regime += f", budget {m0['budget_tokens']:.0f} tokens on average"
        if m0.get("generated_tokens_median") is not None:
            regime += f", {rows[0]['policy']} writes a median {m0['generated_tokens_median']:.0f} tokens"
        out.append(f"{task}, budget {budget}: {regime}; mean ± half-width of the 95% bootstrap interval over prompts, "
                   f"then policy − {baseline} [95% paired-bootstrap interval], **bold**: excludes zero\n")
        out.append("| policy | " + " | ".join(cols) + " | " + " | ".join(f"{c} − {baseline}" for c in cols) + " |")
        out.append("|---|" + "---|" * (2 * len(cols)))
        for r in rows:
            cells = [_with_interval(c, r["metrics"]) for c in cols]
            for c in cols:
                d = next((p for p in diffs if p["policy"] == r["policy"] and p["metric"] == c), None)
                if d is None:  # the baseline itself, or a metric it has no value for
                    cells.append("")
                    continue
                text = _difference(c, d, "+")
                cells.append(f"**{text}**" if d["excludes_zero"] else text)
            out.append(f"| {r['policy']} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"



RESULTS = ("results.json", "results.md")


def _earlier_results(out_dir: Path) -> list[Path]:
    """What an earlier run wrote into ``out_dir`` (the results, the table, the plots)."""
    return [out_dir / name for name in RESULTS if (out_dir / name).is_file()] + sorted(out_dir.glob("*.png"))


def _keep_dir(out_dir: Path, paths: list[Path]) -> Path:
    """Where an earlier run's files move: ``earlier-<their latest time>/`` (a new name, never an existing one)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(max(p.stat().st_mtime for p in paths)))
    keep, n = out_dir / f"earlier-{stamp}", 1
    while keep.exists():
        keep, n = out_dir / f"earlier-{stamp}-{n}", n + 1
    return keep


def keep_aside(out_dir: Path, paths: list[Path]) -> Path:
    """Move an earlier run's files out of the way into a new ``earlier-<time>/`` of ``out_dir``; returns it."""
    keep = _keep_dir(out_dir, paths)
    keep.mkdir()
    for path in paths:
        os.replace(path, keep / path.name)
    return keep


def prepare_output(out_dir: str | Path) -> str | None:
    """Check, before any decode, that the results can be written to ``out_dir`` (created if missing); raises
    ValueError if not. Returns a line saying what an earlier run left there and where it will be kept, or None."""
    out_dir = ensure_dir(out_dir, "output directory")
    blocked = [name for name in RESULTS if (out_dir / name).exists() and not (out_dir / name).is_file()]
    if blocked:
        raise ValueError(f"{out_dir / blocked[0]} is not a file; this run writes its results there")
    earlier = _earlier_results(out_dir)
    if not earlier:
        return None
    return (f"{out_dir} holds an earlier run's results ({len(earlier)} files); they will be kept in "
            f"{_keep_dir(out_dir, earlier)}/ when this run writes its own")


def write_results(records: list[dict], out_dir: str | Path, pairs: list[dict] | None = None,
                  headline: dict[str, Sequence[str]] | None = None) -> dict[str, object]:
    """Write ``results.json`` (``{"records": [...], "paired": [...]}``), ``results.md`` (the tables; with pairs,
    the paired table and the headline tables of `summary_table` over the ``headline`` metrics too) and the plots
    into ``out_dir``; an earlier run's results there are moved into ``earlier-<time>/`` first.

    Returns
    -------
    dict
        ``{"json": Path, "table": Path, "plots": [Path, ...]}``.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if earlier := _earlier_results(out_dir):
        keep_aside(out_dir, earlier)
    json_path, md_path = out_dir / "results.json", out_dir / "results.md"
    write_json_atomic(json_path, {"records": records, "paired": pairs or []})
    tables = [markdown_table(records)]
    if pairs:
        tables += [paired_table(pairs), summary_table(records, pairs, headline)]
    md_path.write_text("\n".join(tables))
    return {"json": json_path, "table": md_path, "plots": plot(records, out_dir)}


__all__ = ["keep_aside", "markdown_table", "paired_table", "plot", "prepare_output", "summary_table", "write_results"]
