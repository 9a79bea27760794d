"""Grid sweeps over a base recipe: the sweep file, its runs (expanded, named, skipped when done) and their commands.

A sweep file is YAML::

    name: embedded_losses              # SwanLab group and default output folder name
    base: ../gsm8k/embedded.yaml       # base recipe (path relative to this file), or {trl: ..., pytrio: ...}
    output_root: runs/embedded_losses  # relative to the working directory
    backend: trl                       # or put `backend: [trl, pytrio]` in the grid
    grid:                              # full product, in the order written
      loss_type: [importance_sampling, ppo, cispo]
      learning_rate: [1.0e-5, 4.0e-5]
    variants:                          # optional bundles of keys that vary together, crossed with the grid
      - {loss_type: cispo, cispo_clip_high: 0.2}
    overrides: {max_steps: 30}         # fixed for every run
    backend_overrides: {pytrio: {...}} # fixed for every run of one backend
    seeds: [0, 1, 2]                   # optional: every configuration once per seed (`compare` groups them)
    evaluate: {data: embedded, limit: 32, k: 4}   # optional: `trl-grpo-ext eval` each finished run
    launcher: slurm                    # optional: local (default) or slurm, with `slurm:` resources (docs/slurm.md)

Each run gets `<output_root>/<name>/` holding `sweep_config.yaml` (the exact recipe config it was given),
`sweep_job.json` (how to start it), `sweep_attempt.json` (what its last job did), `train.log`, the recipe's own
outputs (`metrics.jsonl`, checkpoints) and, on success, `sweep_done.json`. How runs are started, tracked and
resumed, here or through SLURM, is `trl_grpo_ext/experiments/launch/`.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import itertools
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from trl_grpo_ext.evaluation import sweep_eval_options
from trl_grpo_ext.experiments.sweep_options import LAUNCHERS, LEGACY_LAUNCHERS, SlurmOptions
from trl_grpo_ext.pytrio.config import PyTrioGRPOConfig
from trl_grpo_ext.runs import (
    latest_checkpoint,
    load_yaml,
)
from trl_grpo_ext.runs.sweep_files import has_pytrio_state
from trl_grpo_ext.trl.script_args import ScriptArguments

MAX_NAME_LEN = 150

# Keys of the sweep file itself; anything else at top level is a typo worth reporting.
SWEEP_KEYS = {
    "name",
    "base",
    "output_root",
    "backend",
    "grid",
    "variants",
    "overrides",
    "backend_overrides",
    "evaluate",
    "parallel",
    "launcher",
    "slurm",
    "accelerate_config",
    "num_processes",
    "scripts",
    "env",
    "seeds",
}
SWEEP_ONLY_RUN_KEYS = {"backend"}  # grid/override keys consumed here, never passed to a recipe
# Keys the sweep sets per run; a grid over them would send every run to the same place.
RESERVED_KEYS = {"output_dir", "run_name", "resume_from_checkpoint", "config"}


@dataclass(frozen=True)
class Backend:
    """How to launch one execution path: the recipe script, and the flags that resume an interrupted run."""

    name: str
    script: str
    resume_args: Callable[[Path], list[str]]
    takes_run_name: bool = True


def _trl_resume_args(run_dir: Path) -> list[str]:
    ckpt = latest_checkpoint(run_dir)
    return ["--resume_from_checkpoint", str(ckpt)] if ckpt else []


def _pytrio_resume_args(run_dir: Path) -> list[str]:
    # The PyTRIO loop records its last save_state in <output_dir>/pytrio_state.json and reloads it on --resume.
    return ["--resume", "true"] if has_pytrio_state(run_dir) else []


BACKENDS: dict[str, Backend] = {
    "trl": Backend("trl", "recipes/gsm8k_grpo.py", _trl_resume_args),
    "pytrio": Backend("pytrio", "recipes/gsm8k_pytrio.py", _pytrio_resume_args),
}


# --------------------------------------------------------------------------------------------- loading


@dataclass
class SweepSpec:
    """A parsed sweep file; paths are already resolved."""

    name: str
    output_root: Path
    base: dict[str, Path | None]  # backend -> base recipe YAML (None: no base, overrides only)
    grid: dict[str, list]
    variants: list[dict]
    overrides: dict
    backend_overrides: dict[str, dict]
    backend: str = "trl"
    seeds: list[int] = field(default_factory=list)  # empty: each run keeps its recipe's seed
    evaluate: dict | None = None
    parallel: int | None = None  # runs at once (local; SLURM: the array's %N throttle); None: 1 here, no cap there
    launcher: str = "local"  # where runs execute: local | slurm
    use_accelerate: bool = False  # start recipes with `accelerate launch` (also when a run gets >1 GPU)
    slurm: SlurmOptions = field(default_factory=SlurmOptions)
    accelerate_config: str | None = None
    num_processes: int | None = None
    scripts: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    source: Path | None = None


def _resolve_rel(path: str | None, anchor: Path) -> Path | None:
    if path is None:
        return None
    p = Path(os.path.expanduser(str(path)))
    if p.is_absolute():
        return p
    # Written relative to the sweep file; a path relative to the working directory is accepted too.
    for candidate in (anchor / p, Path.cwd() / p):
        if candidate.exists():
            return candidate.resolve()
    return (anchor / p).resolve()


def parse_sweep(data: dict, source: Path | None = None, output_root: str | None = None) -> SweepSpec:
    """Validate a sweep mapping (as read from YAML) into a `SweepSpec`, with clear errors for bad input."""
    unknown = set(data) - SWEEP_KEYS
    where = f"{source}: " if source else ""
    if unknown:
        raise ValueError(f"{where}unknown sweep keys {sorted(unknown)}; known keys: {sorted(SWEEP_KEYS)}")
    anchor = source.parent if source else Path.cwd()
    name = str(data.get("name") or (source.stem if source else "sweep"))

    grid = data.get("grid") or {}
    if not isinstance(grid, dict):
        raise ValueError(f"{where}'grid' must map a config key to a list of values")
    grid = {k: (list(v) if isinstance(v, list) else [v]) for k, v in grid.items()}
    for key, values in grid.items():
        if not values:
            raise ValueError(f"{where}grid key '{key}' has no values")
        if len({json.dumps(v, sort_keys=True, default=str) for v in values}) != len(values):
            raise ValueError(f"{where}grid key '{key}' lists a value twice: {values}")
    variants = data.get("variants") or []
    if not isinstance(variants, list) or not all(isinstance(v, dict) and v for v in variants):
        raise ValueError(f"{where}'variants' must be a list of non-empty mappings")
    overrides = data.get("overrides") or {}
    backend_overrides = data.get("backend_overrides") or {}
    if not isinstance(overrides, dict) or not isinstance(backend_overrides, dict):
        raise ValueError(f"{where}'overrides' and 'backend_overrides' must be mappings")
    for key in RESERVED_KEYS:
        if key in grid or any(key in v for v in variants):
            raise ValueError(f"{where}'{key}' is set by the sweep for each run and cannot be swept")
    seeds = _parse_seeds(data.get("seeds"), where)
    if seeds and ("seed" in grid or any("seed" in v for v in variants)):
        raise ValueError(f"{where}'seeds' and a 'seed' in grid/variants both set the seed; use 'seeds' only")

    backend = str(data.get("backend", "trl"))
    backends_used = set(map(str, grid.get("backend", []))) | {str(v["backend"]) for v in variants if "backend" in v}
    backends_used = backends_used or {backend}
    scripts = {str(k): str(v) for k, v in (data.get("scripts") or {}).items()}
    for b in backends_used:
        if b not in BACKENDS and b not in scripts:
            raise ValueError(
                f"{where}unknown backend '{b}'; known: {sorted(BACKENDS)} (or give 'scripts: {{{b}: ...}}')"
            )

    base_raw = data.get("base")
    if isinstance(base_raw, dict):
        base = {str(b): _resolve_rel(p, anchor) for b, p in base_raw.items()}
        missing = backends_used - set(base)
        if missing:
            raise ValueError(f"{where}'base' names no recipe for backend(s) {sorted(missing)}")
    else:
        path = _resolve_rel(base_raw, anchor)
        base = {b: path for b in backends_used}
    for b, p in base.items():
        if p is not None and not p.is_file():
            raise FileNotFoundError(f"{where}base recipe for backend '{b}' not found: {p}")

    launcher = str(data.get("launcher", "local"))
    if launcher not in LAUNCHERS and launcher not in LEGACY_LAUNCHERS:
        raise ValueError(f"{where}'launcher' must be one of {list(LAUNCHERS)}, got '{launcher}'")
    use_accelerate = bool(LEGACY_LAUNCHERS.get(launcher) or data.get("accelerate_config") or data.get("num_processes"))
    slurm = SlurmOptions.from_mapping(data.get("slurm"), where)
    evaluate = data.get("evaluate")
    if evaluate is not None and not isinstance(evaluate, dict):
        raise ValueError(f"{where}'evaluate' must be a mapping of `trl-grpo-ext eval` options")
    if evaluate:
        evaluate = sweep_eval_options(evaluate, where)
    parallel = int(data["parallel"]) if data.get("parallel") is not None else None
    if parallel is not None and parallel < 1:
        raise ValueError(f"{where}'parallel' must be >= 1")
    root = output_root or data.get("output_root") or str(Path("runs") / name)
    return SweepSpec(
        name=name,
        output_root=Path(root).expanduser().resolve(),
        base=base,
        grid=grid,
        variants=[dict(v) for v in variants],
        overrides=dict(overrides),
        backend_overrides={str(k): dict(v or {}) for k, v in backend_overrides.items()},
        backend=backend,
        seeds=seeds,
        evaluate=dict(evaluate) if evaluate else None,
        parallel=parallel,
        launcher="local" if launcher in LEGACY_LAUNCHERS else launcher,
        use_accelerate=use_accelerate,
        slurm=slurm,
        accelerate_config=(
            str(_resolve_rel(data["accelerate_config"], anchor)) if data.get("accelerate_config") else None
        ),
        num_processes=int(data["num_processes"]) if data.get("num_processes") else None,
        scripts={b: str(_resolve_rel(s, anchor)) for b, s in scripts.items()},
        env={str(k): str(v) for k, v in (data.get("env") or {}).items()},
        source=source,
    )


def _parse_seeds(value: Any, where: str) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not values or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{where}'seeds' must be a non-empty list of integers, e.g. [0, 1, 2]; got {value!r}")
    if len(set(values)) != len(values):
        raise ValueError(f"{where}'seeds' lists a seed twice: {values}")
    return list(values)


def load_sweep(path: str | os.PathLike, output_root: str | None = None) -> SweepSpec:
    path = Path(path).resolve()
    return parse_sweep(load_yaml(path), source=path, output_root=output_root)


# ------------------------------------------------------------------------------------------ expansion


def format_value(value: Any) -> str:
    """Short, stable text for a value in a run name (`4e-05`, `0.2`, `True`, `a+b` for lists)."""
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "+".join(format_value(v) for v in value)
    if isinstance(value, dict):
        return "+".join(f"{k}-{format_value(v)}" for k, v in value.items())
    return str(value)


def sanitize_name(name: str) -> str:
    """A folder-safe run name: only `[A-Za-z0-9._=,+-]`, no leading dot, bounded length (hash-suffixed)."""
    clean = re.sub(r"[^A-Za-z0-9._=,+-]+", "_", name).strip("_") or "run"
    if clean.startswith("."):
        clean = "_" + clean[1:]
    if len(clean) > MAX_NAME_LEN:
        digest = hashlib.sha1(name.encode()).hexdigest()[:8]
        clean = f"{clean[: MAX_NAME_LEN - 9]}-{digest}"
    return clean


@dataclass
class RunSpec:
    """One expanded run: its name, the keys that make it differ, and the full recipe config it gets."""

    name: str
    backend: str
    params: dict  # the swept keys, in grid order
    config: dict  # the recipe config written to sweep_config.yaml
    run_dir: Path
    base: Path | None = None


def expand(spec: SweepSpec) -> list[RunSpec]:
    """All runs of the sweep, in a deterministic order: seeds outermost (a sweep stopped midway has every
    configuration at its first seeds), then variants, then the grid as written; `seed=N` ends a seeded run's name."""
    keys = list(spec.grid)
    combos = [
        dict(zip(keys, values, strict=False)) for values in itertools.product(*(spec.grid[k] for k in keys))
    ] or [{}]
    variants = spec.variants or [{}]
    seeds = [{"seed": seed} for seed in spec.seeds] or [{}]
    base_cache: dict[Path, dict] = {}
    runs: list[RunSpec] = []
    seen: dict[str, dict] = {}
    for seed, variant, combo in itertools.product(seeds, variants, combos):
        params = {**variant, **combo, **seed}
        clash = {k for k in variant if k in combo and variant[k] != combo[k]}
        if clash:
            raise ValueError(f"variant {variant} and grid both set {sorted(clash)}; set each key in one place")
        backend = str(params.get("backend", spec.backend))
        name = sanitize_name(",".join(f"{k}={format_value(v)}" for k, v in params.items()) or spec.name)
        if name in seen:
            raise ValueError(f"two runs map to the same name '{name}': {seen[name]} and {params}")
        seen[name] = params
        base_path = spec.base.get(backend)
        if base_path is not None and base_path not in base_cache:
            base_cache[base_path] = load_yaml(base_path)
        config = copy.deepcopy(base_cache.get(base_path, {})) if base_path else {}
        config.update(copy.deepcopy(spec.overrides))
        config.update(copy.deepcopy(spec.backend_overrides.get(backend, {})))
        config.update({k: v for k, v in params.items() if k not in SWEEP_ONLY_RUN_KEYS})
        for key in SWEEP_ONLY_RUN_KEYS:
            config.pop(key, None)
        run_dir = spec.output_root / name
        config["output_dir"] = str(run_dir)
        if backend_of(spec, backend).takes_run_name:
            config["run_name"] = name  # the sweep is the SwanLab group (SWANLAB_GROUP)
        runs.append(RunSpec(name, backend, params, config, run_dir, base_path))
    return runs


