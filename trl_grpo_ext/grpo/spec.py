"""One GRPO spec: the settings both execution paths share, declared once and validated by one function.

`GRPOSpec` declares every GRPO setting the TRL path (`trl_grpo_ext.trl.config.GRPOConfig`) and the PyTRIO path
(`trl_grpo_ext.pytrio.config.PyTrioGRPOConfig`) both read, spelled and meant as in `trl.GRPOConfig`:

- ``GRPOConfig(GRPOSpec, trl.GRPOConfig)``: TRL's fields come first, in TRL's order (positional arguments land where
  TRL puts them), and a field TRL already declares (``num_generations``, ``temperature``, ``beta``, ``epsilon``,
  ``scale_rewards``...) keeps TRL's declaration on the TRL path (TRL's default and help, as TRL users expect;
  `trl_grpo_ext.trl.config.trl_declarations`); the fields TRL lacks (clip bounds of ``cispo``, degenerate groups,
  dynamic sampling, curriculum) come from here. ``loss_type`` is re-declared there with this help and TRL's default.
- ``PyTrioGRPOConfig(GRPOSpec)`` takes every field from here.

So the spec's defaults are the PyTRIO path's; two differ from TRL's, on purpose: ``loss_type`` ('dapo' is TRL's
default, and dapo's normaliser does not exist on PyTRIO, where 'importance_sampling' is the service's built-in
loss) and ``max_completion_length`` (TRL's 512; the PyTRIO loop samples remotely and has always defaulted to 256).

`spec_problems` is the one validator of these settings, `reward_option_problems` the one check of the options that
name reward functions; each config collects every problem and raises one `trl_grpo_ext.errors.ConfigError` listing
them all, each problem starting with its YAML key.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from trl_grpo_ext.grpo.async_sampling import async_problems, sampler_correction_problems
from trl_grpo_ext.grpo.curriculum import curriculum_settings_problems
from trl_grpo_ext.grpo.distillation import distillation_block_problems, normalize_distillation
from trl_grpo_ext.grpo.loss_table import (
    CISPO_CLIP,
    DEFAULT_CLIP,
    EPSILON,
    EPSILON_HIGH_CAP,
    LOSSES,
    TRL,
    loss_type_help,
    valid_loss_types,
)

SCALE_REWARDS = ("group", "batch", "none")


@dataclass
class GRPOSpec:
    """The GRPO settings both execution paths share (TRL's names and meanings). See the module docstring for how
    `GRPOConfig` and `PyTrioGRPOConfig` use it; docs/losses.md and docs/recipes.md describe each option."""

    loss_type: str = field(default="importance_sampling", metadata={"help": loss_type_help()})
    num_generations: int = field(default=8, metadata={"help": "Completions per prompt (the GRPO group size, >= 2)."})
    max_completion_length: int = field(default=256, metadata={"help": "Maximum generated tokens per completion."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (> 0)."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling threshold, in (0, 1]."})
    top_k: int = field(default=0, metadata={"help": "Top-k sampling; 0 disables it (TRL's convention)."})
    beta: float = field(
        default=0.0, metadata={"help": "KL coefficient (>= 0); the PyTRIO path supports only 0.0 (no reference)."}
    )
    epsilon: float = field(
        default=0.2,
        metadata={"help": "Clipping epsilon: 'ppo' clips the importance ratio to [1 - epsilon, 1 + epsilon_high]."},
    )
    epsilon_high: float | None = field(
        default=None,
        metadata={"help": "Upper clipping epsilon of 'ppo' (and TRL's clipped losses); None: `epsilon`."},
    )
    scale_rewards: str = field(
        default="group",
        metadata={
            "help": "Advantage scaling: 'group' (std of the prompt group), 'batch' (std of the batch) or 'none' "
            "(mean only); true/false mean group/none, as in TRL."
        },
    )
    reward_weights: list[float] | None = field(
        default=None, metadata={"help": "One weight per reward function; None weighs them all 1.0."}
    )
    cispo_clip_low: float = field(
        default=DEFAULT_CLIP["cispo"][0],
        metadata={
            "help": "Lower bound of the importance ratio r (not an epsilon) for loss_type='cispo'. 0 leaves the "
            "lower side open, as MiniMax-M1 and Tinker do. Ignored by other loss types."
        },
    )
    cispo_clip_high: float = field(
        default=DEFAULT_CLIP["cispo"][1],
        metadata={
            "help": "Upper bound of the importance ratio r (not an epsilon) for loss_type='cispo'. Tinker's default "
            "is 4.0; on-policy tokens (r = 1) are never capped as long as it is >= 1. Ignored by other loss types."
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
            "help": "One reward function, by its reward_funcs name or function name (e.g. 'boxed' or "
            "'boxed_reward'). Groups where this reward is flat (within degenerate_tol) count as degenerate even if "
            "a shaping reward such as format varies."
        },
    )
    # Dynamic sampling and the curriculum: `trl_grpo_ext.grpo.dynamic_sampling`, `trl_grpo_ext.grpo.curriculum`
    # (docs/recipes.md, "Dynamic sampling").
    dynamic_sampling: bool = field(
        default=False,
        metadata={
            "help": "DAPO's group filter: drop degenerate prompt groups (degenerate_tol / degenerate_reward) and "
            "sample more prompts until the step has its full number of informative groups, or "
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
            "help": "Reward function whose value decides a pass (e.g. 'boxed'); None: degenerate_reward if set, "
            "else the weighted total reward."
        },
    )
    curriculum_pass_threshold: float = field(
        default=1.0, metadata={"help": "A completion passes when that reward is >= this (boxed/hybrid: 1.0)."}
    )
    # On-policy distillation: `trl_grpo_ext.grpo.distillation` (docs/distillation.md).
    distillation: dict | str | None = field(
        default=None,
        metadata={
            "help": "On-policy distillation: a mapping of teacher (model id or folder; on PyTRIO the base model), "
            "teacher_model_path (PyTRIO: a saved checkpoint of it), coef (weight of the negative reverse KL per "
            "token, default 1.0), reward_coef (weight of GRPO's reward advantage, default 0: pure distillation) "
            "and discount (0: per-token terms; > 0: discounted sum of the later terms). From the command line: "
            "JSON text. None: plain GRPO."
        },
    )

    # Asynchronous sampling: `trl_grpo_ext.grpo.async_sampling` (docs/async.md).
    async_sampling: bool = field(
        default=False,
        metadata={
            "help": "Sample the next steps' batches while the current step trains, sample_ahead optimizer steps "
            "ahead and never more than max_staleness steps old; the loss corrects the gap as async_objective says. "
            "Which weights draw which batch follows the step, not the clock: a seeded run gives the same results "
            "whatever the speed of either side. On a CPU the sampler and the trainer get their own cores. Logs "
            "sample/staleness_*, perf/rollout_wait_s, rollout/weight_wait_s, perf/overlap_frac and the behaviour "
            "ratio by staleness."
        },
    )
    max_staleness: int = field(
        default=1,
        metadata={
            "help": "With async_sampling: the bound on how many optimizer steps older than the trained policy the "
            "weights that drew a sample may be, at every step that trains it (TRL's AsyncGRPOTrainer's name). 0: "
            "on-policy, the synchronous path itself."
        },
    )
    sample_ahead: int = field(
        default=1,
        metadata={
            "help": "With async_sampling: how many optimizer steps ahead of the trainer the sampler draws: step k + "
            "sample_ahead's batch is drawn by the weights of step k while step k trains (1 <= sample_ahead <= "
            "max_staleness; more only lets a sampler that is sometimes slow catch up, at more staleness)."
        },
    )
    async_objective: str = field(
        default="decoupled",
        metadata={
            "help": "With async_sampling: 'decoupled' (AReaL's behaviour/proximal split) takes the loss's own ratio "
            "and clip against the weights at the step's start and weighs each token (or completion) by the "
            "behaviour ratio proximal/sampler, truncated or masked as vllm_importance_sampling_* say; 'coupled' "
            "takes the loss's ratio against the sampler's log-probs directly (no separate behaviour weight)."
        },
    )
    async_timeout_s: float = field(
        default=600.0,
        metadata={
            "help": "With async_sampling: seconds without a batch from the sampler (or, for the sampler, without "
            "the weights its next batch needs) before the run stops with an error; a wait longer than a tenth of "
            "it is logged as a stall."
        },
    )
    # The sampler correction (TRL's names and defaults): the behaviour weight of the decoupled objective, and the
    # on-policy correction of a sampler whose numbers differ from the trainer's (bf16 on the CPU, vLLM).
    vllm_importance_sampling_correction: bool = field(
        default=True,
        metadata={
            "help": "Weigh the loss by the ratio of the trainer's (proximal) log-probs to the sampler's, as "
            "vllm_importance_sampling_mode says: the behaviour weight of asynchronous sampling's decoupled "
            "objective, and the correction of a sampler whose numbers differ from the trainer's."
        },
    )
    vllm_importance_sampling_mode: str = field(
        default="sequence_mask",
        metadata={
            "help": "token_truncate, token_mask, sequence_truncate or sequence_mask: per token or per completion "
            "(the summed log-ratio), clamped to [clip_min, clip_max] (truncate) or zeroed outside it (mask)."
        },
    )
    vllm_importance_sampling_clip_max: float | None = field(
        default=3.0, metadata={"help": "Upper bound C_max of the sampler correction's ratio (None: none)."}
    )
    vllm_importance_sampling_clip_min: float | None = field(
        default=None, metadata={"help": "Lower bound C_min of the sampler correction's ratio (None: none)."}
    )


def spec_field(name: str, default):
    """`GRPOSpec`'s declaration of `name` (its help) with another default: for a path whose default differs."""
    return field(default=default, metadata=GRPOSpec.__dataclass_fields__[name].metadata)


# ------------------------------------------------------------------------------------------ validation


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value) -> bool:
    return _is_number(value) and value == int(value)


