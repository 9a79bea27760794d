"""On-policy distillation (OPD): a teacher's log-probs on the student's own tokens as the per-token advantage.

The student samples as in GRPO; a teacher scores the sampled completion tokens; each completion token ``y_t`` gets

    term_t = -coef * (log p_student(y_t) - log p_teacher(y_t))          (the negative reverse KL, per token)
    A_t    = sum_{s >= t} discount^(s - t) * term_s  +  reward_coef * A_group

``discount = 0`` keeps the per-token term (``A_t = term_t``); ``discount > 0`` adds the discounted future terms of
the same completion. ``A_group`` is the group-relative reward advantage GRPO computes (``reward_coef = 0``: pure
OPD). The loss then treats ``A_t`` as a constant (the ``importance_sampling`` loss, ``-r_t * A_t``).

`DistillationSpec` is the ``distillation:`` block of the GRPO spec (`trl_grpo_ext.grpo.spec.GRPOSpec`), and
`distillation_advantages` the one function both execution paths call: the TRL trainer with the teacher's log-probs
from its reference-model forward, the PyTRIO loop with the teacher sampling client's ``compute_logprobs``. Depends on
torch only.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields

import torch

from trl_grpo_ext.errors import raise_problems

# The metrics both paths log once per generation batch (masked means over completion tokens).
DISTILL_METRICS = (
    "distill/reverse_kl",
    "distill/teacher_logp",
    "distill/student_logp",
    "distill/advantage_mean",
    "distill/advantage_std",
)


@dataclass
class DistillationSpec:
    """The ``distillation:`` block of a recipe: which teacher scores the student's tokens and how its signal enters
    the advantage. docs/distillation.md describes each option."""

    teacher: str = field(
        default="",
        metadata={
            "help": "The teacher: on the TRL path a model id or a local folder (a saved model, e.g. a finished run's "
            "output_dir); on the PyTRIO path the base model the service knows it by ('embedded', a hub id or a "
            "local path with the local server). It must use the student's tokenizer."
        },
    )
    teacher_model_path: str | None = field(
        default=None,
        metadata={
            "help": "PyTRIO path only: a saved checkpoint of the teacher (a 'pytrio://...' sampler path) on top of "
            "`teacher`; None: the teacher base model itself."
        },
    )
    coef: float = field(
        default=1.0, metadata={"help": "Weight of the negative reverse KL in the per-token advantage (>= 0)."}
    )
    reward_coef: float = field(
        default=0.0,
        metadata={
            "help": "Weight of GRPO's group-relative reward advantage added to every token (>= 0; 0: pure OPD)."
        },
    )
    discount: float = field(
        default=0.0,
        metadata={
            "help": "In [0, 1]: 0 keeps each token's own term; > 0 adds the completion's later terms, discounted "
            "by this per token."
        },
    )

    def __post_init__(self):
        raise_problems("distillation", self.problems())

    def problems(self) -> list[str]:
        """Every problem with these values, each starting with its YAML key (``distillation.<key>``)."""
        problems = []
        if not isinstance(self.teacher, str) or not self.teacher.strip():
            problems.append(f"distillation.teacher={self.teacher!r} must name the teacher model (an id or a folder)")
        path = self.teacher_model_path
        if path is not None and (not isinstance(path, str) or not path.strip()):
            problems.append(f"distillation.teacher_model_path={path!r} must be a checkpoint path or null")
        for name, ok, rule in (
            ("coef", lambda v: v >= 0, "a finite number >= 0"),
            ("reward_coef", lambda v: v >= 0, "a finite number >= 0"),
            ("discount", lambda v: 0 <= v <= 1, "a number in [0, 1]"),
        ):
            value = getattr(self, name)
            if not (_is_number(value) and ok(value)):
                problems.append(f"distillation.{name}={value!r} is not valid; it must be {rule}")
        if not problems and self.coef == 0 and self.reward_coef == 0:
            problems.append("distillation: coef and reward_coef are both 0, so every advantage would be 0")
        return problems


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


DISTILLATION_KEYS = tuple(f.name for f in fields(DistillationSpec))


def distillation_block_problems(block) -> list[str]:
    """Problems with a recipe's ``distillation:`` value (None, a mapping, or its JSON text from the command line)."""
    if block is None:
        return []
    if isinstance(block, str):
        try:
            block = json.loads(block)
        except json.JSONDecodeError as error:
            return [f"distillation={block!r} is not a mapping (from the command line: JSON text; {error.msg})"]
    if not isinstance(block, dict):
        return [f"distillation={block!r} must be a mapping of {', '.join(DISTILLATION_KEYS)}"]
    unknown = [key for key in block if key not in DISTILLATION_KEYS]
    if unknown:
        return [f"distillation: unknown key(s) {', '.join(map(repr, unknown))}; valid: {', '.join(DISTILLATION_KEYS)}"]
    return _spec_problems(block)


