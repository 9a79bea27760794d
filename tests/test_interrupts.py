"""Ctrl-C as a stop at the next step boundary (`trl_grpo_ext.interrupts.GracefulStop`): the first asks, the second
stops at once, the previous handler comes back, and a SIGINT the process was started to ignore stays ignored."""

import os
import signal

import pytest

from trl_grpo_ext.interrupts import GracefulStop


@pytest.fixture
def terminal_sigint():
    """SIGINT handled as in a terminal (a background job, as a CI runner may be, starts with it ignored)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_the_first_ctrl_c_asks_for_a_stop_and_the_second_stops_at_once(terminal_sigint, capsys):
    with GracefulStop("stopping after this step") as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested
        assert "Ctrl-C: stopping after this step; Ctrl-C again to stop at once" in capsys.readouterr().out
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_the_previous_handler_comes_back(terminal_sigint):
    with GracefulStop("x"):
        assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_ignored_sigint_stays_ignored():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with GracefulStop("x") as stop:
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGINT)
            assert not stop.requested
    finally:
        signal.signal(signal.SIGINT, previous)
