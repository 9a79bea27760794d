"""`calculate(expression)`: arithmetic by walking the expression's AST (never ``eval``), bounded in length, in the
size of every number, in exponents and in time; and `CalculatorEnvironment`, the environment whose tool it is."""

from __future__ import annotations

import ast
import math
import operator
import time
from fractions import Fraction

from trl_grpo_ext.environments.tools import ToolError, tool

MAX_EXPRESSION_CHARS = 200
MAX_NODES = 100
MAX_EXPONENT = 64
MAX_DIGITS = 60  # digits of any integer or numerator/denominator along the way
TIME_BUDGET_S = 0.05

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _bounded(value: Fraction) -> Fraction:
    limit = 10**MAX_DIGITS
    if abs(value.numerator) >= limit or value.denominator >= limit:
        raise ToolError(f"a number along the way has more than {MAX_DIGITS} digits")
    return value


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise ToolError("only whole-number exponents are supported")
    if abs(exponent) > MAX_EXPONENT:
        raise ToolError(f"exponent {exponent} is larger than {MAX_EXPONENT}")
    if base == 0 and exponent < 0:
        raise ToolError("division by zero")
    # |base| < 10**MAX_DIGITS and |exponent| <= MAX_EXPONENT: check the size before computing it
    if abs(base) > 1 and int(exponent) * math.log10(abs(float(base))) > MAX_DIGITS:
        raise ToolError(f"the result has more than {MAX_DIGITS} digits")
    return base ** int(exponent)


def _format(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    decimal = value.numerator / value.denominator
    return f"{decimal:.10g}"


def evaluate(expression: str) -> Fraction:
    """The exact value of an arithmetic expression: numbers, + - * / // % ** and parentheses; `ToolError` else."""
    if not isinstance(expression, str):
        raise ToolError(f"expression must be a string, not {type(expression).__name__}")
    text = expression.strip().replace("^", "**").replace("×", "*").replace("÷", "/").replace(",", "")
    if not text:
        raise ToolError("empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ToolError(f"not an arithmetic expression: {expression!r}") from None
    nodes = sum(1 for _ in ast.walk(tree))
    if nodes > MAX_NODES:
        raise ToolError(f"expression has more than {MAX_NODES} parts")
    deadline = time.monotonic() + TIME_BUDGET_S

    def value(node) -> Fraction:
        if time.monotonic() > deadline:
            raise ToolError("timed out")
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            number = node.value
            if isinstance(number, float) and not math.isfinite(number):
                raise ToolError("not a finite number")
            return _bounded(Fraction(number) if isinstance(number, int) else Fraction(repr(number)))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
            return _bounded(_power(value(node.left), value(node.right)))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if right == 0 and type(node.op) in (ast.Div, ast.FloorDiv, ast.Mod):
                raise ToolError("division by zero")
            result = _BINARY[type(node.op)](left, right)
            return _bounded(Fraction(result))
        raise ToolError(f"unsupported element {type(node).__name__} (numbers, + - * / // % ** and parentheses only)")

    return value(tree.body)


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: The expression, with numbers, +, -, *, /, //, %, ** and parentheses, e.g. "(48 + 24) / 2".
    """
    return _format(evaluate(expression))


class CalculatorEnvironment:
    """A calculator the model may call while it solves a problem (TRL's ``environment_factory`` protocol).

    The reward stays with the recipe's reward functions (the boxed answer): this environment owns none.
    """

    def __init__(self):
        self.tool_calls = 0
        self.tool_errors = 0

    def reset(self, **row) -> None:
        """A new rollout: nothing to show the model beyond the prompt."""
        self.tool_calls = 0
        self.tool_errors = 0

    @tool
    def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression and return its value.

        Args:
            expression: The expression, with numbers, +, -, *, /, //, %, ** and parentheses, e.g. "(48 + 24) / 2".
        """
        return calculate(expression)