def _defaults() -> dict:
    return {f.name: f.default for f in fields(DistillationSpec)}


def _spec_problems(block: dict) -> list[str]:
    spec = object.__new__(DistillationSpec)  # the values as given, checked without raising
    for key, value in {**_defaults(), **block}.items():
        setattr(spec, key, value)
    return spec.problems()


def normalize_distillation(config) -> None:
    """Before validation: ``config.distillation`` as a full mapping (JSON text from the command line parsed, every
    key present with its default), so saved configs show every value. Invalid values are left for the validator."""
    block = getattr(config, "distillation", None)
    if isinstance(block, str):
        try:
            block = json.loads(block)
        except json.JSONDecodeError:
            return
    if isinstance(block, dict) and all(key in DISTILLATION_KEYS for key in block):
        block = {**_defaults(), **block}
    config.distillation = block


def tokenizer_mismatch(teacher_tokenizer, student_tokenizer, teacher: str, student: str) -> str | None:
    """Why the teacher's tokenizer is not the student's (another token for some id), naming both; None if it is.
    Per-token KL needs one tokenizer: the teacher scores the student's token ids, and nothing is aligned here."""

    def vocabulary(tokenizer) -> dict:
        return getattr(tokenizer, "tokenizer", tokenizer).get_vocab()  # a processor's tokenizer

    teacher_vocab, student_vocab = vocabulary(teacher_tokenizer), vocabulary(student_tokenizer)
    if teacher_vocab == student_vocab:
        return None
    differ = len(set(teacher_vocab.items()) ^ set(student_vocab.items()))
    return (
        f"distillation.teacher={teacher!r} does not share the tokenizer of the student {student!r} "
        f"({len(teacher_vocab)} vs {len(student_vocab)} tokens, {differ} entries differ): on-policy distillation "
        "scores the student's token ids with the teacher, so both must use one tokenizer"
    )


def distillation_of(config) -> DistillationSpec | None:
    """The validated `DistillationSpec` of a config's ``distillation`` mapping; None without one."""
    block = getattr(config, "distillation", None)
    if block is None:
        return None
    if isinstance(block, DistillationSpec):
        return block
    if isinstance(block, str):
        block = json.loads(block)
    return DistillationSpec(**block)


# ------------------------------------------------------------------------------------------ the advantage


@dataclass(frozen=True)
class DistillationTerms:
    """`distillation_advantages`' result: the (B, T) advantages (0 at masked positions) and the metrics."""

    advantages: torch.Tensor
    metrics: dict[str, float]


