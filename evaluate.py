r"""Evaluate eviction policies against the full cache: fidelity, reasoning, needle, chains, math, and what each costs.

    python evaluate.py                     # the baselines at 25% and 50% budget, fidelity, 8 held-out prompts
    python evaluate.py --policy full,streaming,h2o,tova,snapkv,roco,lazy,paged --budget 0.25,0.5 --task fidelity \
        --limit 4                          # what CI runs (about 3 minutes on 2 CPU cores)
    python evaluate.py --policy full,oracle,tova,learned --scorer runs/train/scorer --budget 0.25,0.5
    python evaluate.py --policy full,h2o,tova --budget 64,128 --task reasoning --model qwen2.5-coder-0.5b-instruct
    python evaluate.py --policy full,snapkv --budget 0.25 --task needle --context-tokens 1024,2048 --limit 4
    python evaluate.py --policy h2o,learned --scorer runs/train/scorer --granularity block --block-size 16
                                           # what a paged serving engine can keep: whole blocks, shared by all layers
    python evaluate.py --policy full,h2o,lazy,lazy:variant=paper,lazy:window=16 --budget 192 --max-new-tokens 256 \
        --limit 32 --batch-size 8 --compare lazy
                                           # variants as rows; paired differences to lazy with 95% intervals
    python evaluate.py --policy full,lazy,h2o --budget 0.25 --prefill-policy snapkv --task needle
                                           # prompts over the budget: snapkv compresses them, then each policy decodes
    python evaluate.py --task chain --policy full,h2o,tova,snapkv,lazy --budget 0.5 --limit 4 --batch-size 4
                                           # 30 word problems per prompt, the later ones using earlier answers and facts; 1,000+ generated tokens
    python evaluate.py --task gsm8k --data-file gsm8k-test.jsonl --max-new-tokens 1024
                                           # math benchmarks (gsm8k, math500, aime24, champ), graded by math-verify
    python evaluate.py --config configs/eval-r1-distill-qwen-7b-math500.yaml     # every option from a YAML file

A policy item is NAME[:key=value]...: its own row, labelled by the item as written. Writes DIR/results.json
({"records": one per policy x budget x task: {"policy", "budget", "task", "metrics" (means, "<metric>_ci95",
n_prompts, cost), "per_prompt", "config"}, "paired": differences to --compare}), DIR/results.md (the tables printed
at the end; with --compare also a headline table per budget of the task's main metrics and paired differences, as
the README shows them) and DIR/<task>_<metric>.png (metric vs budget, one line per policy, 95% intervals as error
bars). A budget is a token count (64) or a fraction of each prompt's final length (0.25: a quarter of the prompt
plus the full cache's continuation). Bad input exits with code 2 and one line on stderr, before the model is loaded.
A killed run resumes: rerun the same command and the (policy, budget) runs of each batch of prompts it finished
(kept in DIR/partial.jsonl until results.json is written) are not decoded again. The same command with
--finished-only, while the run goes on or after it was killed, writes the tables of the batches it has finished so
far into DIR/finished/, budget by budget (a budget counts every batch finished at it; each record says how many
prompts). One grid on several cores or machines: run the same command with --shard 0/n, ..., --shard n-1/n at once
(each decodes every n-th batch into DIR/shard-i-of-n/, skipping what the others finished), then once more without
--shard to read them all back and write the results.
"""

from __future__ import annotations

import argparse
import sys

from learnkv.cli import Interruptible, OneLineParser, set_threads, shard_of, thread_count


