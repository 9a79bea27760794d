"""GRPO on the PyTRIO client: rollouts, rewards and advantages here; forward/backward, optimizer and sampling remote.

One optimizer step (`GRPOLoop.train_step`), phase by phase:

1. sample (`GRPOLoop._sampling_client`, `GRPOLoop._sample`): ``save_weights_and_get_sampling_client()`` (the
   sampler holds the current weights, the "old" policy), then ``sample(prompt, num_samples=num_generations)`` per
   prompt (``mode: async`` submits all prompts at once);
2. score (`GRPOLoop._score`; `GRPOLoop._sample_and_score` joins 1 and 2, and runs more rounds with dynamic
   sampling): rewards (`trl_grpo_ext.task.rewards`, aggregated by `trl_grpo_ext.grpo.reward_aggregation` as the TRL path
   does), group advantages (`trl_grpo_ext.grpo.losses.group_advantages`);
3. build datums (`build_train_batch`): one `Datum` per completion (`trl_grpo_ext.pytrio.datums`);
4. step (`GRPOLoop._optimizer_step`): ``forward_backward(datums, loss_type)`` for the service's built-in
   ``importance_sampling`` / ``ppo``, or ``forward_backward_custom`` with `trl_grpo_ext.grpo.losses.policy_loss` for
   ``cispo`` and the other losses, then ``optim_step(AdamParams(...))``;
5. metrics (`reward_step_metrics`, `completion_metrics`, the loss's): one row of ``metrics.jsonl`` (and SwanLab).

Every ``save_every`` steps ``save_state`` checkpoints weights + optimizer remotely and
`trl_grpo_ext.runs.loop_state` records step and data position locally; ``resume: true`` continues from there.
A service that stops answering (or restarts and forgets the run) is retried for ``server_retry_budget_s``, saying
so (`connection.ServiceOutage`); once it answers, the loop reconnects and continues from the last saved state, as
``resume: true`` would.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import time
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path

from trl_grpo_ext.environments import ENVIRONMENTS, environment_tools, tool_metrics
from trl_grpo_ext.environments.chat import turn_parser, use_tool_chat_template
from trl_grpo_ext.environments.rollout import multi_turn_rollouts, stop_reason, tool_suffix_ids
from trl_grpo_ext.grpo.curriculum import CurriculumPromptStream, curriculum_from_tasks, passed_values
from trl_grpo_ext.grpo.distillation import DistillationSpec, distillation_of, tokenizer_mismatch
from trl_grpo_ext.grpo.dynamic_sampling import GroupFilter, GroupRef
from trl_grpo_ext.grpo.loss_table import print_loss_type_notice, wire_loss_config
from trl_grpo_ext.grpo.reward_aggregation import (
    RewardMetricLog,
    frac_reward_zero_std,
    reward_func_name,
    reward_kwargs,
    reward_metrics,
    reward_weight_tensor,
    score_completions,
    weighted_rewards,
)
from trl_grpo_ext.grpo.spec import curriculum_pass_reward
from trl_grpo_ext.models import check_local_model, is_embedded, resolve_model
from trl_grpo_ext.pytrio import connection
from trl_grpo_ext.pytrio.config import PyTrioGRPOConfig
from trl_grpo_ext.pytrio.connection import (
    LOCAL_SERVER_NAME,
    ServiceLost,
    ServiceOutage,
    install_log_redaction,
    redact,
    service_lost,
)
from trl_grpo_ext.pytrio.datums import Rollout, build_datum, shifted_sequences, validate_rollout
from trl_grpo_ext.pytrio.rows import load_train_rows
from trl_grpo_ext.runs import (
    CONFIG_FILENAME,
    METRICS_FILENAME,
    PYTRIO_SERVER_DIRNAME,
    PYTRIO_STATE_FILENAME,
    write_run_config,
)
from trl_grpo_ext.runs.loop_state import (
    LoopState,
    check_resumable,
    load_loop_state,
    pinned_settings,
    save_loop_state,
)
from trl_grpo_ext.runs.metrics import RunLogger
from trl_grpo_ext.runs.tracking import start_swanlab
from trl_grpo_ext.task.data.prompts import use_chat_prompts
from trl_grpo_ext.task.rewards import preflight_rewards, reward_functions

logger = logging.getLogger(__name__)


class PyTrioLoopError(RuntimeError):
    """A service call failed or answered something the loop cannot train on; the message names which."""


class ServiceLostError(PyTrioLoopError, ServiceLost):
    """A service call failed because the service stopped answering or forgot the run (`connection.service_lost`)."""


# pytrio's own retries of a service that does not answer, per call, before the loop's (which say so) take over
PYTRIO_RETRY_WINDOW_S = 5.0


def _failure(what: str, error: BaseException) -> PyTrioLoopError:
    kind = ServiceLostError if service_lost(error) else PyTrioLoopError
    return kind(f"{what} failed: {type(error).__name__}: {redact(error)}")


@dataclass
class StepTimes:
    """Wall-clock seconds of one step's phases (the bench prints these)."""

    save_weights: float = 0.0
    sampling: float = 0.0
    rewards: float = 0.0
    forward_backward: float = 0.0
    optim_step: float = 0.0

    def as_metrics(self) -> dict:
        return {f"time/{k}": v for k, v in vars(self).items()}


def _wait(future, what: str, timeout: float):
    """Result of a pytrio APIFuture, with every failure as a `PyTrioLoopError` free of credentials."""
    try:
        return future.result(timeout=timeout)
    except FutureTimeout:
        raise PyTrioLoopError(f"{what}: no answer from the service within {timeout:.0f} s") from None
    except PyTrioLoopError:
        raise
    except Exception as error:  # noqa: BLE001 - every service failure is reported the same way
        raise _failure(what, error) from None


def _call(fn, what: str, *args, **kwargs):
    """Submit a pytrio call; a failure to submit becomes a `PyTrioLoopError` free of credentials."""
    try:
        return fn(*args, **kwargs)
    except PyTrioLoopError:
        raise
    except Exception as error:  # noqa: BLE001
        raise _failure(what, error) from None


# ----------------------------------------------------------------------------------------------------------------
# Pieces without a service (unit-tested on their own)
# ----------------------------------------------------------------------------------------------------------------


