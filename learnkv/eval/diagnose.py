"""Where a policy loses on the chain task, and what it had evicted that the full cache needed there.

Per held-out chain prompt: the full cache decodes freely (the chain task's reference) and so does the policy under
its budget, both graded per problem (`learnkv.eval.tasks.chain`). A problem is *lost* when the full cache got it
right and the policy got it wrong. For the first lost problem (or every one) the question is which tokens the
policy no longer held when the answer was written.

Alignment. The two free runs share the prompt and diverge after their first differing token, so past that point a
position holds different text in each. The policy is therefore teacher-forced along the full cache's output (as the
fidelity task does): every position then holds the same token in both runs, and the policy's kept set at each step
is the one it would have held on the full cache's path. At the step where the full cache writes a lost answer's
digits (the query that chose each digit token, at position P + i - 1 for output token i), this module takes the full
cache's attention over every earlier position (group mean per KV head, `learnkv.capture.full_attention`)
and the positions the forced policy held after the previous step plus the query itself, and reports:

* ``evicted_share``: the share of that attention on positions the policy had evicted, per layer and KV head, then
  averaged over heads (``evicted_share_per_layer``) and layers, and over the answer's digit tokens; 0 for a policy
  that held everything; ``1 - attention_recall`` of those steps (`learnkv.eval.metrics.attention_recall`);
* ``top_lines``: the lines of prompt and output (``Fact B: Each bag holds 7 beads.``, ``Answer 12: 48``) whose
  evicted tokens carried most of it, each with its share (the shares of every line add up to ``evicted_share``), its
  most-attended evicted tokens, and a tag where the line is what the problem needs (``fact``: the fact it uses;
  ``answer``: the answer line of the problem it uses; ``problem``: its own statement);
* ``needed_share``: the part of ``evicted_share`` on lines tagged ``fact`` or ``answer``;
* ``control_share``: the same ``evicted_share`` at the answers of the problems both runs got right (mean over them),
  what a lost answer's share is to be read against.

What the forced run shows is what the policy evicts on the full cache's path, not on its own: after its first
differing token (``diverged_at``) the policy's own output differs, and so may what it keeps.

A diagnosis at full length runs for hours: `diagnose` keeps each finished batch in a state directory and a rerun
reads it back (`batch_identity` names what a batch's records depend on).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from tqdm.auto import tqdm

from learnkv import chains
from learnkv.atomic import ensure_dir, write_text_atomic
from learnkv.decode import generate
from learnkv.eval.checkpoint import (drop_references, identity_digest, load_references, reference_identity,
                                     run_identity, save_references)
from learnkv.progress import redraw_seconds, token_counter
from learnkv.settings import resolve_budget
from learnkv.eval.metrics import agreement_length, attention_recall
from learnkv.eval.run import batches
from learnkv.eval.stats import bootstrap_ci, paired_difference
from learnkv.eval.tasks.base import RunConfig, Sample, evicts
from learnkv.eval.tasks.chain import Chain, ChainRun, grade_chain, kind_accuracy
from learnkv.eval.tasks.fidelity import kept_positions
from learnkv.capture import full_attention

#: lines and tokens listed per lost problem
TOP = 5


@dataclass
class StepAttention:
    """The full cache's attention at one output step and what the forced policy had evicted by then.

    Attributes
    ----------
    step : int
        i: the output token this step chose (its query is at position P + i - 1).
    attention : Tensor
        ``[layers, H_kv, K]`` float32, the group-mean attention of that query over positions ``0 .. K - 1``
        (K = P + i: up to and including the query).
    evicted : Tensor
        ``[layers, H_kv, K]`` bool: True where the policy held neither the position after pass i - 1 nor the query.
    """

    step: int
    attention: Tensor
    evicted: Tensor

    def share_per_head(self) -> Tensor:
        """``[layers, H_kv]`` float64: the share of each head's attention on evicted positions."""
        return 1.0 - attention_recall(self.attention, ~self.evicted)

    def mass(self) -> Tensor:
        """``[K]`` float64: each position's evicted attention as a share of a head's, averaged over layers and heads
        (sums to the mean of `share_per_head`)."""
        a = self.attention.double()
        total = a.sum(-1, keepdim=True).clamp(min=1e-300)
        return (a * self.evicted / total).mean(dim=(0, 1))


