"""`trl_grpo_ext.progress`: bars only when asked for and both output streams are terminals."""

import io
import sys

import pytest

from trl_grpo_ext.progress import progress_bar, show_progress


class _Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize(
    "stdout_tty, stderr_tty, requested, shown",
    [(True, True, True, True), (True, True, False, False), (False, True, True, False), (True, False, True, False)],
)
def test_bar_only_when_requested_on_a_terminal(monkeypatch, stdout_tty, stderr_tty, requested, shown):
    monkeypatch.setattr(sys, "stdout", _Terminal() if stdout_tty else io.StringIO())
    monkeypatch.setattr(sys, "stderr", _Terminal() if stderr_tty else io.StringIO())
    assert show_progress(requested) is shown
    with progress_bar(3, "eval", "problem", requested) as bar:
        bar.update(3)
        assert bar.disable is (not shown)


def test_a_stream_without_isatty_counts_as_no_terminal(monkeypatch):
    monkeypatch.setattr(sys, "stdout", object())
    assert show_progress() is False
