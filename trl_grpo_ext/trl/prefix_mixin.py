"""`PrefixSharingMixin`: the `trl.GRPOTrainer` hooks that use the shared-prefix computation, and its per-cycle
prompt context (`_Cycle`)."""

from __future__ import annotations

import collections
from dataclasses import dataclass

import torch

from trl_grpo_ext.decode import release_packed
from trl_grpo_ext.prefix.context import PromptContext, context_logps_and_entropies, encode_prompt_context
from trl_grpo_ext.prefix.generation import generation_unsupported_reason, shared_prefix_generate
from trl_grpo_ext.prefix.packing import shared_prefix_logps_and_entropies
from trl_grpo_ext.prefix.plan import PrefixPlan, plan_prefix, prompts_from_left_padded
from trl_grpo_ext.prefix.support import log_fallback_once, log_prefix_once, packed_unsupported_reason
from trl_grpo_ext.trl import internals
from trl_grpo_ext.trl.config import ExtensionOptions


@dataclass
class _Cycle:
    """The prompt context of one gradient-accumulation cycle: `context` holds the graph-attached keys/values, the
    micro-batches read detached leaf copies of them (``leaves``), whose ``.grad`` accumulates over the cycle's
    backward calls until `PrefixSharingMixin._flush_prefix_cycle` sends it through the graph once."""

    model: object
    context: PromptContext
    leaves: PromptContext


