"""The on-disk cache of "before" evals: the greedy results of a model on an eval set, keyed by the model's files,
the eval set and the generation settings, so every run of a sweep that starts from one model evaluates it once."""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Sequence

from trl_grpo_ext.evaluation.problems import Problem
from trl_grpo_ext.evaluation.runner import Generator, evaluate
from trl_grpo_ext.evaluation.scoring import ProblemResult, score_problem
from trl_grpo_ext.models import cache_dir, resolve_model
from trl_grpo_ext.runs import MODEL_CONFIG_FILENAME, TRAINER_STATE_FILENAME, atomic_write_json

EVAL_CACHE_VERSION = 1
# Files of a model folder that decide its outputs: weights, config, tokenizer and chat template.
_IDENTITY_SKIP = {"README.md", ".gitattributes", "training_args.bin", TRAINER_STATE_FILENAME}


def eval_cache_dir() -> Path:
    """`<cache>/eval` (`$TRL_GRPO_EXT_CACHE`, else `~/.cache/trl_grpo_ext`): one JSON file per cached eval."""
    return cache_dir() / "eval"


def folder_identity(folder: str | os.PathLike) -> dict:
    """What a model folder's outputs depend on, cheaply: config.json's hash and each top-level file's name, size
    and modification time (hashing gigabytes of weights on every run would cost more than the eval it saves)."""
    folder = Path(folder)
    config = folder / MODEL_CONFIG_FILENAME
    files = []
    for p in sorted(folder.iterdir()):
        if p.name in _IDENTITY_SKIP or p.name.startswith(".") or not p.is_file():
            continue
        st = p.stat()  # follows the hub cache's symlinks to the blobs
        files.append([p.name, st.st_size, st.st_mtime_ns])
    return {
        "config_sha256": hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else None,
        "files": files,
    }


def local_model_folder(name_or_path: str, revision: str | None = None) -> Path | None:
    """The folder of a local model, or of a hub model already downloaded (its snapshot; no network); else None."""
    path = Path(str(name_or_path)).expanduser()
    if path.is_dir():
        return path
    try:  # a hub id already downloaded: its snapshot folder (no network)
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(str(name_or_path), MODEL_CONFIG_FILENAME, revision=revision)
    except Exception:
        return None
    return Path(found).parent if isinstance(found, str) else None


def model_identity(name_or_path: str, adapter: str | None = None, revision: str | None = None) -> dict | None:
    """Identity of a model (and LoRA adapter) for the eval cache, or None when it cannot be known offline."""
    folder = local_model_folder(resolve_model(name_or_path), revision)
    if folder is None:
        return None
    out = {"model": folder_identity(folder)}
    if adapter:
        if not Path(adapter).is_dir():
            return None
        out["adapter"] = folder_identity(adapter)
    return out


