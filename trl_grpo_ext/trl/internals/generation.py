"""TRL 1.16's generation side, copied: the train-mode input buffer, transformers generation and its completions,
the training data loader, vLLM's weight sync and engine construction, and a frozen second model (the distillation
teacher) with its completion log-probs."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

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
from trl_grpo_ext.trl.internals.mirroring import TRL_GRPO, VLLM_GENERATION, mirrors
from trl_grpo_ext.trl.internals.private_state import pad_token_id


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
    "sample_version": 0,  # ours, one per row (trl.async_sampling): concatenated, never padded
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