def evicted_attention(model, tokenizer, task: Chain, sample: Sample, continuation: Tensor, steps: Sequence[int],
                      run: RunConfig) -> dict[int, StepAttention]:
    """For each output step ``i >= 1`` of ``steps``: the full cache's attention of the query that chose
    ``continuation[0, i]`` and the positions the policy of ``run`` (one row: its budget in tokens) had evicted by then,
    teacher-forced along ``continuation`` ``[1, N]`` with the task's length and granularity (`StepAttention`).

    The forced decode is the fidelity task's (same tokens, same budget, same prefill policy); the attention is one
    full-cache forward over the prompt and the continuation up to the last step asked, keeping only the query rows
    from the first step asked on.
    """
    return evicted_attention_batch(model, tokenizer, task, [sample], [continuation], [steps], run)[0]


def evicted_attention_batch(model, tokenizer, task: Chain, samples: Sequence[Sample], continuations: Sequence[Tensor],
                            steps: Sequence[Sequence[int]], run: RunConfig) -> list[dict[int, StepAttention]]:
    """`evicted_attention` of several prompts, their forced decodes as rows of one batch (each row decodes as it
    would alone; ``run.budgets`` has one budget per row), then each prompt's full-cache attention alone."""
    steps = [sorted({int(i) for i in row}) for row in steps]
    for row, cont in zip(steps, continuations):
        if row and (row[0] < 1 or row[-1] >= cont.shape[1]):
            raise ValueError(f"steps must be in [1, {cont.shape[1] - 1}] (step 0 is chosen at the prefill, before "
                             f"anything is evicted), got {row[0]}..{row[-1]}")
    wanted: dict[int, list[int]] = {}  # pass i - 1's kept set is what step i's query attends to (with itself)
    for b, row in enumerate(steps):
        for i in row:
            wanted.setdefault(i - 1, []).append(b)
    kept: list[dict[int, Tensor]] = [{} for _ in samples]
    passes = iter(range(1 << 30))

    def observe(cache) -> None:
        j = next(passes)
        if j in wanted:
            held = kept_positions(cache).cpu()  # [layers, B, H_kv, T]
            for b in wanted[j]:
                kept[b][j + 1] = held[:, b].clone()

    pad_id = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
    forced = torch.full((len(samples), max(c.shape[1] for c in continuations)), pad_id or 0, dtype=torch.long)
    for b, cont in enumerate(continuations):
        forced[b, : cont.shape[1]] = cont[0]
    task.decode_batch(model, tokenizer, list(samples), run, forced_tokens=forced, observer=observe)
    return [_step_views(model, sample, cont, row, held)
            for sample, cont, row, held in zip(samples, continuations, steps, kept)]


def _step_views(model, sample: Sample, continuation: Tensor, steps: list[int],
                kept: dict[int, Tensor]) -> dict[int, StepAttention]:
    """One prompt's `StepAttention` at ``steps``, from the forced run's kept positions after each step's pass."""
    if not steps:
        return {}
    P = sample.input_ids.shape[1]
    device = next(model.parameters()).device
    seq = torch.cat([sample.input_ids, continuation[:, : steps[-1]]], dim=1).to(device)
    first = P + steps[0] - 1
    rows = full_attention(model, seq, torch.ones_like(seq), generate, first_row=first, dtype=torch.float32)
    out = {}
    for i in steps:
        q = P + i - 1
        attn = torch.stack([layer[0, :, q - first, : q + 1] for layer in rows]).cpu()  # [layers, H_kv, K]
        held = kept[i]
        visible = torch.zeros(*held.shape[:2], q + 2, dtype=torch.bool)  # the last column swallows -1 and beyond
        visible.scatter_(2, torch.where((held >= 0) & (held <= q), held, q + 1), True)
        visible = visible[..., : q + 1]
        visible[..., q] = True
        out[i] = StepAttention(i, attn, ~visible)
    return out


