"""Tools as the model sees them: the check of a tool's definition (one line per problem, before any model loads),
the methods of an environment that are its tools (TRL's rule), and `tool`, the guard that turns a tool's failure
into a message to the model (``ERROR_PREFIX``) and counts it, so a failing tool never stops a run."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

# A tool result starting with this is a failure the model reads (and `metrics.tool_metrics` counts).
ERROR_PREFIX = "Error: "
# The methods of an environment that are not tools (TRL 1.16's `_generate_and_score_completions`).
NOT_TOOLS = ("reset", "get_reward")


class ToolError(Exception):
    """A tool's refusal (bad argument, too large, timed out): its message goes back to the model."""


def tool(method: Callable) -> Callable:
    """Guard an environment's tool method: a `ToolError` or any other exception becomes ``"Error: ..."`` returned
    to the model, counted on the instance (``tool_errors``); each call is counted (``tool_calls``). The signature,
    type hints and docstring stay the method's, so the schema the model sees is unchanged."""

    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        self.tool_calls = getattr(self, "tool_calls", 0) + 1
        try:
            return method(self, *args, **kwargs)
        except ToolError as error:
            message = str(error)
        except Exception as error:  # a tool's own bug is the model's error message too, never the run's end
            message = f"{type(error).__name__}: {error}"
        self.tool_errors = getattr(self, "tool_errors", 0) + 1
        return ERROR_PREFIX + message

    return guarded


def tool_problems(func: Callable, where: str = "") -> list[str]:
    """Why the model could not be shown `func` as a tool (no docstring, an unannotated or unsupported parameter,
    an undocumented argument), as one line each; [] when it is fine. transformers builds the schema TRL renders."""
    from transformers.utils import get_json_schema  # transformers: only when tools are checked

    name = f"{where}{getattr(func, '__name__', repr(func))}"
    if not callable(func):
        return [f"tool {name}: not callable"]
    if not inspect.getdoc(func):
        return [f"tool {name}: no docstring (the model reads the tool's description and its Args: from it)"]
    try:
        get_json_schema(func)
    except Exception as error:  # transformers' TypeHintParsingException / DocstringParsingException, one line
        first = " ".join(str(error).split()).split(". ")[0]  # transformers' first sentence says what is wrong
        return [f"tool {name}: {first}"]
    return []


def environment_tools(environment_class: type) -> list[Callable]:
    """The tools of an environment class as TRL 1.16 finds them: its public functions except ``reset`` and
    ``get_reward``."""
    return [
        member
        for name, member in inspect.getmembers(environment_class, predicate=inspect.isfunction)
        if name not in NOT_TOOLS and not name.startswith("_")
    ]
