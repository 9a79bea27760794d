"""The environments room: the safe calculator, the retrieval environment, tool-definition checks, tool metrics."""

import pytest

from trl_grpo_ext.environments import (
    ENVIRONMENTS,
    FACTS,
    CalculatorEnvironment,
    RetrievalEnvironment,
    calculate,
    environment_factory,
    environment_problems,
    environment_tools,
    retrieval_problems,
    tool,
    tool_metrics,
    tool_problems,
)
from trl_grpo_ext.environments.calculator import MAX_DIGITS, MAX_EXPRESSION_CHARS, evaluate
from trl_grpo_ext.environments.tools import ERROR_PREFIX, ToolError


@pytest.mark.parametrize(
    "expression, value",
    [
        ("3 * 4", "12"),
        ("(48 + 24) / 2", "36"),
        ("7 / 2", "3.5"),
        ("2 ** 10", "1024"),
        ("2^3", "8"),
        ("-(3 - 5) * 2", "4"),
        ("17 // 5 + 17 % 5", "5"),
        ("1,080 / 2", "540"),
        ("0.1 + 0.2", "0.3"),  # exact: decimals are read as written
        ("10 / 3", "3.333333333"),
    ],
)
def test_calculate(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize(
    "expression, message",
    [
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("9 ** 999", "exponent 999 is larger"),
        ("9 ** 63", f"more than {MAX_DIGITS} digits"),
        ("2 ** 0.5", "whole-number exponents"),
        ("10**40 * 10**40", f"more than {MAX_DIGITS} digits"),
        ("__import__('os').system('true')", "unsupported element"),
        ("x + 1", "unsupported element Name"),
        ("[1]", "unsupported element List"),
        ("1 if 1 else 2", "unsupported element IfExp"),
        ("'a' * 3", "unsupported element Constant"),
        ("1e999", "not a finite number"),
        ("1 +", "not an arithmetic expression"),
        ("", "empty expression"),
        ("1+" * (MAX_EXPRESSION_CHARS // 2) + "1", f"longer than {MAX_EXPRESSION_CHARS}"),
        ("+".join(["1"] * 60), "more than 100 parts"),
    ],
)
def test_calculate_refuses_with_a_message(expression, message):
    with pytest.raises(ToolError, match=message.replace("(", r"\(").replace("*", r"\*")):
        evaluate(expression)
    environment = CalculatorEnvironment()
    result = environment.calculate(expression)  # the environment's tool: the message goes to the model, counted
    assert result.startswith(ERROR_PREFIX) and message.split(" ")[0] in result
    assert (environment.tool_calls, environment.tool_errors) == (1, 1)


def test_calculate_time_budget(monkeypatch):
    import trl_grpo_ext.environments.calculator as calculator

    clock = iter(range(0, 1000))
    monkeypatch.setattr(calculator.time, "monotonic", lambda: next(clock))  # every node one second later
    with pytest.raises(ToolError, match="timed out"):
        evaluate("1 + 2")


def test_calculate_never_evals(monkeypatch):
    import builtins

    monkeypatch.setattr(builtins, "eval", lambda *a, **k: pytest.fail("eval called"))
    assert calculate("(1 + 2) * 3") == "9"


def test_a_raising_tool_is_an_error_message_and_counted():
    class Flaky:
        @tool
        def divide(self, a: int, b: int) -> str:
            """Divide.

            Args:
                a: numerator
                b: denominator
            """
            return str(a // b)

    flaky = Flaky()
    assert flaky.divide(6, 3) == "2"
    assert flaky.divide(1, 0) == ERROR_PREFIX + "ZeroDivisionError: integer division or modulo by zero"
    assert (flaky.tool_calls, flaky.tool_errors) == (2, 1)
    assert tool_problems(Flaky.divide) == []  # the guard keeps the schema


def test_retrieval_environment_and_its_reward():
    rows = retrieval_problems(20, seed=3)
    assert rows == retrieval_problems(20, seed=3) and rows != retrieval_problems(20, seed=4)
    for row in rows:
        value = FACTS[row["fact"]][0]
        count, extra = (int(word) for word in row["question"].split() if word.isdigit())
        assert row["answer"] == f"#### {count * value + extra}"
    environment = RetrievalEnvironment()
    environment.reset(**rows[0])
    assert environment.get_reward() == 0.0
    assert environment.lookup("Nothing here").startswith("No fact for 'Nothing here'. Known topics: ")
    assert environment.get_reward() == 0.0
    assert environment.lookup(rows[0]["fact"].upper() + "?") == str(FACTS[rows[0]["fact"]][0])
    assert environment.get_reward() == 1.0
    assert environment.lookup(["not", "text"]).startswith(ERROR_PREFIX + "topic must be a string")
    assert (environment.tool_calls, environment.tool_errors) == (3, 1)
    environment.reset(**rows[1])
    assert environment.get_reward() == 0.0 and environment.tool_calls == 0


def test_environment_definitions_are_checked_in_one_line_each():
    for name, cls in ENVIRONMENTS.items():
        assert environment_problems(cls, name) == []
    assert [t.__name__ for t in environment_tools(RetrievalEnvironment)] == ["lookup"]

    class Bad:
        def search(self, query):
            return query

        def fetch(self, where: set) -> str:
            """Fetch.

            Args:
                where: place
            """
            return ""

    problems = environment_problems(Bad)
    assert problems == [
        "environment Bad: no reset() method",
        "tool environment Bad.fetch: Couldn't convert the type hint <class 'set'> to a JSON schema, likely because it is a "
        "custom class or object",
        "tool environment Bad.search: no docstring (the model reads the tool's description and its Args: from it)",
    ]
    assert all("\n" not in line for line in problems)
    assert environment_factory(["calculator"]) is CalculatorEnvironment
    assert environment_factory(["calculator", "retrieval"]) == ENVIRONMENTS
    with pytest.raises(ValueError, match=r"environments: unknown \['search'\]; choose from"):
        environment_factory(["search"])


def test_tool_metrics():
    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "f"}}]}
    two_calls = {**call, "tool_calls": call["tool_calls"] * 2}
    answer = {"role": "assistant", "content": "\\boxed{1}"}
    result = {"role": "tool", "name": "f", "content": "12"}
    failed = {"role": "tool", "name": "f", "content": "Error: division by zero"}
    trl_failed = {"role": "tool", "name": "f", "content": str({"error": "Tool g not found."})}
    completions = [
        [answer],  # no tool
        [call, result, answer],  # one call, answered
        [call, failed, call, trl_failed, two_calls],  # two rounds (the cap), the third turn's two calls cut by it
        [call, result, call],  # one round, then the length budget cut the second call's result
    ]
    masks = [[1] * 4, [1] * 3 + [0] * 5 + [1] * 2, [1] * 3 + [0] * 5 + [1] * 3 + [0] * 5 + [1] * 4, [1] * 10]
    metrics = tool_metrics(completions, masks, max_iterations=2)
    assert metrics == {
        "tools/calls_per_completion": (0 + 1 + 2 + 1) / 4,
        "tools/turns": (1 + 2 + 3 + 2) / 4,
        "tools/errors": 2.0,
        "tools/cut_by_cap": 2.0,
        "tools/cut_by_length": 1.0,
        "tools/token_fraction": 15 / sum(len(m) for m in masks),
    }
    assert tool_metrics(["plain text"], None, None)["tools/turns"] == 1.0


def test_stop_reason_of_a_multi_turn_completion_is_trls_truncation_rule():
    from trl_grpo_ext.environments.rollout import stop_reason

    eos, pad = 2, 0
    assert stop_reason([5, 6, eos, 9, 9, 7, eos], [eos, pad]) == "stop"  # the last turn ended on its own
    assert stop_reason([5, 6, eos, 9, 9, 7, 8], [eos, pad]) == "length"  # the last turn was cut
    assert stop_reason([5, 6, eos, 9, 9], [eos, pad]) == "length"  # a tool result with no turn after it
    assert stop_reason([], [eos]) == "length"
