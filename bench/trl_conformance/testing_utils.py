"""Stand-in for TRL's ``tests/testing_utils.py`` where only TRL's test file is at hand (a TRL checkout's own module
is used when the script is given the checkout's tests folder).

``TrlTestCase`` gives each test ``self.tmp_dir``; every ``require_<thing>`` skips its test unless <thing> is here:
a package (``require_peft``: peft importable) or an accelerator (``require_torch_accelerator``, ``..._gpu``,
``require_ampere_or_newer``, ``require_flash_attn``...: CUDA present). A ``require_`` name with no rule here
skips, with its name as the reason, the same for TRL's classes and ours.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

# require_<name> -> the modules it needs, when the name is not the module's own
_PACKAGES = {
    "liger_kernel": ["liger_kernel"],
    "vision": ["PIL"],  # transformers' is_vision_available, as TRL's require_vision
    "jmespath": ["jmespath"],
    "kernels": ["kernels"],
    "bitsandbytes": ["bitsandbytes"],
    "peft": ["peft"],
    "vllm": ["vllm"],
    "deepspeed": ["deepspeed"],
    "wandb": ["wandb"],
    "mergekit": ["mergekit"],
    "math_latex": ["math_verify", "latex2sympy2_extended"],
}
_ACCELERATOR_WORDS = ("accelerator", "gpu", "cuda", "ampere", "flash_attn", "multi_", "bf16", "torch_multi")


class TrlTestCase:
    @pytest.fixture(autouse=True)
    def set_tmp_dir(self, tmp_path):
        self.tmp_dir = str(tmp_path)


def _requirement(name: str):
    thing = name.removeprefix("require_")
    if any(word in thing for word in _ACCELERATOR_WORDS):
        return pytest.mark.skipif(not torch.cuda.is_available(), reason=f"{name}: no CUDA device")
    modules = _PACKAGES.get(thing)
    if modules is None:
        return pytest.mark.skip(reason=f"{name}: no rule for it in the conformance run's testing_utils")
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"{name}: {', '.join(missing)} not installed")


def __getattr__(name: str):
    if name.startswith("require_"):
        return _requirement(name)
    raise AttributeError(f"the conformance run's testing_utils has no {name!r}; pass a TRL checkout's tests folder")
