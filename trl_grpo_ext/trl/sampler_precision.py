"""`SamplerPrecisionMixin`: the sampler's token log-probs, and the loss corrected for the sampler's gap to the trainer.

The sampler's log-probs are those of the distribution each token was drawn from (`SampledTokenLogprobs`: the
logits tempered and truncated by the trainer's sampling settings, `trl_grpo_ext.grpo.sampling_distribution`; the
trained policy is the same distribution of the trainer's logits, `trl_grpo_ext.trl.sampled_policy`). They are kept
where the loss is corrected with them, the way TRL 1.16 corrects vLLM's, with TRL's settings
(``vllm_importance_sampling_correction``, ``_mode``, ``_clip_min``, ``_clip_max``) and the maths of
`trl_grpo_ext.grpo.losses.sampler_correction`: the ratio proximal/sampler (proximal: TRL's old log-probs where TRL
computes them, else the loss's own forward, detached) weighs the advantages, per token or per completion. Every TRL
loss type and ours is linear in the advantage with a non-negative weight (``-min(r A w, clip(r) A w) = -w min(r A,
clip(r) A)``), so this is TRL's ``per_token_loss * importance_sampling_ratio`` without touching TRL's
``_compute_loss``; ``vespo``, whose gamma weights take vLLM's ratio inside, gets it as TRL gives vLLM's
(``importance_sampling_ratio``). The mismatch (``sampling/*``, `SAMPLER_MISMATCH_KEYS`) is logged every step. Where:

- bf16 on the CPU (``bf16`` resolved by `trl_grpo_ext.cpu.precision`: autocast, fp32 master weights and optimizer
  state): generation runs inside one bf16 autocast region, so each weight is cast to bf16 once per generation batch
  instead of at every decode step (accelerate's autocast wraps each forward call on its own); the sampler's numbers
  then differ from the trainer's by bf16 rounding (a KV-cached decode against one packed forward);
- asynchronous sampling's decoupled objective (`trl_grpo_ext.trl.async_sampling`): the correction is its behaviour
  weight (the coupled objective takes the sampler's log-probs as the old ones instead: only logged here);
- vLLM on-policy (below).

The fp32 on-policy path runs exactly as before: no autocast region, no recorder.

Around transformers' generation, in either precision, two speed-ups: torch's token draws vectorised
(`trl_grpo_ext.cpu.token_draws`: the same tokens from the same random numbers), and a bf16 decode step's grouped-query
attention as one packed call (`trl_grpo_ext.cpu.decode_attention`: transformers 5.25's own call for the recipes'
left-padded batches, the same attention to rounding for the others).

**vLLM, on-policy.** TRL 1.16 corrects vLLM's mismatch from a no-grad forward of the whole generation batch that it
runs only for that (``old_per_token_logps``). Where the batch is trained with the weights that sampled it (TRL's own
on-policy test: ``gradient_accumulation_steps`` a multiple of ``steps_per_generation * num_iterations``), those
log-probs are the loss's own forward, detached -- what TRL takes as the old policy on that path without vLLM. So
there (and not for ``vespo`` or a ``rollout_func``) TRL's correction is turned off and this class applies the same
correction, with TRL's settings, from the loss's forward and vLLM's token log-probs: one forward of the batch fewer
per generation (0.88 s of an 8.2 s step of the embedded recipe on 2 CPU cores, docs/gpu.md). The mismatch is logged
under this class's names (`SAMPLER_MISMATCH_KEYS`) instead of TRL's ``sampling/importance_sampling_ratio/*``.

Multi-turn rows (TRL's tool loop): each turn's generation records its own tokens, and TRL splices them with 0.0 for
the tool turns' tokens, which ``tool_mask`` keeps out of the correction and the loss. A ``rollout_func`` samples with
a sampler of its own: this class steps aside for its rows (no autocast region, no correction; logged once).
"""

from __future__ import annotations

import logging

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from trl_grpo_ext.cpu.precision import bf16_autocast, bf16_on_cpu
from trl_grpo_ext.cpu.token_draws import fast_token_draws
from trl_grpo_ext.grpo.losses import SAMPLER_MISMATCH_KEYS, sampler_correction
from trl_grpo_ext.grpo.sampling_distribution import SamplingSettings, processed_logits
from trl_grpo_ext.prefix.attention import install as install_attention
from trl_grpo_ext.trl import internals

logger = logging.getLogger(__name__)


