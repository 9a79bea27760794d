"""Compute precision by hardware: fp32, or bf16 autocast where the CPU has bf16 matrix units.

``bf16: auto`` (the CPU default) chooses bf16 autocast -- bf16 matmuls, fp32 master weights and fp32 optimizer
state -- when the CPU has bf16 matrix units (x86: AVX512-BF16 or AMX-BF16; Arm: the BF16 extension), which
torch's CPU kernels (oneDNN) use; elsewhere fp32, where bf16 would only be emulated (slower than fp32). The choice
is read from the CPU's capabilities as torch reports them, never from a model name or a version string.
``bf16: true`` / ``false`` force it. Off the CPU (CUDA, ...) ``auto`` leaves the choice to TRL (its default).

``TRL_GRPO_EXT_CPU_BF16=1`` / ``0`` overrides the detection (tests and CI exercise both answers on any machine).
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
    """The run's `Precision` from its ``bf16`` setting; `on_cpu`: the run computes on the CPU."""
    setting = parse_bf16_setting(value)
    if setting != AUTO:
        return Precision(setting == "true", setting, "set in the config")
    if not on_cpu:
        return Precision(None, setting, "not a CPU run: TRL's default (bf16 unless fp16)")
    units, why = cpu_bf16_units()
    return Precision(units, setting, why)


def sampler_bf16(bf16, device_type: str) -> bool:
    """Whether a run's sampling (generation, evals) runs in one bf16 autocast region: a bf16 run on the CPU.
    Elsewhere accelerate's per-forward autocast (or vLLM) samples as before."""
    return bool(bf16) and device_type == "cpu"


def bf16_autocast(enabled: bool, device_type: str = "cpu"):
    """bf16 autocast on `device_type` when `enabled`, else a no-op context (the fp32 path runs untouched).

    Inside one autocast region torch casts each fp32 weight that requires grad to bf16 once and reuses the copy, so
    a whole ``generate`` call wrapped in it reads bf16 weights at every decode step (a per-call region would cast
    them again each step).
    """
    if not enabled:
        return contextlib.nullcontext()
    import torch

    return torch.autocast(device_type=device_type, dtype=torch.bfloat16)
