"""A retrieval-style environment: the model looks facts up in a local table (`FACTS`) with its ``lookup`` tool;
GSM8K-style problems that need one of them (`retrieval_problems`); the environment owns a reward: whether the
rollout looked the needed fact up."""

from __future__ import annotations

import random

from trl_grpo_ext.environments.tools import ToolError, tool

MAX_TOPIC_CHARS = 100

# topic -> (value, the noun a problem counts)
FACTS: dict[str, tuple[int, str]] = {
    "legs of a spider": (8, "legs"),
    "legs of an insect": (6, "legs"),
    "days in a week": (7, "days"),
    "months in a year": (12, "months"),
    "hours in a day": (24, "hours"),
    "minutes in an hour": (60, "minutes"),
    "sides of a hexagon": (6, "sides"),
    "sides of an octagon": (8, "sides"),
    "players on a soccer team": (11, "players"),
    "strings on a violin": (4, "strings"),
    "eggs in a dozen": (12, "eggs"),
    "cards in a deck": (52, "cards"),
}

# how the question names each topic's thing
_THINGS = {
    "legs of a spider": "spiders",
    "legs of an insect": "insects",
    "days in a week": "weeks",
    "months in a year": "years",
    "hours in a day": "days",
    "minutes in an hour": "hours",
    "sides of a hexagon": "hexagons",
    "sides of an octagon": "octagons",
    "players on a soccer team": "soccer teams",
    "strings on a violin": "violins",
    "eggs in a dozen": "dozens",
    "cards in a deck": "decks",
}


def _normalise(topic: str) -> str:
    return " ".join(topic.lower().replace("?", " ").split())


def retrieval_problems(num_samples: int, seed: int = 0) -> list[dict]:
    """`num_samples` problems that need one fact of `FACTS`: {'question', 'answer' (GSM8K's '#### N'), 'fact'}."""
    generator = random.Random(seed)
    topics = sorted(FACTS)
    rows = []
    for _ in range(num_samples):
        topic = generator.choice(topics)
        value, noun = FACTS[topic]
        count, extra = generator.randint(2, 9), generator.randint(1, 20)
        question = (
            f"There are {count} {_THINGS[topic]} and {extra} more {noun} besides. How many {noun} are there in "
            f"total? Look up '{topic}' if you do not know it."
        )
        rows.append({"question": question, "answer": f"#### {count * value + extra}", "fact": topic})
    return rows


class RetrievalEnvironment:
    """Facts from a local table (TRL's ``environment_factory`` protocol); the reward it owns (`get_reward`) is 1.0
    when the rollout looked up the fact its problem needs (``fact`` of the row), else 0.0."""

    def __init__(self, facts: dict[str, tuple[int, str]] | None = None):
        self._facts = {_normalise(topic): value for topic, (value, _) in (facts or FACTS).items()}
        self._needed: str | None = None
        self._found: set[str] = set()
        self.tool_calls = 0
        self.tool_errors = 0

    def reset(self, **row) -> None:
        """A new rollout for `row` (its ``fact`` column names the fact the problem needs)."""
        fact = row.get("fact")
        self._needed = _normalise(fact) if isinstance(fact, str) else None
        self._found = set()
        self.tool_calls = 0
        self.tool_errors = 0

    @tool
    def lookup(self, topic: str) -> str:
        """Look a fact up in the reference table.

        Args:
            topic: What to look up, e.g. "days in a week".
        """
        if not isinstance(topic, str):
            raise ToolError(f"topic must be a string, not {type(topic).__name__}")
        if len(topic) > MAX_TOPIC_CHARS:
            raise ToolError(f"topic longer than {MAX_TOPIC_CHARS} characters")
        key = _normalise(topic)
        if key in self._facts:
            self._found.add(key)
            return str(self._facts[key])
        known = ", ".join(sorted(self._facts))
        return f"No fact for {topic!r}. Known topics: {known}."

    def get_reward(self) -> float:
        """1.0 when this rollout looked up the fact its problem needs, else 0.0."""
        return float(self._needed is not None and self._needed in self._found)