def rollouts_from_response(response, prompt_tokens, num_generations: int, what: str = "sample") -> list[Rollout]:
    """Check one sampling reply and turn it into `Rollout`s; a malformed reply raises `PyTrioLoopError`.

    A completion with no tokens (the model stopped at once, if the server strips the stop token) is kept with
    empty tokens: it gets a reward and takes part in the group baseline but yields no datum.
    """
    sequences = getattr(response, "sequences", None)
    if sequences is None or not isinstance(sequences, (list, tuple)):
        raise PyTrioLoopError(f"{what}: reply has no sequences ({type(response).__name__})")
    if len(sequences) != num_generations:
        raise PyTrioLoopError(
            f"{what}: asked for {num_generations} completions, the service returned {len(sequences)}"
        )
    rollouts = []
    for index, seq in enumerate(sequences):
        tokens = list(getattr(seq, "tokens", None) or [])
        logprobs = list(getattr(seq, "logprobs", None) or [])
        if tokens:
            problem = validate_rollout(prompt_tokens, tokens, logprobs)
            if problem:
                raise PyTrioLoopError(f"{what}: completion {index} is malformed: {problem}")
        rollouts.append(
            Rollout(
                prompt_tokens=tuple(prompt_tokens),
                completion_tokens=tuple(int(t) for t in tokens),
                completion_logprobs=tuple(float(x) for x in logprobs),
                stop_reason=str(getattr(seq, "stop_reason", "") or ""),
            )
        )
    return rollouts


def advantages_for(config: PyTrioGRPOConfig, rewards, rewards_per_func) -> tuple[list[float], list[bool]]:
    """`trl_grpo_ext.grpo.losses.group_advantages` of the weighted totals (N,) with the config's options (and
    ``degenerate_reward``'s column of ``rewards_per_func`` (N, K)); returns (advantages, degenerate per group)."""
    import torch

    from trl_grpo_ext.grpo.losses import group_advantages  # torch: loaded by the first step, not by importing the loop

    rewards_per_func = torch.as_tensor(rewards_per_func, dtype=torch.float32)
    degenerate_rewards = None
    if config.degenerate_reward is not None:
        degenerate_rewards = rewards_per_func[:, config.reward_column(config.degenerate_reward)]
    advantages, degenerate = group_advantages(
        torch.as_tensor(rewards, dtype=torch.float32),
        config.num_generations,
        scale_rewards=config.scale_rewards,
        degenerate_tol=config.degenerate_tol,
        zero_degenerate=config.zero_degenerate_advantages,
        degenerate_rewards=degenerate_rewards,
    )
    return advantages.tolist(), degenerate.tolist()


@dataclass
class ScoredBatch:
    """One step's sampled and scored completions, prompt-major: ``num_generations`` consecutive rollouts per row."""

    rows: list[dict]
    rollouts: list[Rollout]
    rewards_per_func: object  # torch (N, K), None -> NaN
    rewards: object  # torch (N,), `trl_grpo_ext.grpo.reward_aggregation.weighted_rewards`
    advantages: list[float]
    degenerate: list[bool]  # per prompt group
    logged: dict = field(default_factory=dict)  # what the reward functions sent to ``log_metric``
    # on-policy distillation: one advantage per completion token of each rollout (`GRPOLoop._distill`), else None
    token_advantages: list[list[float]] | None = None


def reward_step_metrics(config: PyTrioGRPOConfig, scored: ScoredBatch, reward_names) -> dict:
    """The TRL path's reward metrics of a step (`trl_grpo_ext.grpo.reward_aggregation`), plus ``frac_degenerate``."""
    metrics = reward_metrics(scored.rewards_per_func, scored.rewards, reward_names)
    metrics["frac_reward_zero_std"] = frac_reward_zero_std(
        scored.rewards, config.num_generations, config.scale_rewards
    )
    metrics["frac_degenerate"] = sum(bool(d) for d in scored.degenerate) / max(len(scored.degenerate), 1)
    metrics.update(scored.logged)
    return metrics


@dataclass
class TokenRows:
    """Per-datum, per-position inputs of the local loss: sampler logprobs, advantages, completion mask."""

    old_logprobs: list[list[float]] = field(default_factory=list)
    advantages: list[list[float]] = field(default_factory=list)
    masks: list[list[float]] = field(default_factory=list)

    def add(self, seq: dict) -> None:
        self.old_logprobs.append(seq["logprobs"])
        self.advantages.append(seq["advantages"])
        self.masks.append(seq["mask"])

    @property
    def completion_tokens(self) -> int:
        return int(sum(sum(m) for m in self.masks))


def make_custom_loss(config: PyTrioGRPOConfig, rows: TokenRows, record: dict):
    """The local loss for ``forward_backward_custom``: `trl_grpo_ext.grpo.losses.policy_loss`, aggregated over the
    completion tokens of the whole batch as ``loss_aggregation`` says. Metrics also land in ``record``."""
    import torch

    from trl_grpo_ext.grpo.losses import policy_loss, sampler_correction, token_level_mean  # torch: first step

    clip_low, clip_high = config.clip_bounds

    def loss_fn(data, logprobs_list):
        if len(logprobs_list) != len(rows.masks):
            raise PyTrioLoopError(f"custom loss got {len(logprobs_list)} logprob rows for {len(rows.masks)} datums")
        width = max(int(lp.numel()) for lp in logprobs_list)
        padded = {"new": [], "old": [], "adv": [], "mask": []}
        for lp, old, adv, mask in zip(logprobs_list, rows.old_logprobs, rows.advantages, rows.masks, strict=True):
            lp = lp.reshape(-1)
            if lp.numel() != len(mask):
                raise PyTrioLoopError(f"service returned {lp.numel()} logprobs for a datum of {len(mask)} positions")
            pad = (0, width - lp.numel())
            padded["new"].append(torch.nn.functional.pad(lp, pad))
            for key, values in (("old", old), ("adv", adv), ("mask", mask)):
                padded[key].append(torch.nn.functional.pad(torch.tensor(values, dtype=torch.float32), pad))
        new, old, adv, mask = (torch.stack(padded[k]) for k in ("new", "old", "adv", "mask"))
        # Prompt positions hold logprob 0 in the datum; make their ratio exactly 1 (they are masked anyway).
        old = torch.where(mask > 0, old, new.detach())
        per_token, loss_metrics = policy_loss(config.loss_type, new, old, adv, mask, clip_low, clip_high)
        if config.loss_aggregation == "sum":
            loss = (per_token * mask).sum()
        else:
            loss = token_level_mean(per_token, mask)
        metrics = {k: float(v) for k, v in loss_metrics.items()}
        metrics["loss"] = float(loss.detach())
        # The sampler/trainer mismatch, as the TRL path logs it with a bf16 sampler. No weight is added: on this
        # path the loss's ratio is already taken against the sampler's log-probs (the service's semantics).
        _, mismatch = sampler_correction(new.detach(), old, mask)
        metrics.update({k: float(v) for k, v in mismatch.items()})
        record.update(metrics)
        return loss, metrics

    return loss_fn


