"""TRL's internals in one place: the code this package copies from TRL and every access to TRL's private state.

The TRL path extends `trl.GRPOTrainer` by overriding its hooks (`OVERRIDDEN_HOOKS`, defined in `trl.trainer`,
`trl.sampling`, `trl.prefix_mixin`, `trl.sampler_precision` and `trl.tools` under TRL's private names, each calling
``super()``). Everything else it needs of TRL beyond TRL's public API is in this package, so a TRL upgrade re-checks
it; its modules:

- `mirroring`: **the register of copies.** Each function copied from TRL is marked ``@mirrors(TRL function, {TRL
  version: source hash})``; `MIRRORS` lists them and the code elsewhere that mirrors TRL (`MIRRORED_ELSEWHERE`: the
  copies in the path-independent core, which the PyTRIO loop imports without TRL and which therefore cannot live
  here, the recipe parser's steps of ``TrlParser.parse_args_and_config``, and two TRL-path hooks that follow a TRL
  function's layout). The copies were made from TRL 1.16.0. The hash is the SHA-256 (first 16 hex digits) of
  ``inspect.getsource`` of the installed TRL function with every run of whitespace made one space.
  ``tests/test_trl_internals.py`` recomputes it and fails, naming the TRL function and our copy, when the installed
  TRL's source is not the one the copy was checked against, or when the installed TRL version has no recorded hash.
  After re-checking a copy against the new TRL, add the new version's hash (the failure prints it).
- `loss`, `generation` and `lm_head`: **the copies**: TRL's loss step; its input buffer, generation, data loader,
  vLLM weight sync and engine construction, and a frozen second model; its fused LM head scoring a truncated
  sampling distribution.
- `private_state`: **TRL's private state.** Named accessors (`log_metric`, `buffered_inputs`, `pad_token_id`, ...)
  for every private attribute of TRL's (or transformers') trainer that the TRL path reads or writes;
  `PRIVATE_STATE` names them, and the same test checks that a built trainer has each one.
- `mixin_state`: **our state on the trainer.** `MixinState`: what our trainer and its mixins hand each other,
  declared once.

Every public name of these modules is a name of this package (``internals.compute_loss``, ``internals.MIRRORS``).
"""

from trl_grpo_ext.trl.internals.generation import (
    GENERATION_BATCH_LEFT_PADDED,
    GENERATION_BATCH_RIGHT_PADDED,
    completion_logps,
    completions_after_prompt,
    generate_single_turn,
    left_padded_generate,
    load_frozen_model,
    prepare_train_inputs,
    sync_weights_by_reload,
    train_dataloader,
    vllm_client_class,
    vllm_engine_kwargs,
)
from trl_grpo_ext.trl.internals.lm_head import add_truncated_lm_head, truncation_problems
from trl_grpo_ext.trl.internals.loss import (
    MODEL_INPUT_KEYS,
    LossTerms,
    PolicyTerm,
    compute_loss,
    entropy_bonus,
    log_importance_weights,
    loss_mask,
)
from trl_grpo_ext.trl.internals.mirroring import (
    MIRRORED_ELSEWHERE,
    MIRRORS,
    TRL_GRPO,
    VLLM_GENERATION,
    Mirror,
    mirrors,
)
from trl_grpo_ext.trl.internals.mixin_state import MixinState
from trl_grpo_ext.trl.internals.private_state import (
    OVERRIDDEN_HOOKS,
    PRIVATE_STATE,
    VLLM_ONLY_STATE,
    buffered_inputs,
    checkpoint_root,
    completions_log,
    drop_metric_values,
    is_vlm,
    log_metric,
    mark_vllm_weights_loaded,
    metric_count,
    micro_steps,
    pad_token_id,
    zero_logged_advantages,
)

__all__ = [
    "GENERATION_BATCH_LEFT_PADDED",
    "GENERATION_BATCH_RIGHT_PADDED",
    "MIRRORED_ELSEWHERE",
    "MIRRORS",
    "MODEL_INPUT_KEYS",
    "OVERRIDDEN_HOOKS",
    "PRIVATE_STATE",
    "TRL_GRPO",
    "VLLM_GENERATION",
    "VLLM_ONLY_STATE",
    "LossTerms",
    "Mirror",
    "MixinState",
    "PolicyTerm",
    "add_truncated_lm_head",
    "buffered_inputs",
    "checkpoint_root",
    "completion_logps",
    "completions_after_prompt",
    "completions_log",
    "compute_loss",
    "drop_metric_values",
    "entropy_bonus",
    "generate_single_turn",
    "is_vlm",
    "left_padded_generate",
    "load_frozen_model",
    "log_importance_weights",
    "log_metric",
    "loss_mask",
    "mark_vllm_weights_loaded",
    "metric_count",
    "micro_steps",
    "mirrors",
    "pad_token_id",
    "prepare_train_inputs",
    "sync_weights_by_reload",
    "train_dataloader",
    "truncation_problems",
    "vllm_client_class",
    "vllm_engine_kwargs",
    "zero_logged_advantages",
]
