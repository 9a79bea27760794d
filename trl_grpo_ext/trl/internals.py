"""TRL's internals in one place: the code this package copies from TRL and every access to TRL's private state.

The TRL path extends `trl.GRPOTrainer` by overriding its hooks (`OVERRIDDEN_HOOKS`, defined in `trl.trainer`,
`trl.sampling`, `trl.prefix_mixin`, `trl.sampler_precision` and `trl.tools` under TRL's private names, each calling ``super()``). Everything else it
needs of TRL beyond TRL's public API is here, so a TRL upgrade re-checks this module:

- **Copies.** Each function copied from TRL is marked ``@mirrors(TRL function, {TRL version: source hash})``;
  `MIRRORS` lists them and the code elsewhere that mirrors TRL (`MIRRORED_ELSEWHERE`: the copies in the
  path-independent core, which the PyTRIO loop imports without TRL and which therefore cannot live here, the recipe
  parser's steps of ``TrlParser.parse_args_and_config``, and two TRL-path hooks that follow a TRL function's layout). The copies were made from TRL 1.16.0. The hash is the
  SHA-256 (first 16 hex digits) of ``inspect.getsource`` of the installed TRL function with every run of whitespace
  made one space. ``tests/test_trl_internals.py`` recomputes it and fails, naming the TRL function and our copy,
  when the installed TRL's source is not the one the copy was checked against, or when the installed TRL version
  has no recorded hash. After re-checking a copy against the new TRL, add the new version's hash (the failure
  prints it).
- **Private state.** Named accessors (`log_metric`, `buffered_inputs`, `pad_token_id`, ...) for every private
  attribute of TRL's (or transformers') trainer that the TRL path reads or writes; `PRIVATE_STATE` names them, and
  the same test checks that a built trainer has each one.
- **Our state on the trainer.** `MixinState`: what our trainer and its mixins hand each other, declared once.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from trl.extras.profiling import profiling_context
from trl.models import prepare_deepspeed, prepare_fsdp, unwrap_model_for_generation
from trl.trainer.utils import (
    add_fused_lm_head,
    create_model_from_path,
    disable_dropout_in_model,
    pad,
    shuffle_sequence_dict,
    split_tensor_dict,
)

from trl_grpo_ext.compat import checkpointing_disabled
from trl_grpo_ext.grpo.losses import token_level_mean

TRL_GRPO = "trl.trainer.grpo_trainer.GRPOTrainer"


# ------------------------------------------------------------------------------------------ the copies


@dataclass(frozen=True)
class Mirror:
    """A copy of TRL code: ``trl`` the dotted name of the TRL function, ``ours`` the dotted name of the copy,
    ``source_hashes`` TRL version -> hash of that TRL function's normalised source the copy was checked against."""

    trl: str
    ours: str
    source_hashes: dict[str, str]
    part: str = ""  # which part of the TRL function is copied, when not all of it


MIRRORS: list[Mirror] = []


def mirrors(trl_function: str, source_hashes: dict[str, str], part: str = ""):
    """Decorator: the function copies (a part of) `trl_function`, checked against the TRL sources `source_hashes`."""

    def record(func):
        MIRRORS.append(Mirror(trl_function, f"{func.__module__}.{func.__qualname__}", source_hashes, part))
        return func

    return record


# Inputs that `_get_per_token_logps_and_entropies` takes for multimodal models, forwarded as `_compute_loss` does.
MODEL_INPUT_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


def loss_mask(inputs: dict) -> torch.Tensor:
    """The tokens TRL's loss counts: ``completion_mask``, times ``tool_mask`` when tools ran (`_compute_loss`)."""
    mask = inputs["completion_mask"]
    return mask if "tool_mask" not in inputs else mask * inputs["tool_mask"]


