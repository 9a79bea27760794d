"""`trl-grpo-ext compare RUN_DIR...`: a markdown table and plots comparing finished runs."""

from __future__ import annotations

import sys

from trl_grpo_ext.experiments.compare import build_report


def add_arguments(parser) -> None:
    parser.add_argument(
        "run_dirs",
        nargs="+",
        metavar="RUN_DIR",
        help="run output folders (each with metrics.jsonl), or a sweep's output root for all its runs",
    )
    parser.add_argument("--out", default="comparison", help="report folder (report.md, summary.json, PNGs)")
    parser.add_argument(
        "--smooth",
        type=int,
        default=1,
        metavar="N",
        help="moving average over N steps for plots and final/best reward (default 1: raw)",
    )


def run(args) -> int:
    try:
        report = build_report(args.run_dirs, args.out, smooth_window=args.smooth)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report.table)
    if report.verdicts:
        print("\ndifferences between configurations (95% intervals):")
        for line in report.verdicts:
            print(f"  {line}")
    for note in report.notes:
        print(f"note: {note}", file=sys.stderr)
    print(f"\nreport: {report.out_dir / 'report.md'} ({len(report.plots)} plots)")
    return 0
