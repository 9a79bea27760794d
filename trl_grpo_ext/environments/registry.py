"""Environments by name (the recipes' ``environments`` key) and the check of their definitions at start."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from trl_grpo_ext.environments.calculator import CalculatorEnvironment
from trl_grpo_ext.environments.retrieval import RetrievalEnvironment
from trl_grpo_ext.environments.tools import environment_tools, tool_problems

ENVIRONMENTS: dict[str, type] = {"calculator": CalculatorEnvironment, "retrieval": RetrievalEnvironment}


def environment_problems(environment_class: type, name: str | None = None) -> list[str]:
    """One line per problem of an environment class: no callable ``reset``, a tool the model could not be shown
    (`tool_problems`)."""
    where = f"environment {name or environment_class.__name__}"
    problems = []
    if not callable(getattr(environment_class, "reset", None)):
        problems.append(f"{where}: no reset() method")
    for function in environment_tools(environment_class):  # none is fine: an environment may only own a reward
        problems += tool_problems(function, where=f"{where}.")
    return problems


def definition_problems(tools=None, factory=None) -> list[str]:
    """Problems of a trainer's ``tools`` and ``environment_factory`` (a class, or a dict of classes), one line each,
    before any model loads; factories that are not classes are left to TRL's own probe of an instance."""
    problems = []
    for function in tools or []:
        problems += tool_problems(function)
    factories = factory if isinstance(factory, dict) else {None: factory} if factory is not None else {}
    for name, candidate in factories.items():
        if isinstance(candidate, type):
            problems += environment_problems(candidate, name)
    return problems


def environment_factory(names: Sequence[str]) -> Callable | dict[str, Callable]:
    """TRL's ``environment_factory`` for `names`: the class itself for one name, a {name: class} dict for several
    (then each dataset row names its environment in an ``environment`` column)."""
    unknown = [name for name in names if name not in ENVIRONMENTS]
    if unknown or not names:
        raise ValueError(f"environments: unknown {unknown or names!r}; choose from {sorted(ENVIRONMENTS)}")
    if len(names) == 1:
        return ENVIRONMENTS[names[0]]
    return {name: ENVIRONMENTS[name] for name in names}