@mirrors(f"{TRL_GRPO}._compute_loss", {"1.16.0": "786b6ecc70228b78"}, part="importance_sampling_level")
def log_importance_weights(trainer, log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """TRL 1.16 ``_compute_loss``'s log importance weights: per token, or one per sequence (B, 1)."""
    if trainer.importance_sampling_level == "token":
        return log_ratio
    if trainer.importance_sampling_level == "sequence":
        return ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    raise ValueError(
        f"Unknown importance sampling level: {trainer.importance_sampling_level}. Possible values are 'token' and "
        "'sequence'."
    )


@dataclass
class LossTerms:
    """What `compute_loss` computed besides the loss, for the caller's metrics."""

    mask: torch.Tensor
    log_importance_weights: torch.Tensor
    ratio_stats: dict[str, torch.Tensor]  # the policy term's ratio metrics (local masked means)
    token_means: dict[str, torch.Tensor]  # per-token values logged as global masked means: entropy, kl (beta > 0)


# policy_term(inputs, log_importance_weights, per_token_logps, advantages, mask) -> (per-token loss, ratio metrics)
PolicyTerm = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]


@mirrors(f"{TRL_GRPO}._compute_loss", {"1.16.0": "786b6ecc70228b78"})
def compute_loss(trainer, model, inputs: dict, policy_term: PolicyTerm) -> tuple[torch.Tensor, LossTerms]:
    """TRL 1.16 ``_compute_loss`` step by step with `policy_term` in place of TRL's per-loss-type branch and TRL's
    ``dapo`` normalisation: reference KL, old log-probabilities (``num_iterations > 1``), ``importance_sampling_level``,
    ``top_entropy_quantile``, off-policy mask, vLLM importance-sampling correction, entropy bonus, MoE aux loss.

    TRL's own metrics (entropy bonus, aux loss) are logged here; the caller logs `LossTerms`'."""
    prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    mask = loss_mask(inputs)
    per_token_logps, entropies, aux_loss = trainer._get_per_token_logps_and_entropies(
        model,
        input_ids,
        attention_mask,
        completion_ids.size(1),
        compute_entropy=True,
        compute_aux_loss=trainer.aux_loss_enabled,
        **{key: inputs.get(key) for key in MODEL_INPUT_KEYS},
    )
    entropy_mask = (
        trainer.get_high_entropy_mask(entropies, mask, 1 - trainer.top_entropy_quantile)
        if trainer.top_entropy_quantile < 1.0
        else None
    )
    advantages = inputs["advantages"]
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    # Without old log-probabilities TRL is on-policy (one update per generation): ratio exactly 1.
    old_per_token_logps = inputs.get("old_per_token_logps")
    if old_per_token_logps is None:
        old_per_token_logps = per_token_logps.detach()

    log_iw = log_importance_weights(trainer, per_token_logps - old_per_token_logps, mask)
    if trainer.beta != 0.0:
        ref_per_token_logps = inputs["ref_per_token_logps"]
        per_token_kl = torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1
        if trainer.args.use_bias_correction_kl:
            per_token_kl = per_token_kl * torch.exp(log_iw)

    per_token_loss, ratio_stats = policy_term(inputs, log_iw, per_token_logps, advantages, mask)
    if trainer.off_policy_mask_threshold is not None:
        per_token_loss = per_token_loss * trainer.get_off_policy_mask(
            advantages=advantages,
            per_token_logps=per_token_logps,
            sampling_per_token_logps=inputs.get("sampling_per_token_logps", old_per_token_logps),
            mask=mask,
            off_policy_threshold=trainer.off_policy_mask_threshold,
        )
    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask
    if trainer.use_vllm and trainer.vllm_importance_sampling_correction:
        per_token_loss = per_token_loss * inputs["importance_sampling_ratio"]
    if trainer.beta != 0.0:
        per_token_loss = per_token_loss + trainer.beta * per_token_kl

    mode = "train" if trainer.model.training else "eval"
    # TRL's dapo normaliser: active tokens of the generation batch (all processes), per process and per
    # accumulation window, so the accumulated gradient is a token mean over the whole window.
    normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / trainer.accelerator.num_processes
    if mode == "train":
        normalizer = normalizer * trainer.current_gradient_accumulation_steps / trainer.args.steps_per_generation
    loss = token_level_mean(per_token_loss, mask, normalizer)
    policy_loss = loss.detach()

    if trainer._entropy_bonus_enabled:
        loss = entropy_bonus(trainer, loss, policy_loss, entropies, mask, entropy_mask, mode)
    if trainer.aux_loss_enabled:
        accumulation = trainer.current_gradient_accumulation_steps if mode == "train" else 1.0
        loss = loss + trainer.router_aux_loss_coef * aux_loss / accumulation
        log_metric(trainer, mode, "aux_loss", trainer.accelerator.gather_for_metrics(aux_loss).mean().item())

    token_means = {"entropy": entropies}
    if trainer.beta != 0.0:
        token_means["kl"] = per_token_kl
    return loss, LossTerms(mask, log_iw, ratio_stats, token_means)


