"""`packed_generate`: transformers' sampling loop over a static KV cache and prepacked weights, one call per step.

transformers' ``generate`` runs each decode step through the model's modules: for the embedded model (30 layers)
about 40 ms of Python and dispatch a step on a 2-core CPU whatever the widths, a KV cache grown by concatenation, and
``linear`` calls that repack their weight each time (`trl_grpo_ext.decode.weights`). This loop keeps what decides the
tokens -- the model's own rotary embedding and activation, its RMSNorm (as torch's fused call), transformers' logits
processors and stopping criteria built by ``generate``'s own methods, ``softmax`` then ``torch.multinomial`` (or
``argmax``), finished rows padded -- and replaces the rest: the keys and values written into a cache allocated once
for the whole generation, q/k/v and gate/up as one packed call each, the residual adds fused into the output
projections, a decode step's grouped-query attention as one ``sdpa`` call (each key/value head's group of queries
together). Mirrors transformers 5.25 ``GenerationMixin._sample`` (its token selection and
stopping; no streamer, no scores returned).

What it decodes: a Llama-layout decoder (`SUPPORTED_MODEL_TYPES`) in fp32 on the CPU, sampled or greedy, one sequence
per row; `engine_unsupported_reason` says why anything else goes to ``generate``. The logits differ from
``generate``'s by float rounding (another summation order in the matmuls and attention): the same tokens except where
two candidates are that close, and the scores a token is drawn from are the scores the loop computed, so a recorder
(`trl_grpo_ext.trl.sampler_precision.SampledTokenLogprobs`) records the log-probs of the distribution that drew it.
"""

from __future__ import annotations

import copy

import torch

from trl_grpo_ext.compat import _base_model, cache_kwargs
from trl_grpo_ext.decode.weights import (
    layer_linears,
    packed_kernels_available,
    packed_linear,
    packed_linear_add,
    packed_weights,
)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
# generate's keyword arguments the loop honours (anything else: generate decodes)
SUPPORTED_KWARGS = frozenset({"generation_config", "logits_processor"})


