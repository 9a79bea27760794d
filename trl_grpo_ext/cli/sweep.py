"""`trl-grpo-ext sweep SWEEP.yaml`: expand a grid over a base recipe and run every variant, here or on SLURM.

trl-grpo-ext sweep SWEEP.yaml                       # every run here, one after another (--parallel N)
trl-grpo-ext sweep SWEEP.yaml --launcher slurm      # every pending run as SLURM job arrays, then return
trl-grpo-ext sweep SWEEP.yaml --status              # one line per run: pending/queued/running/done/failed
"""

from __future__ import annotations

import sys

from trl_grpo_ext.experiments.launch import LauncherError
from trl_grpo_ext.experiments.launch.commands import describe_runs
from trl_grpo_ext.experiments.launch.runner import cancel_sweep, format_status, run_sweep, sweep_status
from trl_grpo_ext.experiments.launch.slurm import describe as describe_slurm
from trl_grpo_ext.experiments.launch.slurm import preflight, require_slurm
from trl_grpo_ext.experiments.sweep import RESERVED_KEYS, expand, load_sweep, validate_runs
from trl_grpo_ext.experiments.sweep_options import LAUNCHERS
from trl_grpo_ext.runs import yaml_loads


def add_arguments(parser) -> None:
    parser.add_argument("sweep_file", help="sweep YAML (base recipe + grid + overrides); see docs/comparison.md")
    parser.add_argument(
        "--dry-run", "--dry_run", dest="dry_run", action="store_true", help="list the runs, run nothing"
    )
    parser.add_argument(
        "--launcher",
        choices=list(LAUNCHERS),
        default=None,
        help="where runs execute: here (local) or as SLURM job arrays (default: the file's `launcher:`, else local)",
    )
    parser.add_argument(
        "--status", action="store_true", help="print each run's state (from its folder and squeue), start nothing"
    )
    parser.add_argument(
        "--wait",
        action="store_true",
        help="SLURM: stay until every submitted run has ended (a progress bar, the summary, exit 1 on failures)",
    )
    parser.add_argument("--cancel", action="store_true", help="stop the sweep's queued and running jobs (scancel)")
    parser.add_argument(
        "--parallel",
        type=int,
        default=None,
        help="runs at once (default: the file's, else 1); SLURM: at most N tasks of each job array at once",
    )
    parser.add_argument("--output_root", "--output-root", default=None, help="override the file's output_root")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        dest="set_values",
        help="extra override for every run, on top of the file's (repeatable; VALUE is YAML: 10, 1e-5, [a, b])",
    )
    parser.add_argument(
        "--only",
        action="append",
        default=None,
        metavar="SUBSTRING",
        help="run only runs whose name contains SUBSTRING (repeatable)",
    )
    parser.add_argument(
        "--force", action="store_true", help="delete the selected runs' folders and run them again from scratch"
    )
    parser.add_argument(
        "--skip-validation",
        "--skip_validation",
        dest="validate",
        action="store_false",
        help="do not check run configs against the recipe's known keys before starting",
    )
    parser.add_argument(
        "--no-progress",
        "--no_progress",
        dest="progress",
        action="store_false",
        help="no progress bar (plain lines only)",
    )


def parse_set_values(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        if key.strip() in RESERVED_KEYS:
            raise ValueError(f"--set {key.strip()}: set by the sweep for each run")
        out[key.strip()] = yaml_loads(value) if value.strip() else None
    return out


def run(args) -> int:
    try:
        spec = load_sweep(args.sweep_file, output_root=args.output_root)
        if args.set_values:
            spec.overrides.update(parse_set_values(args.set_values))
        runs = expand(spec)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.only:
        runs = [r for r in runs if any(s in r.name for s in args.only)]
        if not runs:
            print(f"error: no run name contains any of {args.only}", file=sys.stderr)
            return 2
    if args.parallel is not None and args.parallel < 1:
        print("error: --parallel must be >= 1", file=sys.stderr)
        return 2
    if args.status + args.cancel + args.dry_run > 1:
        print("error: --status, --cancel and --dry-run are separate commands; give one", file=sys.stderr)
        return 2
    launcher = args.launcher or spec.launcher
    try:
        if args.status:
            print(format_status(spec, sweep_status(spec, runs)))
            return 0
        if args.cancel:
            stopped = cancel_sweep(spec, runs)
            print("\n".join(f"stopped {line}" for line in stopped) or "nothing queued or running")
            return 0
        if launcher == "slurm" and not args.dry_run:
            require_slurm()  # a missing sbatch is said before the (slow) config validation
    except LauncherError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.validate:
        problems = validate_runs(spec, runs)
        if problems:
            for line in problems:
                print(f"error: {line}", file=sys.stderr)
            print("fix the sweep file (or pass --skip-validation)", file=sys.stderr)
            return 2
    if args.dry_run:
        print(describe_runs(spec, runs))
        if launcher == "slurm":
            parallel = args.parallel or spec.parallel
            print(describe_slurm(spec, runs, parallel))
            try:
                require_slurm()
                preflight(spec, runs, parallel)
                print("sbatch --test-only: SLURM would take these arrays")
            except LauncherError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
        return 0
    try:
        results, summary = run_sweep(
            spec,
            runs,
            parallel=args.parallel,
            force=args.force,
            progress=args.progress,
            launcher=launcher,
            wait=True if args.wait else None,
        )
    except LauncherError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("sweep interrupted; running it again resumes where it stopped", file=sys.stderr)
        return 130
    bad = [r for r in results if not r.ok]
    in_jobs = [r for r in results if r.status in ("queued", "running")]
    if in_jobs:
        ids = sorted({r.job_id.split("_")[0] for r in in_jobs if r.job_id}, key=int)
        where = f" (SLURM job {', '.join(ids)})" if ids else ""
        print(
            f"{len(in_jobs)} runs queued or running{where}; follow them with: trl-grpo-ext sweep {args.sweep_file} --status"
        )
        print(f"{len(results) - len(in_jobs) - len(bad)} already done, {len(bad)} failed; summary: {summary}")
    else:
        print(f"{len(results) - len(bad)}/{len(results)} runs ok; summary: {summary}")
    for r in bad:
        print(f"  {r.status}: {r.name}: {r.reason or f'exit {r.returncode}'} -> {r.run_dir}", file=sys.stderr)
    return 1 if bad else 0