@mirrors(f"{TRL_GRPO}._compute_loss", {"1.16.0": "786b6ecc70228b78"}, part="entropy bonus")
def entropy_bonus(trainer, loss, policy_loss, entropies, mask, entropy_mask, mode: str) -> torch.Tensor:
    """TRL 1.16's entropy bonus (static or adaptive coefficient, TRL's controller state), unchanged."""
    effective_mask = mask if entropy_mask is None else mask * entropy_mask
    accumulation = trainer.current_gradient_accumulation_steps if mode == "train" else 1.0
    entropy_loss = (entropies * effective_mask).sum() / effective_mask.sum().clamp(min=1.0) / accumulation
    if trainer.use_adaptive_entropy:
        apply_coef = trainer.entropy_coef if trainer._last_world_entropy <= trainer.args.entropy_target else 0.0
    else:
        apply_coef = trainer.entropy_coef
    loss = loss - apply_coef * entropy_loss
    log_metric(trainer, mode, "policy_loss", trainer.accelerator.gather(policy_loss).nanmean().item())
    if trainer.use_adaptive_entropy and mode == "train":
        stats = torch.stack([(entropies * effective_mask).sum(), effective_mask.sum()]).detach()
        window = trainer._entropy_window_stats
        trainer._entropy_window_stats = stats if window is None else window + stats
        if trainer.accelerator.sync_gradients:
            totals = trainer.accelerator.reduce(trainer._entropy_window_stats, reduction="sum")
            world_entropy = (totals[0] / totals[1].clamp(min=1.0)).item()
            args = trainer.args
            if world_entropy <= args.entropy_target:
                trainer.entropy_coef = min(trainer.entropy_coef + args.entropy_coef_delta, args.entropy_coef_max)
            else:
                trainer.entropy_coef = max(trainer.entropy_coef - args.entropy_coef_delta, args.entropy_coef_min)
            trainer._last_world_entropy = world_entropy
            trainer._entropy_window_stats = None
    if mode == "train" and trainer.accelerator.sync_gradients:
        log_metric(trainer, mode, "entropy_coef", trainer.entropy_coef)
    return loss


@mirrors(f"{TRL_GRPO}._prepare_inputs", {"1.16.0": "b4ae2787ce74405c"}, part="train mode")
def prepare_train_inputs(trainer, generation_batch, generate: Callable[[object], dict]) -> dict:
    """TRL 1.16 ``_prepare_inputs`` in train mode with ``generate(generation_batch)`` in place of
    ``_generate_and_score_completions``: generate every ``steps_per_generation * num_iterations`` micro-steps, shuffle,
    split over ``steps_per_generation``, serve the buffered micro-batch. No multimodal split (text only)."""
    generate_every = trainer.args.steps_per_generation * trainer.num_iterations
    if trainer._step % generate_every == 0 or trainer._buffered_inputs is None:
        generated = shuffle_sequence_dict(generate(generation_batch))
        trainer._buffered_inputs = split_tensor_dict(generated, trainer.args.steps_per_generation)
    return trainer._buffered_inputs[trainer._step % trainer.args.steps_per_generation]


