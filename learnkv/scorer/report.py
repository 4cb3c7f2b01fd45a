"""The decode-time comparison `train.py` prints after training: what the exported scorer keeps when it decodes.

Budget recall (the training metric) ranks tokens on recorded states; what matters is the decode. Here the `learned`
policy and a few teachers decode the validation prompts (never the test prompts evaluation uses) at fractions of
each prompt's final length, teacher-forced along the full cache's continuation (`learnkv.eval`, task fidelity):
KL to the full cache's next-token distribution, top-1 agreement and attention recall, with 95% bootstrap intervals
over prompts and each teacher's paired difference to the learned policy. The result is written to
``out_dir/report/`` (results.json, results.md) and reused while the artifact's weights are unchanged.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from learnkv.config import PipelineConfig
from learnkv.eval import build_spec, evaluate, markdown_table, write_results
from learnkv.eval.report import paired_table
from learnkv.eval.run import paired
from learnkv.eval.tasks import Sample
import learnkv.model  # load_model is called through its module: tests stand in for it there
from learnkv.prompts import load_prompts
from learnkv.scorer.artifact import read_artifact_manifest

COLUMNS = ("kl", "top1_agreement", "attention_recall")


def validation_prompts(cfg: PipelineConfig, tokenizer, n: int) -> list:
    """The first ``n`` validation prompts of the collection's sources (interleaved, as traces take them)."""
    per_source = [load_prompts(src, n=n, seed=cfg.collect.seed, split="validation", tokenizer=tokenizer)
                  for src in cfg.collect.sources]
    return [p for group in itertools.zip_longest(*per_source) for p in group if p is not None][:n]


def decode_report(cfg: PipelineConfig, artifact: str | Path, progress: bool = True, model=None,
                  tokenizer=None) -> str:
    """The markdown tables (means with intervals, paired differences to ``learned``) for ``artifact``."""
    r = cfg.report
    out = Path(cfg.out_dir) / "report"
    weights = read_artifact_manifest(artifact)["weights_sha256"]
    stamp = {"weights_sha256": weights, "report": json.loads(json.dumps(r.__dict__))}
    if (out / "stamp.json").is_file() and json.loads((out / "stamp.json").read_text()) == stamp:
        return (out / "results.md").read_text()
    if model is None:
        model, tokenizer = learnkv.model.load_model(cfg.collect.model)
    samples = [Sample.from_prompt(p, tokenizer) for p in validation_prompts(cfg, tokenizer, r.prompts)]
    spec = build_spec(["learned", *r.policies], list(r.budgets), "fidelity", scorer=str(artifact),
                      limit=len(samples), seed=cfg.seed, batch_size=r.batch_size, compare="learned",
                      max_new_tokens=r.max_new_tokens, prefill_policy=r.prefill_policy)
    print(f"decode-time comparison: learned vs {', '.join(r.policies)} on {len(samples)} validation prompts, "
          f"{r.max_new_tokens} new tokens, budgets {', '.join(map(str, r.budgets))} of the final length"
          + (f", prompts over the budget compressed by {r.prefill_policy} at the prefill" if r.prefill_policy else ""))
    records = evaluate(model, tokenizer, spec, samples=samples, progress=progress, model_name=cfg.collect.model)
    pairs = paired(records, "learned", seed=cfg.seed)
    write_results(records, out, pairs)
    text = (markdown_table(records, columns=list(COLUMNS)) + "\n" + paired_table(pairs, metrics=COLUMNS))
    (out / "results.md").write_text(text)
    (out / "stamp.json").write_text(json.dumps(stamp))
    return text