def live_model_identity(model) -> dict | None:
    """Identity of a model in memory (as a trainer holds it) from the folder it was loaded from, or None.

    A PEFT model counts as its base model only when its adapters start as a no-op (LoRA's default zero init):
    then its outputs are the base model's. (dtype and device go into the settings: `live_model_settings`.)
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for cfg in (getattr(model, "peft_config", None) or {}).values():
        if getattr(cfg, "init_lora_weights", True) is not True:
            return None
    config = getattr(base, "config", None)
    name = getattr(config, "_name_or_path", None)
    if not name:
        return None
    folder = local_model_folder(name, getattr(config, "_commit_hash", None))
    return None if folder is None else {"model": folder_identity(folder)}


def engine_settings(decode_engine: str) -> dict:
    """A cache key's entry for the decode engine: none for transformers' generate (the keys of evals cached before
    engines existed hold), the name for another (its logits differ by rounding: a near tie can go the other way)."""
    return {} if decode_engine == "generate" else {"decode_engine": decode_engine}


def greedy_settings(max_new_tokens: int, device: str, dtype: str, decode_engine: str = "generate") -> dict:
    """Generation settings of a greedy eval that change its outputs (a cache key's): the token limit, device and
    dtype, and the decode engine (`engine_settings`). The recipes' eval and `trl-grpo-ext eval` both key by it, so
    the same model evaluated the same way by either is one cache entry."""
    return {"max_new_tokens": max_new_tokens, "device": device, "dtype": dtype, **engine_settings(decode_engine)}


def live_model_settings(model, max_new_tokens: int, decode_engine: str = "generate") -> dict:
    """`greedy_settings` of a model in memory (its parameters' device and dtype)."""
    param = next(model.parameters())
    return greedy_settings(max_new_tokens, param.device.type, str(param.dtype), decode_engine)


def eval_set_hash(problems: Sequence[Problem]) -> str:
    """sha256 of the eval set as generated: each problem's prompt (system prompt, one-shot example, question),
    ground truth and task, in order."""
    h = hashlib.sha256()
    for p in problems:
        h.update(json.dumps([p.prompt, p.answer, p.task], sort_keys=True, default=str).encode("utf-8"))
        h.update(b"\n")
    return h.hexdigest()


def eval_cache_key(identity: dict, problems: Sequence[Problem], settings: dict) -> tuple[str, dict]:
    """(key, what it hashes): model identity, eval-set hash, generation settings and library versions."""
    import torch
    import transformers

    material = {
        "version": EVAL_CACHE_VERSION,
        "identity": identity,
        "eval_set": eval_set_hash(problems),
        "n": len(problems),
        "settings": settings,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    key = hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode("utf-8")).hexdigest()[:32]
    return key, material


def load_cached_eval(key: str, n: int) -> list[ProblemResult] | None:
    """The cached results under `key`, or None when absent, unreadable or not `n` problems."""
    path = eval_cache_dir() / f"{key}.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        results = [ProblemResult.from_dict(row) for row in data["results"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return results if data.get("key") == key and len(results) == n else None


def store_cached_eval(key: str, material: dict, results: Sequence[ProblemResult]) -> Path:
    path = eval_cache_dir() / f"{key}.json"
    atomic_write_json(path, {"key": key, "material": material, "results": [asdict(r) for r in results]})
    return path


def cached_greedy_eval(
    problems: Sequence[Problem],
    make_generator: Callable[[], Generator],
    identity: dict | None,
    settings: dict,
    batch_size: int,
    progress: bool = True,
    desc: str = "eval",
    use_cache: bool = True,
    write: bool = True,
) -> tuple[list[ProblemResult], dict]:
    """Greedy results of a model on `problems`, from the cache when it holds them, else generated (and stored).

    `make_generator` is called only on a cache miss. `identity` None (a model whose files are unknown) or
    `use_cache` False: always generated, never stored. `write` False: read the cache but leave it as it is
    (processes other than the main one). Returns (results, {'cached': bool, 'key': str | None, 'seconds'}).
    """
    start = time.monotonic()
    key = material = None
    if use_cache and identity is not None:
        key, material = eval_cache_key(identity, problems, {**settings, "batch_size": batch_size})
        results = load_cached_eval(key, len(problems))
        if results is not None:
            # The cache holds what is expensive, the completions; verdicts are graded again here, so a change of
            # the grading rules (trl_grpo_ext.task.answers) never leaves a stale "before" figure.
            results = [
                score_problem(r.index, problem, r.greedy_completion, r.samples, r.greedy_tokens)
                for r, problem in zip(results, problems, strict=True)
            ]
            return results, {"cached": True, "key": key, "seconds": round(time.monotonic() - start, 2)}
    results, _ = evaluate(problems, make_generator(), 1, batch_size, progress=progress, desc=desc)
    if key is not None and write:
        store_cached_eval(key, material, results)
    return results, {"cached": False, "key": key, "seconds": round(time.monotonic() - start, 2)}
