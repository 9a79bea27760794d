"""`AsyncSamplingMixin`: the TRL path's asynchronous GRPO, sampling overlapped with training, staleness-bounded.

With ``async_sampling: true`` and ``max_staleness: K >= 1`` (`trl_grpo_ext.grpo.async_sampling` holds the rules
both paths share), the trainer keeps the data loader up to K optimizer steps ahead of the step it trains
(``get_batch_samples``, the hook transformers' loop takes each step's micro-batches through): when version ``v`` of the
weights is current (``v`` optimizer steps done), each generation batch up to step ``v + K`` is tokenized as TRL
tokenizes it and requested from the sampler (`trl_grpo_ext.trl.rollout_worker.RolloutWorker`, a thread with its
own copy of the policy, on its own cores), drawn with version ``v``. When TRL then generates for that batch
(``_generate_single_turn``), the sampler's completions and their token log-probs come back instead, and everything
after generation is TRL's and this package's as on-policy: rewards, advantages, degenerate groups, dynamic sampling
(its extra batches are drawn on demand, with the current weights), distillation, metrics.

The loss. The sampler's token log-probs are the behaviour policy: they become the batch's ``old_per_token_logps``
(``_generate_and_score_completions``), so every loss type, TRL's and ours, takes its ratio against the weights that
drew the batch and clips it as it always does (PPO's clip, CISPO's clipped weight, plain importance sampling's
unclipped ratio; `trl_grpo_ext.grpo.losses`); ``clip_low_frac``/``clip_high_frac`` report what was clipped. The
sampler/trainer mismatch of `trl_grpo_ext.trl.sampler_precision` is logged, not applied (the loss's ratio already
corrects it), with the importance ratio by staleness (``sample/is_ratio/staleness_<s>``).

Checkpoints keep the batches already drawn for the steps after them (``async_rollouts.json``, plain JSON), so a
resumed run trains exactly the batches an uninterrupted one would; a saved batch older than the resumed run's
``max_staleness`` is dropped and counted, and its step samples again with the current weights.

The weights reach the sampler copy-on-write (`trl_grpo_ext.trl.weight_transfer.InProcessWeights`): the sampler
copies each version on its own cores; the trainer copies one aside only when an optimizer step would overwrite a
version the sampler still has to take (``before_update``).

Samplers: transformers' generation of text on the sampler's copy (prefix sharing, the bf16 sampler, token draws and
packed decode attention as on-policy), or TRL's vLLM server (``vllm_mode: server``; the trainer hands each version
over between two of its batches, `trl_grpo_ext.trl.weight_transfer.ServerWeights`). One training process. Refused
with one line at construction, before TRL loads anything it can: a colocated vLLM engine, tools and environments, a
``rollout_func``, several processes, DeepSpeed/FSDP without vLLM's server (the sampler's copy of the policy needs the
whole weights in this process), vision-language models.
"""

from __future__ import annotations

import collections
import copy
import inspect
import json
import logging
import os
import threading
import time

import torch
import trl
from transformers import TrainerCallback

from trl_grpo_ext.cpu.precision import bf16_autocast
from trl_grpo_ext.cpu.threads import CoreSplit, pin_this_thread, split_cores
from trl_grpo_ext.cpu.token_draws import fast_token_draws
from trl_grpo_ext.errors import raise_problems
from trl_grpo_ext.grpo.async_sampling import AsyncStepStats, last_step_to_request, too_stale
from trl_grpo_ext.grpo.losses import ratio_by_staleness
from trl_grpo_ext.prefix.attention import install as install_attention
from trl_grpo_ext.runs import ASYNC_ROLLOUTS_FILENAME, atomic_write_json, checkpoint_dir
from trl_grpo_ext.trl import internals
from trl_grpo_ext.trl.config import ExtensionOptions
from trl_grpo_ext.trl.rollout_worker import AsyncSamplerError, RolloutRequest, RolloutResult, RolloutWorker
from trl_grpo_ext.trl.sampler_precision import SampledTokenLogprobs
from trl_grpo_ext.trl.weight_transfer import InProcessWeights, ServerWeights

logger = logging.getLogger(__name__)

ROLLOUTS_FORMAT = 1  # async_rollouts.json's layout


def request_seed(seed: int, step: int, index: int) -> int:
    """The seed of a request's draws: a function of the run's seed, the step it is for and its index within the
    step (0: the scheduled batch; 1, 2...: on-demand batches), so a resumed run draws what an uninterrupted one would."""
    return (seed * 1_000_003 + step * 1_009 + index * 7_919) % (2**63 - 1)