def builtin_loss_config(config: PyTrioGRPOConfig) -> dict | None:
    """``loss_fn_config`` for the service's built-in losses (Tinker's key names for the ratio bounds)."""
    return wire_loss_config(config.loss_type, *config.clip_bounds)


def local_loss_metrics(config: PyTrioGRPOConfig, rows: TokenRows, new_logprobs) -> dict:
    """Loss and ratio metrics recomputed with `trl_grpo_ext.grpo.losses` from the logprobs the trainer returned, so a
    built-in loss reports the same numbers a custom one does."""
    import torch

    record: dict = {}
    fn = make_custom_loss(config, rows, record)
    with torch.no_grad():
        fn(None, [torch.tensor(lp, dtype=torch.float32) for lp in new_logprobs])
    return record


@dataclass
class TrainBatch:
    """What one step trains on: a datum per non-empty completion, the local loss's token rows."""

    datums: list
    token_rows: TokenRows
    train_tokens: int  # completion tokens with non-zero advantage (the TRL path's `train_tokens`)


def build_train_batch(config: PyTrioGRPOConfig, scored: ScoredBatch, step: int) -> TrainBatch:
    """One `pytrio.Datum` per completion with tokens (`trl_grpo_ext.pytrio.datums`); empty completions count for
    the rewards and the group baseline only."""
    advantages = scored.advantages if scored.token_advantages is None else scored.token_advantages
    trained = [(r, a) for r, a in zip(scored.rollouts, advantages, strict=True) if r.completion_tokens]
    if not trained:
        raise PyTrioLoopError(f"step {step + 1}: every completion was empty; nothing to train on")
    token_rows = TokenRows()
    for rollout, adv in trained:
        token_rows.add(
            shifted_sequences(
                rollout.prompt_tokens, rollout.completion_tokens, rollout.completion_logprobs, adv, rollout.tool_mask
            )
        )
    # The service sums a built-in loss over tokens; dividing the advantages by the batch's completion tokens
    # turns that sum into TRL's token-level mean ("dapo" normalisation) for both linear-in-A losses.
    scale = 1.0
    if config.uses_builtin_loss and config.loss_aggregation == "token_mean":
        scale = 1.0 / max(token_rows.completion_tokens, 1)
    per_token = scored.token_advantages is not None
    datums = [
        build_datum(
            r.prompt_tokens,
            r.completion_tokens,
            r.completion_logprobs,
            [x * scale for x in a] if per_token else a * scale,
            r.tool_mask,
        )
        for r, a in trained
    ]
    if per_token:  # tokens with a non-zero advantage of their own, tool tokens left out
        train_tokens = sum(
            sum(x != 0.0 and (r.tool_mask is None or r.tool_mask[i]) for i, x in enumerate(a)) for r, a in trained
        )
    else:
        train_tokens = sum(
            _model_tokens(r) for r, a in zip(scored.rollouts, scored.advantages, strict=True) if a != 0.0
        )
    return TrainBatch(datums, token_rows, train_tokens)


def teacher_completion_logprobs(prompt_tokens, completion_tokens, logprobs, what: str) -> list[float]:
    """The completion tokens' log-probs out of a ``compute_logprobs`` answer on prompt + completion (one per
    position, the first None), checked: as many as tokens, finite numbers."""
    values = list(logprobs or [])
    total = len(prompt_tokens) + len(completion_tokens)
    if len(values) != total:
        raise PyTrioLoopError(f"{what}: {len(values)} log-probs for {total} tokens")
    tail = values[len(prompt_tokens) :]
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) for v in tail):
        raise PyTrioLoopError(f"{what}: the teacher's log-probs of the completion tokens must be finite numbers")
    return [float(v) for v in tail]


def builtin_loss_metrics(config: PyTrioGRPOConfig, batch: TrainBatch, fb_out) -> dict:
    """Loss metrics of a built-in loss: recomputed locally from the logprobs ``forward_backward`` returned (so
    they match a custom loss's), else the service's ``loss_mean``, else none."""
    record: dict = {}
    outputs = getattr(fb_out, "loss_fn_outputs", None) or []
    if len(outputs) == len(batch.datums) and all("logprobs" in o for o in outputs):
        new_logprobs = [list(o["logprobs"].data) for o in outputs]
        if all(len(lp) == len(m) for lp, m in zip(new_logprobs, batch.token_rows.masks, strict=True)):
            record = local_loss_metrics(config, batch.token_rows, new_logprobs)
    if "loss" not in record:
        server_loss = (getattr(fb_out, "metrics", None) or {}).get("loss_mean")
        if server_loss is not None:
            record["loss"] = float(server_loss)
    return record


def _model_tokens(rollout: Rollout) -> int:
    """The completion tokens the model sampled (a multi-turn completion's tool tokens left out, TRL's count)."""
    return len(rollout.completion_tokens) if rollout.tool_mask is None else sum(rollout.tool_mask)


def completion_metrics(rollouts: list[Rollout]) -> dict:
    """TRL's ``completions/*`` length metrics; ``clipped_ratio``: the share stopped by ``max_tokens``."""
    lengths = [_model_tokens(r) for r in rollouts]
    return {
        "completions/mean_length": sum(lengths) / len(lengths),
        "completions/min_length": min(lengths),
        "completions/max_length": max(lengths),
        "completions/clipped_ratio": sum(r.stop_reason == "length" for r in rollouts) / len(rollouts),
    }


def kept_groups(batches: list[ScoredBatch], selection: list[GroupRef], num_generations: int) -> ScoredBatch:
    """The groups dynamic sampling keeps (`trl_grpo_ext.grpo.dynamic_sampling.GroupFilter.selection`) as one batch.
    Padding groups are left out (fewer datums: what the TRL path's masked-out padding amounts to), unless nothing
    else is left; then they stay with zero advantages, so the step runs and its gradient is zero."""
    import torch

    refs = [ref for ref in selection if not ref.padding] or selection
    g = num_generations
    spans = [(batches[ref.batch], slice(ref.group * g, (ref.group + 1) * g)) for ref in refs]
    return ScoredBatch(
        rows=[batches[ref.batch].rows[ref.group] for ref in refs],
        rollouts=[r for b, span in spans for r in b.rollouts[span]],
        rewards_per_func=torch.cat([b.rewards_per_func[span] for b, span in spans]),
        rewards=torch.cat([b.rewards[span] for b, span in spans]),
        advantages=[
            0.0 if ref.padding else a for ref, (b, s) in zip(refs, spans, strict=True) for a in b.advantages[s]
        ],
        degenerate=[batches[ref.batch].degenerate[ref.group] for ref in refs],
    )