@mirrors(f"{TRL_GRPO}._generate_single_turn", {"1.16.0": "d2590f88b1522c4a"}, part="transformers generate")
def generate_single_turn(trainer, prompt_ids: list[list[int]], generate: Callable) -> tuple[list[list[int]], None]:
    """TRL 1.16 ``_generate_single_turn``'s transformers-generate branch, text only, with
    ``generate(unwrapped_model, prompt_ids)`` (prompt and completion ids, prompts left-padded to TRL's length) in
    place of TRL's padding and ``unwrapped_model.generate``. Returns ``(completion_ids, None)`` as TRL does."""
    with (
        profiling_context(trainer, "transformers.generate"),
        unwrap_model_for_generation(
            trainer.model_wrapped,
            trainer.accelerator,
            gather_deepspeed3_params=trainer.args.ds3_gather_for_generation,
            generation_kwargs=trainer.generation_kwargs,
            gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs,
        ) as unwrapped_model,
        torch.no_grad(),
        trainer._dist.summon_full_params(trainer.model_wrapped, recurse=False),
    ):
        prompt_completion_ids = generate(unwrapped_model, prompt_ids)
    return completions_after_prompt(trainer, prompt_completion_ids, prompt_ids), None


@mirrors(
    f"{TRL_GRPO}._generate_single_turn", {"1.16.0": "d2590f88b1522c4a"}, part="transformers generate's completions"
)
def completions_after_prompt(
    trainer, prompt_completion_ids: torch.Tensor, prompt_ids: list[list[int]]
) -> list[list[int]]:
    """TRL 1.16 ``_generate_single_turn``'s completions out of a left-padded ``generate`` output: the tokens after the
    (padded) prompt, cut after the first EOS, as lists (`generate_single_turn`; the asynchronous sampler too)."""
    prompt_length = max(len(p) for p in prompt_ids)
    if trainer.pad_to_multiple_of:
        prompt_length = -(-prompt_length // trainer.pad_to_multiple_of) * trainer.pad_to_multiple_of
    completion_ids = prompt_completion_ids[:, prompt_length:]
    # Mask everything after the first EOS token (as TRL does)
    is_eos = torch.isin(completion_ids, torch.tensor(trainer.eos_token_ids, device=completion_ids.device))
    eos_idx = torch.full((is_eos.size(0),), is_eos.size(1), dtype=torch.long, device=completion_ids.device)
    eos_idx[is_eos.any(dim=1)] = is_eos.int().argmax(dim=1)[is_eos.any(dim=1)]
    sequence_indices = torch.arange(is_eos.size(1), device=completion_ids.device).expand(is_eos.size(0), -1)
    completion_mask = (sequence_indices <= eos_idx.unsqueeze(1)).int()
    return [c[m].tolist() for c, m in zip(completion_ids.cpu(), completion_mask.bool().cpu(), strict=True)]


@mirrors(f"{TRL_GRPO}._generate_single_turn", {"1.16.0": "d2590f88b1522c4a"}, part="regular generation path")
def left_padded_generate(trainer, unwrapped_model, prompt_ids: list[list[int]], **generate_kwargs) -> torch.Tensor:
    """TRL 1.16 ``_generate_single_turn``'s regular path, text only: the prompts left-padded (to
    ``pad_to_multiple_of``) and ``unwrapped_model.generate``, with `generate_kwargs` added to the call (a logits
    processor that reads the scores). For `generate_single_turn`'s `generate`."""
    tensors = [torch.tensor(ids) for ids in prompt_ids]
    padding = {"padding_side": "left", "pad_to_multiple_of": trainer.pad_to_multiple_of}
    inputs = {
        "input_ids": pad(tensors, padding_value=pad_token_id(trainer), **padding),
        "attention_mask": pad([torch.ones_like(t) for t in tensors], padding_value=0, **padding),
    }
    inputs = {k: v.to(trainer.accelerator.device) for k, v in inputs.items()}  # TRL: Trainer._prepare_inputs
    return unwrapped_model.generate(**inputs, generation_config=trainer.generation_config, **generate_kwargs)


@mirrors(f"{TRL_GRPO}.get_train_dataloader", {"1.16.0": "89d6ad147677148d"})
def train_dataloader(trainer, sampler_fn: Callable, description: str):
    """A training data loader as TRL 1.16's ``get_train_dataloader`` builds one (a generation batch per item:
    ``_train_batch_size * steps_per_generation`` rows) over the train dataset, with `sampler_fn` as its sampler."""
    return trainer._get_dataloader(
        dataset=trainer.train_dataset,
        description=description,
        batch_size=trainer._train_batch_size * trainer.args.steps_per_generation,
        sampler_fn=sampler_fn,
        is_training=True,
    )


VLLM_GENERATION = "trl.generation.vllm_generation.VLLMGeneration"


@mirrors(f"{VLLM_GENERATION}.sync_weights", {"1.16.0": "d5b24c4b1adc2b01"}, part="colocate mode")
def sync_weights_by_reload(generation) -> None:
    """TRL 1.16 ``VLLMGeneration.sync_weights`` in colocate mode, with vLLM's in-place
    ``model_runner.reload_weights(weights_iterator=..., is_checkpoint_format=True)`` in place of one
    ``model.load_weights([(name, param)])`` per parameter. The weights go through the model's checkpoint loader and
    then the backend's post-load processing again, so a backend that repacks its weights after loading (vLLM's CPU
    backend repacks linear layers and drops the per-parameter ``weight_loader`` TRL's call needs) gets them in its
    own layout. Parameters are gathered, named and PEFT-merged as TRL does (``_iter_named_params``); then the
    prefix cache is reset, as TRL does."""
    if generation.enable_sleep_mode:
        generation.llm.wake_up(tags=["weights"])
        generation._llm_weights_sleeping = False
    model_runner = generation.llm.llm_engine.model_executor.driver_worker.model_runner
    model_runner.reload_weights(weights_iterator=generation._iter_named_params(), is_checkpoint_format=True)
    generation.llm.reset_prefix_cache()


@contextlib.contextmanager
def _in_vllm_generation(name: str, replace: Callable):
    """While the block runs, the name `name` of TRL 1.16's ``trl.generation.vllm_generation`` module (what
    ``VLLMGeneration._init_vllm`` calls) is ``replace(original)``."""
    from trl.generation import vllm_generation

    original = getattr(vllm_generation, name)
    setattr(vllm_generation, name, replace(original))
    try:
        yield
    finally:
        setattr(vllm_generation, name, original)


def vllm_client_class(client_cls):
    """While the block runs, TRL 1.16's ``VLLMGeneration`` builds its server-mode client (``VLLMClient(...)`` in
    ``_init_vllm``, which also opens the weight-transfer channel) from `client_cls`, a ``VLLMClient`` subclass."""
    return _in_vllm_generation("VLLMClient", lambda _original: client_cls)


def vllm_engine_kwargs(**extra):
    """While the block runs, TRL 1.16's ``VLLMGeneration`` builds its colocated engine (``LLM(...)`` in
    ``_init_vllm``) with the keyword arguments `extra` added to TRL's (TRL's config has no field for them)."""
    return _in_vllm_generation("LLM", lambda original: functools.partial(original, **extra))


# Per-completion tensors of a TRL 1.16 generation batch (`_generate_and_score_completions`' output) and the value
# that pads each: prompts are left-padded, completions right-padded ("pad": the tokenizer's pad token).
GENERATION_BATCH_LEFT_PADDED = {"prompt_ids": "pad", "prompt_mask": 0}
GENERATION_BATCH_RIGHT_PADDED = {
    "completion_ids": "pad",
    "completion_mask": 0,
    "tool_mask": 1,
    "old_per_token_logps": 0.0,
    "ref_per_token_logps": 0.0,
    "sampling_per_token_logps": 0.0,
    "importance_sampling_ratio": 0.0,
    "advantages": 0.0,
    "sample_staleness": 0,  # ours, one per row (trl.async_sampling): concatenated, never padded
}

# ------------------------------------------------------------------------------------------ a frozen second model


@mirrors(f"{TRL_GRPO}.__init__", {"1.16.0": "14a358d3b256d96a"}, part="reference model")
def load_frozen_model(trainer, name_or_path: str):
    """TRL 1.16's reference-model setup for another model (the distillation teacher): loaded from `name_or_path` as
    TRL loads the reference (``model_init_kwargs``, the policy's dtype and attention implementation), dropout off,
    TRL's fused LM head at the sampling temperature, prepared by accelerate for evaluation (DeepSpeed / FSDP as TRL
    does); no gradients. ``cast_lm_head_to_fp32`` is refused with a teacher (`trl_grpo_ext.trl.config`)."""
    args = trainer.args
    model_init_kwargs = dict(args.model_init_kwargs or {})
    if args.distributed_state.distributed_type in ["MULTI_GPU", "DEEPSPEED"]:
        model_init_kwargs["device_map"] = None
    model_init_kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    model_init_kwargs.setdefault("dtype", trainer.model.dtype)
    model_init_kwargs.setdefault("attn_implementation", trainer.model.config._attn_implementation)
    model = create_model_from_path(name_or_path, **model_init_kwargs)
    if args.disable_dropout:
        disable_dropout_in_model(model)
    add_fused_lm_head(model, temperature=trainer.temperature, cast_lm_head_to_fp32=args.cast_lm_head_to_fp32)
    model.requires_grad_(False)
    model.eval()
    if trainer.is_deepspeed_enabled:
        return prepare_deepspeed(model, trainer.accelerator)
    if trainer.is_fsdp_enabled:
        return prepare_fsdp(model, trainer.accelerator)
    return trainer.accelerator.prepare_model(model, evaluation_mode=True)


@mirrors(f"{TRL_GRPO}._generate_and_score_completions", {"1.16.0": "5f6267d35c18c248"}, part="reference log-probs")
def completion_logps(trainer, model, output: dict, mode: str) -> torch.Tensor:
    """TRL 1.16's no-grad log-prob forward of the reference model, for `model` over a scored generation batch
    (`output` of ``_generate_and_score_completions``: prompt and completion ids and masks); text only. Runs through
    the trainer's ``_get_per_token_logps_and_entropies`` (prefix sharing applies). Returns (B, completion length)."""
    prompt_completion_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
    attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
    logits_to_keep = output["completion_ids"].size(1)
    batch_size = (
        trainer.args.per_device_train_batch_size if mode == "train" else trainer.args.per_device_eval_batch_size
    )
    with torch.no_grad(), checkpointing_disabled(trainer.model, trainer.args.gradient_checkpointing_kwargs):
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            model, prompt_completion_ids, attention_mask, logits_to_keep, batch_size=batch_size
        )
    return logps


