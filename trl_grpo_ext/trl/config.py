"""`GRPOConfig`: TRL's GRPO configuration plus the shared GRPO spec (`trl_grpo_ext.grpo.spec.GRPOSpec`: the extra
loss types' bounds, degenerate groups, dynamic sampling, the curriculum) and the TRL path's own prefix-sharing options.

Every field keeps TRL's name and meaning; `__post_init__` reports every bad value at once (one ValueError naming
each YAML key) before TRL's own setup, so a bad recipe fails when it is parsed, not after the model has loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import trl

from trl_grpo_ext.compat import resolve_checkpointing_fields
from trl_grpo_ext.cpu.precision import Precision, resolve_precision
from trl_grpo_ext.cpu.threads import runs_on_cpu
from trl_grpo_ext.decode import ENGINES as DECODE_ENGINES
from trl_grpo_ext.errors import raise_problems
from trl_grpo_ext.grpo.async_sampling import asynchronous, staleness_span_problems
from trl_grpo_ext.grpo.loss_table import (
    LOCAL_LOSS_TYPES,
    LOSSES,
    TRL,
    TRL_LOSS_TYPES,
    loss_type_of_trl_name,
    trl_loss_type,
    valid_loss_types,
)
from trl_grpo_ext.grpo.spec import (
    GRPOSpec,
    normalize_values,
    number_problem,
    spec_field,
    spec_problems,
)

# Loss names on this path, from the one table (`trl_grpo_ext.grpo.loss_table`): TRL 1.16's own (handed to TRL unchanged),
# the ones the subclass computes (`ppo` is Tinker's/PyTRIO's name, per token TRL's dapo, so one recipe sweeps the same
# names on both paths; `cispo` is the two-sided CISPO) and `trl_cispo`, TRL's own one-sided cispo.
EXTRA_LOSS_TYPES = tuple(name for name in LOCAL_LOSS_TYPES if TRL in LOSSES[name].paths)
TRL_CISPO_ALIAS = loss_type_of_trl_name("cispo")
VALID_LOSS_TYPES = valid_loss_types(TRL)

__all__ = ["EXTRA_LOSS_TYPES", "GRPOConfig", "TRL_CISPO_ALIAS", "TRL_LOSS_TYPES", "VALID_LOSS_TYPES", "trl_loss_type"]


def trl_declarations(cls):
    """Give `cls` (a class body, before ``@dataclass``) TRL's own declaration of every field that `GRPOSpec` and
    `trl.GRPOConfig` both declare and the body does not: TRL's type, default and help, as TRL users expect.

    `GRPOConfig` lists `GRPOSpec` before TRL in its bases because a dataclass orders its fields by the bases in reverse
    (the last base's first): that keeps TRL's field order, so ``GRPOConfig("out")`` sets ``output_dir`` as in TRL. The
    same rule would let the spec's declaration of a shared field win; re-declaring it here keeps TRL's, in TRL's place.
    """
    annotations = cls.__dict__.get("__annotations__", {})
    trl_fields = trl.GRPOConfig.__dataclass_fields__
    for name in GRPOSpec.__dataclass_fields__:
        if name in trl_fields and name not in annotations:
            annotations[name] = trl_fields[name].type
            # TRL's Field itself: @dataclass reads its default and metadata, and sets on it the name and type it has
            setattr(cls, name, trl_fields[name])
    cls.__annotations__ = annotations
    return cls


@dataclass
@trl_declarations
class GRPOConfig(GRPOSpec, trl.GRPOConfig):
    """TRL's `GRPOConfig` with the shared GRPO spec: more loss types, degenerate groups, dynamic sampling, curriculum.

    TRL's fields come first, in TRL's order and with TRL's declaration (default and help), also where the spec
    declares them (`trl_declarations`); the spec's other fields and this path's own follow. See `docs/losses.md`
    for the formulas, the options that do not combine with the new loss types, and the degenerate-group rule.
    """

    # The spec's help (both paths' loss names), TRL's default.
    loss_type: str = spec_field("loss_type", default="dapo")

    # TRL's field (bool | None) also takes `auto`, resolved here before TRL sees it (`trl_grpo_ext.cpu.precision`); typed
    # `str | None` so the command line passes `--bf16 auto` through (YAML true/false stay booleans).
    bf16: str | None = field(
        default="auto",
        metadata={
            "help": "bf16 mixed precision: bf16 autocast with fp32 master weights and fp32 optimizer state, in "
            "training and in sampling. 'auto' (default): on the CPU, bf16 where the CPU has bf16 matrix units "
            "(AVX512-BF16, AMX, Arm BF16), fp32 elsewhere; off the CPU, TRL's default (bf16 unless fp16). true / "
            "false force it. The choice and its reason are printed at start and kept in run_summary.json."
        },
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

    decode_engine: str = field(
        default="generate",
        metadata={
            "help": "The sampler's decode loop when transformers samples in this process (not vLLM): 'generate' "
            "(transformers' generate) or 'packed' (the same token selection over a static KV cache and "
            "oneDNN-prepacked weights: Llama-layout fp32 models on the CPU; elsewhere generate decodes and the "
            "reason is logged once). The recipes' before/after eval uses it too. See docs/decode.md."
        },
    )

    def __post_init__(self):
        normalize_values(self)  # scale_rewards true/false (CLI / YAML strings too)
        # Every problem at once, before TRL's own setup (which would fail later, one at a time, and less clearly).
        raise_problems("GRPOConfig", spec_problems(self, TRL) + self._trl_path_problems())
        # `auto` becomes TRL's bool (or None: TRL's default) here; `precision` keeps the choice and its reason
        self.precision: Precision = self._resolve_precision()
        self.bf16 = self.precision.bf16
        resolve_checkpointing_fields(self)  # TRL's default `gradient_checkpointing`, under transformers' newer name
        super().__post_init__()
        raise_problems("GRPOConfig", self._generation_batch_problems())

    def _resolve_precision(self) -> Precision:
        precision = resolve_precision(self.bf16, on_cpu=runs_on_cpu(self))
        if precision.setting == "auto" and precision.bf16 and not self.use_cpu:
            # transformers refuses bf16 on a machine without a GPU unless use_cpu is set: auto stays valid
            reason = f"{precision.reason}, but transformers trains bf16 on the CPU only with use_cpu: true"
            precision = Precision(False, precision.setting, reason)
        return precision

    def _trl_path_problems(self) -> list[str]:
        problems = number_problem("learning_rate", self.learning_rate, lambda v: v >= 0, "a finite number >= 0")
        for name in ("share_prompt_prefix", "share_prompt_prefix_across_microbatches"):
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name}={getattr(self, name)!r} must be true or false")
        try:
            resolve_precision(self.bf16, on_cpu=runs_on_cpu(self))
        except ValueError as error:  # a bad bf16 value or TRL_GRPO_EXT_CPU_BF16
            problems.append(str(error))
        if self.distillation is not None and self.cast_lm_head_to_fp32:
            problems.append("cast_lm_head_to_fp32 is not supported with a distillation teacher; unset one of them")
        if self.decode_engine not in DECODE_ENGINES:
            problems.append(f"decode_engine={self.decode_engine!r} must be one of {', '.join(DECODE_ENGINES)}")
        elif self.decode_engine != "generate" and self.share_prompt_prefix is False and not self.use_vllm:
            # the engine decodes after the shared-prefix prefill; without it TRL's own generate call samples
            problems.append(
                f"decode_engine={self.decode_engine!r} decodes after the shared prompt prefill: set "
                "share_prompt_prefix: true, or decode_engine: generate"
            )
        packed = self.max_packed_tokens
        if packed is not None and (isinstance(packed, bool) or not isinstance(packed, int) or packed < 1):
            problems.append(f"max_packed_tokens={packed!r} must be a positive integer or None")
        return problems

    def _generation_batch_problems(self) -> list[str]:
        """Checks of values TRL's setup derives (`steps_per_generation`)."""
        problems = []
        local = self.per_device_train_batch_size * self.steps_per_generation
        if self.dynamic_sampling and local % self.num_generations:
            problems.append(
                f"dynamic_sampling keeps each process's groups on that process, so per_device_train_batch_size x "
                f"steps_per_generation ({local}) must be a multiple of num_generations ({self.num_generations})"
            )
        if asynchronous(self):
            problems += staleness_span_problems(self, steps_per_generation_batch(self))
            problems += _async_sampler_problems(self)
        return problems


def steps_per_generation_batch(args) -> int:
    """The most optimizer steps one generation batch trains: TRL generates every ``steps_per_generation *
    num_iterations`` micro-steps and steps the optimizer every ``gradient_accumulation_steps``."""
    every, ga = args.steps_per_generation * args.num_iterations, args.gradient_accumulation_steps
    return max((k * every + every - 1) // ga - (k * every) // ga + 1 for k in range(ga))


# The generation_kwargs an asynchronous run takes: the rest change the distribution a token is drawn from in ways
# the trained policy does not model (n-gram bans, suppressed or biased tokens, a minimum length, warpers the recorder
# does not apply), or set the sampling settings where the trainer does not read them (temperature, top_k, top_p and
# min_p are the config's own keys, read by the sampler's recorder and the trained policy alike)
_ASYNC_GENERATION_KWARGS = ("use_cache", "cache_implementation")


def _async_sampler_problems(args) -> list[str]:
    """What makes the asynchronous sampler's log-probs other than those of the trained policy's distribution."""
    problems = []
    if args.repetition_penalty not in (None, 1.0):
        problems.append(
            f"repetition_penalty={args.repetition_penalty} with async_sampling: the penalty changes the distribution "
            "each token is drawn from by the tokens before it, which the trained policy's log-probs do not model; "
            "unset it"
        )
    extra = sorted(k for k in (args.generation_kwargs or {}) if k not in _ASYNC_GENERATION_KWARGS)
    if extra:
        problems.append(
            f"generation_kwargs {extra} with async_sampling: the sampler's log-probs would not be those of the "
            "trained policy's distribution; set temperature, top_k, top_p and min_p as the config's own keys "
            f"(generation_kwargs takes {', '.join(_ASYNC_GENERATION_KWARGS)})"
        )
    return problems


@dataclass(frozen=True)
class ExtensionOptions:
    """The options of this package's GRPOConfig that the TRL path's trainer and its mixins read, declared once:
    `of(args)` takes each from `args`, or GRPOConfig's default where `args` lacks it (a plain `trl.GRPOConfig` has
    none of them, and then trains as TRL would)."""

    degenerate_tol: float
    zero_degenerate_advantages: bool
    degenerate_reward: str | None
    dynamic_sampling: bool
    max_generation_batches: int
    curriculum: bool
    share_prompt_prefix: bool
    share_prompt_prefix_across_microbatches: bool
    max_packed_tokens: int | None
    decode_engine: str
    async_sampling: bool
    max_staleness: int
    sample_ahead: int
    async_objective: str
    async_timeout_s: float

    @classmethod
    def of(cls, args) -> ExtensionOptions:
        ours = GRPOConfig.__dataclass_fields__
        return cls(**{f.name: getattr(args, f.name, ours[f.name].default) for f in fields(cls)})
