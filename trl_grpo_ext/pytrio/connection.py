"""Connecting the loop to a PyTRIO service, and keeping the API key out of everything the loop writes.

Credentials come only from pytrio's own mechanisms: ``PYTRIO_API_KEY`` / ``PYTRIO_BASE_URL`` (read when pytrio is
imported), the profile written by ``trio login``, or `pytrio.configure`. ``pytrio_base_url: local`` starts the
local server of `trl_grpo_ext.pytrio_server` on 127.0.0.1 and points the client at it with a throw-away key.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time

from trl_grpo_ext.compat import pytrio_setting, pytrio_settings

logger = logging.getLogger(__name__)

REDACTED = "***"
LOCAL_SERVER_NAME = "local"
# Anything that looks like a bearer credential in a message we pass on.
_BEARER = re.compile(r"(?i)(authorization|bearer|api[_-]?key)([\"']?\s*[:=]\s*[\"']?|\s+)([A-Za-z0-9._\-]{8,})")


def current_api_key() -> str:
    """The key the pytrio client would use now ('' if none); never log it."""
    try:
        from pytrio.config.config import auth_state
    except ImportError:  # pytrio missing: nothing to hide
        return ""
    return auth_state.api_key or ""


def redact(text: object, secrets: tuple[str, ...] | None = None) -> str:
    """``text`` with the current API key (and bearer-looking tokens) replaced by ``***``."""
    text = str(text)
    for secret in secrets if secrets is not None else (current_api_key(),):
        if secret and len(secret) >= 4:
            text = text.replace(secret, REDACTED)
    return _BEARER.sub(lambda m: m.group(1) + m.group(2) + REDACTED, text)


class RedactingFilter(logging.Filter):
    """Rewrites log records so the API key cannot reach a handler."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed record is logged as is
            return True
        cleaned = redact(message)
        if cleaned != message:
            record.msg, record.args = cleaned, None
        return True


def install_log_redaction() -> None:
    """Attach `RedactingFilter` to the root and pytrio handlers (idempotent)."""
    for name in ("", "pytrio", "trl_grpo_ext"):
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, RedactingFilter) for f in handler.filters):
                handler.addFilter(RedactingFilter())


@contextlib.contextmanager
def local_server(base_model: str, **options):
    """Run the local pytrio server (`trl_grpo_ext.pytrio_server`) for ``base_model`` on 127.0.0.1 in this process;
    yields the server (``.base_url``, ``.api_key``, a fresh random key)."""
    try:
        from trl_grpo_ext.pytrio_server import running_server  # torch and the [pytrio] extra: local server only
    except ImportError as error:
        raise RuntimeError(
            f"pytrio_base_url: local needs the local server, which cannot be imported: {error}"
        ) from None
    with running_server(base_model, **options) as server:
        yield server


def configure_client(base_url: str | None = None, api_key: str | None = None, home: str | None = None) -> None:
    """Point pytrio at ``base_url`` (None keeps pytrio's own setting) before the `ServiceClient` is created."""
    import pytrio as trio

    kwargs = {}
    if home is not None:
        kwargs["home"] = home
    if base_url is not None:
        kwargs["base_url"] = base_url
    if api_key is not None:
        kwargs["api_key"] = api_key
    if kwargs:
        trio.configure(**kwargs)


def current_base_url() -> str:
    """The service address the pytrio client would use now ("" without pytrio)."""
    try:
        from pytrio.config.config import configuration
    except ImportError:
        return ""
    return configuration.base_url


def create_service_client(retry_window_s: float | None = None):
    """`pytrio.ServiceClient()` with credential problems turned into one clear, key-free message.

    `retry_window_s`: how long this client's calls retry a service that does not answer (pytrio's training, sampling
    and Control retry windows, 15 min by default) before they fail; the loop keeps it short and retries itself,
    saying so (`ServiceOutage`). Other clients of the process keep pytrio's settings.
    """
    import pytrio as trio
    from pytrio.config.config import configuration

    base_url = configuration.base_url
    if not current_api_key():
        raise RuntimeError(
            f"No PyTRIO API key configured for {base_url}: run `trio login`, or set PYTRIO_API_KEY "
            "(and PYTRIO_BASE_URL for another server); or use pytrio_base_url: local for the offline server."
        )
    logger.info("connecting to PyTRIO at %s", base_url)
    # the windows are set for this client's creation only (pytrio 0.2.8 has no Control window)
    windows = dict.fromkeys(RETRY_WINDOWS, retry_window_s) if retry_window_s is not None else {}
    try:
        with pytrio_settings(**windows):
            return trio.ServiceClient()
    except trio.PyTrioError as error:
        if retry_window_s is not None and service_lost(error):
            raise ServiceLost(f"could not open a PyTRIO session at {base_url}: {redact(error)}") from None
        raise RuntimeError(f"Could not open a PyTRIO session at {base_url}: {redact(error)}") from None