def number_problem(name: str, value, ok, rule: str) -> list[str]:
    """``["name=value is not valid; it must be <rule>"]`` unless `value` is a finite number that satisfies `ok`."""
    if _is_number(value) and ok(value):
        return []
    return [f"{name}={value!r} is not valid; it must be {rule}"]


def _name_problem(name: str, value) -> list[str]:
    if value is None or (isinstance(value, str) and value.strip()):
        return []
    return [f"{name}={value!r} must be a reward function name or None"]


def normalize_values(config) -> None:
    """Before validation: TRL's boolean spellings of ``scale_rewards`` (also as CLI/YAML strings); the
    ``distillation`` block as a full mapping (`trl_grpo_ext.grpo.distillation.normalize_distillation`)."""
    normalize_distillation(config)
    scale = getattr(config, "scale_rewards", None)
    if isinstance(scale, str) and scale.lower() in ("true", "false"):
        scale = scale.lower() == "true"
    if isinstance(scale, bool):
        config.scale_rewards = "group" if scale else "none"


def _loss_problems(config, path: str) -> list[str]:
    valid = valid_loss_types(path)
    loss_type = config.loss_type
    if loss_type not in valid:
        return [f"loss_type={loss_type!r} is not valid; valid values: {', '.join(valid)}"]
    problems = []
    bounds = LOSSES[loss_type].bounds
    epsilon, epsilon_high = config.epsilon, config.epsilon_high
    if bounds == EPSILON_HIGH_CAP and epsilon_high is None:
        problems.append(
            f"epsilon_high is not set: loss_type={loss_type!r} (TRL's one-sided cispo) caps the ratio at epsilon_high, "
            "which defaults to epsilon=0.2 and then scales every on-policy gradient by 0.2. Set epsilon_high "
            "explicitly (MiniMax-M1 and Tinker cap at 4.0, ScaleRL recommends 5.0), or use loss_type='cispo' "
            "(cispo_clip_low/high)"
        )
    if LOSSES[loss_type].local and bounds != EPSILON and epsilon_high is not None:
        clip_fields = "cispo_clip_low / cispo_clip_high" if bounds == CISPO_CLIP else "nothing (no clipping)"
        hint = " (or use loss_type='trl_cispo' for TRL's cispo)" if path == TRL else ""
        problems.append(
            f"epsilon_high={epsilon_high} has no effect with loss_type={loss_type!r}; its ratio bounds are "
            f"{clip_fields}. Unset epsilon_high{hint}"
        )
    if bounds == EPSILON and LOSSES[loss_type].local:
        ok_low = _is_number(epsilon) and 0 <= epsilon <= 1
        ok_high = epsilon_high is None or (_is_number(epsilon_high) and epsilon_high >= 0)
        if not (ok_low and ok_high):
            problems.append(
                f"epsilon={epsilon}, epsilon_high={epsilon_high}: loss_type={loss_type!r} clips the ratio to "
                "[1 - epsilon, 1 + epsilon_high]: epsilon must be in [0, 1] and epsilon_high >= 0"
            )
    delta = getattr(config, "delta", None)  # TRL's INTELLECT-2 two-sided clipping (TRL path only)
    if LOSSES[loss_type].local and delta is not None:
        problems.append(
            f"delta={delta} (INTELLECT-2 two-sided clipping of TRL's PPO-style losses) does not apply to "
            f"loss_type={loss_type!r}; unset delta or use loss_type='dapo'/'grpo'"
        )
    return problems