# Code elsewhere that mirrors TRL, checked by the same test: copies in the layers below the TRL path (the PyTRIO
# loop imports them without TRL, so they cannot live here), the recipe parser's steps of TrlParser (it runs before
# any trainer exists), and the TRL path's hooks that follow a TRL function's layout without copying it (the
# curriculum's sampler, the shared-prefix log-prob forward's chunks).
_OUR_GRPO = "trl_grpo_ext.grpo"
MIRRORED_ELSEWHERE = (
    Mirror("trl.trainer.utils.nanstd", f"{_OUR_GRPO}.losses.nanstd", {"1.16.0": "5e4d28a84a305003"}),
    Mirror(
        "trl.trainer.utils.get_callable_name",
        f"{_OUR_GRPO}.reward_aggregation.reward_func_name",
        {"1.16.0": "ce2d9044d283ec91"},
    ),
    Mirror(
        "trl.trainer.utils.is_async_callable",
        f"{_OUR_GRPO}.reward_aggregation.is_async_callable",
        {"1.16.0": "4105f7551123308e"},
    ),
    Mirror(
        "trl.trainer.utils.start_event_loop_in_daemon",
        f"{_OUR_GRPO}.reward_aggregation.start_event_loop_in_daemon",
        {"1.16.0": "5acf290758dd8f7f"},
    ),
    Mirror(
        f"{TRL_GRPO}._generate_and_score_completions",
        f"{_OUR_GRPO}.losses.group_advantages",
        {"1.16.0": "5f6267d35c18c248"},
        part="advantages (sum_then_normalize)",
    ),
    Mirror(
        f"{TRL_GRPO}._generate_and_score_completions",
        f"{_OUR_GRPO}.reward_aggregation.weighted_rewards",
        {"1.16.0": "5f6267d35c18c248"},
        part="weighted NaN-sum of the rewards",
    ),
    Mirror(
        f"{TRL_GRPO}._generate_and_score_completions",
        f"{_OUR_GRPO}.reward_aggregation.frac_reward_zero_std",
        {"1.16.0": "5f6267d35c18c248"},
        part="frac_reward_zero_std",
    ),
    Mirror(
        f"{TRL_GRPO}._generate_and_score_completions",
        f"{_OUR_GRPO}.reward_aggregation.reward_metrics",
        {"1.16.0": "5f6267d35c18c248"},
        part="rewards/<name>/mean and /std",
    ),
    Mirror(
        f"{TRL_GRPO}._generate_and_score_completions",
        f"{_OUR_GRPO}.losses.sampler_correction",
        {"1.16.0": "5f6267d35c18c248"},
        part="vLLM importance-sampling ratio: its four modes and clamp",
    ),
    Mirror(
        f"{TRL_GRPO}._calculate_rewards",
        f"{_OUR_GRPO}.reward_aggregation.score_completions",
        {"1.16.0": "f9363c3464c1c018"},
    ),
    Mirror(
        f"{TRL_GRPO}._calculate_rewards",
        f"{_OUR_GRPO}.reward_aggregation.reward_kwargs",
        {"1.16.0": "f9363c3464c1c018"},
        part="dataset columns as reward keyword arguments",
    ),
    Mirror(
        f"{TRL_GRPO}.__init__",
        "trl_grpo_ext.task.rewards.reward_model.RewardModelReward.load",
        {"1.16.0": "14a358d3b256d96a"},
        part="a reward model given by path",
    ),
    Mirror(
        f"{TRL_GRPO}._calculate_rewards",
        "trl_grpo_ext.task.rewards.reward_model.RewardModelReward.__call__",
        {"1.16.0": "f9363c3464c1c018"},
        part="the nn.Module reward branch",
    ),
    Mirror(
        "trl.scripts.utils.TrlParser.parse_args_and_config",
        "trl_grpo_ext.trl.script_args.parse_recipe_args",
        {"1.16.0": "d2352633503fea9a"},
        part="the config file's env and values applied as defaults, then the command line",
    ),
    Mirror(
        "trl.trainer.utils.RepeatSampler.__iter__",
        "trl_grpo_ext.trl.sampling.CurriculumSampler.__iter__",
        {"1.16.0": "8ec2a99455ecbf62"},
        part="the index layout",
    ),
    Mirror(
        f"{TRL_GRPO}._get_per_token_logps_and_entropies",
        "trl_grpo_ext.trl.prefix_mixin.PrefixSharingMixin._get_per_token_logps_and_entropies",
        {"1.16.0": "1ee7f136f4d322ce"},
        part="rows chunked by batch_size, each chunk's log-probs and entropies",
    ),
)
MIRRORS.extend(MIRRORED_ELSEWHERE)


