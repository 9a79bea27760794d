"""`\\boxed{}` / `\\fbox{}` extraction, the box spans the format reward and the vetoes read, and the one rule
for "the boxes of a completion disagree"."""

from __future__ import annotations

import re
from typing import NamedTuple

from trl_grpo_ext.task.answers.equality import same_answer
from trl_grpo_ext.task.answers.text import completion_text

# Box search looks at the last MAX_SCAN_CHARS characters of a completion (a final answer sits at its
# end); if that region holds more than MAX_BRACE_TOKENS braces, only its last MAX_BRACE_TOKENS characters.
# Brace matching runs one Python step per brace, so this bounds it on adversarial input.
MAX_SCAN_CHARS = 100_000
MAX_BRACE_TOKENS = 4_000
# A box whose content is longer than this is not an answer (it is an unclosed box that a much later
# `}` happened to close); boxes inside it then count on their own.
MAX_BOX_CHARS = 2_000

_BOX_START = re.compile(r"\\(?:boxed|fbox)\s*\{")
# Escaped braces first so `\{` and `\}` (set notation) never count for grouping.
_BOX_TOKEN = re.compile(r"\\[{}]|\\(?:boxed|fbox)\s*\{|[{}]")


class BoxSpan(NamedTuple):
    """Where one box sits in the text it was found in: `text[start:end]` is `\\boxed{...}` and
    `text[content_start:content_end]` its content."""

    start: int
    content_start: int
    content_end: int
    end: int


def _scan_region_start(text: str) -> int:
    start = max(0, len(text) - MAX_SCAN_CHARS)
    region = text[start:]
    if len(region) > MAX_BRACE_TOKENS and region.count("{") + region.count("}") > MAX_BRACE_TOKENS:
        return len(text) - MAX_BRACE_TOKENS
    return start


def box_spans(text: str) -> list[BoxSpan]:
    """The top-level closed boxes of `text`, in order, as offsets into `text`. Only the scanned tail of
    the text counts (see MAX_SCAN_CHARS / MAX_BRACE_TOKENS); unclosed boxes are no answer; a closed box
    nested in another closed box is not top-level; a box longer than MAX_BOX_CHARS is dropped; an empty box
    (`\\boxed{}`, only whitespace inside) is no answer either: it is not a box for the format reward, the
    `no_box` veto or the eval's boxed rate (RL found it: a box that commits to nothing earned the format credit
    of a wrong answer, docs/rewards.md)."""
    if "\\boxed" not in text and "\\fbox" not in text:
        return []
    offset = _scan_region_start(text)
    region = text[offset:]
    return [
        BoxSpan(offset + a, offset + b, offset + c, offset + c + 1)
        for a, b, c in _region_spans(region)
        if region[b:c].strip()
    ]


def _region_spans(text: str) -> list[tuple[int, int, int]]:
    """(box_start, content_start, content_end) of the top-level closed boxes of `text`.

    One pass with a stack; between boxes the search jumps to the next `\\boxed{` at C speed."""
    closed: list[tuple[int, int, int]] = []
    pos = 0
    while True:
        m = _BOX_START.search(text, pos)
        if m is None:
            break
        # (box_start, content_start) for a box's brace, None for a plain brace
        stack: list[tuple[int, int] | None] = [(m.start(), m.end())]
        open_boxes = 1
        pos = len(text)
        for tok in _BOX_TOKEN.finditer(text, m.end()):
            g = tok.group()
            if g == "}":
                opened = stack.pop()
                if opened is not None:
                    open_boxes -= 1
                    if tok.start() - opened[1] <= MAX_BOX_CHARS:
                        closed.append((opened[0], opened[1], tok.start()))
                    if open_boxes == 0:
                        pos = tok.end()
                        break
            elif g == "{":
                stack.append(None)
            elif len(g) > 2:
                stack.append((tok.start(), tok.end()))
                open_boxes += 1
    if len(closed) < 2:
        return closed
    # Closed boxes are nested or disjoint; sorting by (start, -end) puts each parent before its children.
    closed.sort(key=lambda span: (span[0], -span[2]))
    top, reach = [], -1
    for span in closed:
        if span[0] >= reach:
            top.append(span)
            reach = span[2]
    return top


def box_contents(text: str, spans: list[BoxSpan]) -> list[str]:
    return [text[s.content_start : s.content_end].strip() for s in spans]


def extract_all_boxed(text) -> list[str]:
    """Contents of every top-level closed `\\boxed{...}` / `\\fbox{...}` in `text`, in order (stripped).
    Braces are balanced (`\\boxed{\\frac{1}{2}}`); an unclosed box is no answer."""
    text = completion_text(text)
    return box_contents(text, box_spans(text))


def extract_boxed(text) -> str | None:
    """Content of the last top-level closed box in `text`, or None."""
    boxes = extract_all_boxed(text)
    return boxes[-1] if boxes else None


def boxes_disagree(boxes: list[str]) -> bool:
    """Whether some box states a different answer from the last one (`\\boxed{17} ... \\boxed{18}`);
    repeats of one answer in other spellings (`18`, `\\$18.00`, `2 \\times 9`) agree. Decided without
    math-verify (`same_answer`), so it is instant and the same everywhere."""
    return any(not same_answer(b, boxes[-1]) for b in set(boxes[:-1]))
