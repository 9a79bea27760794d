"""The rubric judge against a real socket: a scripted server of the test's own that answers, delays, returns
500/429 or garbage, or closes the connection. Retries, None scores, the step going on, the N-in-a-row stop, the
cache, the concurrency bound, the start-up check, the key kept out of sight."""

import asyncio
import logging
import math
import re

import pytest
from judge_servers import ScriptedServer

from trl_grpo_ext.grpo.reward_aggregation import RewardFunctionError, RewardMetricLog, score_completions
from trl_grpo_ext.task.rewards import (
    JudgeConfig,
    JudgeUnavailableError,
    make_hybrid_reward,
    make_judge_reward,
    reward_functions,
)
from trl_grpo_ext.task.rewards.judge_messages import judge_messages, parse_score

PROMPT = [{"role": "user", "content": "What is 2 + 2?"}]


def judge_for(server, **overrides):
    settings = dict(
        base_url=server.base_url if server else "http://127.0.0.1:9/v1",
        model="judge",
        rubric="Grade the answer: 10 if right, 1 if wrong.",
        score_range=[1, 10],
        timeout_s=5,
        retries=2,
    )
    return make_judge_reward({**settings, **overrides})


def score(judge, completions, prompts=None):
    log = RewardMetricLog()
    prompts = prompts or [PROMPT] * len(completions)
    scores = asyncio.run(judge(prompts=prompts, completions=completions, log_metric=log))
    return scores, log.metrics()


def answer_digit(index, body):
    """Answers the completion's last word as the score: 'A 7' -> 'Score: 7'."""
    text = body["messages"][-1]["content"]
    return ("ok", f"Score: {text.split()[-1]}")


def test_scores_are_parsed_normalised_and_the_request_is_deterministic():
    with ScriptedServer(answer_digit) as server:
        scores, metrics = score(judge_for(server), ["A 1", "A 10", "A 4", "A 11"])
    assert scores == [0.0, 1.0, pytest.approx(3 / 9), None]  # 11: out of range
    body = server.bodies[0]
    assert body["temperature"] == 0 and body["seed"] == 0 and body["model"] == "judge"
    assert body["messages"][0]["role"] == "system" and "integer from 1 to 10" in body["messages"][0]["content"]
    assert "What is 2 + 2?" in body["messages"][1]["content"]
    assert metrics["judge/requests"] == 4 and metrics["judge/failures"] == 0 and metrics["judge/parse_errors"] == 1


def test_parse_rules():
    c = JudgeConfig.from_mapping(dict(base_url="http://x/v1", model="m", rubric="r", score_range=[1, 5]))
    assert parse_score(c, "4") == 0.75
    assert parse_score(c, "I'd say 2 out of 5") == 0.25  # the first integer
    assert parse_score(c, "7") is None and parse_score(c, "no score") is None and parse_score(c, None) is None
    j = JudgeConfig.from_mapping(dict(base_url="http://x/v1", model="m", rubric="r", score_format="json"))
    assert parse_score(j, 'ok {"score": 10} done') == 1.0
    assert parse_score(j, '{"score": "10"}') is None and parse_score(j, "{bad json}") is None
    assert 'JSON object {"score": <an integer from 1 to 10>}' in judge_messages(j, "q", "a")[0]["content"]


def test_the_cache_answers_repeats_without_a_request_and_identical_completions_are_asked_once():
    with ScriptedServer(answer_digit) as server:
        judge = judge_for(server)
        first, m1 = score(judge, ["A 3", "A 3", "A 5"])
        assert len(server.bodies) == 2 and m1["judge/cache_hits"] == 1  # the duplicate shared the request
        second, m2 = score(judge, ["A 5", "A 3"])
        assert len(server.bodies) == 2 and m2["judge/cache_hits"] == 2 and m2["judge/requests"] == 0
        assert judge.last_requests == [0, 0]
        other_prompt, _ = score(judge, ["A 3"], prompts=[[{"role": "user", "content": "What is 1 + 2?"}]])
        assert len(server.bodies) == 3  # another prompt is another key
    assert first == [pytest.approx(2 / 9)] * 2 + [pytest.approx(4 / 9)] and second == [first[2], first[0]]
    with ScriptedServer(answer_digit) as server:
        uncached = judge_for(server, cache=False)
        score(uncached, ["A 3", "A 3"])
        score(uncached, ["A 3"])
        assert len(server.bodies) == 3