# ------------------------------------------------------------------------------------------ TRL's private state

# TRL's (and transformers') private trainer members the TRL path touches, each only through this module, and the
# TRL hooks our classes override. A TRL upgrade that renames one fails tests/test_trl_internals.py.
PRIVATE_STATE = (
    "_metrics",  # TRL: {"train" | "eval": {name: [values of the logging interval]}}
    "_logs",  # TRL: the latest completions (prompt, completion, rewards, advantages) for the completions table
    "_buffered_inputs",  # TRL: the micro-batches of the current generation batch
    "_step",  # TRL: micro-steps since training started (when to generate)
    "_tokenizer",  # TRL: the processing class's tokenizer
    "_is_vlm",  # TRL: a vision-language processing class
    "_dist",  # TRL: the distributed backend (FSDP parameter gathering around generation)
    "_entropy_bonus_enabled",  # TRL: the entropy bonus's controller state
    "_last_world_entropy",
    "_entropy_window_stats",
    "_train_batch_size",  # transformers: per-process batch size of the training loader
    "_get_dataloader",  # transformers: builds a loader with a sampler
    "_get_output_dir",  # transformers: the folder checkpoints go to
)
OVERRIDDEN_HOOKS = (
    "_calculate_rewards",  # trl.trainer (degenerate groups), trl.sampling (curriculum)
    "_generate_and_score_completions",  # trl.trainer, trl.async_sampling (the sampler's log-probs as the old ones)
    "_get_per_token_logps_and_entropies",  # trl.trainer (captured log-probs), trl.prefix_mixin,
    # trl.sampler_precision (the bf16 sampler's correction)
    "_generate",  # trl.sampler_precision (bf16 autocast around generation), trl.tools (tool metrics)
    "_compute_loss",  # trl.trainer
    "_prepare_inputs",  # trl.sampling (dynamic sampling), trl.async_sampling (which batch the sampler drew)
    "_get_train_sampler",  # trl.sampling (curriculum)
    "_save_checkpoint",  # trl.sampling (curriculum state), trl.async_sampling (the batches drawn ahead)
    "_load_optimizer_and_scheduler",  # trl.sampling (curriculum state), trl.async_sampling (the batches drawn ahead)
    "_generate_single_turn",  # trl.prefix_mixin, trl.async_sampling (the batch the sampler drew ahead)
)