def _clip_problems(config) -> list[str]:
    low, high = config.cispo_clip_low, config.cispo_clip_high
    problems = []
    for name, value in (("cispo_clip_low", low), ("cispo_clip_high", high)):
        problems += number_problem(name, value, lambda v: v >= 0, "a finite number >= 0")
    if not problems and low > high:
        problems.append(
            f"cispo_clip_low ({low}) must be <= cispo_clip_high ({high}); both are bounds of the importance ratio "
            "r, not epsilons"
        )
    return problems


def _sampling_problems(config) -> list[str]:
    batches = config.max_generation_batches
    problems = (
        [] if _is_int(batches) and batches >= 1 else [f"max_generation_batches={batches!r} must be an integer >= 1"]
    )
    problems += curriculum_settings_problems(config.curriculum_ema, config.curriculum_floor, 0.5)
    problems += number_problem("curriculum_pass_threshold", config.curriculum_pass_threshold, lambda v: True, "finite")
    return problems


def spec_problems(config, path: str) -> list[str]:
    """Every problem with the `GRPOSpec` settings of `config` on execution path `path` (`loss_table.TRL` or
    `PYTRIO`), each message starting with its YAML key. Call `normalize_values` first."""
    problems = _loss_problems(config, path)
    scale = config.scale_rewards
    if scale not in SCALE_REWARDS:
        problems.append(
            f"scale_rewards={scale!r} is not valid; valid values: {', '.join(SCALE_REWARDS)} (or true/false)"
        )
    problems += number_problem(
        "num_generations", config.num_generations, lambda v: v >= 2 and v == int(v), "an int >= 2 (a group)"
    )
    if not (path == TRL and config.max_completion_length is None):  # TRL: None = no limit
        problems += number_problem(
            "max_completion_length", config.max_completion_length, lambda v: v > 0 and v == int(v), "an int > 0"
        )
    problems += number_problem(
        "temperature", config.temperature, lambda v: v > 0, "a finite number > 0 (sampling temperature)"
    )
    problems += number_problem("top_p", config.top_p, lambda v: 0 < v <= 1, "in (0, 1]")
    problems += number_problem("top_k", config.top_k, lambda v: v >= 0 and v == int(v), "an int >= 0 (0: off)")
    problems += number_problem(
        "beta", config.beta, lambda v: v >= 0, "a finite number >= 0 (the KL coefficient; 0 disables it)"
    )
    weights = config.reward_weights
    if weights is not None and not (isinstance(weights, (list, tuple)) and all(_is_number(w) for w in weights)):
        problems.append(f"reward_weights={weights!r} must be a list of finite numbers or None")
    problems += _clip_problems(config)
    problems += number_problem("degenerate_tol", config.degenerate_tol, lambda v: v >= 0, "a finite number >= 0")
    for name in ("zero_degenerate_advantages", "dynamic_sampling", "curriculum"):
        if not isinstance(getattr(config, name), bool):
            problems.append(f"{name}={getattr(config, name)!r} must be true or false")
    problems += _name_problem("degenerate_reward", config.degenerate_reward)
    problems += _name_problem("curriculum_reward", config.curriculum_reward)
    problems += _sampling_problems(config)
    problems += distillation_block_problems(getattr(config, "distillation", None))
    problems += async_problems(config)
    problems += sampler_correction_problems(config)
    if getattr(config, "distillation", None) is not None and config.dynamic_sampling:
        problems.append(
            "distillation: dynamic_sampling filters groups by their rewards, which a teacher's per-token signal "
            "does not follow; unset one of them"
        )
    return problems