def _numbers(cast):
    def parse(text: str):
        try:
            return tuple(cast(x) for x in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None

    return parse


def build_parser() -> argparse.ArgumentParser:
    from learnkv.settings import GRANULARITIES
    from learnkv.eval.run import DEFAULT_BUDGETS, DEFAULT_POLICIES

    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="YAML file of these options (long names, e.g. max_new_tokens: "
                   "256); options given on the command line win")
    p.add_argument("--policy", default=",".join(DEFAULT_POLICIES),
                   help="ITEM[,ITEM...], each NAME[:key=value]... (e.g. lazy:window=16:variant=paper)")
    p.add_argument("--prefill-policy", default=None, metavar="ITEM",
                   help="compresses prompts over the budget at the prefill, then each policy decodes (e.g. snapkv)")
    # 8: larger is faster on the 2-core CPU (batch 16 decodes 5-6x batch 1's tokens/s, bench/RESULTS.md), but a
    # full-cache reference of 1,536 steps holds ~1 GB a prompt: 8 fit in the 23 GB machine, 16 do not.
    p.add_argument("--batch-size", type=int, default=8,
                   help="prompts decoded together, each row as alone (default 8: the fastest that every bundled task "
                        "fits in 23 GB on a 2-core CPU; 16 is faster on short decodes)")
    p.add_argument("--slack", type=int, default=0,
                   help="dead slots a layer may hold before it compacts: the same kept tokens (metrics equal to float "
                        "rounding), faster on long caches, for up to this many more slots of memory (default 0)")
    p.add_argument("--batch-budgets", action="store_true",
                   help="decode each policy at every budget in one batch (batch size x budgets rows): the same "
                        "metrics, faster where reading the weights dominates a step (a larger model on a CPU)")
    p.add_argument("--compare", default=None, metavar="ITEM",
                   help="paired differences of every other policy to this one, with 95%% intervals")
    p.add_argument("--budget", default=",".join(map(str, DEFAULT_BUDGETS)),
                   help="B[,B...] tokens (64) or fractions of the full length (0.25)")
    p.add_argument("--task", default="fidelity",
                   help="TASK[,TASK...]: fidelity, reasoning, needle, chain, gsm8k, math500, aime24, champ")
    p.add_argument("--model", default=None, help="bundled alias, local folder or hub id (default: SmolLM2-135M)")
    p.add_argument("--scorer", default=None, help="exported scorer for --policy learned (train.py prints its path)")
    p.add_argument("--limit", type=int, default=None,
                   help="prompts per task (default: fidelity 8, reasoning all of the split, needle 9, chain 4, "
                        "math benchmarks all)")
    p.add_argument("--output", default="runs/eval",
                   help="output directory (a rerun of the same grid into it resumes where a killed run stopped)")
    p.add_argument("--seed", type=int, default=0, help="data and torch seed")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="per run (default: fidelity 24, reasoning 256, needle 16, chain 1536, math 1024)")
    p.add_argument("--split", default=None, choices=["test", "validation", "all"],
                   help="held-out prompts: test (default); fidelity: validation, the prompts train.py validates on "
                        "(tune there, report on test); reasoning: all 100 GSM8K items")
    p.add_argument("--source", default=None, help="fidelity: prompt source (gsm_symbolic, gsm8k, needle, ...); "
                   "gsm8k: gsm8k reads the 100 test items shipped offline instead of the hub")
    p.add_argument("--data-file", default=None, metavar="PATH",
                   help="gsm8k, math500, aime24: a local JSON/JSONL/CSV/parquet copy of the hub dataset (offline); "
                        "champ: its v0.json")
    p.add_argument("--context-tokens", type=_numbers(int), default=None,
                   help="needle: prompt lengths L[,L...] (default 1024,2048,4096)")
    p.add_argument("--depths", type=_numbers(float), default=None,
                   help="needle: depths D[,D...] in [0, 1] (default 0.1,0.5,0.9)")
    p.add_argument("--accuracy-only", action="store_true",
                   help="chain: grade free runs only, without the teacher-forced fidelity metrics (half the decodes, "
                        "no reference logits or attention kept; no oracle)")
    p.add_argument("--granularity", default="token", choices=GRANULARITIES,
                   help="block: whole blocks, one decision shared by every layer and KV head (what a paged serving "
                        "engine such as vLLM can do)")
    p.add_argument("--block-size", type=int, default=16, help="slots per block with --granularity block")
    p.add_argument("--threads", type=thread_count, default=None, help="torch CPU threads")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--finished-only", action="store_true",
                   help="decode nothing: the tables of the batches of prompts that a running or killed evaluation of "
                        "this grid into --output has finished so far, per budget, written into OUTPUT/finished/ "
                        "(n stated)")
    p.add_argument("--shard", default=None, metavar="i/n",
                   help="decode only every n-th batch of prompts from the i-th (0 <= i < n) into OUTPUT/shard-i-of-n/, "
                        "as one of n processes (cores, or machines sharing OUTPUT) decoding one grid; the same command "
                        "without --shard then reads every shard's runs back and writes the results")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line over an optional ``--config`` YAML file (whose keys are the long option names)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.config is None:
        return args
    from pathlib import Path

    import yaml

    path = Path(args.config)
    if not path.is_file():
        parser.error(f"--config {args.config!r} does not exist")
    try:
        values = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        parser.error(f"--config {args.config}: not valid YAML ({str(e).splitlines()[0]})")
    if not isinstance(values, dict):
        parser.error(f"--config {args.config}: expected a mapping of option names to values")
    known = {a.dest for a in parser._actions} - {"help", "config"}
    unknown = sorted(set(values) - known)
    if unknown:
        parser.error(f"--config {args.config}: unknown option(s) {', '.join(unknown)}; options: {', '.join(sorted(known))}")
    lists = ("policy", "budget", "task")  # comma-separated on the command line, YAML lists in a file
    parser.set_defaults(**{k: (",".join(map(str, v)) if isinstance(v, list) else str(v)) if k in lists else v
                           for k, v in values.items()})
    return parser.parse_args(argv)


