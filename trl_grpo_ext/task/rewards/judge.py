"""The rubric LLM judge ("type C"): an async reward that asks any OpenAI-compatible chat-completions server
(`vllm serve`, `transformers serve`, SGLang, llama.cpp's server, a hosted API) to score each completion.

Per completion, one request through the `openai` client: the rubric and the declared score format as the system
message, the question and the completion as the user message, ``temperature=0`` and a ``seed`` (deterministic where
the server honours them). The reply is parsed as declared (``integer``: the first integer of the reply; ``json``: a
JSON object's ``score_field``) and must lie in ``score_range``; it is then mapped to [0, 1]. With ``logprobs: true``
and a server that returns them, the score is the probability-weighted mean over the in-range integers of the first
generated token instead. Anything else scores None (TRL's "not applicable") and is counted as a parse error.

Requests run concurrently up to ``max_concurrency``, each attempt bounded by ``timeout_s``; the `openai` client
retries 408, 409, 429, 5xx, timeouts and connection errors ``retries`` times with its exponential backoff (or the
server's Retry-After), other errors are not retried. A completion whose
request still fails scores None (the step goes on, the other reward terms count); a call in which every request
failed counts towards ``max_failed_steps``, and that many in a row stop the run (`JudgeUnavailableError`) rather than
let it train on the other terms alone. Identical (rubric, prompt, completion, judge model) requests are answered from
a cache (and asked once when they share a batch). Per call, ``log_metric`` gets ``judge/requests``, ``judge/failures``,
``judge/retries``, ``judge/parse_errors``, ``judge/cache_hits``, ``judge/latency_p50`` and ``judge/latency_p99``.

The API key is read from the environment variable ``api_key_env`` names (``OPENAI_API_KEY``), never from the
recipe, and never printed.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import asdict, dataclass, field

from trl_grpo_ext.task.answers import completion_text
from trl_grpo_ext.task.rewards._batch import as_list
from trl_grpo_ext.task.rewards.judge_config import JudgeConfig
from trl_grpo_ext.task.rewards.judge_messages import (
    cache_key,
    judge_messages,
    logprob_score,
    pairwise_messages,
    parse_preference,
    parse_score,
    question_text,
)

logger = logging.getLogger(__name__)


class JudgeUnavailableError(RuntimeError):
    """The judge failed every request of ``max_failed_steps`` steps in a row: the run stops."""


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


@dataclass
class _CallStats:
    requests: int = 0
    failures: int = 0
    retries: int = 0
    parse_errors: int = 0
    cache_hits: int = 0
    position_disagreements: int = 0  # pairwise: pairs whose two orders disagree
    asked: int = 0  # items that needed a request (not answered from the cache)
    latencies: list = field(default_factory=list)
    last_error: str = ""

    def metrics(self) -> dict[str, float]:
        out = {f"judge/{k}": float(v) for k, v in asdict(self).items() if isinstance(v, int) and k != "asked"}
        if self.latencies:
            out["judge/latency_p50"] = percentile(self.latencies, 50)
            out["judge/latency_p99"] = percentile(self.latencies, 99)
        return out


class _LoopState:
    """What belongs to one event loop: the client (its connection pool), the concurrency bound, requests in flight."""

    def __init__(self, config: JudgeConfig):
        import openai  # the `judge` extra: only a run with a judge needs it

        # The client retries 408, 409, 429, 5xx, timeouts and connection errors `retries` times, waiting 0.5 s
        # doubling (at most 8 s, less up to 25% jitter) or what a Retry-After header asks (up to 60 s).
        self.client = openai.AsyncOpenAI(
            base_url=config.url, api_key=config.api_key(), timeout=config.timeout_s, max_retries=config.retries
        )
        self.semaphore = asyncio.Semaphore(config.max_concurrency)
        self.inflight: dict[str, asyncio.Future] = {}


class JudgeReward:
    """The judge as an async TRL reward function; see the module docstring."""

    def __init__(self, config: JudgeConfig):
        self.config = config
        self.__name__ = config.name
        self.cache: dict[str, float] = {}
        self.failed_steps = 0  # calls in a row in which every request failed
        # The TRL trainer sets `defer_stop`: the stop is kept in `unavailable` instead of raised, and the trainer
        # raises it on every process at once (`GRPOTrainer._stop_if_a_judge_is_down`): one process raising alone
        # would leave the others waiting for it in the rewards' gather.
        self.defer_stop = False
        self.unavailable: JudgeUnavailableError | None = None
        self.last_requests: list[int] = []  # requests each completion of the last call sent (the cost term)
        self._states: dict[int, tuple[asyncio.AbstractEventLoop, _LoopState]] = {}

    # The hybrid reads these: a judge's None is one missing term, not an unscorable completion; a request is spent on
    # completions no veto fired on only.
    abstains_on_failure = True
    scored_after_vetoes = True

    def preflight(self) -> None:
        """Raise a one-line ValueError naming the URL unless the server answers ``GET <base_url>/models`` and lists
        the judge model (``model: auto`` becomes the one model it lists). Runs before any model loads."""
        import httpx  # the openai client's HTTP library

        url = self.config.url
        try:
            response = httpx.get(
                f"{url}/models",
                headers={"Authorization": f"Bearer {self.config.api_key()}"},
                timeout=min(self.config.timeout_s, 10.0),
            )
        except httpx.HTTPError as error:
            raise ValueError(f"judge: cannot reach {url} ({type(error).__name__})") from None
        if response.status_code in (401, 403):
            raise ValueError(
                f"judge: {url} refused the API key from ${self.config.api_key_env} (HTTP {response.status_code})"
            )
        if response.status_code >= 400:
            raise ValueError(f"judge: {url}/models answers HTTP {response.status_code}; is it an OpenAI-style server?")
        try:
            served = [m.get("id") for m in response.json().get("data", []) if isinstance(m, dict)]
        except (ValueError, AttributeError):
            served = None  # a server that lists nothing readable: take the model name on trust
        if self.config.model == "auto":
            if not served or len(served) != 1:
                raise ValueError(f"judge: model: auto needs {url} to list exactly one model; it lists {served}")
            self.config.model = served[0]
        elif served and self.config.model not in served:
            raise ValueError(f"judge: {url} does not serve model {self.config.model!r}; it serves {served[:5]}")

    def _state(self) -> _LoopState:
        loop = asyncio.get_running_loop()
        for key in [k for k, (old, _) in self._states.items() if old.is_closed()]:  # asyncio.run()'s, finished
            del self._states[key]
        entry = self._states.get(id(loop))
        if entry is None or entry[0] is not loop:
            entry = (loop, _LoopState(self.config))
            self._states[id(loop)] = entry
        return entry[1]

    async def _ask(self, state: _LoopState, messages: list[dict], stats: _CallStats, sent: list) -> object | None:
        """The server's reply to one request, or None once it failed. The `openai` client retries it (``retries``
        times, its own backoff); the attempts it made are read from the ``x-stainless-retry-count`` header of its
        last request, on the reply or on the error."""
        import openai

        c = self.config
        extra = {"logprobs": True, "top_logprobs": 20} if c.logprobs else {}
        if c.seed is not None:
            extra["seed"] = c.seed
        async with state.semaphore:
            try:
                raw = await state.client.chat.completions.with_raw_response.create(
                    model=c.model, messages=messages, temperature=0.0, max_tokens=c.max_tokens, **extra
                )
                response = raw.parse()
            except openai.APIError as error:  # after the client's retries, or one it does not retry (most 4xx)
                _count_attempts(stats, sent, _retries_taken(error.request))
                stats.last_error = _error_line(error)
                stats.failures += 1
                return None
        _count_attempts(stats, sent, _retries_taken(raw.http_request))
        stats.latencies.append(raw.elapsed.total_seconds())  # the answered attempt's server time
        return response

    def _parse(self, response, stats: _CallStats):
        """The reply's value: a score in [0, 1] (pointwise) or the preferred side 'A' / 'B' (pairwise); None, and a
        parse error counted, when it has none."""
        try:
            choice = response.choices[0]
            reply = choice.message.content
        except (AttributeError, IndexError, TypeError):  # a 200 whose body is no chat completion
            value = None
        else:
            if self.config.mode == "pairwise":
                value = parse_preference(reply)
            else:
                value = logprob_score(self.config, choice) if self.config.logprobs else None
                if value is None:
                    value = parse_score(self.config, reply)
        if value is None:
            stats.parse_errors += 1
        return value

    async def _cached_ask(self, key: str, messages: list[dict], stats: _CallStats, state: _LoopState):
        """(parsed value, requests sent): from the cache, from an identical request in flight, or asked."""
        if self.config.cache and key in self.cache:
            stats.cache_hits += 1
            return self.cache[key], 0
        if self.config.cache and key in state.inflight:  # the same request is on its way: share its answer
            stats.cache_hits += 1
            return await asyncio.shield(state.inflight[key]), 0
        stats.asked += 1
        future = asyncio.get_running_loop().create_future()
        state.inflight[key] = future
        sent = [0]
        value = None
        try:
            response = await self._ask(state, messages, stats, sent)
            value = None if response is None else self._parse(response, stats)
            # A reply is cached even when it has no score: the request is deterministic, so asking again would get
            # the same reply. A request that got no reply (failures after retries) is not: it may succeed next step.
            if response is not None and self.config.cache:
                self.cache[key] = value
        finally:
            state.inflight.pop(key, None)
            future.set_result(value)
        return value, sent[0]

    async def _pointwise(self, prompts, completions, stats, state) -> tuple[list, list[int]]:
        results = await asyncio.gather(
            *(
                self._cached_ask(cache_key(self.config, p, c), judge_messages(self.config, p, c), stats, state)
                for p, c in zip(prompts, completions, strict=True)
            )
        )
        return [v for v, _ in results], [n for _, n in results]

    async def _pairwise(self, prompts, completions, stats, state) -> tuple[list, list[int]]:
        """Each completion against every other one of its prompt, both orders asked: a pair's outcome is the mean of
        the orders that parsed (1 win, 0 loss; orders that disagree, the position bias, give 0.5); a completion's
        score is the mean of its outcomes (None with none). Identical completions tie without a request."""
        groups: dict[str, list[int]] = {}
        for i, p in enumerate(prompts):
            groups.setdefault(question_text(p), []).append(i)
        pairs = [(i, j) for members in groups.values() for a, i in enumerate(members) for j in members[a + 1 :]]
        texts = [completion_text(c) for c in completions]
        asks, order = [], []
        for i, j in pairs:
            if texts[i] == texts[j]:
                continue
            for first, second in ((i, j), (j, i)):
                key = cache_key(self.config, prompts[i], [texts[first], texts[second]])
                messages = pairwise_messages(self.config, prompts[i], completions[first], completions[second])
                asks.append(self._cached_ask(key, messages, stats, state))
                order.append((i, j, first == i))
        answers = await asyncio.gather(*asks)
        sent = [0] * len(completions)
        votes: dict[tuple[int, int], list[float]] = {}
        for (i, j, i_first), (side, n) in zip(order, answers, strict=True):
            sent[i] += n
            sent[j] += n
            if side is not None:  # 1.0: i preferred
                votes.setdefault((i, j), []).append(float((side == "A") == i_first))
        outcomes: list[list[float]] = [[] for _ in completions]
        for i, j in pairs:
            result = 0.5 if texts[i] == texts[j] else None
            if (i, j) in votes:
                result = sum(votes[(i, j)]) / len(votes[(i, j)])
                stats.position_disagreements += len(votes[(i, j)]) == 2 and votes[(i, j)][0] != votes[(i, j)][1]
            if result is not None:
                outcomes[i].append(result)
                outcomes[j].append(1.0 - result)
        return [sum(o) / len(o) if o else None for o in outcomes], sent

    async def __call__(self, completions, prompts=None, log_metric=None, **kwargs) -> list[float | None]:
        completions = as_list(completions)
        prompts = list(prompts) if prompts is not None else [""] * len(completions)
        if self.config.model == "auto":  # a judge built without the start-up check: it names the model now
            await asyncio.to_thread(self.preflight)
        state = self._state()
        stats = _CallStats()
        judge = self._pairwise if self.config.mode == "pairwise" else self._pointwise
        scores, self.last_requests = await judge(prompts, completions, stats, state)
        if stats.asked and stats.failures >= stats.asked:
            self.failed_steps += 1
        elif stats.asked:
            self.failed_steps = 0
        if callable(log_metric):
            for name, value in stats.metrics().items():
                log_metric(name, value)
        if stats.failures:
            logger.warning(
                "judge: %d of %d requests failed after retries (last: %s)",
                stats.failures,
                stats.asked,
                stats.last_error,
            )
        if self.failed_steps >= self.config.max_failed_steps:
            error = JudgeUnavailableError(
                f"judge at {self.config.url} failed every request of {self.failed_steps} step(s) in a row (last: "
                f"{stats.last_error}); stopping rather than training on the other rewards alone"
            )
            if not self.defer_stop:
                raise error
            self.unavailable = error
        return scores


def _retries_taken(request) -> int:
    """The retries the `openai` client had made before sending `request` (its ``x-stainless-retry-count``)."""
    try:
        return max(0, int(request.headers.get("x-stainless-retry-count", 0)))
    except (AttributeError, TypeError, ValueError):
        return 0


def _count_attempts(stats: _CallStats, sent: list, retries: int) -> None:
    sent[0] += retries + 1
    stats.requests += retries + 1
    stats.retries += retries


def _error_line(error) -> str:
    status = getattr(error, "status_code", None)
    text = str(error).strip().splitlines()[0][:160] if str(error).strip() else ""
    return f"{type(error).__name__}" + (f" {status}" if status else "") + (f": {text}" if text else "")


def judges_in(funcs) -> list[JudgeReward]:
    """The judges among reward functions, those weighed inside a hybrid (its ``components``) included."""
    found = []
    for func in funcs:
        if isinstance(func, JudgeReward):
            found.append(func)
        components = getattr(func, "components", None)
        if isinstance(components, dict):
            found += judges_in(components.values())
    return found


def make_judge_reward(value) -> JudgeReward:
    """The judge reward for the recipe's ``judge:`` mapping (or a `JudgeConfig`)."""
    return JudgeReward(value if isinstance(value, JudgeConfig) else JudgeConfig.from_mapping(value))