# ----------------------------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------------------------


class PromptStream:
    """Rows in a seeded order, reshuffled each epoch; ``position`` counts the prompts handed out so far."""

    def __init__(self, rows: list[dict], seed: int, position: int = 0):
        if not rows:
            raise ValueError("the training dataset is empty")
        self.rows = rows
        self.seed = seed
        self.position = position
        self._epoch = None
        self._order: list[int] = []

    def _order_for(self, epoch: int) -> list[int]:
        if epoch != self._epoch:
            order = list(range(len(self.rows)))
            random.Random(f"{self.seed}-{epoch}").shuffle(order)
            self._epoch, self._order = epoch, order
        return self._order

    def take(self, n: int) -> list[dict]:
        out = []
        for _ in range(n):
            epoch, index = divmod(self.position, len(self.rows))
            out.append(self.rows[self._order_for(epoch)[index]])
            self.position += 1
        return out


class GRPOLoop:
    """Runs `PyTrioGRPOConfig` against a `pytrio.ServiceClient` (created from pytrio's configuration if not given).

    ``rows``: training rows, each with a ``prompt`` (chat messages or text) plus the columns the reward
    functions read (``answer``); None loads them from the config's dataset.
    """

    def __init__(
        self,
        config: PyTrioGRPOConfig,
        service_client=None,
        rows: list[dict] | None = None,
        tokenizer=None,
    ):
        self.config = config
        self._service = service_client
        self._rows = rows
        self._rows_chat: bool | None = None  # how `_load_rows` built the prompts (None: rows given, kept as they are)
        self._tokenizer = tokenizer
        self._prompt_cache: dict[int, list[int]] = {}
        self.curriculum = None  # `trl_grpo_ext.grpo.curriculum.Curriculum` with ``curriculum: true`` (`prepare`)
        self._checked: tuple[LoopState | None] | None = None  # (resume state,) once `check_inputs` has passed
        # else `_service_client` makes one, and a new one after an outage
        self._given_service = service_client is not None
        self.distillation: DistillationSpec | None = distillation_of(config)
        self._teacher = None  # the teacher's sampling client (`_teacher_client`), with a distillation block

    # --- setup -------------------------------------------------------------------------------------------------

    def _service_client(self):
        if self._service is None:
            window = min(PYTRIO_RETRY_WINDOW_S, self.config.server_retry_budget_s)
            self._service = connection.create_service_client(retry_window_s=window)
        return self._service

    def _drop_service(self) -> bool:
        """Release the service client this loop created (its service was lost); False if the loop was given one."""
        if self._given_service:
            return False
        if self._service is not None:
            connection.close_service_client(self._service)
        self._service = None
        self._teacher = None  # it belonged to the lost service
        return True

    def _load_rows(self, chat: bool | None = None) -> list[dict]:
        """The training rows, loaded once: `check_inputs` checks them before the tokenizer is known (chat prompts
        unless ``prompt_format: text``); `prepare` passes the format the tokenizer decides (`use_chat_prompts`), and
        rows built the other way (``auto`` with a tokenizer without a chat template) are built again as text."""
        if self._rows is not None and (chat is None or self._rows_chat in (None, chat)):
            return self._rows
        chat = self.config.prompt_format != "text" if chat is None else chat
        self._rows, self._rows_chat = load_train_rows(self.config, chat=chat), chat
        return self._rows

    def _load_tokenizer(self, training_client):
        """``tokenizer_name_or_path`` if set, else the client's own (`TrainingClient.get_tokenizer`, the base
        model's tokenizer), else transformers on the locally resolved base model."""
        if self._tokenizer is not None:
            return self._tokenizer
        from transformers import AutoTokenizer

        if self.config.tokenizer_name_or_path:
            return AutoTokenizer.from_pretrained(self.config.tokenizer_name_or_path)
        try:
            return training_client.get_tokenizer()
        except Exception as error:  # noqa: BLE001 - fall back to a local copy of the model
            base = self.config.base_model
            if is_embedded(base) or Path(base).is_dir():
                return AutoTokenizer.from_pretrained(resolve_model(base))
            raise PyTrioLoopError(
                f"no tokenizer for {base!r} ({type(error).__name__}: {redact(error)}); set tokenizer_name_or_path"
            ) from None

    def prepare(self, training_client, data_position: int = 0, curriculum_state: dict | None = None) -> PromptStream:
        """Tokenizer, reward functions and the prompt stream for ``training_client`` (`run` calls it; so do benches
        that drive `train_step` themselves). ``curriculum_state``: a resumed run's saved pass rates."""
        self.tokenizer = self._load_tokenizer(training_client)
        if self.config.environments:  # tools: a template that renders them, each environment's tools for prompts
            use_tool_chat_template(self.tokenizer)
            self._env_tools = {
                name: [getattr(ENVIRONMENTS[name](), f.__name__) for f in environment_tools(ENVIRONMENTS[name])]
                for name in self.config.environments
            }
            self._parsers = {name: turn_parser(self.tokenizer, t) for name, t in self._env_tools.items()}
        self.reward_funcs, self.reward_names, self.reward_weights = self._reward_setup()
        if self.distillation is not None:  # a service without the teacher fails here, before the first step
            self._check_teacher_tokenizer(self._teacher_client())
        rows = self._load_rows(chat=use_chat_prompts(self.config.prompt_format, self.tokenizer))
        if self.config.curriculum:
            c = self.config
            self.curriculum = curriculum_from_tasks(
                [row.get("task") for row in rows], ema=c.curriculum_ema, floor=c.curriculum_floor
            )
            if curriculum_state is not None:
                self.curriculum.load_state_dict(curriculum_state)
            return CurriculumPromptStream(rows, self.curriculum, c.seed, data_position)
        return PromptStream(rows, self.config.seed, data_position)

    def _reward_setup(self):
        """Reward functions with the TRL recipe's context (`trl_grpo_ext.task.rewards.reward_functions`: the length limit
        and EOS let rewards that veto truncated completions recognise them), TRL's names and weights."""
        funcs = reward_functions(self.config.reward_funcs, self.config, self.tokenizer, settings=self.config)
        return (
            funcs,
            [reward_func_name(f) for f in funcs],
            reward_weight_tensor(self.config.reward_weights, len(funcs)),
        )

    def _prompt_tokens(self, row: dict) -> list[int]:
        key = id(row)
        if key not in self._prompt_cache:
            prompt = row["prompt"]
            tok = self.tokenizer
            if isinstance(prompt, list):
                tools = self._env_tools[self._environment_name(row)] if self.config.environments else None
                text = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True, tools=tools or None)
            else:
                text = str(prompt)
            ids = tok(text, add_special_tokens=False)["input_ids"]
            if not ids:
                raise PyTrioLoopError("a prompt tokenized to nothing")
            self._prompt_cache[key] = list(ids)
        return self._prompt_cache[key]

    def _environment_name(self, row: dict) -> str:
        names = self.config.environments
        return row.get("environment") if len(names) > 1 else names[0]

    def _continue_with_tools(self, sampler, rows: list[dict], rollouts: list[Rollout], step: int, first_index: int):
        """Multi-turn: each first turn continued through its tool calls (`environments.rollout`, TRL's rules),
        one environment instance per rollout, reset with its row; continuations sampled one per prompt."""
        import pytrio as trio

        c = self.config
        per_rollout = [row for row in rows for _ in range(c.num_generations)]
        names = [self._environment_name(row) for row in per_rollout]
        environments = []
        for row, name in zip(per_rollout, names, strict=True):
            environment = ENVIRONMENTS[name]()
            environment.reset(**{k: v for k, v in row.items() if k != "environment"})
            environments.append(environment)
        tools = [{f.__name__: getattr(e, f.__name__) for f in environment_tools(type(e))} for e in environments]
        rounds = iter(range(1, 1_000_000))

        def sample(prompts):
            base = 10_000 * next(rounds) + first_index * c.num_generations  # seeds of (step, round, rollout)
            futures = [
                _call(sampler.sample, "sample", trio.ModelInput.from_ints(tokens), num_samples=1,
                      sampling_params=self._sampling_params(step, base + i), return_text=False)
                for i, tokens in enumerate(prompts)
            ]  # fmt: skip
            replies = [_wait(f, "sample (tool turn)", c.request_timeout_s) for f in futures]
            turns = [rollouts_from_response(r, p, 1, "sample (tool turn)")[0] for r, p in zip(replies, prompts,
                     strict=True)]  # fmt: skip
            return [list(t.completion_tokens) for t in turns], [list(t.completion_logprobs) for t in turns]

        results = multi_turn_rollouts(
            [list(r.prompt_tokens) for r in rollouts],
            ([list(r.completion_tokens) for r in rollouts], [list(r.completion_logprobs) for r in rollouts]),
            sample,
            lambda ids, prefix, i: self._parsers[names[i]](ids, prefix),
            lambda messages: tool_suffix_ids(self.tokenizer, messages),
            tools,
            c.max_tool_calling_iterations,
            c.max_completion_length,
            getattr(self.tokenizer, "model_max_length", None) or 1_000_000,
        )
        stops = [t for t in (self.tokenizer.eos_token_id, self.tokenizer.pad_token_id) if t is not None]
        return [
            Rollout(
                prompt_tokens=first.prompt_tokens,
                completion_tokens=tuple(result.completion_ids),
                completion_logprobs=tuple(result.logprobs),
                # a continued rollout ends with its last turn, which the sampler's stop reason does not describe
                stop_reason=first.stop_reason
                if len(result.messages) == 1
                else stop_reason(result.completion_ids, stops),
                tool_mask=tuple(result.tool_mask),
                messages=tuple(result.messages),
            )
            for first, result in zip(rollouts, results, strict=True)
        ]

    # --- one step: sample -> score -> build datums -> step -> metrics --------------------------------------------

    def _sampling_params(self, step: int, index: int):
        import pytrio as trio

        c = self.config
        return trio.SamplingParams(
            max_tokens=c.max_completion_length,
            temperature=c.temperature,
            top_p=c.top_p,
            top_k=c.top_k if c.top_k > 0 else -1,
            # A function of (seed, step, prompt): a resumed run samples what an uninterrupted one would.
            seed=(c.seed * 1_000_003 + step * 1_009 + index) % (2**31 - 1),
        )

    def _teacher_client(self):
        """The teacher's sampling client: ``create_sampling_client(base_model=teacher, model_path=...)``."""
        if self._teacher is None:
            spec = self.distillation
            self._teacher = _call(
                self._service_client().create_sampling_client,
                f"create_sampling_client (teacher {spec.teacher!r})",
                base_model=spec.teacher,
                model_path=spec.teacher_model_path,
            )
        return self._teacher

    def _check_teacher_tokenizer(self, teacher) -> None:
        """The teacher's tokenizer (its sampling client's ``get_tokenizer``) against the student's: one line naming
        both when they differ. A teacher whose tokenizer cannot be loaded here is trusted, with a warning."""
        try:
            teacher_tokenizer = teacher.get_tokenizer()
        except Exception as error:  # noqa: BLE001 - e.g. a hosted model's tokenizer while offline
            logger.warning("distillation: the teacher's tokenizer could not be loaded to compare with the student's "
                           "(%s: %s); they must be the same", type(error).__name__, redact(error))  # fmt: skip
            return
        mismatch = tokenizer_mismatch(
            teacher_tokenizer, self.tokenizer, self.distillation.teacher, self.config.base_model
        )
        if mismatch:
            raise PyTrioLoopError(mismatch)

    def _distill(self, scored: ScoredBatch) -> dict:
        """The teacher's log-probs of every sampled completion (``compute_logprobs`` on prompt + completion), made
        per-token advantages by `trl_grpo_ext.grpo.distillation` (the student's log-probs: the sampler's); sets
        ``scored.token_advantages`` and returns the ``distill/*`` metrics."""
        import pytrio as trio

        from trl_grpo_ext.grpo.distillation import distillation_row_advantages  # torch: first step

        t0 = time.perf_counter()
        teacher = self._teacher_client()
        rollouts = [r for r in scored.rollouts if r.completion_tokens]
        what = [f"compute_logprobs (teacher, completion {i})" for i in range(len(rollouts))]

        def submit(i, r):
            tokens = list(r.prompt_tokens) + list(r.completion_tokens)
            return _call(teacher.compute_logprobs, what[i], trio.ModelInput.from_ints(tokens))

        timeout = self.config.request_timeout_s
        if self.config.mode == "async":
            futures = [submit(i, r) for i, r in enumerate(rollouts)]
            answers = [_wait(f, what[i], timeout) for i, f in enumerate(futures)]
        else:
            answers = [_wait(submit(i, r), what[i], timeout) for i, r in enumerate(rollouts)]
        teacher_rows = iter(
            teacher_completion_logprobs(r.prompt_tokens, r.completion_tokens, a, what[i])
            for i, (r, a) in enumerate(zip(rollouts, answers, strict=True))
        )
        student, teacher_logps = [], []
        for r in scored.rollouts:  # empty completions: no tokens, no teacher call
            student.append(list(r.completion_logprobs))
            teacher_logps.append(next(teacher_rows) if r.completion_tokens else [])
        scored.token_advantages, metrics = distillation_row_advantages(
            student, teacher_logps, self.distillation, scored.advantages
        )
        metrics["time/teacher_logprobs"] = time.perf_counter() - t0
        return metrics

    def _sampling_client(self, training_client, times: StepTimes):
        """A sampler holding the current weights: the "old" policy of this step."""
        t0 = time.perf_counter()
        sampler = _call(training_client.save_weights_and_get_sampling_client, "save_weights_and_get_sampling_client")
        times.save_weights += time.perf_counter() - t0
        return sampler

    def _sample(self, sampler, rows: list[dict], step: int, times: StepTimes, first_index: int = 0):
        """``num_generations`` rollouts per row, prompt-major; ``first_index`` numbers the rows within the step
        (their sampling seeds), so a step that samples more rows later gives them new seeds."""
        import pytrio as trio

        c = self.config
        t = c.request_timeout_s
        prompt_tokens = [self._prompt_tokens(row) for row in rows]
        t0 = time.perf_counter()

        def submit(i, tokens):
            return _call(
                sampler.sample,
                "sample",
                trio.ModelInput.from_ints(tokens),
                num_samples=c.num_generations,
                sampling_params=self._sampling_params(step, i),
                return_text=False,
            )

        indexed = list(enumerate(prompt_tokens, start=first_index))
        if c.mode == "async":
            futures = [submit(i, tokens) for i, tokens in indexed]
            replies = [_wait(f, f"sample (prompt {i})", t) for (i, _), f in zip(indexed, futures, strict=True)]
        else:
            replies = [_wait(submit(i, tokens), f"sample (prompt {i})", t) for i, tokens in indexed]
        rollouts = [
            r
            for (i, tokens), reply in zip(indexed, replies, strict=True)
            for r in rollouts_from_response(reply, tokens, c.num_generations, f"sample (prompt {i})")
        ]
        if c.environments:
            rollouts = self._continue_with_tools(sampler, rows, rollouts, step, first_index)
        times.sampling += time.perf_counter() - t0
        return rollouts

    def _score(self, rows: list[dict], rollouts: list[Rollout], times: StepTimes) -> ScoredBatch:
        """Rewards as TRL computes them (`trl_grpo_ext.grpo.reward_aggregation`), then group advantages."""
        t0 = time.perf_counter()
        g = self.config.num_generations
        completion_ids = [list(r.completion_tokens) for r in rollouts]
        texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        conversational = isinstance(rows[0]["prompt"], list)
        completions = [[{"role": "assistant", "content": t}] if conversational else t for t in texts]
        if rollouts and rollouts[0].messages is not None:  # multi-turn: the turns and tool results, as TRL has them
            completions = [list(r.messages) for r in rollouts]
        inputs = [row for row in rows for _ in range(g)]  # TRL's per-completion inputs
        log = RewardMetricLog()
        rewards_per_func = score_completions(
            self.reward_funcs,
            self.reward_names,
            [row["prompt"] for row in inputs],
            completions,
            completion_ids,
            {**reward_kwargs(inputs), "log_metric": log},
        )
        rewards = weighted_rewards(rewards_per_func, self.reward_weights)
        advantages, degenerate = advantages_for(self.config, rewards, rewards_per_func)
        times.rewards += time.perf_counter() - t0
        return ScoredBatch(rows, rollouts, rewards_per_func, rewards, advantages, degenerate, log.metrics())

    def _sample_and_score(self, training_client, stream: PromptStream, step: int, times: StepTimes):
        """The step's rollouts, scored: ``prompts_per_step`` rows from the stream, ``num_generations`` each; with
        ``dynamic_sampling``, more rounds until `GroupFilter` has the step's informative groups (or its budget is
        spent). Returns ``(batch to train on, sampling metrics)``: the metrics average each round's, as TRL's
        logging averages each generation batch's."""
        c = self.config
        sampler = self._sampling_client(training_client, times)
        groups = GroupFilter(c.prompts_per_step, c.max_generation_batches) if c.dynamic_sampling else None
        batches, metrics = [], []
        while True:
            rows = stream.take(c.prompts_per_step)
            first = len(batches) * c.prompts_per_step  # each round's prompts get their own sampling seeds
            batches.append(self._score(rows, self._sample(sampler, rows, step, times, first), times))
            metrics.append(self._batch_metrics(batches[-1]))
            if groups is None:
                return batches[0], metrics[0]
            groups.add(batches[-1].degenerate)
            if groups.done:
                break
        averaged = {key: sum(m[key] for m in metrics) / len(metrics) for key in metrics[0]}
        averaged.update(groups.metrics())  # frac_degenerate after the filter
        return kept_groups(batches, groups.selection(), c.num_generations), averaged

    def _batch_metrics(self, scored: ScoredBatch) -> dict:
        """Reward and completion metrics of one sampled batch; with the curriculum, its update and weights."""
        metrics = reward_step_metrics(self.config, scored, self.reward_names)
        metrics.update(completion_metrics(scored.rollouts))
        if self.config.environments:
            rollouts = scored.rollouts
            masks = [list(r.tool_mask or [1] * len(r.completion_tokens)) for r in rollouts]
            messages = [list(r.messages or []) for r in rollouts]
            metrics.update(tool_metrics(messages, masks, self.config.max_tool_calling_iterations))
        if self.curriculum is not None:
            c = self.config
            name = curriculum_pass_reward(c)
            rewards = scored.rewards if name is None else scored.rewards_per_func[:, c.reward_column(name)]
            tasks = [row.get("task") for row in scored.rows for _ in range(c.num_generations)]
            self.curriculum.update(tasks, passed_values(rewards.tolist(), c.curriculum_pass_threshold))
            metrics.update(self.curriculum.metrics())
        return metrics

    def _optimizer_step(self, training_client, batch: TrainBatch, learning_rate: float, times: StepTimes):
        """``forward_backward`` (built-in loss) or ``forward_backward_custom``, then ``optim_step``; returns
        ``(loss metrics, optim_step metrics)``."""
        import pytrio as trio

        c = self.config
        adam = trio.AdamParams(
            learning_rate=learning_rate,
            beta1=c.adam_beta1,
            beta2=c.adam_beta2,
            eps=c.adam_epsilon,
            weight_decay=c.weight_decay,
            grad_clip_norm=c.max_grad_norm,
        )
        loss_record: dict = {}
        t0 = time.perf_counter()
        if c.uses_builtin_loss:
            fb_future = _call(
                training_client.forward_backward,
                "forward_backward",
                batch.datums,
                c.loss_type,
                loss_fn_config=builtin_loss_config(c),
            )
        else:
            fb_future = _call(
                training_client.forward_backward_custom,
                "forward_backward_custom",
                batch.datums,
                make_custom_loss(c, batch.token_rows, loss_record),
            )
        # async: optim_step is queued right behind forward_backward, so the trainer applies it as soon as the
        # gradients are in; sync: submitted once forward_backward has answered
        optim_future = _call(training_client.optim_step, "optim_step", adam) if c.mode == "async" else None
        fb_out = _wait(fb_future, "forward_backward", c.request_timeout_s)
        times.forward_backward = time.perf_counter() - t0
        t1 = time.perf_counter()
        if optim_future is None:
            optim_future = _call(training_client.optim_step, "optim_step", adam)
        optim_out = _wait(optim_future, "optim_step", c.request_timeout_s)
        times.optim_step = time.perf_counter() - t1
        if c.uses_builtin_loss:
            loss_record = builtin_loss_metrics(c, batch, fb_out)
        return loss_record, getattr(optim_out, "metrics", None) or {}

    def train_step(self, training_client, stream: PromptStream, step: int) -> dict:
        """One GRPO step (0-based ``step``): sample -> score -> build datums -> step -> metrics; returns its metrics."""
        times = StepTimes()
        t_step = time.perf_counter()
        scored, sampling_metrics = self._sample_and_score(training_client, stream, step, times)
        if self.distillation is not None:
            sampling_metrics = {**sampling_metrics, **self._distill(scored)}
        batch = build_train_batch(self.config, scored, step)
        learning_rate = self.config.learning_rate_at(step)
        loss_record, optim_metrics = self._optimizer_step(training_client, batch, learning_rate, times)

        metrics = dict(sampling_metrics)
        metrics.update(loss_record)
        metrics["train_tokens"] = batch.train_tokens
        metrics["learning_rate"] = learning_rate
        metrics["num_datums"] = len(batch.datums)
        if "grad_norm" in optim_metrics:
            metrics["grad_norm"] = float(optim_metrics["grad_norm"])
        metrics["step_time"] = time.perf_counter() - t_step
        metrics.update(times.as_metrics())
        return metrics

    # --- checkpoints ---------------------------------------------------------------------------------------------

    def _checkpoint(self, training_client, state: LoopState, stream: PromptStream, step_done: int) -> None:
        name = f"step-{step_done:06d}"
        result = _wait(
            _call(training_client.save_state, "save_state", name, overwrite=True),
            "save_state",
            self.config.request_timeout_s,
        )
        path = getattr(result, "path", None)
        if not isinstance(path, str) or not path:
            raise PyTrioLoopError(f"save_state returned no checkpoint path ({result!r})")
        # Saved remotely, not yet recorded here: a kill now resumes from the previous recorded checkpoint.
        state.step = step_done
        state.data_position = stream.position
        state.curriculum = self.curriculum.state_dict() if self.curriculum is not None else None
        state.state_path = path
        state.checkpoints.append({"step": step_done, "path": path, "time": time.time()})
        with _output_errors(Path(self.config.output_dir), PYTRIO_STATE_FILENAME):
            save_loop_state(self.config.output_dir, state)

    # --- entry point ---------------------------------------------------------------------------------------------

    def check_inputs(self) -> LoopState | None:
        """Check everything bad input can break before a model loads or a file is written: the data (loaded and
        kept), the reward names, the local server's model path, and a resume's recorded state against this config.
        Raises ValueError / FileNotFoundError with one line; returns the state to resume from (None: fresh run)."""
        if self._checked is not None:
            return self._checked[0]
        c = self.config
        print_loss_type_notice(c)  # our cispo is not TRL's: say which one runs, first
        # unknown names, bad reward options, a reward model that is no classifier, a judge that does not answer
        preflight_rewards(reward_functions(c.reward_funcs, c, settings=c))
        self._load_rows()
        if c.pytrio_base_url == LOCAL_SERVER_NAME:
            for model in (c.base_model, *local_sampling_models(c)):
                if not is_embedded(model):
                    check_local_model(model)  # a local-looking path that is not a model folder
        previous = load_loop_state(c.output_dir) if c.resume else None
        if c.resume and previous is None:
            logger.warning("resume: no loop state in %s; starting from step 0", c.output_dir)
        if previous is not None:
            check_resumable(previous, c)
        self._checked = (previous,)
        return previous

    def run(self) -> dict:
        """Train to ``max_steps`` (or resume to it); returns a summary with the final sampler weights' path.

        A service that stops answering or forgets the run is retried for ``server_retry_budget_s``
        (`connection.ServiceOutage` says so); once it answers, a new client continues from the last saved loop
        state, as ``resume: true`` would: the rows logged after that checkpoint are dropped and their steps run
        again, so every step is logged once."""
        install_log_redaction()
        c = self.config
        out = Path(c.output_dir)
        # Before the first write to the run folder (config.yaml, then the metrics truncation below): a failing
        # rerun leaves the previous run's files as they were.
        state = self.check_inputs()
        self._checked = None  # a later run() reads the loop state again
        outage = ServiceOutage(connection.current_base_url(), c.server_retry_budget_s)
        sink = None
        try:
            while True:
                try:
                    training_client, state = self._start(state)
                    stream = self.prepare(training_client, state.data_position, state.curriculum)
                    if sink is None:
                        sink = self._open_run_folder(out)
                    # A resumed run drops the rows logged after its checkpoint (those steps run again); a fresh one
                    # starts empty.
                    with _output_errors(out, METRICS_FILENAME):
                        sink.start(state.step)
                    return self._train(training_client, stream, state, sink, outage)
                except ServiceLost as error:
                    if not self._drop_service():  # a client we were given: we cannot make another
                        raise
                    if not outage.wait(error):
                        raise _gave_up(outage, error, out) from None
                    state = load_loop_state(out)  # the last saved state (None: nothing saved, start over)
                    if state is not None:
                        check_resumable(state, c)
        finally:
            if sink is not None:
                sink.close()

    def _start(self, state: LoopState | None):
        """``(training client, state)``: restored from `state`'s checkpoint, or a new LoRA run (`state` None)."""
        c = self.config
        service = self._service_client()
        if state is not None:
            training_client = _call(
                service.create_training_client_from_state_with_optimizer,
                "restore from checkpoint",
                state.state_path,
            )
            logger.info("resumed at step %d from %s", state.step, state.state_path)
            return training_client, state
        training_client = _call(
            service.create_lora_training_client,
            "create_lora_training_client",
            c.base_model,
            rank=c.lora_r,
            seed=c.seed,
        )
        return training_client, LoopState(pinned=pinned_settings(c))

    def _open_run_folder(self, out: Path) -> RunLogger:
        """config.yaml written, SwanLab started: the run's logger."""
        c = self.config
        with _output_errors(out, CONFIG_FILENAME):
            out.mkdir(parents=True, exist_ok=True)
            _write_config(c, out)
        swanlab = None
        if c.report_to == "swanlab":
            swanlab = start_swanlab(
                out, c.swanlab_project, c.run_name, c.swanlab_mode, c.to_dict(), required=False, redact=redact
            )
        return RunLogger(out, swanlab, redact)

    def _train(self, training_client, stream: PromptStream, state: LoopState, sink: RunLogger, outage) -> dict:
        """Steps ``state.step`` to ``max_steps``, the final checkpoint and sampler weights; returns the summary."""
        c = self.config
        out = Path(c.output_dir)
        for step in range(state.step, c.max_steps):
            metrics = self.train_step(training_client, stream, step)
            step_done = step + 1
            # Logged before the checkpoint: a kill in between re-runs this step and the resume drops the row.
            with _output_errors(out, METRICS_FILENAME):
                sink.log(step_done, metrics)
            logger.info(
                "step %d/%d reward=%.3f loss=%s step_time=%.2fs",
                step_done,
                c.max_steps,
                metrics["reward"],
                metrics.get("loss"),
                metrics["step_time"],
            )
            if c.save_every and step_done % c.save_every == 0 and step_done < c.max_steps:
                self._checkpoint(training_client, state, stream, step_done)
            outage.over()

        if state.step < c.max_steps:
            self._checkpoint(training_client, state, stream, c.max_steps)
        final = _wait(
            _call(training_client.save_weights_for_sampler, "save_weights_for_sampler", "final"),
            "save_weights_for_sampler",
            c.request_timeout_s,
        )
        state.sampler_path = getattr(final, "path", None)
        with _output_errors(out, PYTRIO_STATE_FILENAME):
            save_loop_state(out, state)
        return {
            "steps": state.step,
            "state_path": state.state_path,
            "sampler_path": state.sampler_path,
            "output_dir": str(out),
        }


