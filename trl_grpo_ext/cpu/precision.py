"""Compute precision by hardware: fp32, or bf16 autocast where the CPU has bf16 matrix units.

``bf16: auto`` (the CPU default) chooses bf16 autocast -- bf16 matmuls, fp32 master weights and fp32 optimizer
state -- when the CPU has bf16 matrix units (x86: AVX512-BF16 or AMX-BF16; Arm: the BF16 extension), which
torch's CPU kernels (oneDNN) use; elsewhere fp32, where bf16 would only be emulated (slower than fp32). The choice
is read from the CPU's capabilities as torch reports them, never from a model name or a version string.
``bf16: true`` / ``false`` force it. Off the CPU (CUDA, ...) ``auto`` leaves the choice to TRL (its default).

``TRL_GRPO_EXT_CPU_BF16=1`` / ``0`` overrides the detection (tests and CI exercise both answers on any machine).

A bf16 run on the CPU also caps oneDNN's caches (`limit_onednn_caches`): left at their defaults they grow its memory
with every new batch shape.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import asdict, dataclass

ENV_CPU_BF16 = "TRL_GRPO_EXT_CPU_BF16"
AUTO = "auto"
# torch.cpu.get_capabilities() names of bf16 matrix/dot-product units: x86 (AVX512-BF16, AMX-BF16), Arm (BF16, SVE-BF16)
BF16_UNITS = ("amx_bf16", "avx512_bf16", "bf16", "sve_bf16")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
# oneDNN keeps each matmul primitive it builds, and ideep (torch's wrapper around it) each matmul's computation, in
# LRU caches of 1024 entries; bf16 matmuls on the CPU go through them (fp32 ones through MKL do not). A training
# batch's shapes follow its sequence lengths, so nearly every step adds entries, each holding memory: the embedded
# recipe's bf16 runs grew by about 0.1 GB a step until the caches filled (docs/precision.md). A step's working set
# (a few shapes per micro-batch, each reused by every layer, and one per decode batch) fits in far fewer entries.
ONEDNN_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
ONEDNN_CACHE_ENTRIES = 32


@dataclass(frozen=True)
class Precision:
    """The precision a run computes in, and why."""

    bf16: bool | None  # None: not decided here (off the CPU with `auto`: TRL's default applies)
    setting: str  # "auto", "true" or "false", as configured
    reason: str

    @property
    def name(self) -> str:
        if self.bf16 is None:
            return "TRL's default"
        return "bf16 autocast (fp32 master weights and optimizer state)" if self.bf16 else "fp32"

    def line(self) -> str:
        """The startup line: ``precision: <choice> (bf16: <setting>: <reason>)``."""
        return f"precision: {self.name} (bf16: {self.setting}: {self.reason})"

    def as_dict(self) -> dict:
        return asdict(self)


def parse_bf16_setting(value) -> str:
    """``"auto"``, ``"true"`` or ``"false"`` from a config value (bool, None = auto, or a string); ValueError else."""
    if value is None:
        return AUTO
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        text = value.strip().lower()
        if text == AUTO:
            return AUTO
        if text in _TRUE:
            return "true"
        if text in _FALSE:
            return "false"
    raise ValueError(f"bf16={value!r} must be auto, true or false")


def cpu_bf16_units() -> tuple[bool, str]:
    """(whether this CPU has bf16 matrix units, why), from torch's CPU capabilities or the env override."""
    forced = os.environ.get(ENV_CPU_BF16)
    if forced is not None and forced.strip() != "":
        text = forced.strip().lower()
        if text not in _TRUE + _FALSE:
            raise ValueError(f"{ENV_CPU_BF16}={forced!r} must be 1 or 0 (or unset: detect)")
        on = text in _TRUE
        return on, f"{ENV_CPU_BF16}={forced.strip()} forces the detection {'on' if on else 'off'}"
    import torch

    getter = getattr(torch.cpu, "get_capabilities", None)  # torch >= 2.13: every cpuinfo flag
    if getter is not None:
        caps = getter()
        found = [name for name in BF16_UNITS if caps.get(name) is True]
        cpu = caps.get("cpu_name") or caps.get("architecture") or "this CPU"
    else:  # older torch: the two x86 probes it has
        found = [
            name
            for name, probe in (("amx_bf16", "_is_amx_tile_supported"), ("avx512_bf16", "_is_avx512_bf16_supported"))
            if getattr(torch.cpu, probe, lambda: False)()
        ]
        cpu = "this CPU"
    if found:
        return True, f"{cpu} has bf16 matrix units ({', '.join(found)})"
    return (
        False,
        f"{cpu} has no bf16 matrix units (torch: {torch.backends.cpu.get_cpu_capability()}); bf16 would be emulated",
    )


def resolve_precision(value, *, on_cpu: bool) -> Precision:
    """The run's `Precision` from its ``bf16`` setting; `on_cpu`: the run computes on the CPU (a bf16 one caps
    oneDNN's caches, `limit_onednn_caches`)."""
    setting = parse_bf16_setting(value)
    if setting != AUTO:
        precision = Precision(setting == "true", setting, "set in the config")
    elif not on_cpu:
        precision = Precision(None, setting, "not a CPU run: TRL's default (bf16 unless fp16)")
    else:
        units, why = cpu_bf16_units()
        precision = Precision(units, setting, why)
    if on_cpu and precision.bf16:
        limit_onednn_caches()
    return precision


def limit_onednn_caches(entries: int = ONEDNN_CACHE_ENTRIES) -> None:
    """Cap oneDNN's primitive cache and ideep's computation cache at `entries` each (`ONEDNN_CACHE_VARIABLES`), where
    the environment does not set them already. Each library reads its variable once, at the process's first bf16
    matmul on the CPU, so this must run before it (precision is resolved before any model computes); later calls
    change nothing."""
    for name in ONEDNN_CACHE_VARIABLES:
        os.environ.setdefault(name, str(entries))


def bf16_on_cpu(bf16, device_type: str) -> bool:
    """A bf16 run on the CPU: its sampling (generation, evals) runs in one bf16 autocast region, and its training
    forward keeps no bf16 weight copies for the backward pass (`trl_grpo_ext.cpu.autocast_weights`). Elsewhere
    accelerate's per-forward autocast (or vLLM) samples, and autocast trains, as before."""
    return bool(bf16) and device_type == "cpu"


def bf16_autocast(enabled: bool, device_type: str = "cpu"):
    """bf16 autocast on `device_type` when `enabled`, else a no-op context (the fp32 path runs untouched).

    Inside one autocast region torch casts each fp32 weight that requires grad to bf16 once and reuses the copy, so
    a whole ``generate`` call wrapped in it reads bf16 weights at every decode step (a per-call region would cast
    them again each step).
    """
    if not enabled:
        return contextlib.nullcontext()
    if device_type == "cpu":
        limit_onednn_caches()  # an eval or a script that never resolved a precision
    import torch

    return torch.autocast(device_type=device_type, dtype=torch.bfloat16)