def close_service_client(service) -> None:
    """Release `service` (its session, connections and threads) without waiting on a service that is gone: its
    Control retries are cut to nothing first (the close is best effort)."""
    runtime = getattr(service, "_runtime", None)  # pytrio 0.2.8 and 0.2.9 keep the lifecycle there
    if runtime is None:
        return
    try:
        window = pytrio_setting("control_retry_timeout_seconds")  # None on 0.2.8: its Control retries by attempts
        if window:
            setattr(runtime.configuration, window, 0.0)
        runtime.shutdown(status="CANCELLED")
    except Exception:  # noqa: BLE001 - best effort: the process goes on with a new client
        logger.debug("closing a PyTRIO client failed", exc_info=True)


class ServiceLost(RuntimeError):
    """The service stopped answering, or answers but no longer knows this client's session or runs (restarted)."""


# pytrio's codes for a session or run the service does not know (a restarted server forgot them)
_FORGOTTEN = ("service_session_not_found", "training_run_not_found", "sampling_run_not_found", "event_not_found")
RETRY_WINDOWS = ("training_retry_timeout_seconds", "sampling_retry_timeout_seconds", "control_retry_timeout_seconds")


def service_lost(error: BaseException) -> bool:
    """Whether `error`, raised by a pytrio call, means the service is unreachable (no HTTP answer: refused, reset,
    timed out; or 502/503/504, a proxy without its server or a server stopping, after pytrio's retries) or restarted
    (it no longer knows our session or runs). A 500 is a failure of the call, not of the service."""
    try:
        from pytrio.errors.base import PyTrioError
    except ImportError:
        return False
    if not isinstance(error, PyTrioError):
        return False
    status = getattr(error, "status_code", 0) or 0
    if status == 0:
        return bool(getattr(error, "retryable", False))
    if status in (502, 503, 504):
        return True
    text = f"{getattr(error, 'code', '')} {error}"
    return status == 404 and any(code in text for code in _FORGOTTEN)


def service_answers(base_url: str, timeout: float = 3.0) -> bool:
    """Whether anything answers HTTP at `base_url` (any status: the probe carries no key)."""
    import httpx

    try:
        httpx.get(base_url, timeout=timeout)
    except httpx.HTTPError:
        return False
    return True


class ServiceOutage:
    """The loop's side of a service that stopped answering: one line when it is noticed, one per retry, and a verdict.

    The budget runs from the first failure until a step completes again (`over`), across reconnections that fail
    again at once, so a server that keeps dropping the loop cannot hold it forever.
    """

    def __init__(self, base_url: str, budget_s: float, probe=service_answers, sleep=time.sleep, clock=time.monotonic):
        self.base_url, self.budget_s = base_url, budget_s
        self._probe, self._sleep, self._clock = probe, sleep, clock
        self.started: float | None = None
        self.attempts = 0
        self._delay = 1.0  # grows over the whole outage: a service that answers but drops us again is not hammered

    def elapsed(self) -> float:
        return 0.0 if self.started is None else self._clock() - self.started

    def wait(self, error: BaseException) -> bool:
        """After `error` (a `ServiceLost`): retry until the service answers (True) or the budget is spent (False)."""
        if self.budget_s <= 0:  # retries are off: the caller stops with the error
            return False
        if self.started is None:
            self.started = self._clock()
            logger.warning(
                "PyTRIO service at %s stopped answering (%s); retrying for up to %.0f s (server_retry_budget_s), "
                "then continuing from the last saved state", self.base_url, redact(error), self.budget_s,
            )  # fmt: skip
        else:
            logger.warning("PyTRIO service at %s failed again (%s)", self.base_url, redact(error))
        while self.elapsed() < self.budget_s:
            self._sleep(min(self._delay, max(0.0, self.budget_s - self.elapsed())))
            self._delay = min(self._delay * 2, 10.0)
            self.attempts += 1
            if self._probe(self.base_url):
                logger.warning(
                    "PyTRIO service at %s answers again after %.0f s; reconnecting", self.base_url, self.elapsed()
                )
                return True
            logger.warning(
                "still no answer from %s after %.0f s (retry %d; giving up at %.0f s)",
                self.base_url, self.elapsed(), self.attempts, self.budget_s,
            )  # fmt: skip
        return False

    def over(self) -> None:
        """A step completed: the next failure starts a new outage with the whole budget."""
        if self.started is not None:
            logger.info("PyTRIO service at %s: back to normal after %.0f s", self.base_url, self.elapsed())
        self.started, self.attempts, self._delay = None, 0, 1.0