def test_concurrency_is_bounded_at_the_server():
    with ScriptedServer(lambda i, body: ("delay", 0.25, "5")) as server:
        scores, metrics = score(judge_for(server, max_concurrency=3), [f"A {i}" for i in range(9)])
    assert server.max_in_flight == 3  # never more, and the bound is used
    assert scores == [pytest.approx(4 / 9)] * 9
    assert metrics["judge/latency_p50"] >= 0.25 and metrics["judge/latency_p99"] >= metrics["judge/latency_p50"]


def test_500_429_and_dropped_connections_are_retried():
    faults = {}

    def plan(index, body):
        text = body["messages"][-1]["content"]
        seen = faults.setdefault(text, 0)
        faults[text] += 1
        if seen == 0:
            return ("status", 500) if "A 2" in text else ("close",) if "A 3" in text else ("status", 429)
        return ("ok", text.strip()[-1])

    with ScriptedServer(plan) as server:
        scores, metrics = score(judge_for(server), ["A 2", "A 3", "A 4"])
    assert scores == [pytest.approx(1 / 9), pytest.approx(2 / 9), pytest.approx(3 / 9)]
    assert metrics["judge/retries"] == 3 and metrics["judge/failures"] == 0 and metrics["judge/requests"] == 6


def test_the_client_retries_and_its_attempts_are_counted_per_request():
    """The openai client retries (its own backoff); `judge/retries` and `judge/requests` count its attempts, as the
    server saw them, and the hybrid's cost (`last_requests`) is per completion."""
    attempts = {}

    def plan(index, body):
        text = body["messages"][-1]["content"].split()[-1]  # the completion
        attempts[text] = attempts.get(text, 0) + 1
        if "down" in text or ("flaky" in text and attempts[text] <= 2):
            return ("status", 503)
        return ("ok", "5")

    with ScriptedServer(plan) as server:
        judge = judge_for(server, retries=2)
        scores, metrics = score(judge, ["flaky", "steady", "down"])
    assert scores == [pytest.approx(4 / 9), pytest.approx(4 / 9), None]
    assert attempts == {"flaky": 3, "steady": 1, "down": 3}
    assert sorted(server.retry_counts) == ["0", "0", "0", "1", "1", "2", "2"]  # the client's own retries
    assert metrics["judge/requests"] == 7 and metrics["judge/retries"] == 4 and metrics["judge/failures"] == 1
    assert judge.last_requests == [3, 1, 3]
    assert judge.failed_steps == 0


def test_an_error_the_client_does_not_retry_fails_the_request_at_once():
    with ScriptedServer(lambda i, body: ("status", 400)) as server:
        judge = judge_for(server, retries=3)
        scores, metrics = score(judge, ["x"])
    assert scores == [None] and server.retry_counts == ["0"]
    assert metrics["judge/requests"] == 1 and metrics["judge/retries"] == 0 and metrics["judge/failures"] == 1
    assert judge.failed_steps == 1  # every request of the call failed


def test_a_reply_without_a_score_is_cached_and_a_failed_request_is_asked_again():
    def plan(index, body):
        return ("status", 503) if "broken" in body["messages"][-1]["content"] else ("ok", "I cannot grade this.")

    with ScriptedServer(plan) as server:
        judge = judge_for(server, retries=0)
        first, m1 = score(judge, ["chatty", "broken"])
        assert len(server.bodies) == 2 and m1["judge/parse_errors"] == 1 and m1["judge/failures"] == 1
        again, m2 = score(judge, ["chatty", "broken"])
        # the deterministic request's reply comes from the cache; the request that got no reply is sent again
        assert len(server.bodies) == 3 and "broken" in server.bodies[-1]["messages"][-1]["content"]
        assert m2["judge/cache_hits"] == 1 and m2["judge/parse_errors"] == 0 and m2["judge/failures"] == 1
    assert first == again == [None, None]


