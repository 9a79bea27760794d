"""Progress bars for long work (evals, model conversion, sweeps), shown the way TRL shows its training bar.

A bar is shown only when it was asked for (`--no-progress`, a recipe's `disable_tqdm: true` or a caller's
`progress=False` turn it off) and both stdout and stderr are terminals: a log file, a pipe or a sweep's
`train.log` never fills up with carriage-return redraws.
"""

from __future__ import annotations

import sys

from tqdm.auto import tqdm


def _is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # a replaced stream without isatty, or one already closed
        return False


def show_progress(requested: bool = True) -> bool:
    """Whether to draw a progress bar: `requested`, and stdout and stderr (tqdm's stream) are both terminals."""
    return bool(requested) and _is_terminal(sys.stdout) and _is_terminal(sys.stderr)


def progress_bar(total: int | None, desc: str, unit: str, requested: bool = True, **kwargs) -> tqdm:
    """A tqdm bar over `total` units, disabled unless `show_progress(requested)`; use it as a context manager."""
    return tqdm(total=total, desc=desc, unit=unit, disable=not show_progress(requested), dynamic_ncols=True, **kwargs)
