"""`AsyncSamplingMixin`: the TRL path's asynchronous GRPO, sampling overlapped with training, staleness-bounded.

With ``async_sampling: true`` and ``max_staleness: K >= 1`` (`trl_grpo_ext.grpo.async_sampling` holds the rules
both paths share), the trainer keeps the data loader ``sample_ahead`` (N) optimizer steps ahead of the step it trains
(``get_batch_samples``, the hook transformers' loop takes each step's micro-batches through): when version ``v`` of
the weights is current (``v`` optimizer steps done), each generation batch up to step ``v + N`` is tokenized as TRL
tokenizes it and requested from the sampler (`trl_grpo_ext.trl.rollout_worker.RolloutWorker`, a thread with its own
copy of the policy, on its own cores), drawn with version ``v``. The requests and what comes back live in the
look-ahead both paths share (`trl_grpo_ext.grpo.lookahead.Lookahead`: keyed by step, staleness checked, saved in
checkpoints, busy metrics); this module supplies how a batch is submitted and collected (`_WorkerSampler`). When TRL
then generates for that batch (``_generate_single_turn``), the sampler's completions and their token log-probs come
back instead, and everything after generation is TRL's and this package's as on-policy: rewards, advantages,
degenerate groups, dynamic sampling (its extra batches drawn on demand with the current weights, before anything
requested ahead), distillation, metrics.

The loss (``async_objective``). The sampler's token log-probs (of the distribution it drew from,
`trl_grpo_ext.grpo.sampling_distribution`) are the behaviour policy. ``decoupled`` (default): TRL's old log-probs
stay the proximal policy (the weights at the start of the step: this forward, detached, when each batch trains one
step; TRL's generation-time forward when ``num_iterations > 1`` or ``steps_per_generation`` spans several steps), so
every loss type takes its own ratio and clip against it, and the behaviour ratio proximal/sampler weighs the
advantages, truncated or masked as TRL's ``vllm_importance_sampling_*`` settings say
(`trl_grpo_ext.trl.sampler_precision`, the mechanism of the on-policy bf16 correction). ``coupled``: the sampler's
log-probs are the old ones, so the loss's ratio is taken against them (a NaN sampler log-prob counts as no
difference). The staleness of what each micro-batch trains, at the step that trains it, and the behaviour ratio by
staleness (``sample/is_ratio/staleness_<s>``) are logged.

Checkpoints keep the batches already drawn for the steps after them (``async_rollouts.json``, the look-ahead's plain
JSON), so a resumed run trains exactly the batches an uninterrupted one would; a saved batch older than the resumed
run's ``max_staleness`` is dropped and counted, and its step samples again with the current weights.

The weights reach the sampler copy-on-write (`trl_grpo_ext.trl.weight_transfer.InProcessWeights`): the sampler
copies each version on its own cores; the trainer copies one aside only when an optimizer step would overwrite a
version the sampler still has to take (``before_update``).

Samplers: transformers' generation of text on the sampler's copy (prefix sharing, the bf16 sampler, token draws and
packed decode attention as on-policy), or TRL's vLLM server (``vllm_mode: server``; the trainer hands each version
over between two of its batches, `trl_grpo_ext.trl.weight_transfer.ServerWeights`; an evaluation during training
waits for the sampler's batches, then hands the current weights over the same way before TRL generates). One
training process. Refused with one line at construction, before TRL loads anything it can: a colocated vLLM engine,
tools and environments, a ``rollout_func``, several processes, DeepSpeed/FSDP without vLLM's server (the sampler's
copy of the policy needs the whole weights in this process), vision-language models.
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
from trl_grpo_ext.grpo.async_sampling import last_step_to_request
from trl_grpo_ext.grpo.lookahead import SAVED_FORMAT, Completion, DrawnBatch, Lookahead
from trl_grpo_ext.grpo.losses import ratio_by_staleness
from trl_grpo_ext.prefix.attention import install as install_attention
from trl_grpo_ext.runs import ASYNC_ROLLOUTS_FILENAME, atomic_write_json, checkpoint_dir
from trl_grpo_ext.trl import internals
from trl_grpo_ext.trl.config import ExtensionOptions
from trl_grpo_ext.trl.rollout_worker import AsyncSamplerError, RolloutRequest, RolloutWorker
from trl_grpo_ext.trl.sampler_precision import SampledTokenLogprobs
from trl_grpo_ext.trl.weight_transfer import InProcessWeights, ServerWeights

logger = logging.getLogger(__name__)


def request_seed(seed: int, step: int, index: int) -> int:
    """The seed of a request's draws: a function of the run's seed, the step it is for and its index within the
    step (0, 1...: the scheduled batches; -1, -2...: on-demand batches), so a resumed run draws what an uninterrupted
    one would."""
    return (seed * 1_000_003 + step * 1_009 + index * 7_919) % (2**63 - 1)


class _WorkerSampler:
    """The look-ahead's `BatchSampler` on the sampler thread: a batch becomes a `RolloutRequest`, its result the
    completions; the sampler's own hand-over time is kept for the step's ``perf/weight_sync_s``."""

    def __init__(self, trainer: AsyncSamplingMixin):
        self.trainer = trainer
        self._next_seq = 0
        self.weight_sync_s = 0.0

    def submit(self, batch: DrawnBatch, now: bool = False) -> int:
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        step = None if batch.slot < 0 else batch.step
        self.trainer._worker.submit(RolloutRequest(seq, step, batch.version, batch.prompt_ids, batch.seed, now))
        return seq

    def collect(self, seq: int) -> list[Completion]:
        result, _ = self.trainer._worker.result(seq)
        self.weight_sync_s += result.weight_sync_s
        prompts = result.request.prompt_ids
        return [
            # a log-prob vLLM's server sent as null (NaN in JSON) is NaN: no difference in the correction
            Completion(tuple(p), tuple(ids), tuple(float("nan") if x is None else float(x) for x in logps))
            for p, ids, logps in zip(prompts, result.completion_ids, result.logprobs, strict=True)
        ]


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
        self.async_active = active  # before the mixins' setup reads it (`sampler_precision`)
        super().__init__(*args, **kwargs)
        if not active:
            return  # max_staleness 0 is on-policy: the synchronous path, unchanged
        raise_problems("GRPOTrainer", self._async_problems())
        # TRL's own vLLM correction off: `sampler_precision` applies the behaviour weight (decoupled) in the loss
        self.vllm_importance_sampling_correction = False
        self.max_staleness = options.max_staleness
        self.sample_ahead = options.sample_ahead
        self.async_objective = options.async_objective
        self.async_timeout_s = float(options.async_timeout_s)
        self._worker: RolloutWorker | None = None
        self._sampler = _WorkerSampler(self)
        self._lookahead = Lookahead(self._sampler, self.max_staleness)
        self._cores: CoreSplit | None = None
        self._saved_affinity: set[int] | None = None
        self._saved_threads: int | None = None
        self._ahead: collections.deque = collections.deque()  # the data loader's micro-batches pulled ahead
        self._ahead_iterator = None
        self._keys: dict[int, tuple[int, int]] = {}  # id(generation batch) -> its (step, slot) in the look-ahead
        self._slots: collections.Counter = collections.Counter()  # generation batches requested per step
        self._on_demand: collections.Counter = collections.Counter()  # on-demand requests per step
        self._current_key: tuple[int, int] | None = None
        self._batch_version: int | None = None  # the weights that drew the batch being scored
        self._step_started = time.monotonic()
        self._weight_sync_s = 0.0  # the trainer's side of the step's hand-over
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

    def _coupled_objective(self) -> bool:
        return self.async_active and self.async_objective == "coupled"

    # ------------------------------------------------------------------ the sampler's side, set up on first use
    def _start_sampler(self) -> RolloutWorker:
        """The sampler thread: with vLLM's server, its requests to the server; else with its own copy of the policy,
        on its own cores (said at start)."""
        if self.use_vllm:
            return self._start_server_sampler()
        model = self.accelerator.unwrap_model(self.model)
        sampler_model = copy.deepcopy(model)
        # a forward patched in place (TRL's fused head, ours; on PEFT's inner model too) closes over the trainer's
        # model and would still call it: the copy runs its class's own forward
        for module in sampler_model.modules():
            module.__dict__.pop("forward", None)
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
        print(f"async sampling: {self._schedule_line()}; {line}", flush=True)
        install_attention()  # the packed bf16 decode attention, as the on-policy sampler
        shared = self._generation_sharing_reason(sampler_model) is None
        bf16 = self._sampler_bf16()

        def generate(request: RolloutRequest):
            prompt_ids = [list(p) for p in request.prompt_ids]
            recorder = SampledTokenLogprobs(self.sampling_settings)
            generator = torch.Generator().manual_seed(request.seed)
            with torch.no_grad(), bf16_autocast(bf16), fast_token_draws(generator):
                sequences = self._text_generate(shared, recorder)(sampler_model, prompt_ids)
            completion_ids = internals.completions_after_prompt(self, sequences, prompt_ids)
            return completion_ids, recorder.per_row(completion_ids)

        cores = self._cores.sampler_cores if self._cores is not None else None
        threads = self._cores.threads if self._cores is not None else None
        return RolloutWorker(generate, weights, self.async_timeout_s, cores, threads, self._lookahead.record_busy)

    def _start_server_sampler(self) -> RolloutWorker:
        """TRL's vLLM server as the sampler (``vllm_mode: server``): the thread sends each batch's prompts to it as
        TRL's generation does (`trl.generation.vllm_generation.VLLMGeneration.generate`); the trainer hands the weights
        over itself, between two of the thread's requests (`ServerWeights`: TRL's sync, NCCL on GPUs, the file the
        CPU server reloads otherwise, `trl_grpo_ext.trl.vllm_cpu`)."""
        print(f"async sampling: {self._schedule_line()}; sampler: vLLM server", flush=True)
        generation = self.vllm_generation

        def generate(request: RolloutRequest):
            prompt_ids = [list(p) for p in request.prompt_ids]
            _, completion_ids, logprobs, _ = generation.generate(
                prompts=prompt_ids, images=None, num_generations=self.num_generations
            )
            return completion_ids, [[lp[0] for lp in row] for row in logprobs]  # the sampled token's log-prob

        weights = ServerWeights(generation.sync_weights)
        return RolloutWorker(generate, weights, self.async_timeout_s, on_drawn=self._lookahead.record_busy)

    def _schedule_line(self) -> str:
        correction = (
            f"behaviour weight {self.vllm_importance_sampling_mode}, clip [{self.vllm_importance_sampling_clip_min}, "
            f"{self.vllm_importance_sampling_clip_max}]"
            if self.sampler_correction_on
            else "no behaviour weight (vllm_importance_sampling_correction: false)"
        )
        if self._coupled_objective():
            correction = "the loss's ratio against the sampler's log-probs"
        return (
            f"sample_ahead {self.sample_ahead}, max_staleness {self.max_staleness}, {self.async_objective} objective "
            f"({correction}); sampling with {self.sampling_settings.describe()}"
        )

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

    # ------------------------------------------------------------------ the look-ahead
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
        self._publish(version)
        if epoch_iterator is not self._ahead_iterator:  # a new epoch: nothing of the last one is ahead
            self._ahead_iterator, self._ahead = epoch_iterator, collections.deque()
        # a batch of an earlier step that no step will take (a checkpoint's, when the resumed run's generation
        # windows start elsewhere) is let go
        self._lookahead.discard_before(version)
        ga = self.args.gradient_accumulation_steps
        generate_every = self.args.steps_per_generation * self.num_iterations
        # the micro-batches of every step whose batches this version may draw (grpo.async_sampling's schedule)
        ahead = (last_step_to_request(version, self.sample_ahead, self.state.max_steps) - version + 1) * ga
        while len(self._ahead) < ahead:
            try:
                item = next(epoch_iterator)
            except StopIteration:
                break
            offset = len(self._ahead)
            if (internals.micro_steps(self) + offset) % generate_every == 0:
                self._request(item, version + offset // ga, version)
            self._ahead.append(item)
        batch = [self._ahead.popleft() for _ in range(min(num_batches, len(self._ahead)))]
        return batch, self._get_num_items_in_batch(batch, device)

    def _publish(self, version: int) -> None:
        """Version `version` is the trainer's: the sampler may draw with it (a vLLM server gets it between two of its
        batches: the server holds one copy of the weights)."""
        if self.use_vllm:
            self._lookahead.stats.trainer_wait_s += self._worker.wait_idle()
        t0 = time.monotonic()
        self._worker.weights.publish(version)
        self._weight_sync_s += time.monotonic() - t0
        if self.use_vllm:
            internals.mark_vllm_weights_loaded(self)  # TRL's own sync (an evaluation's generation) need not run

    def _request(self, generation_batch: list[dict], step: int, version: int) -> None:
        """Request the sampler's draw of `generation_batch` for `step` with `version` (or keep the one a checkpoint
        saved for it)."""
        prompt_ids = self._tokenize_prompts([row["prompt"] for row in generation_batch])[0]
        slot = self._slots[step]
        self._slots[step] += 1
        self._slots.pop(step - self.max_staleness - 1, None)
        seed = request_seed(self.args.seed, step, slot)
        batch = self._lookahead.request(step, slot, version, seed, prompt_ids)
        self._keys[id(generation_batch)] = batch.key

    # ------------------------------------------------------------------ TRL's hooks
    def _prepare_inputs(self, generation_batch):
        if self.async_active and self.model.training:
            self._current_key = self._keys.pop(id(generation_batch), None)
        return super()._prepare_inputs(generation_batch)

    def _generate(self, prompts):
        if self.async_active and not self.model.training and self.use_vllm and self._worker is not None:
            # an evaluation's generation on the server: after the sampler's batches, with the current weights
            self._publish(self.state.global_step)
        return super()._generate(prompts)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if not (self.async_active and self.model.training and self._worker is not None):
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        key, self._current_key = self._current_key, None
        version = self.state.global_step
        if key is None:  # an on-demand batch (dynamic sampling's extra rounds): the current weights, drawn first
            self._on_demand[version] += 1
            seed = request_seed(self.args.seed, version, -self._on_demand[version])
            batch = self._lookahead.draw_now(version, version, seed, prompt_ids)
        else:
            batch = self._lookahead.take(key[0], version, key[1])
        if [list(p) for p in batch.prompt_ids] != [list(p) for p in prompt_ids]:
            raise AsyncSamplerError(
                f"async sampling: {batch.what()} was drawn for other prompts than the ones being scored"
            )
        self._batch_version = batch.version
        return [list(c.completion_ids) for c in batch.completions], [list(c.logprobs) for c in batch.completions]

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if not self.async_active:
            return output
        version, self._batch_version = self._batch_version, None
        if version is None or output.get("sampling_per_token_logps") is None:
            return output
        if self._coupled_objective():  # the loss's ratio is taken against the weights that drew the batch
            output["old_per_token_logps"] = output["sampling_per_token_logps"]
        rows = output["completion_ids"].shape[0]
        output["sample_version"] = torch.full(
            (rows,), version, dtype=torch.long, device=output["completion_ids"].device
        )
        return output

    def _after_sampler_correction(self, inputs: dict, proximal_logps: torch.Tensor) -> None:
        """A micro-batch trained: the staleness of its rows at this step and ``sample/is_ratio/staleness_<s>``, the
        mean behaviour ratio proximal/sampler of its tokens by that staleness."""
        versions = inputs.get("sample_version")
        if versions is None or not self.model.training:
            return
        step = self.state.global_step
        for version, rows in collections.Counter(versions.tolist()).items():
            self._lookahead.trained(version, step, rows)
        staleness = step - versions
        log_ratio = proximal_logps - inputs["sampling_per_token_logps"]
        for key, value in ratio_by_staleness(log_ratio, internals.loss_mask(inputs), staleness).items():
            internals.log_metric(self, "train", key, value)

    # ------------------------------------------------------------------ checkpoints
    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if not (self.async_active and self._worker is not None and self.args.should_save):
            return
        folder = checkpoint_dir(internals.checkpoint_root(self, trial), self.state.global_step)
        t0 = time.monotonic()
        batches = self._lookahead.saved()  # the batches drawn ahead, waited for (still trained when their step comes)
        self._lookahead.stats.trainer_wait_s += time.monotonic() - t0
        atomic_write_json(folder / ASYNC_ROLLOUTS_FILENAME, {"format": SAVED_FORMAT, "batches": batches})

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
            if saved.get("format") != SAVED_FORMAT:
                raise ValueError(f"unknown format {saved.get('format')!r}")
            self._lookahead = Lookahead(self._sampler, self.max_staleness, saved["batches"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise ValueError(
                f"{path}: unreadable asynchronous batches ({error}); remove the file to sample them again"
            ) from None

    # ------------------------------------------------------------------ per-step metrics (`_AsyncSamplingCallback`)
    def _log_async_step(self) -> None:
        sync, self._weight_sync_s = self._weight_sync_s + self._sampler.weight_sync_s, 0.0
        self._sampler.weight_sync_s = 0.0
        for key, value in self._lookahead.step_metrics(self._step_started, sync).items():
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
            self.trainer._weight_sync_s += time.monotonic() - t0

    def on_step_end(self, args, state, control, **kwargs):
        if self.trainer._worker is not None:
            self.trainer._log_async_step()

    def on_train_end(self, args, state, control, **kwargs):
        self.trainer._stop_sampler()