def test_failed_and_unparseable_completions_score_none_and_the_step_goes_on(caplog):
    def plan(index, body):
        text = body["messages"][-1]["content"]
        if "broken" in text:
            return ("status", 503)
        if "garbage" in text:
            return ("garbage",)
        if "chatty" in text:
            return ("ok", "I cannot grade this.")
        if "slow" in text:
            return ("delay", 2.0, "9")
        return ("ok", "8")

    with ScriptedServer(plan) as server, caplog.at_level(logging.WARNING):
        judge = judge_for(server, timeout_s=0.5, retries=1)
        scores, metrics = score(judge, ["fine", "broken", "garbage", "chatty", "slow"])
    assert scores[0] == pytest.approx(7 / 9) and scores[1:] == [None] * 4
    assert metrics["judge/failures"] == 2  # 503 twice, the timeout twice
    assert metrics["judge/parse_errors"] == 2  # a body that is no completion, a reply without a score
    assert metrics["judge/retries"] == 2
    assert judge.failed_steps == 0  # some requests got through: not a failed step
    assert "2 of 5 requests failed" in caplog.text

    # TRL's handling: the judge's None is NaN in its column, the other functions still count
    def length(completions, **kwargs):
        return [float(len(c)) for c in completions]

    with ScriptedServer(plan) as server:
        judge = judge_for(server, timeout_s=0.5, retries=0)
        table = score_completions(
            [length, judge], ["length", "judge_reward"], [PROMPT] * 2, ["fine", "broken"], [[1], [1]], {}
        )
    assert table[:, 0].tolist() == [4.0, 6.0] and table[0, 1].item() == pytest.approx(7 / 9)
    assert math.isnan(table[1, 1].item())


def test_a_judge_failing_whole_steps_n_times_in_a_row_stops_the_run():
    state = {"down": True}

    def plan(index, body):
        return ("status", 500) if state["down"] else ("ok", "5")

    with ScriptedServer(plan) as server:
        judge = judge_for(server, retries=1, max_failed_steps=2)
        assert score(judge, ["a", "b"])[0] == [None, None] and judge.failed_steps == 1
        state["down"] = False
        assert score(judge, ["c"])[0] == [pytest.approx(4 / 9)] and judge.failed_steps == 0  # a good step resets
        state["down"] = True
        score(judge, ["d"])
        with pytest.raises(JudgeUnavailableError, match=re.escape(f"judge at {server.base_url} failed every request")):
            score(judge, ["e"])
        # on the PyTRIO path the error reaches the loop as a reward failure naming the judge
        judge.failed_steps = 1
        with pytest.raises(RewardFunctionError, match="'judge_reward' failed: JudgeUnavailableError"):
            score_completions([judge], ["judge_reward"], [PROMPT], ["f"], [[1]], {})


def test_start_up_check_names_the_url_and_the_key_stays_out_of_sight(monkeypatch, caplog):
    secret = "sk-test-0123456789abcdef"
    monkeypatch.setenv("MY_JUDGE_KEY", secret)
    with ScriptedServer(lambda i, body: ("status", 500)) as server:
        judge = judge_for(server, api_key_env="MY_JUDGE_KEY", retries=0)
        judge.preflight()  # reachable
        with caplog.at_level(logging.DEBUG):
            score(judge, ["x"])
    assert server.auth == [f"Bearer {secret}"]
    assert secret not in caplog.text and secret not in repr(judge.config)
    dead = judge_for(None)
    with pytest.raises(ValueError) as info:
        dead.preflight()
    assert str(info.value) == "judge: cannot reach http://127.0.0.1:9/v1 (ConnectError)"