class AsyncSamplingMixin:
    """`trl.GRPOTrainer` hooks for ``async_sampling`` (module docstring). First among the trainer's mixins: its
    ``_prepare_inputs`` marks the batch the sampler drew before dynamic sampling runs."""

    async_active = False
    _worker: RolloutWorker | None = None

    def __init__(self, *args, **kwargs):
        given = inspect.signature(trl.GRPOTrainer.__init__).bind(self, *args, **kwargs).arguments
        options = ExtensionOptions.of(given.get("args"))
        active = bool(options.async_sampling) and options.max_staleness > 0
        if active:  # what the arguments already say, before TRL loads anything
            raise_problems("GRPOTrainer", _argument_problems(given))
        super().__init__(*args, **kwargs)
        self.async_active = active
        if not active:
            return  # max_staleness 0 is on-policy: the synchronous path, unchanged
        raise_problems("GRPOTrainer", self._async_problems())
        # the sampler's log-probs are the loss's old ones: TRL's separate vLLM correction would apply the gap twice
        self.vllm_importance_sampling_correction = False
        self.max_staleness = options.max_staleness
        self.async_timeout_s = float(options.async_timeout_s)
        self._worker: RolloutWorker | None = None
        self._cores: CoreSplit | None = None
        self._saved_affinity: set[int] | None = None
        self._saved_threads: int | None = None
        self._lookahead: collections.deque = collections.deque()
        self._lookahead_iterator = None
        self._tickets: dict[int, int] = {}  # id(generation batch) -> request seq
        # results in hand before their step: restored from a checkpoint, or waited for when one was saved; by seq
        self._ready: dict[int, RolloutResult] = {}
        self._next_seq = 0
        self._on_demand: collections.Counter = collections.Counter()  # on-demand requests per step
        self._restored: dict[int, dict] = {}  # saved batches by step (a resumed run's)
        self._current_ticket: int | None = None
        self._batch_staleness: list[int] | None = None  # the rows of the batch being scored
        self._stats = AsyncStepStats()
        self._step_started = time.monotonic()
        self.callback_handler.callbacks.insert(0, _AsyncSamplingCallback(self))

    def _async_problems(self) -> list[str]:
        """What the built trainer says async sampling cannot run with (`_argument_problems`: what its arguments say)."""
        problems = []
        if self.accelerator.num_processes != 1:
            problems.append("async_sampling runs on one training process (its sampler thread draws for it alone)")
        elif not self.use_vllm and (self.is_deepspeed_enabled or self.is_fsdp_enabled):
            problems.append(f"async_sampling without vLLM needs the whole weights in this process ({_WHY}): not "
                            "with DeepSpeed/FSDP; sample with vLLM's server (use_vllm, vllm_mode: server)")  # fmt: skip
        if internals.is_vlm(self):
            problems.append("async_sampling samples text only; this is a vision-language model")
        return problems

    # ------------------------------------------------------------------ the sampler's side, set up on first use
    def _start_sampler(self) -> RolloutWorker:
        """The sampler thread: with vLLM's server, its requests to the server; else with its own copy of the policy,
        on its own cores (said at start)."""
        if self.use_vllm:
            return self._start_server_sampler()
        model = self.accelerator.unwrap_model(self.model)
        sampler_model = copy.deepcopy(model)
        sampler_model.__dict__.pop("forward", None)  # a forward wrapped in place would still call the trainer's
        sampler_model.eval()
        sampler_model.requires_grad_(False)
        names = [name for name, p in model.named_parameters() if p.requires_grad]
        weights = InProcessWeights(
            [model.get_parameter(n) for n in names],
            [sampler_model.get_parameter(n) for n in names],
            version=self.state.global_step,
        )
        on_cpu = self.accelerator.device.type == "cpu"
        self._cores = split_cores() if on_cpu else None
        if self._cores is not None:
            if hasattr(os, "sched_getaffinity"):
                self._saved_affinity = os.sched_getaffinity(threading.get_native_id())
            self._saved_threads = torch.get_num_threads()
            pin_this_thread(self._cores.trainer_cores, self._cores.threads)
            line = self._cores.line()
        else:
            line = "sampler and trainer share this process's cores (one core)" if on_cpu else "on the model's device"
        print(f"async sampling: max_staleness {self.max_staleness}; {line}", flush=True)
        install_attention()  # the packed bf16 decode attention, as the on-policy sampler
        shared = self._generation_sharing_reason(sampler_model) is None
        bf16 = self._sampler_bf16()

        def generate(request: RolloutRequest):
            prompt_ids = [list(p) for p in request.prompt_ids]
            recorder = SampledTokenLogprobs()
            generator = torch.Generator().manual_seed(request.seed)
            with torch.no_grad(), bf16_autocast(bf16), fast_token_draws(generator):
                sequences = self._text_generate(shared, recorder)(sampler_model, prompt_ids)
            completion_ids = internals.completions_after_prompt(self, sequences, prompt_ids)
            return completion_ids, recorder.per_row(completion_ids)

        cores = self._cores.sampler_cores if self._cores is not None else None
        threads = self._cores.threads if self._cores is not None else None
        return RolloutWorker(generate, weights, self.async_timeout_s, cores, threads)

    def _start_server_sampler(self) -> RolloutWorker:
        """TRL's vLLM server as the sampler (``vllm_mode: server``): the thread sends each batch's prompts to it as
        TRL's generation does (`trl.generation.vllm_generation.VLLMGeneration.generate`); the trainer hands the weights
        over itself, between two of the thread's requests (`ServerWeights`: TRL's sync, NCCL on GPUs, the file the
        CPU server reloads otherwise, `trl_grpo_ext.trl.vllm_cpu`)."""
        print(f"async sampling: max_staleness {self.max_staleness}; sampler: vLLM server", flush=True)
        generation = self.vllm_generation

        def generate(request: RolloutRequest):
            prompt_ids = [list(p) for p in request.prompt_ids]
            _, completion_ids, logprobs, _ = generation.generate(
                prompts=prompt_ids, images=None, num_generations=self.num_generations
            )
            return completion_ids, [[lp[0] for lp in row] for row in logprobs]  # the sampled token's log-prob

        return RolloutWorker(generate, ServerWeights(generation.sync_weights), self.async_timeout_s)

    def _stop_sampler(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        if self._saved_threads is not None:
            torch.set_num_threads(self._saved_threads)
            self._saved_threads = None
        if self._saved_affinity is not None:
            os.sched_setaffinity(threading.get_native_id(), self._saved_affinity)
            self._saved_affinity = None

    def train(self, *args, **kwargs):
        try:
            return super().train(*args, **kwargs)
        finally:  # also when training stopped on an error: no sampler thread outlives it
            if self.async_active:
                self._stop_sampler()

    # ------------------------------------------------------------------ the lookahead
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        # transformers' training loop alone calls this (each optimizer step's micro-batches), before the model is put
        # in training mode: the training-only hooks below test ``model.training``, this one need not
        if not self.async_active:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        if self._worker is None:
            self._worker = self._start_sampler()
        self._worker.raise_if_failed()
        version = self.state.global_step
        self._step_started = time.monotonic()
        if self.use_vllm:  # the server holds one copy of the weights: swapped between two requests, not during one
            self._stats.trainer_wait_s += self._worker.wait_idle()
        self._worker.weights.publish(version)
        if epoch_iterator is not self._lookahead_iterator:  # a new epoch: nothing of the last one is ahead
            self._lookahead_iterator, self._lookahead = epoch_iterator, collections.deque()
        ga = self.args.gradient_accumulation_steps
        generate_every = self.args.steps_per_generation * self.num_iterations
        # the micro-batches of every step whose batch this version may draw (grpo.async_sampling's schedule)
        ahead = (last_step_to_request(version, self.max_staleness, self.state.max_steps) - version + 1) * ga
        while len(self._lookahead) < ahead:
            try:
                item = next(epoch_iterator)
            except StopIteration:
                break
            offset = len(self._lookahead)
            if (internals.micro_steps(self) + offset) % generate_every == 0:
                self._request(item, version + offset // ga, version)
            self._lookahead.append(item)
        batch = [self._lookahead.popleft() for _ in range(min(num_batches, len(self._lookahead)))]
        return batch, self._get_num_items_in_batch(batch, device)

    def _request(self, generation_batch: list[dict], step: int, version: int) -> None:
        """Request the sampler's draw of `generation_batch` for `step` with `version` (or take the one a checkpoint
        kept)."""
        prompt_ids = self._tokenize_prompts([row["prompt"] for row in generation_batch])[0]
        prompt_ids = tuple(tuple(int(t) for t in ids) for ids in prompt_ids)
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        self._tickets[id(generation_batch)] = seq
        saved = self._restored.pop(step, None)
        if saved is not None and tuple(tuple(p) for p in saved["prompt_ids"]) == prompt_ids:
            request = RolloutRequest(seq, step, saved["version"], prompt_ids, saved["seed"])
            self._ready[seq] = RolloutResult(request, saved["completion_ids"], saved["logprobs"], 0.0, 0.0, 0.0, 0.0)
            return
        if saved is not None:
            logger.warning(
                "async sampling: the batch saved for step %d has other prompts; sampling it again", step + 1
            )
        self._worker.submit(RolloutRequest(seq, step, version, prompt_ids, request_seed(self.args.seed, step, 0)))

    def _request_now(self, prompt_ids) -> int:
        """An on-demand request drawn with the current weights (an extra batch of dynamic sampling, a dropped one)."""
        step = self.state.global_step
        self._on_demand[step] += 1
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        prompts = tuple(tuple(int(t) for t in ids) for ids in prompt_ids)
        seed = request_seed(self.args.seed, step, self._on_demand[step])
        self._worker.submit(RolloutRequest(seq, None, step, prompts, seed))
        return seq

    def _take(self, seq: int) -> RolloutResult:
        """Request `seq`'s result (waiting for it, counted as the trainer's wait)."""
        if seq in self._ready:
            return self._ready.pop(seq)
        result, waited = self._worker.result(seq)
        self._stats.trainer_wait_s += waited
        self._stats.weight_sync_s += result.weight_sync_s
        return result

    # ------------------------------------------------------------------ TRL's hooks
    def _prepare_inputs(self, generation_batch):
        if self.async_active and self.model.training:
            self._current_ticket = self._tickets.pop(id(generation_batch), None)
        return super()._prepare_inputs(generation_batch)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if not (self.async_active and self.model.training and self._worker is not None):
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        seq, self._current_ticket = self._current_ticket, None
        if seq is None:
            seq = self._request_now(prompt_ids)
        result = self._take(seq)
        version = self.state.global_step
        if too_stale(result.request.version, version, self.max_staleness):
            self._stats.dropped += len(result.completion_ids)
            logger.warning(
                "async sampling: dropped %s, %d steps older than the policy (max_staleness %d); sampling it again",
                result.request.what(),
                version - result.request.version,
                self.max_staleness,
            )
            result = self._take(self._request_now(prompt_ids))
        if [list(p) for p in result.request.prompt_ids] != [list(p) for p in prompt_ids]:
            raise AsyncSamplerError(
                f"async sampling: {result.request.what()} was drawn for other prompts than the ones being scored"
            )
        self._stats.trained(result.request.version, version, len(result.completion_ids))
        self._batch_staleness = [version - result.request.version] * len(result.completion_ids)
        return result.completion_ids, result.logprobs

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if not self.async_active:
            return output
        staleness, self._batch_staleness = self._batch_staleness, None
        if staleness is None or output.get("sampling_per_token_logps") is None:
            return output
        # The behaviour policy: the loss's ratio is taken against the weights that drew the batch.
        output["old_per_token_logps"] = output["sampling_per_token_logps"]
        start = self.accelerator.process_index * output["completion_ids"].shape[0]
        rows = staleness[start : start + output["completion_ids"].shape[0]]
        output["sample_staleness"] = torch.tensor(rows, dtype=torch.long, device=output["completion_ids"].device)
        return output

    def _log_async_ratios(self, per_token_logps: torch.Tensor, inputs: dict) -> None:
        """``sample/is_ratio/staleness_<s>``: the mean ratio of this micro-batch's tokens by their batch's staleness
        (`trl.sampler_precision` calls it with the loss's forward)."""
        staleness = inputs.get("sample_staleness")
        if staleness is None:
            return
        log_ratio = per_token_logps.detach() - inputs["sampling_per_token_logps"]
        for key, value in ratio_by_staleness(log_ratio, internals.loss_mask(inputs), staleness).items():
            internals.log_metric(self, "train", key, value)

    # ------------------------------------------------------------------ checkpoints
    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if not (self.async_active and self._worker is not None and self.args.should_save):
            return
        folder = checkpoint_dir(internals.checkpoint_root(self, trial), self.state.global_step)
        for request in self._worker.pending():  # the batches being drawn ahead: wait for them, keep them
            result, waited = self._worker.result(request.seq)
            self._stats.trainer_wait_s += waited
            self._ready[request.seq] = result  # still trained when its step comes
        # with those restored from an earlier checkpoint and not trained yet: every batch drawn for a later step
        batches = {r.request.step: _saved_batch(r) for r in self._ready.values() if r.request.step is not None}
        atomic_write_json(
            folder / ASYNC_ROLLOUTS_FILENAME,
            {"format": ROLLOUTS_FORMAT, "batches": [batches[step] for step in sorted(batches)]},
        )

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if not self.async_active or checkpoint is None:
            return
        path = os.path.join(checkpoint, ASYNC_ROLLOUTS_FILENAME)
        if not os.path.isfile(path):
            return
        try:
            with open(path, encoding="utf-8") as handle:
                saved = json.load(handle)
            if saved.get("format") != ROLLOUTS_FORMAT:
                raise ValueError(f"unknown format {saved.get('format')!r}")
            self._restored = {int(b["step"]): _checked_batch(b) for b in saved["batches"]}
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise ValueError(
                f"{path}: unreadable asynchronous batches ({error}); remove the file to sample them again"
            ) from None

    # ------------------------------------------------------------------ per-step metrics (`_AsyncSamplingCallback`)
    def _log_async_step(self) -> None:
        now = time.monotonic()
        stats, self._stats = self._stats, AsyncStepStats()
        if self._worker is not None:
            stats.sampler_busy_s = self._worker.busy_since(self._step_started, now)
            # the schedule requests a batch only once its weights exist: a sampler with nothing to draw is waiting
            # for the trainer's next version
            idle = now - self._step_started - stats.sampler_busy_s - stats.weight_sync_s
            stats.sampler_wait_s = max(0.0, idle)
        for key, value in stats.metrics(now - self._step_started).items():
            internals.log_metric(self, "train", key, value)


_WHY = "the asynchronous sampler draws with transformers' generate on a copy of the policy in this process"
_SERVER_ONLY = "async_sampling samples with vLLM's server (vllm_mode: server), not a colocated engine"


def _argument_problems(given: dict) -> list[str]:
    """What the trainer's arguments say async sampling cannot run with (`trl.GRPOTrainer.__init__`'s, bound)."""
    problems = []
    args = given.get("args")
    if getattr(args, "use_vllm", False) and getattr(args, "vllm_mode", None) != "server":
        problems.append(f"{_SERVER_ONLY}: the engine would sample while this process trains; set vllm_mode: server")
    if given.get("tools") or given.get("environment_factory") is not None:
        problems.append("async_sampling does not sample multi-turn tool calls yet; unset tools/environments")
    if given.get("rollout_func") is not None:
        problems.append("async_sampling with a rollout_func: the rollout samples itself; unset one of them")
    return problems


def _saved_batch(result: RolloutResult) -> dict:
    request = result.request
    return {
        "step": request.step,
        "version": request.version,
        "seed": request.seed,
        "prompt_ids": [list(p) for p in request.prompt_ids],
        "completion_ids": result.completion_ids,
        "logprobs": result.logprobs,
    }


def _checked_batch(batch: dict) -> dict:
    """A saved batch with the types a resumed run relies on (plain JSON: nothing in it runs)."""
    for key in ("step", "version", "seed"):
        if isinstance(batch[key], bool) or not isinstance(batch[key], int):
            raise ValueError(f"{key} must be an integer")
    rows = (batch["prompt_ids"], batch["completion_ids"], batch["logprobs"])
    if not all(isinstance(r, list) for r in rows) or len({len(r) for r in rows}) != 1:
        raise ValueError("prompt_ids, completion_ids and logprobs must be lists of one row per completion")
    for ids, logps in zip(batch["completion_ids"], batch["logprobs"], strict=True):
        if len(ids) != len(logps) or not all(isinstance(t, int) for t in ids):
            raise ValueError("each completion needs integer token ids and one log-prob per token")
    return batch


class _AsyncSamplingCallback(TrainerCallback):
    """The step boundaries of an asynchronous run: the weights published to the sampler are about to change
    (``on_pre_optimizer_step``), the step's metrics (``on_step_end``), the sampler stopped and the cores given back
    before anything runs after training (``on_train_end``; first among the callbacks, so before the evals)."""

    def __init__(self, trainer: AsyncSamplingMixin):
        self.trainer = trainer

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        worker = self.trainer._worker
        if worker is not None:
            t0 = time.monotonic()
            worker.weights.before_update()
            self.trainer._stats.weight_sync_s += time.monotonic() - t0

    def on_step_end(self, args, state, control, **kwargs):
        if self.trainer._worker is not None:
            self.trainer._log_async_step()

    def on_train_end(self, args, state, control, **kwargs):
        self.trainer._stop_sampler()
