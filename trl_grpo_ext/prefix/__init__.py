"""Shared-prefix computation: every prompt token encoded once per generation batch, in training and in generation.

A GRPO batch repeats each prompt ``num_generations`` times, and all prompts usually start with the same tokens (chat
template, system prompt, one-shot example). Two sharing levels (after Prefix Grouper, arXiv 2506.05433, which has
the second one only):

- level 1: the longest token prefix common to every row of the batch;
- level 2: the rest of each *distinct* prompt (rows with the same prompt form a group; they need not be adjacent).

Training (`shared_prefix_logps_and_entropies`; the local PyTRIO server's forward/backward through `pack_rows`) packs a
chunk of rows as *segments*::

    [level-1 prefix][rest of prompt g1][row 1: last prompt token + completion][row 2: ...][rest of prompt g2]...

with explicit ``position_ids`` (each token keeps the position it has in its own row), no padding, and attention
under which a row's tokens see the level-1 prefix, their own prompt's rest and their own earlier tokens only: the
attention each row has in the plain forward, so outputs equal the plain forward's to float rounding; gradients flow
through the shared encodings as sums over the rows that read them. The model's own attention kernel runs it
(`attention.SegmentAttention`, through transformers' `AttentionInterface`: sdpa buckets, varlen flash-attention,
a flex-attention BlockMask; eager a dense mask), in one ordinary forward: gradient checkpointing, LoRA and TRL's
fused LM head work unchanged. A cost model (`cost`) keeps TRL's padded rows where they are cheaper. The last prompt
token is part of each row's segment because its hidden state scores the first completion token.

Across chunks (`encode_prompt_context`, `context_logps_and_entropies`): the shared parts of a whole generation
batch are encoded once, keeping every layer's keys/values, and each chunk of rows (a micro-batch, or ``batch_size``
rows of a no-grad log-prob call) encodes only its rows' own tokens, attending to them. In training the context is
encoded with gradients once per accumulation cycle; `PrefixSharingMixin` gives the micro-batches detached leaf
copies and sends their accumulated gradient through the context once, after the cycle's last backward.

Generation (`shared_prefix_generate`) encodes the level-1 prefix once, each distinct prompt's rest once on top of it,
expands the `DynamicCache` to the rows and hands it to ``model.generate``, which decodes as usual (greedy, sampling,
logits processors, stopping criteria are all its own).

Two planners feed that one layout, attention path and cost model: `plan_prefix` from prompt boundaries (what the TRL
trainer and the eval generator know) and `plan_token_rows` from token sequences alone (what the local PyTRIO server
sees: rows grouped by their longest common prefixes); `PackedBatch.row_reads` then gives the server every position
of every row, shared ones included, each row scoring its own targets there.

Sharing applies only where it is exact (`packed_unsupported_reason`, `sharing_unsupported_reason`); elsewhere
callers use the plain path. `docs/prefix_sharing.md` lists the conditions.

Modules: `plan` (`PrefixPlan`, `plan_prefix`, `plan_token_rows`: which tokens a batch shares; TRL's left-padded
prompts), `support`
(when sharing is exact; the once-per-process fallback log), `layout` (segments placed and gathered into a packed
stream; the eager dense mask), `attention` (`SegmentAttention` and the `AttentionInterface` wrapper), `cost` (packed
vs padded), `packing` (one packed forward: `pack_chunk`, `pack_rows`, `shared_prefix_logps_and_entropies`), `context` (`PromptContext`: shared parts encoded once for many chunks), `generation`
(`shared_prefix_generate`). The TRL trainer's hooks onto this engine are `trl_grpo_ext.trl.prefix_mixin`
(`PrefixSharingMixin`).
"""

# The package's public names: what the TRL path, the eval generator and the local PyTRIO server use (private helpers
# are imported from their modules).
from trl_grpo_ext.prefix.attention import SegmentAttention
from trl_grpo_ext.prefix.context import PromptContext as PromptContext
from trl_grpo_ext.prefix.context import context_logps_and_entropies, encode_prompt_context
from trl_grpo_ext.prefix.generation import generation_unsupported_reason, shared_prefix_generate
from trl_grpo_ext.prefix.layout import DEFAULT_MAX_PACKED_TOKENS
from trl_grpo_ext.prefix.packing import (
    PackedBatch,
    pack_chunk,
    pack_rows,
    shared_prefix_logps_and_entropies,
)
from trl_grpo_ext.prefix.plan import PrefixPlan, TokenRowsPlan, plan_prefix, plan_token_rows, prompts_from_left_padded
from trl_grpo_ext.prefix.support import (
    PACKED_ATTENTION,
    STATIC_ROPE_TYPES,
    SUPPORTED_ATTENTION,
    SUPPORTED_MODEL_TYPES,
    log_fallback_once,
    log_prefix_once,
    logger,
    packed_unsupported_reason,
    sharing_unsupported_reason,
)

__all__ = [
    "DEFAULT_MAX_PACKED_TOKENS",
    "PACKED_ATTENTION",
    "STATIC_ROPE_TYPES",
    "SUPPORTED_ATTENTION",
    "SUPPORTED_MODEL_TYPES",
    "PackedBatch",
    "PrefixPlan",
    "PromptContext",
    "SegmentAttention",
    "TokenRowsPlan",
    "context_logps_and_entropies",
    "encode_prompt_context",
    "generation_unsupported_reason",
    "log_fallback_once",
    "log_prefix_once",
    "logger",
    "pack_chunk",
    "pack_rows",
    "packed_unsupported_reason",
    "plan_prefix",
    "plan_token_rows",
    "prompts_from_left_padded",
    "shared_prefix_generate",
    "shared_prefix_logps_and_entropies",
    "sharing_unsupported_reason",
]