def token_pieces(tokenizer, ids: Sequence[int]) -> list[str]:
    """Each token's text alone (special tokens kept): what a position is shown as."""
    return [tokenizer.decode([int(t)], skip_special_tokens=False) for t in ids]


def token_spans(tokenizer, ids: Sequence[int]) -> list[tuple[int, int]]:
    """Per token of a continuation, the ``(start, end)`` characters it adds to its decoded text (``decode`` of the
    whole row with special tokens skipped, as the chain task grades it): each token's own text where they add up to
    the whole (ASCII text), else by decoding each prefix."""
    ids = [int(t) for t in ids]
    pieces = tokenizer.batch_decode([[t] for t in ids], skip_special_tokens=True)
    ends = []
    if "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True):
        for piece in pieces:
            ends.append((ends[-1] if ends else 0) + len(piece))
    else:
        for n in range(1, len(ids) + 1):
            ends.append(max(len(tokenizer.decode(ids[:n], skip_special_tokens=True)), ends[-1] if ends else 0))
    return [(0 if i == 0 else ends[i - 1], end) for i, end in enumerate(ends)]


def answer_steps(spans: Sequence[tuple[int, int]], answer: tuple[int, int]) -> list[int]:
    """The output steps (token indices) whose characters (`token_spans`) overlap the characters ``answer``."""
    return [i for i, (a, b) in enumerate(spans) if a < answer[1] and b > answer[0] and b > a]


def lines_of(pieces: Sequence[str]) -> list[int]:
    """Each token's line: the newlines written before it (a token that starts with newlines is on the next line)."""
    out, n = [], 0
    for piece in pieces:
        stripped = piece.lstrip("\n")
        n += len(piece) - len(stripped)
        out.append(n)
        n += stripped.count("\n")
    return out


def needs(problem: int, depends: int | None, fact: int | None) -> dict[str, re.Pattern]:
    """The lines problem ``problem`` (1-based) needs, as patterns on a line's text: its fact's line, the answer line
    of the problem it uses, its own statement."""
    out = {"problem": re.compile(rf"^\W*Problem {problem}\b")}
    if fact is not None:
        out["fact"] = re.compile(rf"^\W*Fact {chains.FACT_LETTERS[fact]}\b")
    if depends is not None:
        out["answer"] = re.compile(rf"\bAnswer {depends}\b", re.I)
    return out


def top_lines(mass: Tensor, pieces: Sequence[str], line: Sequence[int], prompt_len: int,
              tags: dict[str, re.Pattern], top: int = TOP) -> list[dict]:
    """The lines whose evicted tokens carried the most attention (``mass`` ``[K]`` per position), most first:
    ``{"text", "where" (prompt or output), "positions" [first, last], "share", "tag", "tokens"}``, ``tokens`` the
    line's most-attended evicted tokens ``{"position", "text", "share"}``."""
    K = mass.shape[0]
    by_line: dict[int, list[int]] = {}
    for p in range(K):
        by_line.setdefault(line[p], []).append(p)
    out = []
    for positions in by_line.values():
        share = float(mass[positions].sum())
        if share <= 0:
            continue
        text = "".join(pieces[p] for p in positions).strip()
        tag = next((name for name, pattern in tags.items() if pattern.search(text)), None)
        ranked = sorted((p for p in positions if mass[p] > 0), key=lambda p: -float(mass[p]))[:top]
        out.append({"text": text, "where": "prompt" if positions[0] < prompt_len else "output",
                    "positions": [positions[0], positions[-1]], "share": share, "tag": tag,
                    "tokens": [{"position": p, "text": pieces[p], "share": float(mass[p])} for p in ranked]})
    return sorted(out, key=lambda r: -r["share"])


def diagnose_prompt(model, tokenizer, task: Chain, sample: Sample, ref: ChainRun, policy_text: str,
                    policy_tokens: Tensor, run: RunConfig, all_lost: bool = False, top: int = TOP) -> dict:
    """One prompt's diagnosis (the module docstring): grades both free runs, finds the lost problems and, for the
    first (or every) one, what the policy of ``run`` (one row) had evicted of the full cache's attention there."""
    record, plan = _plan(tokenizer, task, sample, ref, policy_text, policy_tokens, run, all_lost)
    if not plan["wanted"]:
        return record
    views = evicted_attention(model, tokenizer, task, sample, ref.tokens, plan["wanted"], run)
    return _explain(tokenizer, task, sample, ref, record, plan, views, top)