def test_logprob_weighted_score():
    top = [
        {"token": "7", "logprob": math.log(0.5), "bytes": None},
        {"token": "9", "logprob": math.log(0.25), "bytes": None},
        {"token": "x", "logprob": math.log(0.25), "bytes": None},
    ]
    logprobs = [{"token": "7", "logprob": math.log(0.5), "bytes": None, "top_logprobs": top}]
    with ScriptedServer(lambda i, body: ("ok", "7", logprobs)) as server:
        scores, _ = score(judge_for(server, logprobs=True), ["a"])
    assert server.bodies[0]["logprobs"] is True and server.bodies[0]["top_logprobs"] == 20
    expected = (0.5 * 7 + 0.25 * 9) / 0.75  # the in-range integers, renormalised
    assert scores == [pytest.approx((expected - 1) / 9)]
    with ScriptedServer(lambda i, body: ("ok", "7")) as server:  # a server without logprobs: the parsed score
        assert score(judge_for(server, logprobs=True), ["a"])[0] == [pytest.approx(6 / 9)]


def test_the_pytrio_loops_event_loop_keeps_one_client_across_steps():
    """Async rewards run on one daemon loop, as in TRL, so the judge's client outlives a step."""
    with ScriptedServer(answer_digit) as server:
        judge = judge_for(server, cache=False)
        for _ in range(3):
            table = score_completions([judge], ["judge_reward"], [PROMPT] * 2, ["A 2", "A 6"], [[1], [1]], {})
            assert table[:, 0].tolist() == pytest.approx([1 / 9, 5 / 9])
    assert len(judge._states) == 1


def test_hybrid_with_judge_and_cost_terms():
    """Vetoes first; a judge term that failed is left out, a cost per judge call counts the requests sent."""
    plan_state = {"fail": "zzz"}

    def plan(index, body):
        text = body["messages"][-1]["content"]
        return ("status", 500) if plan_state["fail"] in text else ("ok", "10")

    with ScriptedServer(plan) as server:
        judge = judge_for(server, retries=1)

        class Settings:
            hybrid = {"components": {"boxed": 0.7, "judge": 0.3, "cost": -0.05}, "vetoes": ["no_box"]}
            cost = {"per": "judge_calls"}

        Settings.judge = judge.config
        (hybrid,) = reward_functions(["hybrid"], settings=Settings)
        completions = ["So \\boxed{4}.", "So \\boxed{5}.", "no box", "So \\boxed{4}. zzz"]
        log = RewardMetricLog()
        scores = asyncio.run(
            hybrid(prompts=[PROMPT] * 4, completions=completions, answer=["#### 4"] * 4, log_metric=log)
        )
    assert scores[0] == pytest.approx(0.7 + 0.3 - 0.05)
    assert scores[1] == pytest.approx(0.3 - 0.05)
    assert scores[2] == 0.0  # vetoed
    assert scores[3] == pytest.approx(0.7 - 0.05 * 2)  # judge failed after a retry: two calls, no judge term
    metrics = log.metrics()
    assert metrics["rewards/hybrid_reward/judge"] == pytest.approx(1.0) and metrics["judge/failures"] == 1
    # Vetoes first in time too: the vetoed completion cost no request (1 + 1 + 2 for the others).
    asked = [body["messages"][-1]["content"] for body in server.bodies]
    assert len(asked) == 4 and not any("no box" in text for text in asked)
    assert metrics["judge/requests"] == 4
    with pytest.raises(ValueError, match="needs a judge component"):
        make_hybrid_reward({"boxed": 1.0, "cost": -0.1}, resolve=lambda k: reward_functions([k], settings=Settings)[0])