class PrefixSharingMixin:
    """`trl.GRPOTrainer` mixin: log-probs/entropies and non-vLLM generation with each shared prompt token encoded once.

    Put it before `trl.GRPOTrainer` in the bases. It overrides three hooks and leaves every other part of TRL alone, so
    loss types, ``beta > 0`` (reference model or PEFT adapter toggle), ``num_iterations > 1`` (old log-probs),
    LoRA, gradient checkpointing and the fused LM head all go through TRL's code with the same numbers:

    - ``_get_per_token_logps_and_entropies``:
      - training forward/backward (inside ``training_step``): the shared prompt parts of the whole generation batch
        are encoded once per gradient-accumulation cycle (`encode_prompt_context`, with gradients) and every
        micro-batch encodes only its rows' own tokens on top of them (`context_logps_and_entropies`); the micro-
        batches read detached leaf copies of the context, and after the cycle's last backward the gradient those
        leaves accumulated goes through the context's graph once (``training_step``), so every parameter gets
        the gradient of the plain computation. Single process without DeepSpeed/FSDP, no gradient checkpointing,
        ``steps_per_generation == gradient_accumulation_steps`` (`_cycle_unsupported_reason`); elsewhere each
        micro-batch shares what its own rows have in common (`shared_prefix_logps_and_entropies`).
      - no-grad calls over many chunks (old log-probs, reference log-probs over the generation batch): the
        context is encoded once for the whole call, each chunk of ``batch_size`` rows on top of it.
    - ``_generate_single_turn`` (transformers ``generate`` path only): `shared_prefix_generate`.

    ``args.share_prompt_prefix`` (default on) switches all of it off, ``args.share_prompt_prefix_across_microbatches``
    (default on) the once-per-cycle / once-per-call context; where sharing can't be exact (see
    `sharing_unsupported_reason`, multimodal inputs, MoE aux loss, vLLM/continuous batching) TRL's own code runs and
    the reason is logged once.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # attributes (not only the frozen args) so a caller can compare the paths on one trainer
        options = ExtensionOptions.of(self.args)
        self.share_prompt_prefix = options.share_prompt_prefix
        self.share_prompt_prefix_across_microbatches = options.share_prompt_prefix_across_microbatches
        self.max_packed_tokens = options.max_packed_tokens
        self.decode_engine = options.decode_engine  # the sampler's decode loop (trl_grpo_ext.decode)
        # chunks and generate calls run shared / plain and their tokens, over the trainer's life (`_count_*`)
        self.prefix_sharing_stats = collections.Counter()
        self._prefix_cycle: _Cycle | None = None
        self._in_training_step = False
        self._micro_batches_in_step = 0  # training_step calls since the last optimizer step
        # this optimizer step's training forwards: tokens TRL's padded rows would run and those run; prompt tokens
        # and those encoded (logged as prefix/saved_tokens and prefix/shared_fraction when the step ends)
        self._prefix_step = collections.Counter()

    def _count_prefix_tokens(self, plan: PrefixPlan | None, rows: int, shared: bool, kind: str = "chunks") -> None:
        """``prefix_sharing_stats``: log-prob chunks / generate calls run shared and plain, and the log-prob
        forwards' prompt tokens encoded vs those of the plain path."""
        stats = self.prefix_sharing_stats
        stats[f"{'shared' if shared else 'plain'}_{kind}"] += 1
        stats["rows"] += rows if kind == "chunks" else 0
        if plan is not None:
            stats["prompt_tokens"] += plan.plain_prompt_tokens
            stats["prompt_tokens_encoded"] += plan.shared_prompt_tokens if shared else plan.plain_prompt_tokens

    def _count_context(self, context: PromptContext, grad: bool) -> None:
        """``prefix_sharing_stats``: contexts encoded (``cycle_contexts`` with gradients once per accumulation cycle,
        ``call_contexts`` without, once per log-prob call) and their tokens, which count as encoded prompt tokens."""
        stats = self.prefix_sharing_stats
        stats["cycle_contexts" if grad else "call_contexts"] += 1
        stats["context_tokens"] += context.tokens
        stats["prompt_tokens_encoded"] += context.tokens

    def _count_chunk_tokens(self, ids, mask, prompt_length: int, prompts, plan, info: dict) -> None:
        """``prefix_sharing_stats`` ``tokens`` / ``padded_tokens``: what a log-prob chunk ran through the model
        against TRL's padded rows (equal where TRL's forward ran), and the step's metrics."""
        stats = self.prefix_sharing_stats
        padded = ids.numel()
        run = info.get("tokens", padded)
        stats["padded_tokens"] += padded
        stats["tokens"] += run
        prompt = sum(map(len, prompts)) if prompts is not None else int(mask[:, :prompt_length].sum())
        if info.get("layout") == "context":
            encoded = ids.size(0)
        elif info.get("layout") == "packed":
            encoded = plan.shared_prompt_tokens
        else:
            encoded = prompt
        self._count_step(padded, run, prompt, encoded)

    def _count_context_chunk(self, prompts: list, grad: bool) -> None:
        """A chunk run on a context: its plain prompt tokens against the one token per row it encodes itself."""
        stats = self.prefix_sharing_stats
        stats["shared_chunks"] += 1
        stats["cycle_chunks" if grad else "call_chunks"] += 1
        stats["rows"] += len(prompts)
        stats["prompt_tokens"] += sum(len(p) for p in prompts)
        stats["prompt_tokens_encoded"] += len(prompts)

    def _count_step(self, padded: int, run: int, prompt: int, encoded: int) -> None:
        """Add a training forward's tokens to this optimizer step's (forwards with gradients inside
        ``training_step`` only: the old/reference log-prob calls are not the step's training forward)."""
        if self._in_training_step and torch.is_grad_enabled():
            self._prefix_step.update(padded=padded, run=run, prompt=prompt, encoded=encoded)

    def _log_prefix_step(self) -> None:
        """``prefix/saved_tokens``: tokens TRL's padded rows would have run through the model in this step's
        training forwards minus those run (shared prompt parts and padding left out); ``prefix/shared_fraction``:
        the fraction of the step's prompt tokens not encoded (encoded once for several rows instead)."""
        step, self._prefix_step = self._prefix_step, collections.Counter()
        if not step["padded"]:
            return
        internals.log_metric(self, "train", "prefix/saved_tokens", float(step["padded"] - step["run"]))
        internals.log_metric(self, "train", "prefix/shared_fraction", 1.0 - step["encoded"] / max(1, step["prompt"]))

    def _max_packed_tokens(self) -> int | None:
        return self.max_packed_tokens

    def _sharing_enabled(self) -> bool:
        return self.share_prompt_prefix

    def _prefix_sharing_reason(self, model, model_inputs: dict) -> str | None:
        if any(value is not None for value in model_inputs.values()):
            return "multimodal inputs"
        return packed_unsupported_reason(model)

    def _cycle_unsupported_reason(self, grad: bool) -> str | None:
        """Why the prompt context can't serve many chunks exactly and simply ("" when switched off), or ``None``."""
        if not self.share_prompt_prefix_across_microbatches:
            return ""
        if self.accelerator.num_processes != 1:
            return "more than one process (each process's backward must see its own gradient sync)"
        if getattr(self, "is_deepspeed_enabled", False) or getattr(self, "is_fsdp_enabled", False):
            return "DeepSpeed/FSDP shard or gather parameters around each forward"
        if grad and self.args.gradient_checkpointing:
            return "gradient checkpointing drops the cache from the forward"
        if grad and self.args.steps_per_generation != self.args.gradient_accumulation_steps:
            return "steps_per_generation != gradient_accumulation_steps (a cycle is not one generation batch)"
        return None

    def training_step(self, model, inputs, num_items_in_batch):
        self._in_training_step = True
        try:
            loss = super().training_step(model, inputs, num_items_in_batch)
        except BaseException:
            self._prefix_cycle, self._micro_batches_in_step = None, 0  # a cut-short cycle must not serve the next
            raise
        finally:
            self._in_training_step = False
        # The optimizer steps after the last of the optimizer step's `current_gradient_accumulation_steps` micro-
        # batches (transformers sets it per optimizer step, fewer at an epoch's end; TRL's training_step reads it
        # too). Not `accelerator.sync_gradients`, though transformers sets it before that last training_step:
        # accelerate's gradient state is process-global, so another trainer in the process (bench/step_time.py
        # runs two in threads) flips it. Settling early would be exact too, only slower (a new context).
        self._micro_batches_in_step += 1
        if self._micro_batches_in_step >= max(1, int(self.current_gradient_accumulation_steps)):
            self._micro_batches_in_step = 0
            if self._prefix_cycle is not None:
                self._flush_prefix_cycle()
            self._log_prefix_step()
        return loss

    def _flush_prefix_cycle(self) -> None:
        """Send the gradient the cycle's micro-batches left on the context leaves through the context's graph (one
        backward, then the graph is freed). Exact at any point before the optimizer step: the parameters the context
        was encoded with are still the current ones."""
        cycle, self._prefix_cycle = self._prefix_cycle, None
        tensors, grads = [], []
        for tensor, leaf in zip(
            cycle.context.keys + cycle.context.values, cycle.leaves.keys + cycle.leaves.values, strict=True
        ):
            if leaf.grad is not None and tensor.requires_grad:  # frozen parts (LoRA without k_proj) have no graph
                tensors.append(tensor)
                grads.append(leaf.grad)
        if tensors:
            torch.autograd.backward(tensors, grads)

    def _generation_batch_prompts(self, prompts: list) -> list:
        """The prompts of the buffered generation batch (all its micro-batches) and `prompts`."""
        everything = list(prompts)
        for micro_batch in internals.buffered_inputs(self):
            ids, mask = micro_batch.get("prompt_ids"), micro_batch.get("prompt_mask")
            if isinstance(ids, torch.Tensor) and isinstance(mask, torch.Tensor):
                everything.extend(prompts_from_left_padded(ids, mask, ids.size(1)) or [])
        return everything

    def _cycle_context(self, model, prompts: list, pad_token_id: int) -> PromptContext | None:
        """The leaf context of the current accumulation cycle (encoded at its first micro-batch), or ``None``."""
        cycle = self._prefix_cycle
        if cycle is not None and (
            cycle.model is not model or any(tuple(p) not in cycle.context.group_of for p in prompts)
        ):
            self._flush_prefix_cycle()  # not this generation batch: settle the old one, encode anew (still exact)
            cycle = None
        if cycle is None:
            with self.accelerator.autocast():
                context = encode_prompt_context(
                    model, self._generation_batch_prompts(prompts), self._max_packed_tokens(), pad_token_id
                )
            if context is None:
                return None
            self._count_context(context, grad=True)
            self._count_step(0, context.tokens, 0, context.tokens)
            leaves = context.with_kv(
                [k.detach().requires_grad_(k.requires_grad) for k in context.keys],
                [v.detach().requires_grad_(v.requires_grad) for v in context.values],
            )
            cycle = self._prefix_cycle = _Cycle(model, context, leaves)
        return cycle.leaves

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **model_inputs,
    ):
        plain = super()._get_per_token_logps_and_entropies  # TRL's
        if not self._sharing_enabled():
            return plain(model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                         compute_aux_loss, **model_inputs)  # fmt: skip
        reason = self._prefix_sharing_reason(model, model_inputs)
        if reason is None and compute_aux_loss:
            reason = "the MoE load-balancing loss reads a 2D padding mask"
        if reason is not None:
            log_fallback_once(reason)
            return plain(model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                         compute_aux_loss, **model_inputs)  # fmt: skip
        # TRL 1.16 chunks the rows by `batch_size` to bound memory; so do we (a mirror `internals.MIRRORS` checks)
        batch_size = batch_size or input_ids.size(0)
        pad_token_id = internals.pad_token_id(self) or 0
        prompt_length = input_ids.size(1) - logits_to_keep
        context = self._call_context(model, input_ids, attention_mask, prompt_length, batch_size, pad_token_id)
        limit = self._max_packed_tokens()
        all_logps, all_entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            ids, mask = input_ids[start : start + batch_size], attention_mask[start : start + batch_size]
            result, info, plan = None, {}, None
            prompts = prompts_from_left_padded(ids, mask, prompt_length)
            if context is not None:  # the prompt parts are encoded already: only the rows' own tokens
                with self.accelerator.autocast():
                    result = context_logps_and_entropies(
                        model, context, ids, mask, logits_to_keep, compute_entropy, limit, pad_token_id, info
                    )
                if result is not None:
                    self._count_context_chunk(prompts, torch.is_grad_enabled())
            if result is None:
                info = {}
                plan = plan_prefix(prompts) if prompts is not None else None
                if plan is None:
                    log_fallback_once("a prompt is empty or not left-padded")
                elif plan.shares:
                    with self.accelerator.autocast():
                        result = shared_prefix_logps_and_entropies(
                            model,
                            ids,
                            mask,
                            logits_to_keep,
                            compute_entropy,
                            limit,
                            pad_token_id,
                            plan,
                            "auto",
                            info,
                        )
                self._count_prefix_tokens(plan, ids.size(0), result is not None)
                if info.get("layout") == "padded":  # the cost model found TRL's padded rows cheaper
                    self.prefix_sharing_stats["padded_chunks"] += 1
            if result is None:  # nothing shared in this chunk, or cheaper padded: TRL's forward, bit for bit
                result = plain(model, ids, mask, logits_to_keep, compute_entropy=compute_entropy)[:2]
            self._count_chunk_tokens(ids, mask, prompt_length, prompts, plan, info if result is not None else {})
            all_logps.append(result[0])
            all_entropies.append(result[1])
        logps = torch.cat(all_logps, dim=0)
        entropies = torch.cat(all_entropies, dim=0) if compute_entropy else None
        return logps, entropies, None

    def _call_context(self, model, input_ids, attention_mask, prompt_length, batch_size, pad_token_id):
        """The prompt context the chunks of this call read, or ``None`` (then each chunk shares on its own): the
        accumulation cycle's in a training forward with gradients; one encoded for the call when it runs without
        gradients over more than one chunk (old and reference log-probs of the generation batch)."""
        grad = torch.is_grad_enabled()
        if grad and not (self._in_training_step and model.training):
            return None
        if not grad and input_ids.size(0) <= batch_size:
            return None  # one chunk: the per-chunk packing encodes each shared token once already
        reason = self._cycle_unsupported_reason(grad)
        if reason is not None:
            if reason:
                log_prefix_once(f"prompt parts encoded per micro-batch, not once per generation batch: {reason}")
            return None
        prompts = prompts_from_left_padded(input_ids, attention_mask, prompt_length)
        if prompts is None:
            return None
        if grad:
            return self._cycle_context(model, prompts, pad_token_id)
        with self.accelerator.autocast():
            context = encode_prompt_context(model, prompts, self._max_packed_tokens(), pad_token_id)
        if context is not None:
            self._count_context(context, grad=False)
        return context

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        multimodal = images is not None or multimodal_fields or has_tool_images or internals.is_vlm(self)
        reason = self._generation_sharing_reason(self.model, multimodal)
        if reason is not None:
            if reason:
                log_fallback_once(reason)
            transformers_text = not (self.use_vllm or self.use_transformers_continuous_batching or multimodal)
            recorder = self._sampler_logprob_recorder() if transformers_text else None
            if recorder is not None:  # bf16 sampler (trl.sampler_precision): TRL's generate, its log-probs recorded
                completion_ids, _ = internals.generate_single_turn(
                    self, prompt_ids, self._text_generate(False, recorder)
                )
                return completion_ids, recorder.per_row(completion_ids)
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        self._count_prefix_tokens(None, len(prompt_ids), True, kind="generations")
        recorder = self._sampler_logprob_recorder()  # bf16 sampler: its token log-probs (trl.sampler_precision)
        generate = self._text_generate(True, recorder, release=self.model.training)
        completion_ids, _ = internals.generate_single_turn(self, prompt_ids, generate)
        return completion_ids, recorder.per_row(completion_ids) if recorder is not None else None

    def _generation_sharing_reason(self, model, multimodal: bool = False) -> str | None:
        """Why transformers' generation of `model` does not share the prompt prefix ("" when switched off or vLLM,
        which caches prefixes itself), or None when it does."""
        if not self._sharing_enabled() or self.use_vllm:
            return ""
        if self.use_transformers_continuous_batching:
            return "transformers continuous batching manages its own cache"
        if multimodal:
            return "multimodal inputs"
        return generation_unsupported_reason(model, self.generation_config)

    def _text_generate(self, shared: bool, recorder=None, release: bool = False):
        """``generate(model, prompt_ids) -> prompt and completion ids``: TRL 1.16 ``_generate_single_turn``'s text
        generation (`internals.left_padded_generate`), or the shared-prefix prefill (`shared_prefix_generate`) in
        its place; with `recorder` (`trl.sampler_precision.SampledTokenLogprobs`) the sampled tokens' log-probs are
        recorded. For the trainer's model (`internals.generate_single_turn`) and the asynchronous sampler's.
        `release`: free the decode engine's packed copy of the model after (a training model's weights change at
        the next optimizer step, so a copy kept through it would only hold memory)."""
        kwargs = recorder.generate_kwargs() if recorder is not None else {}
        if not shared:
            return lambda model, prompts: internals.left_padded_generate(self, model, prompts, **kwargs)

        def generate(model, prompts):
            try:
                return shared_prefix_generate(
                    model,
                    prompts,
                    internals.pad_token_id(self),
                    generation_config=self.generation_config,
                    pad_to_multiple_of=self.pad_to_multiple_of,
                    engine=self.decode_engine,
                    **kwargs,
                )
            finally:
                if release:
                    release_packed(model)

        return generate