def _plan(tokenizer, task: Chain, sample: Sample, ref: ChainRun, policy_text: str, policy_tokens: Tensor,
          run: RunConfig, all_lost: bool) -> tuple[dict, dict]:
    """Both free runs graded, the lost problems, and the output steps that wrote the answers to look at."""
    gold, given, kinds = task.gold(sample), task.given(sample), task.kinds(sample)
    if kinds is None:
        raise ValueError(f"chain sample {sample.id} has no problem kinds (meta['depends'] and meta['facts'])")
    full = grade_chain(ref.text, gold, given=given, kinds=kinds)
    pol = grade_chain(policy_text, gold, ref.answers, given=given, kinds=kinds)
    lost = [k for k in range(given, len(gold)) if full["right"][k] and not pol["right"][k]]
    both = [k for k in range(given, len(gold)) if full["right"][k] and pol["right"][k]]
    ids = ref.tokens[0].tolist()
    spans = chains.answer_spans(ref.text, len(gold), first=given + 1)
    chars = token_spans(tokenizer, ids)
    steps = {k: [i for i in answer_steps(chars, spans[k]) if i >= 1]
             for k in lost + both if spans[k] is not None}
    targets = [k for k in lost if steps.get(k)][: None if all_lost else 1]
    controls = [k for k in both if steps.get(k)]
    record = {
        "id": sample.id, "budget_tokens": run.budgets[0], "prompt_tokens": sample.input_ids.shape[1],
        "full_tokens": len(ids), "policy_tokens": int(policy_tokens.shape[-1]),
        "diverged_at": agreement_length(ids, policy_tokens.tolist()),
        "graded": full["graded"], "full_correct": full["correct"], "policy_correct": pol["correct"],
        "full": kind_accuracy(full["by_kind"]), "policy": kind_accuracy(pol["by_kind"]),
        "lost": [{"problem": k + 1, "kind": kinds[k]} for k in lost],
        "lost_by_kind": {kind: sum(kinds[k] == kind for k in lost) for kind in chains.KINDS},
        "problems": [], "control_share": None, "control_problems": len(controls),
    }
    plan = {"steps": steps, "targets": targets, "controls": controls, "spans": spans, "parsed": pol["parsed"],
            "kinds": kinds, "wanted": [i for k in targets + controls for i in steps[k]]}
    return record, plan


def _explain(tokenizer, task: Chain, sample: Sample, ref: ChainRun, record: dict, plan: dict,
             views: dict[int, StepAttention], top: int) -> dict:
    """The record's evicted shares and top evicted lines, from the forced run's `StepAttention` at the planned
    steps."""
    steps, kinds, spans, gold, meta = plan["steps"], plan["kinds"], plan["spans"], task.gold(sample), sample.meta
    pieces = token_pieces(tokenizer, sample.input_ids[0].tolist() + ref.tokens[0].tolist())
    line = lines_of(pieces)
    P = sample.input_ids.shape[1]

    def share(k: int) -> tuple[float, list[float]]:
        per_layer = torch.stack([views[i].share_per_head().mean(-1) for i in steps[k]]).mean(0)
        return float(per_layer.mean()), per_layer.tolist()

    if plan["controls"]:
        record["control_share"] = sum(share(k)[0] for k in plan["controls"]) / len(plan["controls"])
    for k in plan["targets"]:
        mean, per_layer = share(k)
        K = views[steps[k][-1]].attention.shape[-1]
        mass = torch.zeros(K, dtype=torch.float64)
        for i in steps[k]:
            m = views[i].mass()
            mass[: m.shape[0]] += m / len(steps[k])
        lines = top_lines(mass, pieces, line, P, needs(k + 1, meta["depends"][k], meta["facts"][k]), top)
        a, b = spans[k]
        record["problems"].append({
            "problem": k + 1, "kind": kinds[k], "gold": gold[k], "policy_answer": plan["parsed"][k],
            "uses": {"problem": meta["depends"][k],
                     "fact": None if meta["facts"][k] is None else chains.FACT_LETTERS[meta["facts"][k]]},
            "answer_text": ref.text[a:b], "steps": steps[k], "positions": [P + i - 1 for i in steps[k]],
            "evicted_share": mean, "evicted_share_per_layer": per_layer,
            "needed_share": sum(r["share"] for r in lines if r["tag"] in ("fact", "answer")),
            "top_lines": lines[:top],
        })
    return record


