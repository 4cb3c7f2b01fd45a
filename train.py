"""Train a learned eviction scorer: collect traces (if the trace directory lacks them), train, evaluate budget
recall against every teacher, export, then compare its decode-time fidelity with the best teachers'.

    python train.py                                   # the bundled default (configs/default.yaml), ~10 min on 2 idle CPU cores
    python train.py --config configs/smoke.yaml       # the same pipeline in a few minutes (CI)
    python train.py train.lr=0.01 collect.prompts=32  # any setting, overridden on the command line
    python train.py rounds=2                          # then collect under the learned scorer, retrain on the union
    python train.py collect.policy=rkv                # traces under eviction by R-KV instead of the full cache

Quiet by default: it prints progress bars and its tables; Lightning's and wandb's messages and warnings go to
OUT_DIR/train.log (`--verbose` shows them too). Resumable: traces resume shard by shard, training from the last
checkpoint, rounds one by one. The last line printed is `artifact: PATH`, the exported scorer that `--policy learned
--scorer PATH` loads.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "default.yaml"


def main(argv: list[str] | None = None) -> int:
    from learnkv.cli import Interruptible, OneLineParser, set_threads, thread_count

    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="YAML config (default: configs/default.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    parser.add_argument("--threads", type=thread_count, default=None, help="torch CPU threads")
    parser.add_argument("--verbose", action="store_true",
                        help="also show Lightning's and wandb's messages and warnings (always in OUT_DIR/train.log)")
    args = parser.parse_intermixed_args(argv)  # overrides before, between or after the options
    try:
        with Interruptible() as interrupt:
            from learnkv.config import load_config

            cfg = load_config(args.config, args.overrides)
            set_threads(args.threads)
            from learnkv.runlog import LOG, run_log
            from learnkv.scorer.fit import train
            from learnkv.scorer.report import decode_report

            with run_log(Path(cfg.out_dir) / LOG, verbose=args.verbose):
                artifact, metrics, table = train(cfg, progress=True, verbose=args.verbose)
            report = decode_report(cfg, artifact, progress=True) if cfg.report.prompts else None
    except ValueError as e:  # bad config, bad traces, bad model: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # during collection (Lightning handles it during fit)
        print(f"\n{interrupt.how}: finished trace shards and the last epoch's checkpoint are kept; rerun the same "
              "command to resume", file=sys.stderr)
        return interrupt.code
    print("budget recall on the validation prompts (share of the oracle's top-b tokens kept):")
    print(table)
    if report:
        print("\ndecode-time fidelity on the validation prompts (teacher-forced along the full cache's continuation):")
        print(report)
    print(f"artifact: {artifact}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
