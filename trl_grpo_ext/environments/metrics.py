"""Per-step tool metrics of multi-turn completions, the same for both paths: computed from the completions as
messages (TRL's form: the assistant turns, each tool result a ``tool`` message) and each completion's tool mask
(1 = the model's token, 0 = a tool's)."""

from __future__ import annotations

from collections.abc import Sequence

from trl_grpo_ext.environments.tools import ERROR_PREFIX

TOOL_METRIC_KEYS = (
    "tools/calls_per_completion",
    "tools/turns",
    "tools/errors",
    "tools/cut_by_cap",
    "tools/cut_by_length",
    "tools/token_fraction",
)


def _is_error(content) -> bool:
    # ours ("Error: ..."); TRL's own catch of a raising tool is str({"error": ...})
    return isinstance(content, str) and (content.startswith(ERROR_PREFIX) or content.startswith("{'error': "))


def completion_tool_counts(messages: Sequence[dict], max_iterations: int | None) -> dict[str, int]:
    """One completion's counts: executed calls, assistant turns, failed calls, calls never run (the last turn's,
    cut by the iteration cap when the rollout used every round, else by the length budget)."""
    if isinstance(messages, str):  # a text completion: one turn, no tools
        return {"calls": 0, "turns": 1, "errors": 0, "cut_by_cap": 0, "cut_by_length": 0}
    messages = list(messages)
    tool_messages = [m for m in messages if m.get("role") == "tool"]
    assistant = [m for m in messages if m.get("role") == "assistant"]
    rounds = sum(
        1
        for i, m in enumerate(messages)
        if m.get("role") == "assistant" and i + 1 < len(messages) and messages[i + 1].get("role") == "tool"
    )
    unanswered = 0
    if messages and messages[-1].get("role") == "assistant":
        unanswered = len(messages[-1].get("tool_calls") or [])
    capped = max_iterations is not None and rounds >= max_iterations
    return {
        "calls": len(tool_messages),
        "turns": len(assistant),
        "errors": sum(_is_error(m.get("content")) for m in tool_messages),
        "cut_by_cap": unanswered if capped else 0,
        "cut_by_length": 0 if capped else unanswered,
    }


def tool_metrics(
    completions: Sequence, tool_masks: Sequence[Sequence[int]] | None, max_iterations: int | None
) -> dict[str, float]:
    """`TOOL_METRIC_KEYS` of one step: means per completion of calls and turns, counts of errors and cut calls, the
    fraction of completion tokens that are tool output."""
    counts = [completion_tool_counts(c, max_iterations) for c in completions]
    n = max(1, len(counts))
    total_tokens = sum(len(mask) for mask in tool_masks) if tool_masks is not None else 0
    tool_tokens = sum(len(mask) - sum(mask) for mask in tool_masks) if tool_masks is not None else 0
    return {
        "tools/calls_per_completion": sum(c["calls"] for c in counts) / n,
        "tools/turns": sum(c["turns"] for c in counts) / n,
        "tools/errors": float(sum(c["errors"] for c in counts)),
        "tools/cut_by_cap": float(sum(c["cut_by_cap"] for c in counts)),
        "tools/cut_by_length": float(sum(c["cut_by_length"] for c in counts)),
        "tools/token_fraction": tool_tokens / total_tokens if total_tokens else 0.0,
    }