def _saved(out: Path) -> str:
    """What a resume from `out` would start from, as the loop state on disk says."""
    try:
        state = load_loop_state(out)
    except (OSError, ValueError):
        state = None
    if state is None or not state.state_path:
        return "no checkpoint was saved yet"
    return f"the checkpoint of step {state.step} is kept"


@contextlib.contextmanager
def _output_errors(out: Path, filename: str):
    """A failed write to the run folder (a full disk) as one `PyTrioLoopError` line saying what is kept."""
    try:
        yield
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise PyTrioLoopError(
            f"cannot write {filename} in {out} ({reason}): the run stopped and {_saved(out)}; free space, then "
            "rerun with resume: true"
        ) from None


def _gave_up(outage: ServiceOutage, error: BaseException, out: Path) -> PyTrioLoopError:
    last = " ".join(redact(error).split())  # one line, whatever the client's message looked like
    return PyTrioLoopError(
        f"the PyTRIO service at {outage.base_url} did not answer for {outage.elapsed():.0f} s "
        f"(server_retry_budget_s={outage.budget_s:g}); stopped, {_saved(out)}: rerun with resume: true once it is "
        f"back. Last error: {last}"
    )


def _write_config(config: PyTrioGRPOConfig, out: Path) -> None:
    write_run_config(out, {**config.to_dict(), "backend": "pytrio"})