def diagnose(model, tokenizer, spec, all_lost: bool = False, top: int = TOP, state_dir: str | Path | None = None,
             model_name: str | None = None, progress: bool | None = None) -> list[dict]:
    """`diagnose_prompt` on every prompt of a checked grid (`learnkv.eval.run.build_spec` of ``full`` and evicting
    policies, one budget, the chain task) for each evicting policy, ``spec.batch_size`` prompts at a time: the
    full-cache free runs once per batch, shared by every policy, then per policy its free runs as a batch, the forced
    runs of the prompts with a problem to look at as one batch, and each such prompt's full-cache attention alone.
    Returns one ``{"config", "prompts": [per prompt], "summary"}`` per evicting policy, in the grid's order.

    ``state_dir``: a diagnosis of full-length decodes runs for hours, so each finished batch's records are kept
    there (``diagnosed-<digest>.json``, named by everything they depend on: `batch_identity`) and a rerun reads them
    back instead of decoding the batch again; so is each batch's full-cache reference while its policies run
    (`learnkv.eval.checkpoint.save_references`, the same file an evaluation of the chain task with the same model,
    options and batch of prompts stores, so one hard-linked from an evaluation's directory is read, not decoded).
    ``model_name`` names the model in those identities. ``progress``: a bar over the batch's decodes (None: only on
    a terminal; True: also into a log, every 30 s)."""
    task, budget = spec.tasks[0], spec.budgets[0]
    runs = [run for run in spec.runs if evicts(run.name)]
    prompts = task.load(tokenizer, spec.limit or task.default_limit, spec.seed)
    prefill = (spec.prefill.name, spec.prefill.params) if spec.prefill else None
    records: dict[str, list[dict]] = {run.label: [] for run in runs}
    redraw_s = redraw_seconds()
    # per prompt: the full cache's free run, then per policy its free run and its forced run
    bar = tqdm(total=len(prompts) * (1 + 2 * len(runs)), desc="diagnose", unit="run", mininterval=redraw_s,
               disable=not sys.stderr.isatty() if progress is None else not progress, file=sys.stderr)
    task.on_step = counter = token_counter(bar, every_s=redraw_s)
    state = None if state_dir is None else ensure_dir(state_dir, "the diagnosis's state directory")
    try:
        for batch in batches(prompts, spec.batch_size):
            ids = [s.id for s in batch]
            identity = batch_identity(spec, runs, model_name, ids, all_lost, top)
            done = _read_batch(state, identity)
            if done is not None:
                for run in runs:
                    records[run.label] += done[run.label]
                bar.update(len(batch) * (1 + 2 * len(runs)))
                continue
            ref_identity = reference_identity(model_name, task, ids)
            refs = load_references(state, ref_identity) if state is not None else None
            if refs is None:
                counter(0, doing=f"full-cache free runs of {len(batch)} prompts")
                refs = task.reference_batch(model, tokenizer, batch)
                if state is not None:
                    save_references(state, ref_identity, refs)
            bar.update(len(batch))
            budgets = [resolve_budget(budget, task.final_length(s, r)) for s, r in zip(batch, refs)]
            batch_records: dict[str, list[dict]] = {}
            for run in runs:
                config = lambda rows: RunConfig(run.name, run.params, rows, prefill, spec.slack)  # noqa: E731
                counter(0, doing=f"{run.label}: free runs")
                result = task.decode_batch(model, tokenizer, batch, config(budgets))
                bar.update(len(batch))
                planned = [_plan(tokenizer, task, sample, ref, result.texts[b],
                                 result.tokens[b, : result.new_tokens[b]], config([budgets[b]]), all_lost)
                           for b, (sample, ref) in enumerate(zip(batch, refs))]
                look = [b for b, (_, plan) in enumerate(planned) if plan["wanted"]]
                counter(0, doing=f"{run.label}: forced runs and the full cache's attention")
                views = dict(zip(look, evicted_attention_batch(
                    model, tokenizer, task, [batch[b] for b in look], [refs[b].tokens for b in look],
                    [planned[b][1]["wanted"] for b in look], config([budgets[b] for b in look])) if look else []))
                bar.update(len(batch))
                batch_records[run.label] = [
                    _explain(tokenizer, task, batch[b], refs[b], record, plan, views[b], top) if b in views else record
                    for b, (record, plan) in enumerate(planned)]
            if state is not None:
                _write_batch(state, identity, batch_records)
                drop_references(state, ref_identity, keep_small=True)
            for run in runs:
                records[run.label] += batch_records[run.label]
    finally:
        task.on_step = None
        bar.close()
    out = []
    for run in runs:
        rows = records[run.label]
        config = {"policy": run.label, "policy_params": run.params, "budget": budget,
                  "prefill_policy": spec.prefill.label if spec.prefill else None, "seed": spec.seed,
                  "max_new_tokens": task.max_new_tokens, "n_prompts": len(rows), "all_lost": all_lost}
        out.append({"config": config, "prompts": rows, "summary": summarise(rows, spec.seed)})
    return out


