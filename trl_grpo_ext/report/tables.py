"""Markdown tables of the reports (`tabulate`'s GitHub format): cells written as given, one row per line."""

from __future__ import annotations

from tabulate import tabulate


def escape(text: str) -> str:
    """A cell's text with the characters that would break a markdown row (`|`, newlines) made harmless."""
    return text.replace("|", "\\|").replace("\n", " ")


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """`| a | b |` rows under a header: cells are already formatted strings (no number parsing, no padding)."""
    return tabulate(rows, headers=header, tablefmt="github", stralign=None, numalign=None, disable_numparse=True)