def _masked_mean(x: torch.Tensor, mask: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / count


def distillation_advantages(
    student_logps: torch.Tensor,
    teacher_logps: torch.Tensor,
    mask: torch.Tensor,
    spec: DistillationSpec,
    reward_advantages: torch.Tensor | None = None,
) -> DistillationTerms:
    """Per-token OPD advantages (see the module docstring) of B completions, right-padded to T tokens.

    ``student_logps`` / ``teacher_logps`` (B, T): each model's log-prob of the sampled token; ``mask`` (B, T): 1 on
    the completion tokens that count. ``reward_advantages`` (B,): GRPO's group-relative advantages, needed when
    ``spec.reward_coef > 0``. Computed in float64 (the paths' parity does not depend on their dtypes), returned in
    float32. Metrics are masked means over the batch's tokens: ``distill/reverse_kl`` (mean of ``student - teacher``
    log-prob, a sample estimate of KL(student || teacher)), ``distill/teacher_logp``, ``distill/student_logp``,
    ``distill/advantage_mean`` and ``distill/advantage_std``.
    """
    student = torch.as_tensor(student_logps).detach().to(torch.float64)
    teacher = torch.as_tensor(teacher_logps).detach().to(torch.float64)
    weights = torch.as_tensor(mask).detach().to(torch.float64)
    if student.dim() != 2 or student.shape != teacher.shape or student.shape != weights.shape:
        raise ValueError(
            f"student log-probs {tuple(student.shape)}, teacher log-probs {tuple(teacher.shape)} and mask "
            f"{tuple(weights.shape)} must be the same (B, T) shape"
        )
    student = student.masked_fill(weights == 0, 0.0)  # padding may hold anything (even -inf)
    teacher = teacher.masked_fill(weights == 0, 0.0)
    if not (torch.isfinite(student).all() and torch.isfinite(teacher).all()):
        raise ValueError("student and teacher log-probs must be finite on the completion tokens")
    reverse_kl = (student - teacher) * weights
    terms = -float(spec.coef) * reverse_kl
    if spec.discount > 0:
        advantages = torch.zeros_like(terms)
        running = torch.zeros_like(terms[:, 0])
        for t in range(terms.shape[1] - 1, -1, -1):  # A_t = term_t + discount * A_{t+1}
            running = terms[:, t] + float(spec.discount) * running
            advantages[:, t] = running
    else:
        advantages = terms
    if spec.reward_coef > 0:
        if reward_advantages is None:
            raise ValueError("reward_coef > 0 needs the group-relative reward advantages")
        rewards = torch.as_tensor(reward_advantages).detach().to(torch.float64).reshape(-1, 1)
        if rewards.shape[0] != terms.shape[0]:
            raise ValueError(f"{rewards.shape[0]} reward advantages for {terms.shape[0]} completions")
        advantages = advantages + float(spec.reward_coef) * rewards
    advantages = advantages * weights

    count = weights.sum().clamp(min=1.0)
    adv_mean = _masked_mean(advantages, weights, count)
    adv_var = _masked_mean((advantages - adv_mean) ** 2, weights, count)
    metrics = {
        "distill/reverse_kl": _masked_mean(reverse_kl, weights, count).item(),
        "distill/teacher_logp": _masked_mean(teacher, weights, count).item(),
        "distill/student_logp": _masked_mean(student, weights, count).item(),
        "distill/advantage_mean": adv_mean.item(),
        "distill/advantage_std": adv_var.sqrt().item(),
    }
    return DistillationTerms(advantages.to(torch.float32), metrics)


def distillation_row_advantages(
    student_rows: list[list[float]],
    teacher_rows: list[list[float]],
    spec: DistillationSpec,
    reward_advantages: list[float] | None = None,
) -> tuple[list[list[float]], dict[str, float]]:
    """`distillation_advantages` of ragged rows, one list of completion-token log-probs per completion (the PyTRIO
    loop's form): padded to (B, T) with a mask of each row's length; returns each row's advantages and the metrics."""
    if len(student_rows) != len(teacher_rows):
        raise ValueError(f"{len(teacher_rows)} teacher rows for {len(student_rows)} completions")
    for student, teacher in zip(student_rows, teacher_rows, strict=True):
        if len(student) != len(teacher):
            raise ValueError(f"{len(teacher)} teacher log-probs for a completion of {len(student)} tokens")
    width = max((len(row) for row in student_rows), default=0)
    shape = (len(student_rows), max(width, 1))
    student, teacher, mask = (torch.zeros(shape, dtype=torch.float64) for _ in range(3))
    for i, (s, t) in enumerate(zip(student_rows, teacher_rows, strict=True)):
        student[i, : len(s)] = torch.tensor(s, dtype=torch.float64)
        teacher[i, : len(t)] = torch.tensor(t, dtype=torch.float64)
        mask[i, : len(s)] = 1.0
    rewards = None if reward_advantages is None else torch.tensor(reward_advantages, dtype=torch.float64)
    terms = distillation_advantages(student, teacher, mask, spec, rewards)
    rows = [terms.advantages[i, : len(s)].tolist() for i, s in enumerate(student_rows)]
    return rows, terms.metrics
