"""`ConfigError`: bad config values, every problem found, in one message (both paths' configs and the data spec
raise it through `raise_problems`). No project imports: every layer may raise it."""

from __future__ import annotations

from collections.abc import Sequence


class ConfigError(ValueError):
    """Bad config values: every problem found, each starting with its YAML key, in one message."""

    def __init__(self, what: str, problems: Sequence[str]):
        self.problems = list(problems)
        super().__init__(f"invalid {what}: " + "; ".join(self.problems))


def raise_problems(what: str, problems: Sequence[str]) -> None:
    """Raise one `ConfigError` listing `problems`, if there are any."""
    if problems:
        raise ConfigError(what, problems)