def batch_identity(spec, runs, model_name: str | None, ids: Sequence[str], all_lost: bool, top: int) -> dict:
    """What one batch's diagnosis depends on: a stored batch with the same identity is read back, not decoded."""
    task = spec.tasks[0]
    identity = {"format": 1, "model": model_name, "task": task.name, "options": task.options(), "ids": list(ids),
                "runs": [run_identity(r) for r in runs], "budget": spec.budgets[0],
                "prefill": run_identity(spec.prefill) if spec.prefill else None, "slack": spec.slack,
                "all_lost": all_lost, "top": top}
    return json.loads(json.dumps(identity, default=str))  # the form it has after a round trip through the file


def _batch_path(state_dir: Path, identity: dict) -> Path:
    return state_dir / f"diagnosed-{identity_digest(identity)}.json"


def _read_batch(state_dir: Path | None, identity: dict) -> dict | None:
    """A finished batch's records per policy label, or None (not stored, or another batch's or a damaged file:
    decoded again, and the file replaced)."""
    if state_dir is None or not (path := _batch_path(state_dir, identity)).is_file():
        return None
    try:
        stored = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return stored["records"] if isinstance(stored, dict) and stored.get("identity") == identity else None


def _write_batch(state_dir: Path, identity: dict, records: dict) -> None:
    write_text_atomic(_batch_path(state_dir, identity), json.dumps({"identity": identity, "records": records}) + "\n")


def summarise(records: list[dict], seed: int = 0) -> dict:
    """Over prompts: per-kind accuracy of both runs (mean over the prompts that have the kind, 95% bootstrap
    interval), the lost problems by kind, the kinds of each prompt's first lost problem, and its evicted share
    against the control share (the prompts that have both, paired)."""
    out = {"n_prompts": len(records), "with_lost": sum(bool(r["lost"]) for r in records),
           "lost_by_kind": {k: sum(r["lost_by_kind"][k] for r in records) for k in chains.KINDS}}
    for who in ("full", "policy"):
        for metric in [f"{k}_accuracy" for k in chains.KINDS]:
            out[f"{who}_{metric}"] = _stat([r[who][metric] for r in records], seed)
    firsts = [r["problems"][0] if r["problems"] else None for r in records]
    out["first_lost_kind"] = {k: sum(f is not None and f["kind"] == k for f in firsts) for k in chains.KINDS}
    lost = [None if f is None else f["evicted_share"] for f in firsts]
    control = [r["control_share"] for r in records]
    for name, values in (("first_lost_evicted_share", lost), ("control_share", control),
                         ("first_lost_needed_share", [None if f is None else f["needed_share"] for f in firsts])):
        out[name] = _stat(values, seed)
    out["lost_minus_control"] = paired_difference(lost, control, seed=seed)
    return out