def test_a_hybrid_asks_the_judge_nothing_when_every_completion_is_vetoed():
    with ScriptedServer(lambda index, body: ("ok", "10")) as server:
        judge = judge_for(server)
        hybrid = make_hybrid_reward({"boxed": 0.7, judge: 0.3}, vetoes=["no_box"], veto_value=-1.0, name="h")
        scores = asyncio.run(hybrid(prompts=[PROMPT] * 2, completions=["no box", "none"], answer=["#### 4"] * 2))
        assert scores == [-1.0, -1.0] and server.bodies == []
        # A batch with one completion left: only it is asked, with its own prompt.
        other = [{"role": "user", "content": "What is 3 + 1?"}]
        scores = asyncio.run(
            hybrid(prompts=[PROMPT, other], completions=["none", "So \\boxed{4}."], answer=["#### 4"] * 2)
        )
    assert scores == [-1.0, pytest.approx(1.0)]
    assert len(server.bodies) == 1 and "3 + 1" in server.bodies[0]["messages"][-1]["content"]


def test_a_pairwise_judge_in_a_hybrid_compares_the_completions_no_veto_fired_on():
    with ScriptedServer(lambda index, body: ("ok", "A")) as server:
        judge = judge_for(server, mode="pairwise")
        hybrid = make_hybrid_reward({judge: 1.0}, vetoes=["no_box"], name="h")
        completions = ["So \\boxed{4}.", "no box", "Hence \\boxed{5}."]
        scores = asyncio.run(hybrid(prompts=[PROMPT] * 3, completions=completions))
    # one pair, both orders (the position bias gives 0.5 each); the vetoed one was in no pair
    assert scores == [0.5, 0.0, 0.5] and len(server.bodies) == 2
    assert not any("no box" in m["content"] for body in server.bodies for m in body["messages"])


@pytest.mark.parametrize(
    "mapping, message",
    [
        ({}, "needs a judge: mapping"),
        ({"base_url": "127.0.0.1:8000", "model": "m", "rubric": "r"}, "base_url='127.0.0.1:8000' must be an http"),
        ({"base_url": "http://x/v1", "model": "m"}, "set exactly one of rubric"),
        ({"base_url": "http://x/v1", "model": "m", "rubric_file": "nope.md"}, "rubric_file 'nope.md' does not exist"),
        ({"base_url": "http://x/v1", "model": "m", "rubric": "r", "score_range": [5, 1]}, "score_range"),
        ({"base_url": "http://x/v1", "model": "m", "rubric": "r", "max_concurrency": 0}, "max_concurrency=0"),
        ({"base_url": "http://x/v1", "model": "m", "rubric": "r", "timout_s": 3}, "unknown key(s) ['timout_s']"),
    ],
)
def test_bad_judge_options_are_one_line(mapping, message):
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        JudgeConfig.from_mapping(mapping)
    assert "\n" not in str(info.value)


def _side(body):
    text = body["messages"][-1]["content"]
    a = text.split("Response A:\n")[1].split("\n\nResponse B:")[0]
    return a, text.split("Response B:\n")[1]


def test_pairwise_mode_asks_both_orders_and_cancels_position_bias():
    def fair(index, body):  # prefers the longer answer, wherever it stands
        a, b = _side(body)
        return ("ok", "A" if len(a) > len(b) else "B")

    prompts = [PROMPT] * 3 + [[{"role": "user", "content": "What is 3 + 3?"}]] * 2
    completions = ["x", "xxx", "xx", "only", "only"]
    with ScriptedServer(fair) as server:
        judge = judge_for(server, mode="pairwise")
        log = RewardMetricLog()
        scores = asyncio.run(judge(completions, prompts=prompts, log_metric=log))
    # group 1: 3 pairs x 2 orders; group 2: two identical completions tie without a request
    assert len(server.bodies) == 6 and scores == [0.0, 1.0, 0.5, 0.5, 0.5]
    assert "A or B" in server.bodies[0]["messages"][0]["content"]
    assert log.metrics()["judge/position_disagreements"] == 0 and judge.last_requests == [4, 4, 4, 0, 0]

    with ScriptedServer(lambda index, body: ("ok", "A")) as server:  # always the first shown
        biased = judge_for(server, mode="pairwise")
        log = RewardMetricLog()
        scores = asyncio.run(biased(completions[:3], prompts=prompts[:3], log_metric=log))
    assert scores == [0.5, 0.5, 0.5] and log.metrics()["judge/position_disagreements"] == 3
