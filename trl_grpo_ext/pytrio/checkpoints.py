"""Checkpoints: remote (``save_state``: weights and optimizer, on the service) and recorded here (the loop state,
`trl_grpo_ext.runs.loop_state`: step, data position, curriculum, checkpoint paths). A run starts from its last
recorded checkpoint or a new LoRA client (`start_training_client`), saves every ``save_every`` steps
(`save_checkpoint`) and ends with the sampler weights (`save_final_weights`)."""

from __future__ import annotations

import time
from pathlib import Path

from trl_grpo_ext.pytrio.calls import PyTrioLoopError, call, wait
from trl_grpo_ext.pytrio.config import PyTrioGRPOConfig
from trl_grpo_ext.pytrio.run_folder import output_errors
from trl_grpo_ext.runs import PYTRIO_STATE_FILENAME
from trl_grpo_ext.runs.loop_state import LoopState, pinned_settings, save_loop_state


def start_training_client(service, config: PyTrioGRPOConfig, state: LoopState | None):
    """``(training client, state)``: restored from `state`'s checkpoint, or a new LoRA run (`state` None)."""
    if state is not None:
        training_client = call(
            service.create_training_client_from_state_with_optimizer,
            "restore from checkpoint",
            state.state_path,
        )
        return training_client, state
    training_client = call(
        service.create_lora_training_client,
        "create_lora_training_client",
        config.base_model,
        rank=config.lora_r,
        seed=config.seed,
    )
    return training_client, LoopState(pinned=pinned_settings(config))


def save_checkpoint(
    config: PyTrioGRPOConfig,
    training_client,
    state: LoopState,
    step_done: int,
    data_position: int,
    curriculum: dict | None,
    extra_data_position: int = 0,
) -> None:
    """``save_state`` after ``step_done`` steps, then the loop state recorded (``data_position``: prompts taken;
    ``extra_data_position``: those of dynamic sampling's extra rounds; ``curriculum``: its pass rates)."""
    name = f"step-{step_done:06d}"
    result = wait(
        call(training_client.save_state, "save_state", name, overwrite=True),
        "save_state",
        config.request_timeout_s,
    )
    path = getattr(result, "path", None)
    if not isinstance(path, str) or not path:
        raise PyTrioLoopError(f"save_state returned no checkpoint path ({result!r})")
    # Saved remotely, not yet recorded here: a kill now resumes from the previous recorded checkpoint.
    state.step = step_done
    state.data_position = data_position
    state.extra_data_position = extra_data_position
    state.curriculum = curriculum
    state.state_path = path
    state.checkpoints.append({"step": step_done, "path": path, "time": time.time()})
    with output_errors(Path(config.output_dir), PYTRIO_STATE_FILENAME):
        save_loop_state(config.output_dir, state)


def save_final_weights(config: PyTrioGRPOConfig, training_client, state: LoopState) -> None:
    """The trained weights for sampling (``save_weights_for_sampler``), their path recorded in the loop state."""
    final = wait(
        call(training_client.save_weights_for_sampler, "save_weights_for_sampler", "final"),
        "save_weights_for_sampler",
        config.request_timeout_s,
    )
    state.sampler_path = getattr(final, "path", None)
    with output_errors(Path(config.output_dir), PYTRIO_STATE_FILENAME):
        save_loop_state(config.output_dir, state)