def _stat(values: list, seed: int) -> dict:
    """Mean over the prompts that have a value, its 95% bootstrap interval and how many prompts that is."""
    have = [v for v in values if v is not None]
    return {"mean": sum(have) / len(have) if have else None, "ci95": bootstrap_ci(values, seed=seed), "n": len(have)}


def _num(value, fmt: str = ".3f") -> str:
    return "—" if value is None else format(value, fmt)


def table(result: dict) -> str:
    """The readable report: one row per prompt, then the first lost problem's top evicted lines, then the summary."""
    cfg = result["config"]
    out = [f"policy {cfg['policy']} at budget {cfg['budget']} (prefill {cfg['prefill_policy'] or 'none'}), "
           f"{cfg['n_prompts']} prompts; share = full-cache attention at the answer's digits on tokens the policy had "
           "evicted (teacher-forced along the full cache's output; mean over layers, KV heads and digits)", "",
           "| prompt | budget | right full → policy | lost fact/linked/alone | first lost | kind | share | needed "
           "| control share | diverged at |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["prompts"]:
        first = r["problems"][0] if r["problems"] else None
        lk = r["lost_by_kind"]
        out.append(f"| {r['id']} | {r['budget_tokens']} | {r['full_correct']} → {r['policy_correct']} of "
                   f"{r['graded']} "
                   f"| {lk['fact']}/{lk['linked']}/{lk['alone']} | {first['problem'] if first else '—'} "
                   f"| {first['kind'] if first else '—'} | {_num(first and first['evicted_share'])} "
                   f"| {_num(first and first['needed_share'])} | {_num(r['control_share'])} | {r['diverged_at']} |")
    for r in result["prompts"]:
        for p in r["problems"]:
            uses = ", ".join(f"{k} {v}" for k, v in p["uses"].items() if v is not None) or "nothing earlier"
            out += ["", f"{r['id']} Problem {p['problem']} ({p['kind']}; uses {uses}): gold {p['gold']}, policy "
                        f"{p['policy_answer']}; evicted share {p['evicted_share']:.4f}, needed "
                        f"{p['needed_share']:.4f}, top lines:"]
            for line in p["top_lines"]:
                tokens = ", ".join(f"{t['text']!r} {t['share']:.4f}" for t in line["tokens"][:3])
                tag = f" [{line['tag']}]" if line["tag"] else ""
                out.append(f"  {line['share']:.4f} {line['where']} {line['positions'][0]}-{line['positions'][1]}"
                           f"{tag}: {line['text'][:90]!r} ({tokens})")
    s = result["summary"]
    out += ["", f"prompts with a lost problem: {s['with_lost']} of {s['n_prompts']}; lost problems by kind: "
                + ", ".join(f"{k} {v}" for k, v in s["lost_by_kind"].items())
                + "; first lost by kind: " + ", ".join(f"{k} {v}" for k, v in s["first_lost_kind"].items())]
    for kind in chains.KINDS:
        f, p = s[f"full_{kind}_accuracy"], s[f"policy_{kind}_accuracy"]
        out.append(f"{kind} accuracy: full {_interval(f)}, policy {_interval(p)} (n = {f['n']} prompts with the kind)")
    for name in ("first_lost_evicted_share", "first_lost_needed_share", "control_share"):
        out.append(f"{name}: {_interval(s[name])} (n = {s[name]['n']})")
    d = s["lost_minus_control"]
    if d is not None:
        out.append(f"first lost share - control share: {d['mean_diff']:+.3f} [{d['ci95'][0]:+.3f}, "
                   f"{d['ci95'][1]:+.3f}] (paired, n = {d['n']})")
    return "\n".join(out) + "\n"


def _interval(stat: dict) -> str:
    if stat["mean"] is None:
        return "—"
    ci = stat["ci95"]
    return f"{stat['mean']:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]"


__all__ = ["StepAttention", "batch_identity", "evicted_attention", "evicted_attention_batch", "diagnose_prompt",
           "diagnose", "summarise", "table"]
