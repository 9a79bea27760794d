"""Service calls as the loop makes them: submitted (`call`) and waited for (`wait`), every failure one
`PyTrioLoopError` free of credentials; a lost service (`connection.service_lost`) a `ServiceLostError`, which the
loop answers by waiting for the service and resuming."""

from __future__ import annotations

from concurrent.futures import TimeoutError as FutureTimeout

from trl_grpo_ext.pytrio.connection import ServiceLost, redact, service_lost


class PyTrioLoopError(RuntimeError):
    """A service call failed or answered something the loop cannot train on; the message names which."""


class ServiceLostError(PyTrioLoopError, ServiceLost):
    """A service call failed because the service stopped answering or forgot the run (`connection.service_lost`)."""


def _failure(what: str, error: BaseException) -> PyTrioLoopError:
    kind = ServiceLostError if service_lost(error) else PyTrioLoopError
    return kind(f"{what} failed: {type(error).__name__}: {redact(error)}")


def wait(future, what: str, timeout: float):
    """Result of a pytrio APIFuture, with every failure as a `PyTrioLoopError` free of credentials."""
    try:
        return future.result(timeout=timeout)
    except FutureTimeout:
        raise PyTrioLoopError(f"{what}: no answer from the service within {timeout:.0f} s") from None
    except PyTrioLoopError:
        raise
    except Exception as error:  # noqa: BLE001 - every service failure is reported the same way
        raise _failure(what, error) from None


def call(fn, what: str, *args, **kwargs):
    """Submit a pytrio call; a failure to submit becomes a `PyTrioLoopError` free of credentials."""
    try:
        return fn(*args, **kwargs)
    except PyTrioLoopError:
        raise
    except Exception as error:  # noqa: BLE001
        raise _failure(what, error) from None