def log_metric(trainer, mode: str, name: str, value: float) -> None:
    """Log `value` under `name` as TRL logs its metrics (averaged over the logging interval)."""
    trainer._metrics[mode][name].append(value)


def metric_count(trainer, mode: str, name: str) -> int:
    """How many values of `name` the current logging interval holds."""
    return len(trainer._metrics[mode][name])


def drop_metric_values(trainer, mode: str, name: str, keep: int) -> None:
    """Forget the values of `name` logged after the first `keep` of the current logging interval."""
    del trainer._metrics[mode][name][keep:]


def zero_logged_advantages(trainer, zero: list[bool]) -> None:
    """Show 0 as the advantage of the latest logged completions whose entry in `zero` (the generation batch's
    completions, in order) is true: TRL logged the advantages before we zeroed them, and the completions table
    should show what is trained on."""
    logged = trainer._logs["advantages"]
    k = min(len(logged), len(zero))
    recent = [0.0 if z else a for a, z in zip(list(logged)[-k:], zero[-k:], strict=True)]
    for _ in range(k):
        logged.pop()
    logged.extend(recent)


def completions_log(trainer) -> dict | None:
    """TRL's latest completions (``prompt``, ``completion``, ``rewards`` by name, ``advantages``); None for a
    trainer that keeps none (a callback may be handed any trainer)."""
    return getattr(trainer, "_logs", None)


