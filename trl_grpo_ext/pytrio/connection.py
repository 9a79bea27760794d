"""Connecting the loop to a PyTRIO service, and keeping the API key out of everything the loop writes.

Credentials come only from pytrio's own mechanisms: ``PYTRIO_API_KEY`` / ``PYTRIO_BASE_URL`` (read when pytrio is
imported), the profile written by ``trio login``, or `pytrio.configure`. ``pytrio_base_url: local`` starts the
local server of `trl_grpo_ext.pytrio.server` on 127.0.0.1 and points the client at it with a throw-away key.
"""

from __future__ import annotations

import contextlib
import logging
import re

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
    """Run the local pytrio server (`trl_grpo_ext.pytrio.server`) for ``base_model`` on 127.0.0.1 in this process;
    yields the server (``.base_url``, ``.api_key``, a fresh random key)."""
    try:
        from trl_grpo_ext.pytrio.server import running_server  # torch and the [pytrio] extra: local server only
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


def create_service_client():
    """`pytrio.ServiceClient()` with credential problems turned into one clear, key-free message."""
    import pytrio as trio
    from pytrio.config.config import configuration

    base_url = configuration.base_url
    if not current_api_key():
        raise RuntimeError(
            f"No PyTRIO API key configured for {base_url}: run `trio login`, or set PYTRIO_API_KEY "
            "(and PYTRIO_BASE_URL for another server); or use pytrio_base_url: local for the offline server."
        )
    # pytrio retries an unreachable service for minutes (control_retry_timeout_seconds): say where we wait
    logger.info("connecting to PyTRIO at %s", base_url)
    try:
        return trio.ServiceClient()
    except trio.PyTrioError as error:
        raise RuntimeError(f"Could not open a PyTRIO session at {base_url}: {redact(error)}") from None
