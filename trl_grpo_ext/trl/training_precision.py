"""`RecastWeightsMixin`: a bf16 training forward on the CPU without a bf16 copy of the weights held for backward.

Where the run trains in bf16 autocast on the CPU (``bf16`` resolved by `trl_grpo_ext.cpu.precision`), the loss's forward
runs inside `trl_grpo_ext.cpu.autocast_weights.recast_weights`: the bf16 copies of the trainable weights that autograd
would keep for the backward pass are cast again from the fp32 weights when the backward pass reads them. The hook is
``compute_loss_context_manager``, which transformers' ``training_step`` enters around ``compute_loss`` (the backward
pass follows outside it); accelerate's autocast, entered inside each forward call, is built there with its cache
off. The same gradients to the bit; the embedded recipe's bf16 `make train` peaked at 4.18 GB with it, against 4.40 GB
without and 4.25 GB in fp32 (docs/precision.md).

The fp32 path and runs off the CPU run exactly as before.
"""

from __future__ import annotations

import contextlib

from trl_grpo_ext.cpu.autocast_weights import recast_weights
from trl_grpo_ext.cpu.precision import bf16_on_cpu


class RecastWeightsMixin:
    """`trl.GRPOTrainer` hook: the loss forward of a bf16 CPU run in `recast_weights`."""

    def _recasts_weights(self) -> bool:
        return bf16_on_cpu(self.args.bf16, self.accelerator.device.type)

    def compute_loss_context_manager(self):
        stack = contextlib.ExitStack()
        if self._recasts_weights():
            stack.enter_context(recast_weights())  # before the autocast regions inside: they read the cache flag
        stack.enter_context(super().compute_loss_context_manager())
        return stack