class SampledTokenLogprobs(LogitsProcessor):
    """Draws each token from the sampler's processed distribution and records its log-prob there.

    transformers merges custom logits processors before its temperature, top-k, top-p and min-p warpers, so a
    processor cannot just read the final scores. This one applies them itself
    (`trl_grpo_ext.grpo.sampling_distribution.processed_logits`: the warpers' own ops, so the same tokens are drawn)
    and `generate_kwargs` switches generate's warpers off for the call: the scores it returns are the ones the token
    is drawn from. The token drawn from step k's scores is the last input id at step k + 1; the final step's token is
    read from the completions (`per_row`). One (rows, vocab) log-softmax is held at a time.
    """

    def __init__(self, settings: SamplingSettings):
        self.settings = settings
        self.steps: list[torch.Tensor] = []
        self._pending: torch.Tensor | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self._pending is not None:
            self.steps.append(self._pending.gather(-1, input_ids[:, -1:]).squeeze(-1))
        scores = processed_logits(scores, self.settings)
        self._pending = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def per_row(self, completion_ids: list[list[int]]) -> list[list[float]]:
        """Each completion's token log-probs (completions as TRL keeps them: cut after the first EOS)."""
        steps = list(self.steps)
        if self._pending is not None:
            n = len(steps) + 1
            last = [ids[n - 1] if len(ids) >= n else 0 for ids in completion_ids]
            index = torch.tensor(last, dtype=torch.long, device=self._pending.device)[:, None]
            steps.append(self._pending.gather(-1, index).squeeze(-1))
        table = torch.stack(steps, dim=1).tolist() if steps else [[] for _ in completion_ids]
        return [row[: len(ids)] for row, ids in zip(table, completion_ids, strict=True)]

    def generate_kwargs(self) -> dict:
        """``generate``'s keywords: this recorder, and generate's own warpers off (it applies them)."""
        return {
            "logits_processor": LogitsProcessorList([self]),
            "temperature": 1.0,
            "top_k": 0,
            "top_p": 1.0,
            "min_p": None,
        }