def spec_of(args: argparse.Namespace):
    """The validated grid (`learnkv.eval.build_spec`) of parsed options; raises ValueError on bad input."""
    from learnkv.eval import build_spec

    return build_spec(args.policy, args.budget, args.task, scorer=args.scorer, limit=args.limit, seed=args.seed,
                      prefill_policy=args.prefill_policy, batch_size=args.batch_size, compare=args.compare,
                      slack=args.slack, batch_budgets=args.batch_budgets, max_new_tokens=args.max_new_tokens,
                      split=args.split, context_tokens=args.context_tokens,
                      depths=args.depths, granularity=args.granularity, block_size=args.block_size,
                      source=args.source, data_file=args.data_file,
                      accuracy_only=args.accuracy_only or None)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from learnkv.eval.checkpoint import PARTIAL, kept_runs

    interrupt = Interruptible()
    kept_in = args.output  # where this run's finished runs are kept (a shard's own directory)
    try:
        from learnkv.eval import evaluate, write_results
        from learnkv.eval.checkpoint import finish, partial_files, shard_dir
        from learnkv.eval.run import paired

        spec = spec_of(args)
        from pathlib import Path

        from learnkv.atomic import dir_lock, ensure_dir
        from learnkv.eval.report import prepare_output

        shard = shard_of(args.shard) if args.shard is not None else None
        if shard and args.finished_only:
            raise ValueError("--shard decodes and --finished-only decodes nothing: give one of them")
        out = Path(args.output) / "finished" if args.finished_only else args.output
        if shard:
            out = kept_in = shard_dir(args.output, shard)
        if args.finished_only and not partial_files(args.output):
            raise ValueError(f"{args.output} holds no running or killed evaluation ({PARTIAL}) to report on")
        # one run at a time writes a directory: a second one would take the first one's partial file for another
        # grid's and move it aside (--finished-only only reads it, and writes finished/, which it locks)
        with interrupt, dir_lock(ensure_dir(out, "output directory"), "output directory"):
            note = None if shard else prepare_output(out)  # before any decode: a bad --output must not cost a finished run
            if note:
                print(f"note: {note}", file=sys.stderr)
            # -------------------------------------------------------------- everything valid: load and run
            import torch

            from learnkv.model import DEFAULT_MODEL, load_model

            set_threads(args.threads)
            torch.manual_seed(args.seed)
            device = "cuda" if torch.cuda.is_available() else "cpu"
            model, tokenizer = load_model(args.model or DEFAULT_MODEL, device=device)
            records = evaluate(model, tokenizer, spec, progress=not args.no_progress and not args.finished_only,
                               model_name=args.model or DEFAULT_MODEL, resume_dir=args.output,
                               finished_only=args.finished_only, shard=shard)
            if shard:  # the results are written by the run without --shard, once every shard is done
                left = f"left to the other shards: batch {', '.join(map(str, records))}" if records else \
                    "every other batch is finished too"
                print(f"shard {args.shard}: its batches are finished (runs in {out}); {left}. The same command "
                      f"without --shard reads every shard back and writes the results (--finished-only: the "
                      f"tables so far).", file=sys.stderr)
                return 0
            pairs = paired(records, spec.compare, seed=args.seed) if spec.compare else []
            paths = write_results(records, out, pairs, headline={t.name: t.headline for t in spec.tasks})
            if not args.finished_only:
                finish(args.output)  # results.json holds it all now
    except ValueError as e:  # bad input, bad scorer, bad model: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: every finished run is in the partial file already
        print(f"\n{interrupt.how}: {kept_runs(kept_in)}. Rerun the same command to resume.", file=sys.stderr)
        return interrupt.code
    except OSError as e:  # a full disk, say: what failed, and what the partial file still holds
        print(f"error: {e.strerror or e}: {e.filename or args.output}; {kept_runs(kept_in)}. Rerun the same "
              "command to resume once that is fixed.", file=sys.stderr)
        return 1
    print(paths["table"].read_text())
    print(f"results: {paths['json']}\ntable: {paths['table']}\nplots: {len(paths['plots'])} PNGs in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