def buffered_inputs(trainer) -> list[dict]:
    """The micro-batches of the generation batch being trained on (none before the first)."""
    return trainer._buffered_inputs or []


def micro_steps(trainer) -> int:
    """``training_step`` calls since this ``train()`` began: TRL generates when it is a multiple of
    ``steps_per_generation * num_iterations`` (``_prepare_inputs``)."""
    return trainer._step


def pad_token_id(trainer) -> int | None:
    return trainer._tokenizer.pad_token_id


def is_vlm(trainer) -> bool:
    return trainer._is_vlm


def checkpoint_root(trainer, trial) -> str:
    """The folder transformers saves this run's ``checkpoint-<step>`` folders in."""
    return trainer._get_output_dir(trial=trial)


# ------------------------------------------------------------------------------------------ our state on the trainer


@dataclass
class MixinState:
    """What `trl_grpo_ext.trl.trainer.GRPOTrainer` and its mixins (`trl_grpo_ext.trl.sampling`) hand each other on
    one trainer, declared here once and created by the trainer right after TRL's constructor (``mixin_state``)."""

    # Reward columns named by the options (index into rewards_per_func; None: not set), resolved once.
    degenerate_column: int | None = None  # degenerate_reward
    curriculum_column: int | None = None  # curriculum_reward, else degenerate_reward (None: the weighted total)
    # The generation batch being scored: all processes' rewards (N, K) from TRL's `_calculate_rewards`, read right
    # after it by the trainer's degenerate-group check.
    rewards_per_func: torch.Tensor | None = None
    # (num_groups,) bool over the last scored generation batch (all processes): dynamic sampling filters on it.
    degenerate_groups: torch.Tensor | None = None
    # The rubric judges among the reward functions (hybrids' components included): the trainer stops every process
    # at once when one is down (`GRPOTrainer._stop_if_a_judge_is_down`).
    judges: list = field(default_factory=list)
