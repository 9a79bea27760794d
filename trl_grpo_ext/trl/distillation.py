"""`DistillationMixin`: on-policy distillation on the TRL path (a recipe's ``distillation:`` block).

The teacher is loaded once, at the trainer's start, as TRL loads its reference model (`internals.load_frozen_model`:
the run's dtype and precision, no gradients), after one check that it shares the student's tokenizer. After TRL has
scored a generation batch (and the trainer has zeroed its degenerate groups), the teacher's and the student's
log-probs of the sampled completion tokens come from TRL's no-grad reference forward (`internals.completion_logps`;
the student's are TRL's old log-probs when it computed them) and `trl_grpo_ext.grpo.distillation` turns them into
per-token advantages (B, T), which TRL's loss takes as they are. The ``distill/*`` metrics are logged per batch.
"""

from __future__ import annotations

import torch

from trl_grpo_ext.errors import raise_problems
from trl_grpo_ext.grpo.distillation import (
    DistillationSpec,
    distillation_advantages,
    distillation_of,
    tokenizer_mismatch,
)
from trl_grpo_ext.models import resolve_model
from trl_grpo_ext.trl import internals


def teacher_problems(spec: DistillationSpec, student_tokenizer, student_name: str) -> list[str]:
    """Why the teacher of `spec` cannot teach the student: it cannot be found or its tokenizer is not the student's
    (same token ids for the same tokens; per-token KL is meaningless otherwise, and nothing is aligned here)."""
    from transformers import AutoTokenizer  # transformers loads in seconds: only with a teacher

    try:
        path = resolve_model(spec.teacher, progress=False)
        teacher_tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as error:
        return [f"distillation.teacher={spec.teacher!r} cannot be loaded: {str(error).splitlines()[0]}"]
    mismatch = tokenizer_mismatch(teacher_tokenizer, student_tokenizer, spec.teacher, student_name)
    return [] if mismatch is None else [mismatch]


class DistillationMixin:
    """`trl.GRPOTrainer` with a teacher: per-token advantages from its log-probs (`_with_distillation`, called by
    the trainer at the end of ``_generate_and_score_completions``). Without a ``distillation`` block, nothing."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.distillation: DistillationSpec | None = distillation_of(self.args)
        self.teacher_model = None
        if self.distillation is not None:
            student = getattr(self.model.config, "_name_or_path", "") or "the student"
            raise_problems("distillation", teacher_problems(self.distillation, self.processing_class, student))
            self.teacher_model = internals.load_frozen_model(self, resolve_model(self.distillation.teacher))

    def _with_distillation(self, output: dict) -> dict:
        """`output` of ``_generate_and_score_completions`` with the distillation advantages (B, T) in place of the
        reward advantages (B,), which they include with ``reward_coef``; the ``distill/*`` metrics logged."""
        spec = self.distillation
        if spec is None:
            return output
        mode = "train" if self.model.training else "eval"
        student = output.get("old_per_token_logps")
        if student is None:  # on-policy: TRL did not compute them; the policy that sampled is the model now
            student = internals.completion_logps(self, self.model, output, mode)
        teacher = internals.completion_logps(self, self.teacher_model, output, mode)
        advantages = output["advantages"]
        if advantages.dim() == 2:  # another hook made them per token already: one value per completion expected
            raise ValueError("distillation expects one reward advantage per completion")
        terms = distillation_advantages(student, teacher, internals.loss_mask(output), spec, advantages)
        output = dict(output)
        output["advantages"] = terms.advantages.to(device=advantages.device, dtype=torch.float32)
        for name, value in terms.metrics.items():
            internals.log_metric(self, mode, name, value)
        return output
