"""One spelling for what the pytrio client releases the server supports name differently, for tests that reach past
the client's public calls: pytrio 0.2.9 renamed a run's id attribute (0.2.8's ``task_id``) and made its actor calls
coroutines on the client's event loop (0.2.8's return at once). CI runs the client tests with 0.2.9 (`make test`) and
with 0.2.8 (`make test-pytrio028`); the protocol on the wire is the same (docs/pytrio_server.md, "Client versions").
"""

from __future__ import annotations

import inspect


def run_id(client) -> str:
    """The run id of a training or sampling client (``training_run_cuid`` / ``sampling_run_cuid``, else ``task_id``)."""
    for name in ("training_run_cuid", "sampling_run_cuid", "task_id"):
        if hasattr(client, name):
            return getattr(client, name)
    raise AttributeError(f"{type(client).__name__} has no run id")


def coordinator(training_client):
    """The object that submits a training client's events and turns their answers into futures (its
    ``actor_client``, ``_future_for_response``): 0.2.9's coordinator, 0.2.8's actor training session."""
    binding = getattr(training_client, "_actor_binding", None)
    return binding.coordinator if binding is not None else training_client._actor_state.session


def on_client_loop(client, value):
    """`value`, or what the coroutine `value` returns run on `client`'s event loop (a service or training client)."""
    if not inspect.iscoroutine(value):
        return value
    runtime = client._runtime
    runner = getattr(runtime, "event_loop", None) or runtime.holder
    return runner.run_sync(value)


def configure(**options) -> None:
    """`pytrio.configure` with settings named as pytrio 0.2.9 names them (renamed for 0.2.8)."""
    import pytrio

    from trl_grpo_ext.compat import pytrio_configure_options

    pytrio.configure(**pytrio_configure_options(options))