class SamplerPrecisionMixin:
    """`trl.GRPOTrainer` hooks: bf16 generation on the CPU, its token log-probs kept, the loss corrected.

    Sits above `PrefixSharingMixin` in the trainer's bases: its shared log-prob forward does not call up to TRL's.
    """

    _pending_correction: dict | None = None
    _warned_uncorrected = False
    _warned_rollout = False
    _loss_corrects_vllm = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # the user's setting: TRL's attribute of the same name is switched off below where this class corrects instead
        self.sampler_correction_on = bool(self.vllm_importance_sampling_correction)
        if self._vllm_on_policy():
            # TRL's correction off (its extra no-grad forward and its ratio); this class's, in the loss, on
            self._loss_corrects_vllm = True
            self.vllm_importance_sampling_correction = False

    def _vllm_on_policy(self) -> bool:
        """vLLM samples, TRL's correction is asked for, and every batch is trained with the weights that sampled it
        (TRL's test in ``_generate_and_score_completions``); not ``vespo`` (vLLM's ratio inside its gamma weights)
        nor a ``rollout_func`` (its own log-probs)."""
        if not (self.use_vllm and self.vllm_importance_sampling_correction) or self._user_rollout():
            return False
        generate_every = self.args.steps_per_generation * self.num_iterations
        return self.args.gradient_accumulation_steps % generate_every == 0 and self.loss_type != "vespo"

    def _sampler_bf16(self) -> bool:
        """Generation runs in bf16 autocast here: bf16 on the CPU, not vLLM (TRL's own sampler)."""
        return bf16_on_cpu(self.args.bf16, self.accelerator.device.type) and not self.use_vllm

    def _keeps_sampler_logprobs(self) -> bool:
        """The loss is corrected here from the sampler's token log-probs: the bf16 sampler's, vLLM's on-policy, and
        every asynchronous sampler's (the behaviour policy)."""
        if getattr(self, "async_active", False):
            return True
        return (self._sampler_bf16() and self.sampler_correction_on) or self._loss_corrects_vllm

    def _user_rollout(self) -> bool:
        """A ``rollout_func`` samples the completions: its sampler, precision and log-probs are its own."""
        return getattr(self, "rollout_func", None) is not None

    def _generate(self, prompts):
        if self._user_rollout():  # TRL's dispatch alone: the rollout needs none of this class's config
            return super()._generate(prompts)
        # transformers' generate draws each sampled token with torch.multinomial: the same draws, vectorised
        # (trl_grpo_ext.cpu.token_draws); CPU bf16 decode steps' attention as one packed call (decode_attention)
        install_attention()
        with bf16_autocast(self._sampler_bf16()), fast_token_draws():
            return super()._generate(prompts)

    def _sampler_logprob_recorder(self) -> SampledTokenLogprobs | None:
        """Hook for the generate call (`PrefixSharingMixin`, shared-prefix or TRL's own text generation): a recorder
        of the sampler's token log-probs, or None (fp32; or a generation config whose rows are not one sample
        each: beam search, several sequences per row, assisted decoding)."""
        config = self.generation_config
        one_sample_per_row = (
            (getattr(config, "num_beams", 1) or 1) == 1
            and (getattr(config, "num_return_sequences", 1) or 1) == 1
            and not (getattr(config, "prompt_lookup_num_tokens", None) or getattr(config, "assistant_model", None))
        )
        records = self._keeps_sampler_logprobs() and not self.use_vllm
        return SampledTokenLogprobs(self.sampling_settings) if records and one_sample_per_row else None

    # ------------------------------------------------------------------ the correction in the loss
    def _with_sampler_correction(self, inputs: dict) -> dict:
        """Hook at the start of ``_compute_loss``: a copy of `inputs` whose advantages the first log-prob forward
        weighs by the sampler correction (the batch buffered for ``num_iterations > 1`` stays as generated)."""
        if not self._keeps_sampler_logprobs():
            return inputs
        if self._user_rollout():
            # the rollout's log-probs come from a sampler of its own (TRL reads them only with vLLM): no correction
            if not self._warned_rollout:
                self._warned_rollout = True
                logger.warning(
                    "rollout_func supplies the completions and their log-probs: the bf16 sampler correction steps "
                    "aside for its rows (the loss is TRL's, uncorrected)"
                )
            return inputs
        if inputs.get("sampling_per_token_logps") is None:
            if not self._warned_uncorrected:
                self._warned_uncorrected = True
                logger.warning(
                    "bf16 sampling without its token log-probs (they are kept for text-only transformers "
                    "generation of one sample per row): the loss is not corrected for the sampler/trainer mismatch"
                )
            return inputs
        inputs = dict(inputs)
        self._pending_correction = inputs
        return inputs

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        result = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        inputs, self._pending_correction = self._pending_correction, None
        if inputs is not None:
            self._correct_for_sampler(inputs, result[0])
        return result

    def _correct_for_sampler(self, inputs: dict, per_token_logps: torch.Tensor) -> None:
        """Weigh the micro-batch's advantages by the behaviour ratio proximal/sampler (TRL's vLLM correction, with
        TRL's settings), the proximal policy being the trainer's old log-probs where TRL computed them, else
        (trained by the weights of the step's start) this forward's; the mismatch logged. Asynchronous sampling's
        coupled objective instead takes the loss's ratio against the sampler (its old log-probs) and only logs."""
        sampler, mask = inputs["sampling_per_token_logps"], internals.loss_mask(inputs)
        old = inputs.get("old_per_token_logps")
        if self._coupled_objective():
            # a NaN sampler log-prob (vLLM can return one) carries no behaviour information: that token's ratio is 1
            proximal = per_token_logps.detach()
            inputs["old_per_token_logps"] = torch.where(torch.isnan(old), proximal.to(old.dtype), old)
            _, metrics = sampler_correction(proximal, sampler, mask)
        else:
            proximal = per_token_logps.detach() if old is None else old
            weights, metrics = sampler_correction(
                proximal,
                sampler,
                mask,
                self.vllm_importance_sampling_mode,
                self.vllm_importance_sampling_clip_min,
                self.vllm_importance_sampling_clip_max,
            )
            if self.sampler_correction_on:
                self._weigh_by_sampler_correction(inputs, weights)
        self._log_sampler_mismatch(metrics)
        self._after_sampler_correction(inputs, proximal)

    def _weigh_by_sampler_correction(self, inputs: dict, weights: torch.Tensor) -> None:
        if self.loss_type == "vespo":
            # vespo's weights are not linear in a per-token ratio: TRL folds vLLM's ratio into its gamma weights
            # (`get_gamma_weights` reads ``importance_sampling_ratio``); this sampler's goes the same way.
            inputs["importance_sampling_ratio"] = weights
        else:
            advantages = inputs["advantages"]
            if advantages.dim() == 1:
                advantages = advantages.unsqueeze(1)
            inputs["advantages"] = advantages * weights.to(advantages.dtype)

    def _coupled_objective(self) -> bool:
        """Asynchronous sampling's coupled objective (`trl.async_sampling` says)."""
        return False

    def _after_sampler_correction(self, inputs: dict, proximal_logps: torch.Tensor) -> None:
        """Hook after a micro-batch's correction (`trl.async_sampling`: staleness and ratios by staleness)."""

    def _log_sampler_mismatch(self, metrics: dict[str, torch.Tensor]) -> None:
        mode = "train" if self.model.training else "eval"
        local = torch.stack([metrics[key].float() for key in SAMPLER_MISMATCH_KEYS])
        every = self.accelerator.gather(local[None]) if self.accelerator.num_processes > 1 else local[None]
        for i, key in enumerate(SAMPLER_MISMATCH_KEYS):
            column = every[:, i]
            value = column.min() if key.endswith("/min") else column.max() if key.endswith("/max") else column.mean()
            internals.log_metric(self, mode, key, value.item())
