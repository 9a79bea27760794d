"""`GRPOConfig`: TRL's GRPO configuration plus the fields of the extra loss types and the degenerate-group rule.

Every field keeps TRL's name and meaning; the additions are validated in `__post_init__`, so a bad recipe fails
when it is parsed, not after the model has loaded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import trl

from trl_grpo_ext.losses import DEFAULT_CLIP

# Loss types TRL 1.16's `GRPOTrainer._compute_loss` implements; the subclass hands these to TRL unchanged.
TRL_LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")
# Loss types the subclass computes itself (per-token math in `trl_grpo_ext.losses`, TRL's `dapo` normaliser).
# `ppo` is Tinker's/PyTRIO's name: per token the same as TRL's dapo, with ratio bounds 1 - epsilon, 1 + epsilon_high;
# it lets one recipe sweep the same loss names on both execution paths.
EXTRA_LOSS_TYPES = ("importance_sampling", "cispo", "ppo")
# `cispo` means the two-sided CISPO here; TRL's own (one-sided, capped at `epsilon_high`) stays reachable by this name.
TRL_CISPO_ALIAS = "trl_cispo"
VALID_LOSS_TYPES = tuple(t for t in TRL_LOSS_TYPES if t != "cispo") + EXTRA_LOSS_TYPES + (TRL_CISPO_ALIAS,)
SCALE_REWARDS = ("group", "batch", "none")


def trl_loss_type(loss_type: str) -> str | None:
    """The TRL loss type that `loss_type` delegates to, or ``None`` when the subclass computes it."""
    if loss_type == TRL_CISPO_ALIAS:
        return "cispo"
    if loss_type in EXTRA_LOSS_TYPES:
        return None
    return loss_type


@dataclass
class GRPOConfig(trl.GRPOConfig):
    """TRL's `GRPOConfig` with two more loss types and a tolerance for degenerate prompt groups.

    See `docs/losses.md` for the formulas, the options that do not combine with the new loss types, and the
    degenerate-group rule.
    """

    loss_type: str = field(
        default="dapo",
        metadata={
            "help": "Loss formulation. TRL's types ('grpo', 'dr_grpo', 'dapo', 'bnpo', 'sapo', 'luspo', 'vespo') run "
            "unchanged in TRL's code. Added: 'importance_sampling' (-r * A, no clipping) and 'cispo' (two-sided "
            "CISPO: -sg(clip(r, cispo_clip_low, cispo_clip_high)) * A * logp) and 'ppo' (Tinker's name: "
            "-min(r * A, clip(r, 1 - epsilon, 1 + epsilon_high) * A), i.e. dapo's per-token loss), all normalised like "
            "'dapo'. "
            "'trl_cispo' selects TRL's own one-sided cispo (ratio capped at `epsilon_high`, which must then be set)."
        },
    )
    cispo_clip_low: float = field(
        default=DEFAULT_CLIP["cispo"][0],
        metadata={
            "help": "Lower bound of the importance ratio r (not an epsilon) for loss_type='cispo'. 0 leaves the "
            "lower side open, as MiniMax-M1 and Tinker do."
        },
    )
    cispo_clip_high: float = field(
        default=DEFAULT_CLIP["cispo"][1],
        metadata={
            "help": "Upper bound of the importance ratio r (not an epsilon) for loss_type='cispo'. Tinker's default "
            "is 4.0; on-policy tokens (r = 1) are never capped as long as it is >= 1."
        },
    )
    degenerate_tol: float = field(
        default=1e-6,
        metadata={
            "help": "A prompt group whose rewards all lie within this absolute distance (max - min) is degenerate: "
            "counted in `frac_degenerate` and, with zero_degenerate_advantages, given zero advantage. TRL's own "
            "exact test misses float rounding noise (std ~1e-7) that scale_rewards='group' turns into ±1e-3."
        },
    )
    zero_degenerate_advantages: bool = field(
        default=True,
        metadata={"help": "Set the advantages of degenerate prompt groups to exactly zero (any loss type)."},
    )
    degenerate_reward: str | None = field(
        default=None,
        metadata={
            "help": "Name of one reward function (e.g. 'boxed_reward'). Groups where this reward is flat (within "
            "degenerate_tol) count as degenerate even if a shaping reward such as format varies."
        },
    )

    # Dynamic sampling and the curriculum: `trl_grpo_ext.trl_sampling` (docs/recipes.md, "Dynamic sampling").
    dynamic_sampling: bool = field(
        default=False,
        metadata={
            "help": "DAPO's group filter: drop degenerate prompt groups (degenerate_tol / degenerate_reward) and "
            "generate more prompts until the generation batch has its full number of informative groups, or "
            "max_generation_batches is reached (then the missing groups are padding that trains on nothing). Logs "
            "generation_batches, frac_degenerate_before_filter and frac_degenerate (after the filter)."
        },
    )
    max_generation_batches: int = field(
        default=4,
        metadata={"help": "With dynamic_sampling: generation batches one step may use, the first included (>= 1)."},
    )
    curriculum: bool = field(
        default=False,
        metadata={
            "help": "Adaptive task curriculum (needs a `task` column, e.g. dataset_name: synthetic): each task's "
            "sampling weight is base_share * (p * (1 - p) + curriculum_floor), p its running pass rate. Logs "
            "curriculum/<task>/weight and curriculum/<task>/pass_rate."
        },
    )
    curriculum_ema: float = field(
        default=0.3,
        metadata={"help": "Weight of the newest generation batch in each task's running pass rate, in (0, 1]."},
    )
    curriculum_floor: float = field(
        default=0.05, metadata={"help": "Added to p * (1 - p) so no task's weight reaches 0 (> 0)."}
    )
    curriculum_reward: str | None = field(
        default=None,
        metadata={
            "help": "Reward function whose value decides a pass (e.g. 'boxed_reward'); None: degenerate_reward if "
            "set, else the weighted total reward."
        },
    )
    curriculum_pass_threshold: float = field(
        default=1.0, metadata={"help": "A completion passes when that reward is >= this (boxed/hybrid: 1.0)."}
    )

    share_prompt_prefix: bool = field(
        default=True,
        metadata={
            "help": "Encode the prompt tokens rows share once per micro-batch: the prefix common to all rows (system "
            "prompt, few-shot example) and each distinct prompt for its group's rows, in the log-prob forward/"
            "backward and in non-vLLM generation. Outputs equal the plain computation to float rounding; models or "
            "inputs where that can't hold use TRL's path (see docs/prefix_sharing.md)."
        },
    )
    share_prompt_prefix_across_microbatches: bool = field(
        default=True,
        metadata={
            "help": "With share_prompt_prefix: encode the shared prompt parts of the whole generation batch once per "
            "gradient-accumulation cycle (with gradients; micro-batches then encode only their rows' own tokens) "
            "and once per no-grad log-prob call (old/reference log-probs). Applies on a single process without "
            "DeepSpeed/FSDP; the training part also needs no gradient checkpointing and steps_per_generation == "
            "gradient_accumulation_steps; elsewhere each micro-batch shares on its own (docs/prefix_sharing.md)."
        },
    )
    max_packed_tokens: int | None = field(
        default=None,
        metadata={
            "help": "With share_prompt_prefix: most tokens in one packed sequence of the shared-prefix log-prob "
            "forward; rows past it start another sequence with its own copy of the shared prompt parts. None: no "
            "limit under sdpa, flash_attention_2/3 and flex_attention (their attention cost is per row), 4096 under "
            "eager (its dense mask costs T^2 per sequence). See docs/prefix_sharing.md."
        },
    )

    def __post_init__(self):
        if isinstance(self.scale_rewards, str) and self.scale_rewards.lower() in ("true", "false"):
            self.scale_rewards = self.scale_rewards.lower() == "true"  # CLI / YAML strings
        self._validate_generation_numbers()  # before TRL's own setup, which would fail later and less clearly
        super().__post_init__()
        self._validate_extensions()
        self._validate_sampling()

    def _validate_sampling(self):
        from trl_grpo_ext.data.curriculum import check_curriculum_settings

        if isinstance(self.max_generation_batches, bool) or not (
            isinstance(self.max_generation_batches, int) and self.max_generation_batches >= 1
        ):
            raise ValueError(f"max_generation_batches={self.max_generation_batches!r} must be an integer >= 1")
        local = self.per_device_train_batch_size * self.steps_per_generation
        if self.dynamic_sampling and local % self.num_generations:
            raise ValueError(
                f"dynamic_sampling keeps each process's groups on that process, so per_device_train_batch_size x "
                f"steps_per_generation ({local}) must be a multiple of num_generations ({self.num_generations})"
            )
        check_curriculum_settings(self.curriculum_ema, self.curriculum_floor, 0.5)
        if not math.isfinite(self.curriculum_pass_threshold):
            raise ValueError(f"curriculum_pass_threshold={self.curriculum_pass_threshold!r} must be finite")
        if self.curriculum_reward is not None and (
            not isinstance(self.curriculum_reward, str) or not self.curriculum_reward.strip()
        ):
            raise ValueError(f"curriculum_reward={self.curriculum_reward!r} must be a reward function name or None")

    def _validate_generation_numbers(self):
        """TRL leaves these to fail deep inside generation or the loss (or to train silently wrong, beta < 0)."""

        def number(name, value, ok, rule):
            numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not numeric or not math.isfinite(value) or not ok(value):
                raise ValueError(f"{name}={value!r} is not valid; it must be {rule}")

        number("beta", self.beta, lambda v: v >= 0, "a finite number >= 0 (the KL coefficient; 0 disables it)")
        number("temperature", self.temperature, lambda v: v > 0, "a finite number > 0 (sampling temperature)")
        if self.max_completion_length is not None:
            number("max_completion_length", self.max_completion_length, lambda v: v > 0 and v == int(v), "an int > 0")
        number("learning_rate", self.learning_rate, lambda v: v >= 0, "a finite number >= 0")

    def _validate_extensions(self):
        if self.loss_type not in VALID_LOSS_TYPES:
            raise ValueError(f"loss_type={self.loss_type!r} is not valid; valid values: {', '.join(VALID_LOSS_TYPES)}")
        if self.scale_rewards not in SCALE_REWARDS:
            raise ValueError(
                f"scale_rewards={self.scale_rewards!r} is not valid; valid values: {', '.join(SCALE_REWARDS)} "
                "(or true/false)"
            )
        for name in ("cispo_clip_low", "cispo_clip_high", "degenerate_tol"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name}={value!r} is not valid; it must be a finite number >= 0")
        if self.cispo_clip_low > self.cispo_clip_high:
            raise ValueError(
                f"cispo_clip_low ({self.cispo_clip_low}) must be <= cispo_clip_high ({self.cispo_clip_high}); both "
                "are bounds of the importance ratio r, not epsilons"
            )
        for name in ("share_prompt_prefix", "share_prompt_prefix_across_microbatches"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be true or false")
        if self.max_packed_tokens is not None and (
            isinstance(self.max_packed_tokens, bool) or not isinstance(self.max_packed_tokens, int)
            or self.max_packed_tokens < 1
        ):  # fmt: skip
            raise ValueError(f"max_packed_tokens={self.max_packed_tokens!r} must be a positive integer or None")
        if self.degenerate_reward is not None and (
            not isinstance(self.degenerate_reward, str) or not self.degenerate_reward.strip()
        ):
            raise ValueError(f"degenerate_reward={self.degenerate_reward!r} must be a reward function name or None")

        if self.loss_type == TRL_CISPO_ALIAS and self.epsilon_high is None:
            raise ValueError(
                "loss_type='trl_cispo' (TRL's one-sided cispo) caps the ratio at epsilon_high, which defaults to "
                "epsilon=0.2 and then scales every on-policy gradient by 0.2. Set epsilon_high explicitly (MiniMax-M1 "
                "and Tinker cap at 4.0, ScaleRL recommends 5.0), or use loss_type='cispo' (cispo_clip_low/high)."
            )
        if self.loss_type in ("importance_sampling", "cispo"):
            clip_fields = "cispo_clip_low / cispo_clip_high" if self.loss_type == "cispo" else "nothing (no clipping)"
            if self.epsilon_high is not None:
                raise ValueError(
                    f"epsilon_high={self.epsilon_high} has no effect with loss_type={self.loss_type!r}; its ratio "
                    f"bounds are {clip_fields}. Unset epsilon_high (or use loss_type='trl_cispo' for TRL's cispo)."
                )
        if self.loss_type == "ppo" and not (0 <= self.epsilon <= 1 and (self.epsilon_high or 0) >= 0):
            raise ValueError(
                f"loss_type='ppo' clips the ratio to [1 - epsilon, 1 + epsilon_high]: epsilon must be in [0, 1] and "
                f"epsilon_high >= 0, got epsilon={self.epsilon}, epsilon_high={self.epsilon_high}"
            )
        if self.loss_type in EXTRA_LOSS_TYPES and self.delta is not None:
            raise ValueError(
                f"delta={self.delta} (INTELLECT-2 two-sided clipping of TRL's PPO-style losses) does not apply to "
                f"loss_type={self.loss_type!r}; unset delta or use loss_type='dapo'/'grpo'."
            )