def _model_reason(model) -> str | None:
    if not packed_kernels_available():
        return "this torch build has no oneDNN packed linear"
    if _base_model(model) is not model:
        return "a wrapped model (PEFT adapters or a distributed engine)"
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {model_type!r} (the engine decodes {', '.join(SUPPORTED_MODEL_TYPES)})"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "sliding-window attention"
    if getattr(model, "_hf_hook", None) is not None:
        return "accelerate hooks (offloaded weights)"
    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "rotary_emb") or not hasattr(model, "lm_head"):
        return "not the Llama layout (model.model.layers, rotary_emb, lm_head)"
    for layer in base.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if any(type(m) is not torch.nn.Linear for m in layer_linears(layer)) or not hasattr(mlp, "act_fn"):
            return "a layer that is not plain linear projections (adapters, quantization, another layout)"
        if getattr(attn, "q_norm", None) is not None or getattr(attn, "sinks", None) is not None:
            return "per-head query/key norms or attention sinks"
        norms = (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
        if any(not hasattr(n, "variance_epsilon") for n in norms):
            return "norms that are not RMSNorm"
    head = model.lm_head
    if type(head) is not torch.nn.Linear:
        return "an output layer that is not a plain linear"
    weight = head.weight
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return f"weights in {weight.dtype} on {weight.device.type} (the engine runs fp32 on the CPU)"
    return None


def effective_config(model, generation_config):
    """The settings ``generate`` decodes with: `generation_config` (a copy) with what it leaves unset taken from the
    model's generation config and transformers' global defaults (``top_k`` 50, ...), as ``generate`` does."""
    return model._prepare_generation_config(copy.deepcopy(generation_config))[0]


def engine_unsupported_reason(model, generation_config, generate_kwargs: dict) -> str | None:
    """Why `packed_generate` would not decode what ``model.generate(**generate_kwargs)`` decodes, or ``None``."""
    reason = _model_reason(model)
    if reason is not None:
        return reason
    config = effective_config(model, generation_config)
    if torch.is_autocast_enabled("cpu"):
        return "bf16 autocast (the packed kernels are fp32)"
    extra = sorted(set(generate_kwargs) - SUPPORTED_KWARGS)
    if extra:
        return f"generate keywords {', '.join(extra)}"
    if (config.num_beams or 1) != 1 or (config.num_return_sequences or 1) != 1:
        return "beam search / several sequences per prompt"
    if config.max_new_tokens is None:
        return "max_length without max_new_tokens"
    if config.return_dict_in_generate or config.output_scores or config.output_logits:
        return "per-step scores returned"
    if getattr(config, "stop_strings", None) or getattr(config, "assistant_model", None):
        return "stop strings / assisted decoding"
    if getattr(config, "prompt_lookup_num_tokens", None):
        return "prompt lookup decoding"
    if getattr(config, "cache_implementation", None) not in (None, "dynamic"):
        return f"cache_implementation {config.cache_implementation!r}"
    if getattr(config, "use_cache", True) is False:
        return "use_cache=False"
    return None


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """generate's position ids from the attention mask (``prepare_inputs_for_generation``)."""
    return (mask.long().cumsum(-1) - 1).masked_fill_(mask == 0, 1)


class _StaticCache:
    """Each layer's keys and values for the whole generation, allocated once: (rows, kv heads, slots, head dim)."""

    def __init__(self, model, rows: int, slots: int, dtype):
        config = model.config
        heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.groups = heads // self.kv_heads
        shape = (rows, self.kv_heads, slots, self.head_dim)
        layers = len(model.model.layers)
        self.keys = [torch.empty(shape, dtype=dtype) for _ in range(layers)]
        self.values = [torch.empty(shape, dtype=dtype) for _ in range(layers)]

    def fill(self, cache) -> int:
        """Copy a prefilled transformers cache in; returns its length."""
        length = 0
        for i, layer in enumerate(cache.layers):
            keys, values = layer.keys, layer.values
            if keys is None or keys.dim() != 4 or keys.numel() == 0:
                continue
            length = keys.shape[2]
            self.keys[i][:, :, :length] = keys
            self.values[i][:, :, :length] = values
        return length


def _prefill(model, input_ids: torch.Tensor, mask: torch.Tensor):
    """The prompts but their last token through the model into a transformers cache (generate's prefill, less the
    token whose logits start the loop)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    if input_ids.shape[1] > 1:
        model(
            input_ids=input_ids[:, :-1],
            attention_mask=mask[:, :-1],
            position_ids=_positions(mask[:, :-1]),
            use_cache=True,
            logits_to_keep=1,
            **cache_kwargs(model, cache),
        )
    return cache


def _rms_norm(x: torch.Tensor, norm) -> torch.Tensor:
    """The model's RMSNorm module (fp32: ``weight * x * rsqrt(mean(x^2) + eps)``) as torch's one fused call."""
    return torch.nn.functional.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama's ``apply_rotary_pos_emb`` on (rows, heads, dim) with (rows, 1, dim) tables: ``x * cos +
    rotate_half(x) * sin``, the same operations element by element, for the queries and keys in one call."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _step(model, weights, cache: _StaticCache, bias: torch.Tensor, tokens, positions, slot: int) -> torch.Tensor:
    """One decode step: `tokens` (rows,) at `positions` written to cache `slot`; the next-token logits (rows, vocab).
    `bias`: (rows, slots) 0 where a row attends to a slot, -inf where not (padding)."""
    base = model.model
    rows = tokens.shape[0]
    x = base.embed_tokens(tokens)  # (rows, hidden)
    cos, sin = base.rotary_emb(x, positions[:, None])  # (rows, 1, head dim)
    kv, d, groups = cache.kv_heads, cache.head_dim, cache.groups
    heads = kv * groups
    mask = bias[:, None, None, : slot + 1]  # every query head of a row sees that row's valid slots
    for layer, packed, keys, values in zip(base.layers, weights.layers, cache.keys, cache.values, strict=True):
        norm = layer.input_layernorm
        qkv = packed_linear(_rms_norm(x, norm), packed.qkv, packed.qkv_bias)
        qk = _rotated(qkv[:, : (heads + kv) * d].view(rows, heads + kv, d), cos, sin)
        keys[:, :, slot] = qk[:, heads:]
        values[:, :, slot] = qkv[:, (heads + kv) * d :].view(rows, kv, d)
        # query head h reads key/value head h // groups: each key/value head's queries as one (groups, d) block
        out = torch.nn.functional.scaled_dot_product_attention(
            qk[:, :heads].reshape(rows, kv, groups, d),
            keys[:, :, : slot + 1],
            values[:, :, : slot + 1],
            attn_mask=mask,
            scale=layer.self_attn.scaling,
        )
        x = packed_linear_add(out.reshape(rows, heads * d), packed.o, packed.o_bias, x)
        gate, up = packed_linear(
            _rms_norm(x, layer.post_attention_layernorm), packed.gate_up, packed.gate_up_bias
        ).chunk(2, -1)
        x = packed_linear_add(layer.mlp.act_fn(gate) * up, packed.down, packed.down_bias, x)
    return packed_linear(_rms_norm(x, base.norm), weights.head, weights.head_bias)


@torch.no_grad()
def packed_generate(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    generation_config,
    cache=None,
    logits_processor=None,
) -> torch.Tensor:
    """``model.generate(input_ids=..., attention_mask=..., generation_config=..., logits_processor=...)``'s
    sequences (rows, prompt + new) by the packed loop (module docstring). `cache`: a transformers cache holding
    every prompt token but the last (`trl_grpo_ext.prefix.shared_prefix_generate` builds one), else the prompts are
    prefilled here. Check `engine_unsupported_reason` first."""
    from transformers import LogitsProcessorList, StoppingCriteriaList

    rows, length = input_ids.shape
    device = input_ids.device
    config = effective_config(model, generation_config)
    config.max_length = length + config.max_new_tokens  # generate: max_new_tokens counts from the input ids
    model._prepare_special_tokens(config, True, device=device)
    processors = model._get_logits_processor(
        generation_config=config,
        input_ids_seq_length=length,
        encoder_input_ids=input_ids,
        prefix_allowed_tokens_fn=None,
        logits_processor=logits_processor if logits_processor is not None else LogitsProcessorList(),
        device=device,
        model_kwargs={"attention_mask": attention_mask},
    )
    criteria = model._get_stopping_criteria(generation_config=config, stopping_criteria=StoppingCriteriaList())
    has_eos = any(hasattr(c, "eos_token_id") for c in criteria)
    pad = config._pad_token_tensor

    weights = packed_weights(model, rows)
    slots = length - 1 + config.max_new_tokens
    static = _StaticCache(model, rows, slots, model.lm_head.weight.dtype)
    cached = static.fill(cache if cache is not None else _prefill(model, input_ids, attention_mask))
    if cached != length - 1:
        raise ValueError(f"the cache holds {cached} tokens; expected every prompt token but the last ({length - 1})")
    # attention bias: 0 for the slots a row attends to, -inf for its padding; each new token's slot opens for every
    # row (generate extends the mask with ones, finished rows included)
    bias = torch.full((rows, slots), float("-inf"), dtype=static.keys[0].dtype)
    bias[:, :length].masked_fill_(attention_mask.bool(), 0.0)
    positions = attention_mask.long().sum(-1) - 1  # the last prompt token's position in each row
    tokens = input_ids[:, -1]
    unfinished = torch.ones(rows, dtype=torch.long)
    slot = length - 1
    while True:
        logits = _step(model, weights, static, bias, tokens, positions, slot)
        scores = processors(input_ids, logits)
        if config.do_sample:
            next_tokens = torch.multinomial(torch.nn.functional.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        else:
            next_tokens = torch.argmax(scores, dim=-1)
        if has_eos:  # finished rows continue with padding
            next_tokens = next_tokens * unfinished + pad * (1 - unfinished)
        input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
        unfinished = unfinished & ~criteria(input_ids, None)
        if unfinished.max() == 0:
            return input_ids
        tokens, positions, slot = next_tokens, positions + 1, slot + 1
        bias[:, slot] = 0.0
