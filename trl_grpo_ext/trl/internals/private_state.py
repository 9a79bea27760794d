"""TRL's (and transformers') private trainer state: `PRIVATE_STATE` names every private member the TRL path reads or
writes, the copies of TRL code in this package as TRL's code does, every other module through the named accessors
below; `OVERRIDDEN_HOOKS` names TRL's private hooks our classes override (each calling ``super()``)."""

from __future__ import annotations

# TRL's (and transformers') private trainer members the TRL path touches, each only through this package, and the
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
    "_last_loaded_step",  # TRL, with vLLM only (`VLLM_ONLY_STATE`): the step whose weights vLLM holds
)
VLLM_ONLY_STATE = ("_last_loaded_step",)
OVERRIDDEN_HOOKS = (
    "_calculate_rewards",  # trl.trainer (degenerate groups), trl.sampling (curriculum)
    "_generate_and_score_completions",  # trl.trainer, trl.async_sampling (the sampler's log-probs as the old ones)
    "_get_per_token_logps_and_entropies",  # trl.trainer (captured log-probs), trl.prefix_mixin,
    # trl.sampler_precision (the bf16 sampler's correction)
    "_generate",  # trl.sampler_precision (bf16 autocast around generation), trl.tools (tool metrics),
    # trl.async_sampling (an evaluation's generation on vLLM's server after the sampler's hand-over)
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


def mark_vllm_weights_loaded(trainer) -> None:
    """vLLM holds the weights of the current step: TRL's generation need not sync them (it syncs whenever
    ``_last_loaded_step`` is not the current step; asynchronous sampling hands them over itself)."""
    trainer._last_loaded_step = trainer.state.global_step


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