def local_sampling_models(config: PyTrioGRPOConfig) -> tuple[str, ...]:
    """The base models the local server serves besides ``base_model``: a distillation teacher that is another
    model (a teacher checkpoint, ``teacher_model_path``, is an adapter of ``base_model`` and needs none)."""
    spec = distillation_of(config)
    if spec is None or spec.teacher_model_path or spec.teacher == config.base_model:
        return ()
    return (spec.teacher,)


def run_from_config(config: PyTrioGRPOConfig, loop: GRPOLoop | None = None, **kwargs) -> dict:
    """Connect as ``pytrio_base_url`` says (``local``: start the local server first) and train ``loop`` (default:
    ``GRPOLoop(config, **kwargs)``). Its inputs are checked before the local server loads the model."""
    install_log_redaction()
    loop = loop or GRPOLoop(config, **kwargs)
    loop.check_inputs()
    if config.pytrio_base_url == LOCAL_SERVER_NAME:
        # Checkpoints live beside the run, so a resumed run's fresh server finds the earlier process's states. The
        # recipe is the operator of its own server: it keeps the newest 3 of each kind per run (and always what its
        # loop state resumes from), as it did before the server's default became keeping everything, and sums the
        # loss over tokens (`build_train_batch` normalises the advantages itself). A distillation teacher other than
        # the base model is served beside it for sampling and log-probs.
        storage = str(Path(config.output_dir) / PYTRIO_SERVER_DIRNAME)
        options = {"storage_dir": storage, "keep_checkpoints": 3, "loss_normalization": "sum"}
        options["sampling_models"] = local_sampling_models(config)
        with connection.local_server(config.base_model, **options) as server:
            connection.configure_client(base_url=server.base_url, api_key=server.api_key)
            return loop.run()
    if config.pytrio_base_url:
        connection.configure_client(base_url=config.pytrio_base_url)
    return loop.run()
