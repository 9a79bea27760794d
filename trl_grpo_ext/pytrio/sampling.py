"""The sample phase: a sampler holding the current weights (`sampling_client`), one round of sampling requests
submitted (`submit_samples`, a `PendingSamples` keyed by the step and the sampler it samples from) and collected
(`collect_samples`: the replies waited for, checked and turned into `Rollout`s); in a multi-turn run each first
turn continued through its tool calls (`ToolTurns`, `trl_grpo_ext.environments.rollout`'s TRL rules)."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from trl_grpo_ext.environments import ENVIRONMENTS, environment_tools
from trl_grpo_ext.environments.chat import turn_parser
from trl_grpo_ext.environments.rollout import multi_turn_rollouts, stop_reason, tool_suffix_ids
from trl_grpo_ext.pytrio.calls import PyTrioLoopError, call, wait
from trl_grpo_ext.pytrio.config import PyTrioGRPOConfig
from trl_grpo_ext.pytrio.datums import validate_rollout
from trl_grpo_ext.pytrio.logprobs import completion_logprobs
from trl_grpo_ext.pytrio.prompts import environment_name
from trl_grpo_ext.pytrio.types import Rollout, StepTimes


def sampling_client(training_client, times: StepTimes):
    """A sampler holding the current weights: the "old" policy of this step."""
    t0 = time.perf_counter()
    sampler = call(training_client.save_weights_and_get_sampling_client, "save_weights_and_get_sampling_client")
    times.save_weights += time.perf_counter() - t0
    return sampler


def sampling_params(config: PyTrioGRPOConfig, step: int, index: int):
    """The sampling settings of request ``index`` of ``step``."""
    import pytrio as trio

    c = config
    return trio.SamplingParams(
        max_tokens=c.max_completion_length,
        temperature=c.temperature,
        top_p=c.top_p,
        top_k=c.top_k if c.top_k > 0 else -1,
        # A function of (seed, step, prompt): a resumed run samples what an uninterrupted one would.
        seed=(c.seed * 1_000_003 + step * 1_009 + index) % (2**31 - 1),
    )


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


@dataclass
class PendingSamples:
    """One round of a step's sampling requests: ``num_generations`` completions of each row's prompt, sampled by
    ``sampler`` (the weights it was made from) for step ``step``. ``first_index`` numbers the rows within the step
    (their sampling seeds), so a step that samples more rows later gives them new seeds."""

    step: int
    sampler: object
    rows: list[dict]
    prompt_tokens: list[list[int]]
    first_index: int
    # one per row, in flight (``mode: async``); None: each request is submitted by `collect_samples` once the one
    # before it has answered (``mode: sync``)
    futures: list | None

    def indexed(self) -> list[tuple[int, list[int]]]:
        return list(enumerate(self.prompt_tokens, start=self.first_index))


def _submit(config: PyTrioGRPOConfig, sampler, tokens: list[int], step: int, index: int):
    import pytrio as trio

    return call(
        sampler.sample,
        "sample",
        trio.ModelInput.from_ints(tokens),
        num_samples=config.num_generations,
        sampling_params=sampling_params(config, step, index),
        return_text=False,
    )


def submit_samples(
    config: PyTrioGRPOConfig,
    sampler,
    rows: list[dict],
    prompt_tokens: list[list[int]],
    step: int,
    first_index: int = 0,
    in_flight: bool | None = None,
) -> PendingSamples:
    """The round's requests: with ``mode: async`` (or `in_flight`: a batch requested ahead, `lookahead`) all
    submitted now (the service works on them while the caller goes on); with ``mode: sync`` none yet
    (`collect_samples` sends them one at a time)."""
    pending = PendingSamples(step, sampler, rows, prompt_tokens, first_index, None)
    if config.mode == "async" if in_flight is None else in_flight:
        pending.futures = [_submit(config, sampler, tokens, step, i) for i, tokens in pending.indexed()]
    return pending


def collect_samples(config: PyTrioGRPOConfig, pending: PendingSamples, tool_turns: ToolTurns | None = None):
    """The round's rollouts, prompt-major (``num_generations`` per row): each reply waited for and checked
    (`rollouts_from_response`); with `tool_turns`, each first turn continued through its tool calls."""
    t = config.request_timeout_s
    indexed = pending.indexed()
    if pending.futures is not None:
        replies = [wait(f, f"sample (prompt {i})", t) for (i, _), f in zip(indexed, pending.futures, strict=True)]
    else:
        replies = [
            wait(_submit(config, pending.sampler, tokens, pending.step, i), f"sample (prompt {i})", t)
            for i, tokens in indexed
        ]
    rollouts = [
        r
        for (i, tokens), reply in zip(indexed, replies, strict=True)
        for r in rollouts_from_response(reply, tokens, config.num_generations, f"sample (prompt {i})")
    ]
    if tool_turns is not None:
        rollouts = tool_turns.continue_rollouts(pending.sampler, pending.rows, rollouts, pending.step,
                                                pending.first_index)  # fmt: skip
    if config.rescores_behaviour:  # the behaviour log-probs the service's forward_backward compares with
        scored = completion_logprobs(pending.sampler, rollouts, "behaviour", t, pending.futures is not None)
        rollouts = [replace(r, completion_logprobs=tuple(lp)) for r, lp in zip(rollouts, scored, strict=True)]
    return rollouts


class ToolTurns:
    """Multi-turn sampling: each first turn continued through its tool calls (`environments.rollout`, TRL's rules),
    one environment instance per rollout, reset with its row; continuations sampled one per prompt. ``tools``: each
    environment's tools (`prompts.environment_tool_methods`), which a sampled turn is parsed against."""

    def __init__(self, config: PyTrioGRPOConfig, tokenizer, tools: dict[str, list]):
        self.config = config
        self.tokenizer = tokenizer
        self.parsers = {name: turn_parser(tokenizer, t) for name, t in tools.items()}

    def continue_rollouts(self, sampler, rows: list[dict], rollouts: list[Rollout], step: int, first_index: int):
        import pytrio as trio

        c = self.config
        per_rollout = [row for row in rows for _ in range(c.num_generations)]
        names = [environment_name(c, row) for row in per_rollout]
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
                call(sampler.sample, "sample", trio.ModelInput.from_ints(tokens), num_samples=1,
                     sampling_params=sampling_params(c, step, base + i), return_text=False)
                for i, tokens in enumerate(prompts)
            ]  # fmt: skip
            replies = [wait(f, "sample (tool turn)", c.request_timeout_s) for f in futures]
            turns = [rollouts_from_response(r, p, 1, "sample (tool turn)")[0] for r, p in zip(replies, prompts,
                     strict=True)]  # fmt: skip
            return [list(t.completion_tokens) for t in turns], [list(t.completion_logprobs) for t in turns]

        results = multi_turn_rollouts(
            [list(r.prompt_tokens) for r in rollouts],
            ([list(r.completion_tokens) for r in rollouts], [list(r.completion_logprobs) for r in rollouts]),
            sample,
            lambda ids, prefix, i: self.parsers[names[i]](ids, prefix),
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
