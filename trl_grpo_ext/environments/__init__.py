"""Tools and environments for multi-turn GRPO, in TRL's ``environment_factory`` protocol (one class per environment:
``reset(**row)``, public methods as tools with docstrings, an optional ``get_reward()`` the environment owns), used by
both execution paths: the safe calculator, the fact-table retrieval environment, tool-definition checks, tool
metrics."""

from trl_grpo_ext.environments.calculator import CalculatorEnvironment, calculate
from trl_grpo_ext.environments.metrics import TOOL_METRIC_KEYS, tool_metrics
from trl_grpo_ext.environments.registry import (
    ENVIRONMENTS,
    definition_problems,
    environment_factory,
    environment_problems,
)
from trl_grpo_ext.environments.retrieval import FACTS, RetrievalEnvironment, retrieval_problems
from trl_grpo_ext.environments.tools import ToolError, environment_tools, tool, tool_problems

__all__ = [
    "ENVIRONMENTS",
    "FACTS",
    "TOOL_METRIC_KEYS",
    "CalculatorEnvironment",
    "RetrievalEnvironment",
    "ToolError",
    "calculate",
    "definition_problems",
    "environment_factory",
    "environment_problems",
    "environment_tools",
    "retrieval_problems",
    "tool",
    "tool_metrics",
    "tool_problems",
]
