"""Completion log-probs a sampling client gives (``compute_logprobs`` on prompt + completion): the distillation
teacher's (`trl_grpo_ext.pytrio.teacher`), and the behaviour log-probs of a sampler at a temperature or truncation
the service's ``forward_backward`` does not score (`trl_grpo_ext.pytrio.sampling`)."""

from __future__ import annotations

import math

from trl_grpo_ext.pytrio.calls import PyTrioLoopError, call, wait
from trl_grpo_ext.pytrio.types import Rollout


def tail_logprobs(prompt_tokens, completion_tokens, logprobs, what: str) -> list[float]:
    """The completion tokens' log-probs out of a ``compute_logprobs`` answer on prompt + completion (one per
    position, the first None), checked: as many as tokens, finite numbers."""
    values = list(logprobs or [])
    total = len(prompt_tokens) + len(completion_tokens)
    if len(values) != total:
        raise PyTrioLoopError(f"{what}: {len(values)} log-probs for {total} tokens")
    tail = values[len(prompt_tokens) :]
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) for v in tail):
        raise PyTrioLoopError(f"{what}: the log-probs of the completion tokens must be finite numbers")
    return [float(v) for v in tail]


def completion_logprobs(client, rollouts: list[Rollout], label: str, timeout: float, in_flight: bool) -> list:
    """Each rollout's completion log-probs under `client` (``compute_logprobs``; [] for an empty completion): all
    requests submitted at once (`in_flight`, the loop's ``mode: async``) or one after another."""
    import pytrio as trio

    todo = [(i, r) for i, r in enumerate(rollouts) if r.completion_tokens]
    what = {i: f"compute_logprobs ({label}, completion {i})" for i, _ in todo}

    def submit(i, r):
        tokens = list(r.prompt_tokens) + list(r.completion_tokens)
        return call(client.compute_logprobs, what[i], trio.ModelInput.from_ints(tokens))

    if in_flight:
        futures = [(i, r, submit(i, r)) for i, r in todo]
        answers = {i: (r, wait(f, what[i], timeout)) for i, r, f in futures}
    else:
        answers = {i: (r, wait(submit(i, r), what[i], timeout)) for i, r in todo}
    out = [[] for _ in rollouts]
    for i, (r, answer) in answers.items():
        out[i] = tail_logprobs(r.prompt_tokens, r.completion_tokens, answer, what[i])
    return out