def backend_of(spec: SweepSpec, name: str) -> Backend:
    known = BACKENDS.get(name)
    script = spec.scripts.get(name)
    if known is None:
        return Backend(name, script, lambda run_dir: [], takes_run_name=False)
    return Backend(name, script or known.script, known.resume_args, known.takes_run_name)


# ------------------------------------------------------------------------------------------ validation


def recipe_keys(backend: str) -> set[str] | None:
    """Config keys the shipped recipe of `backend` accepts, or None when they cannot be known here."""
    try:
        if backend == "trl":
            # trl loads in seconds: only when a sweep is validated, never for --status or --cancel
            from trl import ModelConfig, TrlParser

            from trl_grpo_ext.trl.config import GRPOConfig

            parser = TrlParser((ScriptArguments, GRPOConfig, ModelConfig))
            return {action.dest for action in parser._actions} | {"env"}
        if backend == "pytrio":
            return {f.name for f in dataclasses.fields(PyTrioGRPOConfig)} | {"env"}
    except ImportError:
        return None
    return None


def validate_runs(spec: SweepSpec, runs: list[RunSpec]) -> list[str]:
    """Keys a run's recipe would reject, found before hours of other runs go by (shipped recipes only)."""
    import difflib

    problems, cache = [], {}
    for run in runs:
        if run.backend in spec.scripts:  # a custom script: its keys are its own business
            continue
        if run.backend not in cache:
            cache[run.backend] = recipe_keys(run.backend)
        known = cache[run.backend]
        if known is None:
            continue
        for key in run.config:
            if key not in known:
                close = difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=0.6)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                problems.append(f"{run.name}: the {run.backend} recipe has no key '{key}'{hint}")
    return problems