# ------------------------------------------------------------------------------------------ reward options


def curriculum_pass_reward(config) -> str | None:
    """The reward whose value decides a curriculum pass: ``curriculum_reward``, else ``degenerate_reward``; None:
    the weighted total reward."""
    return getattr(config, "curriculum_reward", None) or getattr(config, "degenerate_reward", None)


def reward_option_problems(config, reward_names: Sequence[Collection[str]], weighted: int | None = None) -> list[str]:
    """``reward_weights``, ``degenerate_reward`` and ``curriculum_reward`` of `config` against its reward functions.

    `reward_names[i]` holds every name reward function i answers to: its ``reward_funcs`` entry and its function
    name (TRL's ``rewards/<name>/mean``), from `trl_grpo_ext.task.rewards.reward_names`. Both paths call this: the TRL
    recipe before the model loads, the PyTRIO config when parsed (the trainer, when built, `reward_name_problems`).

    `weighted`: how many of the reward functions, from the first, ``reward_weights`` weighs (None: all). TRL's
    trainer weighs the ``reward_funcs`` it was given and appends a reward an environment owns (``environment_factory``
    with ``get_reward``) after them with weight 1; the options that name a reward may still name that one.
    """
    shown = ["/".join(dict.fromkeys(names)) for names in reward_names]
    weighted = len(reward_names) if weighted is None else weighted
    problems = []
    weights = getattr(config, "reward_weights", None)
    if isinstance(weights, (list, tuple)) and len(weights) != weighted:
        problems.append(
            f"reward_weights has {len(weights)} entries for {weighted} reward functions ({shown[:weighted]})"
        )
    return problems + reward_name_problems(config, reward_names)


def reward_name_problems(config, reward_names: Sequence[Collection[str]]) -> list[str]:
    """``degenerate_reward`` and ``curriculum_reward`` of `config` against its reward functions (`reward_option_problems`
    without ``reward_weights``: the TRL trainer's check, as TRL's constructor checks ``reward_weights`` itself)."""
    shown = ["/".join(dict.fromkeys(names)) for names in reward_names]
    problems = []
    for option in ("degenerate_reward", "curriculum_reward"):
        name = getattr(config, option, None)
        if isinstance(name, str) and name.strip() and not any(name in names for names in reward_names):
            problems.append(f"{option}={name!r} is not one of the reward functions {shown}")
    return problems
