"""Test hook of the local server: answer matching requests with an error status a fixed number of times."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class Fault:
    path_contains: str
    status: int
    remaining: int
    method: str | None = None
    hits: int = 0


@dataclass
class FaultInjector:
    """Test hook: answer matching requests with an error status a fixed number of times."""

    faults: list[Fault] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, path_contains: str, status: int = 500, times: int = 1, method: str | None = None) -> Fault:
        fault = Fault(path_contains, status, times, method.upper() if method else None)
        with self.lock:
            self.faults.append(fault)
        return fault

    def take(self, method: str, path: str) -> Fault | None:
        with self.lock:
            for fault in self.faults:
                if fault.remaining > 0 and fault.path_contains in path and fault.method in (None, method):
                    fault.remaining -= 1
                    fault.hits += 1
                    return fault
        return None
