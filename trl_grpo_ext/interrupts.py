"""Ctrl-C as a stop at the next step boundary, for both execution paths' training loops.

`GracefulStop` replaces SIGINT's handler while a loop trains: the first Ctrl-C sets ``requested`` and says what
happens next (the loop finishes the step it is in, saves a checkpoint a resume continues from, and stops); a second
one stops at once, as Python would (KeyboardInterrupt). Signals reach Python's main thread only: elsewhere it does
nothing; an ignored SIGINT (``nohup``, a background job) stays ignored.
"""

from __future__ import annotations

import signal
import threading


class GracefulStop:
    def __init__(self, message: str):
        self.message = message
        self.requested = False
        self._previous = None

    def _handle(self, signum, frame):
        if self.requested:  # the second Ctrl-C: stop now
            self.restore()
            raise KeyboardInterrupt
        self.requested = True
        print(f"\nCtrl-C: {self.message}; Ctrl-C again to stop at once", flush=True)

    def install(self) -> GracefulStop:
        """Take over SIGINT, unless it is ignored (a run started with ``nohup`` or in the background keeps ignoring
        it) or this is not the main thread."""
        if threading.current_thread() is not threading.main_thread() or self._previous is not None:
            return self
        if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def __enter__(self) -> GracefulStop:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.restore()
