"""Local PyTRIO server: request hardening, served model names, checkpoint retention, the CLI's key sources.

Raw sockets where the point is what the server does before it reads a body; the real pytrio client otherwise.
All servers of this module share one `ModelEngine` on the tiny model.
"""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields

import pytest

trio = pytest.importorskip("pytrio")

from pytrio.errors.control import ControlAPIError  # noqa: E402

from trl_grpo_ext.pytrio_server import LocalPyTrioServer, ServerConfig  # noqa: E402

VERIFY = "/api/openapi/v1/api-key/verify"
DEMO_NAME = "Qwen/Qwen3-4B-Instruct-2507"  # what the hosted service's demo scripts pass as base_model


def _raw(server: LocalPyTrioServer, head: str, body: bytes = b"", wait: float = 10.0) -> tuple[int, dict, bytes]:
    """Send `head` (request line + headers) and `body`; return (status, json answer, what followed)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=wait) as sock:
        sock.sendall(head.encode() + b"\r\n\r\n" + body)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        header, _, rest = data.partition(b"\r\n\r\n")
        length = int(next(h.split(b":")[1] for h in header.split(b"\r\n") if h.lower().startswith(b"content-length")))
        while len(rest) < length:
            rest += sock.recv(65536)
    return int(header.split()[1]), json.loads(rest[:length]), header


def test_key_is_checked_before_the_body_is_read(make_server):
    server = make_server(api_key="right-key")
    # a body of 50 MB is announced and never sent: the 401 can only come back if the server did not wait for it
    status, answer, header = _raw(
        server, f"POST /api/openapi/v1/service-sessions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer wrong\r\n"
        f"Content-Length: {50 * 1024 * 1024}", wait=10,
    )  # fmt: skip
    assert status == 401 and answer["code"] == "unauthorized"
    assert b"connection: close" in header.lower()  # the unread body makes the connection unusable
    status, answer, _ = _raw(server, f"POST /actor/v1/events HTTP/1.1\r\nHost: x\r\nContent-Length: {10**8}")
    assert status == 401 and "actor token" in answer["message"]


def test_body_size_is_capped_with_a_clear_413(make_server):
    server = make_server(api_key="k", max_request_bytes=2048)
    body = b"{" + b" " * 4000 + b"}"
    status, answer, _ = _raw(
        server, f"POST /api/openapi/v1/service-sessions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n"
        f"Content-Length: {len(body)}", body,
    )  # fmt: skip
    assert status == 413 and answer["code"] == "request_too_large"
    assert (
        "4002 bytes" in answer["message"] and "2048" in answer["message"] and "max_request_bytes" in answer["message"]
    )
    ok, _, _ = _raw(server, f"GET {VERIFY} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k")
    assert ok == 200


def _chunked(body: bytes, size: int = 1000) -> bytes:
    parts = [body[i : i + size] for i in range(0, len(body), size)]
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


def test_a_body_without_length_is_read_up_to_the_cap(make_server):
    """Chunked bodies are decoded by uvicorn; Starlette's body limit stops one at the cap, before it is all read."""
    server = make_server(api_key="k", max_request_bytes=2048)
    head = "POST /api/telemetry/event HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\nTransfer-Encoding: chunked"
    status, answer, _ = _raw(server, head, _chunked(b"{}" * 500))
    assert status == 200 and answer == {"accepted": True}
    status, answer, header = _raw(server, head, _chunked(b"x" * 4000))
    assert status == 413 and answer["code"] == "request_too_large"
    assert "more than 2048 bytes" in answer["message"] and "max_request_bytes" in answer["message"]
    assert b"connection: close" in header.lower()  # the rest of the body is never read


def test_key_is_checked_before_the_declared_size(make_server):
    """Above the cap too, a wrong key is a 401 (nothing says how large a body this server takes); the right key
    gets the 413 from the Content-Length alone: neither answer waits for the announced body, never sent."""
    server = make_server(api_key="k", max_request_bytes=1024)
    head = f"POST /api/openapi/v1/service-sessions HTTP/1.1\r\nHost: x\r\nContent-Length: {10**12}\r\n"
    status, answer, header = _raw(server, head + "Authorization: Bearer wrong")
    assert status == 401 and answer["code"] == "unauthorized" and b"connection: close" in header.lower()
    status, answer, header = _raw(server, head + "Authorization: Bearer k")
    assert status == 413 and answer["code"] == "request_too_large" and f"{10**12} bytes" in answer["message"]
    assert b"connection: close" in header.lower()
    # a small unread body is dropped by the server instead: the connection stays usable
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        body = b'{"sdk_version": "x"}'
        request = f"POST /api/openapi/v1/service-sessions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
        sock.sendall(request.encode() + b"Authorization: Bearer wrong\r\n\r\n" + body)
        sock.sendall(f"GET {VERIFY} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n\r\n".encode())
        data = b""
        while data.count(b"HTTP/1.1 ") < 2 or not data.endswith(b"}"):
            chunk = sock.recv(65536)
            assert chunk, data
            data += chunk
    assert data.startswith(b"HTTP/1.1 401") and b"\r\nHTTP/1.1 200" in data.replace(b"}HTTP", b"}\r\nHTTP")


def test_idle_and_half_sent_connections_are_closed(make_server):
    server = make_server(api_key="k", idle_timeout_seconds=0.5)
    for opening in (b"", b"GET /api/openapi/v1/api-key/verify HTTP/1.1\r\nHost: x\r\n"):  # silent; slowloris
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            sock.sendall(opening)
            start = time.monotonic()
            assert sock.recv(1024) == b""  # closed by the server, not by our 30 s timeout
            assert time.monotonic() - start < 20
    # a client that keeps talking is unaffected
    assert _raw(server, f"GET {VERIFY} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k")[0] == 200


def test_idle_timeout_covers_half_sent_bodies_and_idle_keep_alive_not_slow_answers(make_server, engine):
    import httpx

    server = make_server(api_key="k", idle_timeout_seconds=0.5)
    head = "POST /api/openapi/v1/service-sessions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\nContent-Length: 50"
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(head.encode() + b"\r\n\r\n" + b'{"sdk_versi')  # the body stops halfway
        start = time.monotonic()
        assert sock.recv(1024) == b"" and time.monotonic() - start < 20
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:  # keep-alive, then silence
        sock.sendall(f"GET {VERIFY} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n\r\n".encode())
        data = b""
        while not data.endswith(b"}"):
            data += sock.recv(65536)
        assert data.startswith(b"HTTP/1.1 200")
        start = time.monotonic()
        assert sock.recv(1024) == b"" and time.monotonic() - start < 20
    # a request the server takes longer than the idle timeout to answer is answered, not cut
    auth = {"Authorization": "Bearer k"}
    with httpx.Client(base_url=server.base_url, timeout=60) as client, ThreadPoolExecutor(1) as pool:
        sid = client.post("/api/openapi/v1/service-sessions", json={"sdk_version": "x"}, headers=auth).json()
        run = client.post(f"/api/openapi/v1/service-sessions/{sid['service_session_cuid']}/sampling-runs",
                          json={"base_model": server.model_alias}, headers=auth).json()  # fmt: skip
        token = {"Authorization": f"Bearer {run['actor_jwt']['token']}"}
        request = {"request_id": "r1", "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
                   "sampling_params": {"max_tokens": 2, "seed": 0}}  # fmt: skip
        url = f"/actor/v1/sampling-runs/{run['sampling_run_cuid']}/sample"
        with engine.for_sampling.lock:  # sampling stays busy for three idle timeouts while the request waits for it
            pending = pool.submit(client.post, url, json=request, headers=token)
            time.sleep(1.5)
        answer = pending.result(timeout=60)
    assert answer.status_code == 200 and 1 <= len(answer.json()["sequences"][0]["tokens"]) <= 2


def test_num_samples_is_capped(make_server):
    server = make_server(max_num_samples=4)
    service = trio.ServiceClient()
    try:
        sampler = service.create_sampling_client(base_model=server.model_alias)
        prompt = trio.ModelInput.from_ints([1, 2, 3])
        params = trio.SamplingParams(max_tokens=2, seed=0)
        assert len(sampler.sample(prompt, num_samples=4, sampling_params=params).result().sequences) == 4
        from pytrio.errors.actor import ActorAPIError

        with pytest.raises(ActorAPIError) as error:
            sampler.sample(prompt, num_samples=5, sampling_params=params).result()
        assert error.value.code == "too_many_samples" and "max_num_samples" in str(error.value)
    finally:
        service._runtime.shutdown()


def test_served_names_let_hosted_demo_scripts_run_unmodified(make_server):
    server = make_server(served_names=(DEMO_NAME,))
    service = trio.ServiceClient()
    try:
        assert DEMO_NAME in service.get_supported_models() and server.model_alias == DEMO_NAME
        tc = service.create_lora_training_client(base_model=DEMO_NAME, rank=4, seed=0)  # as the demo writes it
        tokens = [1, 5, 9, 14, 3, 7]
        datum = trio.Datum(model_input=trio.ModelInput.from_ints(tokens[:-1]),
                           loss_fn_inputs={"target_tokens": tokens[1:]})  # fmt: skip
        assert tc.forward_backward([datum], "cross_entropy").result().metrics["loss_sum"] > 0
        with pytest.raises(ControlAPIError) as error:
            service.create_lora_training_client(base_model="meta-llama/Llama-3.1-8B", rank=4)
        message = str(error.value)
        assert error.value.status_code == 404 and "--served-name" in message and DEMO_NAME in message
    finally:
        service._runtime.shutdown()


def _save_states(tc, names):
    tokens = [1, 5, 9, 14, 3, 7]
    datum = trio.Datum(
        model_input=trio.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:]}
    )
    paths = []
    for name in names:
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(trio.AdamParams(learning_rate=1e-2)).result()
        paths.append(tc.save_state(name).result().path)
    return paths


def test_by_default_no_saved_checkpoint_is_deleted(make_server, tmp_path, caplog):
    server = make_server(storage_dir=str(tmp_path / "default"))
    assert server.config.keep_checkpoints == 0
    service = trio.ServiceClient()
    try:
        tc = service.create_lora_training_client(base_model=server.model_alias, rank=4, seed=3)
        with caplog.at_level("INFO", logger="trl_grpo_ext.pytrio_server.checkpoints"):
            states = _save_states(tc, ["a", "b", "c", "d", "e"])
            samplers = [tc.save_weights_for_sampler(f"w{i}").result().path for i in range(5)]
        mine = {c.uri for c in server.registry.checkpoints.values() if c.run == tc.training_run_cuid}
        assert mine == {*states, *samplers}
        assert all(server.registry.checkpoint(uri).path.exists() for uri in mine)
        listed = service.create_rest_client().list_checkpoints(tc.training_run_cuid).result().checkpoints
        assert len(listed) == 10
        assert "retention: deleted" not in caplog.text
    finally:
        service._runtime.shutdown()


def test_retention_when_asked_deletes_the_oldest_and_logs_it(make_server, tmp_path, caplog):
    server = make_server(storage_dir=str(tmp_path / "kept"), keep_checkpoints=2)
    service = trio.ServiceClient()
    try:
        tc = service.create_lora_training_client(base_model=server.model_alias, rank=4, seed=3)
        with caplog.at_level("INFO", logger="trl_grpo_ext.pytrio_server.checkpoints"):
            states = _save_states(tc, ["a", "b", "c", "d"])
        mine = {c.uri for c in server.registry.checkpoints.values() if c.run == tc.training_run_cuid}
        assert mine == set(states[-2:])
        deleted = [r.getMessage() for r in caplog.records if "retention: deleted" in r.getMessage()]
        assert len(deleted) == 2 and all(uri in " ".join(deleted) for uri in states[:2])
    finally:
        service._runtime.shutdown()


def test_retention_keeps_the_newest_and_every_referenced_checkpoint(make_server, tmp_path):
    from trl_grpo_ext.runs.loop_state import LoopState, save_loop_state

    run_dir = tmp_path / "run"  # the recipe's layout: <output_dir>/pytrio-server beside the loop state file
    server = make_server(storage_dir=str(run_dir / "pytrio-server"), keep_checkpoints=2)
    service = trio.ServiceClient()
    try:
        tc = service.create_lora_training_client(base_model=server.model_alias, rank=4, seed=3)
        first = _save_states(tc, ["s1"])[0]
        save_loop_state(run_dir, LoopState(step=1, state_path=first))  # a saved loop state resumes from s1
        second = _save_states(tc, ["s2"])[0]
        sampler_src = second
        service.create_sampling_client(server.model_alias, model_path=sampler_src)  # a live sampler reads s2
        later = _save_states(tc, ["s3", "s4", "s5", "s6"])
        on_disk = {c.uri for c in server.registry.checkpoints.values() if c.run == tc.training_run_cuid}
        assert on_disk == {first, second, *later[-2:]}
        for uri in (*later[:2],):
            folder = run_dir / "pytrio-server" / tc.training_run_cuid / "weights" / uri.rsplit("/", 1)[1]
            assert not folder.exists()
        # the referenced ones still load
        assert service.create_training_client_from_state(first).training_run_cuid
    finally:
        service._runtime.shutdown()
    # another run's checkpoints are never touched by this run's retention; 0 keeps everything
    keep_all = make_server(storage_dir=str(tmp_path / "all"), keep_checkpoints=0)
    service = trio.ServiceClient()
    try:
        tc = service.create_lora_training_client(base_model=keep_all.model_alias, rank=4, seed=3)
        assert len(set(_save_states(tc, ["a", "b", "c", "d"])) & set(keep_all.registry.checkpoints)) == 4
    finally:
        service._runtime.shutdown()


@pytest.mark.parametrize(
    "options, fragment",
    [
        ({"keep_checkpoints": 1}, "keep_checkpoints"),
        ({"max_request_bytes": 0}, "max_request_bytes"),
        ({"max_num_samples": -2}, "max_num_samples"),
        ({"served_names": ("",)}, "served_names"),
        ({"idle_timeout_seconds": 0}, "idle_timeout_seconds"),
        ({"api_key": "has space"}, "api_key"),
    ],
)
def test_bad_server_config_is_one_line_error(options, fragment):
    with pytest.raises(ValueError, match=fragment) as error:
        ServerConfig(model="embedded", **options)
    assert "\n" not in str(error.value)


def _cli_args(*argv):
    from trl_grpo_ext.cli import pytrio_serve

    parser = argparse.ArgumentParser()
    pytrio_serve.add_arguments(parser)
    return pytrio_serve, parser.parse_args(["--model", "embedded", *argv])


def test_cli_key_from_file_or_environment_and_bad_options_fail_before_loading(tmp_path, monkeypatch, capsys):
    module, args = _cli_args("--api-key-file", str(tmp_path / "missing"))
    assert module.run(args) == 2  # before any model loads: "embedded" would take seconds to convert
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: cannot read the API key file") and "\n" not in err
    key_file = tmp_path / "key"
    key_file.write_text("file-secret-123\n")
    module, args = _cli_args("--api-key-file", str(key_file), "--served-name", DEMO_NAME, "--served-name", "x")
    config, chosen = module._config(args)
    assert config.api_key == "file-secret-123" and chosen and config.served_names == (DEMO_NAME, "x")
    assert config.api_keys == ()
    monkeypatch.setenv("TRL_GRPO_EXT_PYTRIO_API_KEY", "env-secret")
    config, chosen = module._config(_cli_args()[1])
    assert config.api_key == "env-secret" and chosen
    module, args = _cli_args("--keep-checkpoints", "1")
    assert module.run(args) == 2 and "keep_checkpoints" in capsys.readouterr().err
    # several clients: the file's keys, then each --api-key (the environment's key only when neither is given)
    key_file.write_text("# one client per line\nfile-secret-123\n\nfile-secret-456\n")
    config, chosen = module._config(_cli_args("--api-key-file", str(key_file), "--api-key", "a", "--api-key", "b")[1])
    assert (config.api_key, config.api_keys) == ("file-secret-123", ("file-secret-456", "a", "b")) and chosen
    key_file.write_text("good-key\nhas space\n")
    module, args = _cli_args("--api-key-file", str(key_file))
    assert module.run(args) == 2 and "line 2 has whitespace" in capsys.readouterr().err


def test_pytrio_serve_options_are_the_config_fields():
    """The options besides --model, the keys and --log-level are derived from `ServerConfig` fields: the spellings
    are the ones users have, their defaults parse to the config's own (the port aside: 8710 on the command line),
    and each one sets its field (units converted)."""
    module, args = _cli_args()
    config, _ = module._config(args)
    defaults = ServerConfig(model="embedded")
    assert {f.name: getattr(config, f.name) for f in fields(ServerConfig) if f.name != "port"} == {
        f.name: getattr(defaults, f.name) for f in fields(ServerConfig) if f.name != "port"
    }
    assert config.port == 8710
    assert {spec.flag for spec in module.config_flags()} == {
        "--host", "--port", "--served-name", "--storage-dir", "--device", "--dtype", "--bf16", "--bf16-sampling",
        "--max-batch-size", "--no-concurrent-sampling", "--no-vision", "--keep-checkpoints", "--loss-normalization",
        "--max-request-mb", "--max-num-samples", "--max-topk-logprobs", "--idle-timeout", "--session-timeout",
        "--memory-budget-gb", "--request-timeout", "--max-connections", "--max-connections-per-peer",
        "--adopt-unsigned-checkpoints",
    }  # fmt: skip
    config, _ = module._config(_cli_args(
        "--host", "0.0.0.0", "--port", "0", "--served-name", "a", "--served-name", "b", "--storage-dir", "/tmp/s",
        "--device", "cpu", "--dtype", "bfloat16", "--bf16", "false", "--bf16-sampling", "--max-batch-size", "3",
        "--no-vision", "--keep-checkpoints", "2", "--loss-normalization", "sum", "--max-request-mb", "0.5",
        "--max-num-samples", "7", "--idle-timeout", "9", "--session-timeout", "0", "--memory-budget-gb", "2",
        "--adopt-unsigned-checkpoints",
    )[1])  # fmt: skip
    assert (config.host, config.port, config.served_names, config.storage_dir) == ("0.0.0.0", 0, ("a", "b"), "/tmp/s")
    assert (config.device, config.dtype, config.bf16, config.bf16_sampling, config.vision) == (
        "cpu",
        "bfloat16",
        "false",
        True,
        False,
    )
    assert (config.max_batch_size, config.keep_checkpoints, config.loss_normalization) == (3, 2, "sum")
    assert (config.max_request_bytes, config.max_num_samples, config.memory_budget_bytes) == (
        512 * 1024,
        7,
        2 * 1024**3,
    )
    assert (config.idle_timeout_seconds, config.session_timeout_seconds) == (9, 0)
    assert config.adopt_unsigned_checkpoints


SERVER_THREADS = ("pytrio-local-server", "pytrio-request", "pytrio-sampling", "pytrio-events-", "pytrio-housekeeping")


def test_stop_leaves_no_thread_behind(engine, tiny_model_path, tmp_path):
    """A training event, a sample and a long poll served, then `stop`: every thread the server started has ended."""
    server = LocalPyTrioServer(ServerConfig(model=tiny_model_path, ephemeral_storage=True), engine=engine).start()
    server.configure_client(home=str(tmp_path / "trio-home"), retry_initial_delay_seconds=0.05)
    service = trio.ServiceClient()
    tc = service.create_lora_training_client(base_model=server.model_alias, rank=4, seed=0)
    tokens = [1, 5, 9, 14, 3, 7]
    datum = trio.Datum(model_input=trio.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:]})  # fmt: skip
    assert tc.forward_backward([datum], "cross_entropy").result().metrics["token_count"] == 5
    sampler = service.create_sampling_client(base_model=server.model_alias)
    params = trio.SamplingParams(max_tokens=3, seed=1)
    assert sampler.sample(trio.ModelInput.from_ints(tokens), sampling_params=params).result().sequences
    started = [t for t in threading.enumerate() if t.name.startswith(SERVER_THREADS)]
    assert {t.name.split("_")[0] for t in started} >= {"pytrio-local-server", "pytrio-request", "pytrio-sampling"}
    server.stop()  # closes this process's client first, as the recipe's `pytrio_base_url: local` does
    deadline = time.monotonic() + 30
    while any(t.is_alive() for t in started) and time.monotonic() < deadline:  # a run's worker ends after its event
        time.sleep(0.05)
    assert not [t.name for t in started if t.is_alive()]


def test_every_control_route_passes_the_path_parameters_its_handler_takes():
    import inspect
    import re

    from trl_grpo_ext.pytrio_server.routes import CONTROL_ROUTES

    assert len({(r.method, r.path) for r in CONTROL_ROUTES}) == len(CONTROL_ROUTES)
    for route in CONTROL_ROUTES:
        taken = list(inspect.signature(route.handler).parameters)[4:]  # after self, query, body, caller
        assert taken == re.findall(r"{(\w+)}", route.path), route.path


def test_an_answer_the_client_could_not_parse_is_a_clear_server_error(make_server):
    import httpx

    server = make_server(api_key="k")
    server.model_alias = None  # a bug: the model list would go out without an alias
    answer = httpx.get(f"{server.base_url}/api/models", headers={"Authorization": "Bearer k"})
    assert answer.status_code == 422 and answer.json()["code"] == "internal_error"
    assert "ModelListResponse" in answer.json()["message"] and "alias" in answer.json()["message"]


def test_stop_answers_a_waiting_long_poll(make_server, engine, monkeypatch):
    """A status read waiting for an event that cannot run (the model is busy) is answered when the server stops,
    not cut off when uvicorn gives up on it."""
    import httpx
    import msgpack
    from pytrio.protocol.actor.events.event import (
        EventEnvelope,
        EventMetadata,
        EventType,
        generate_event_id,
        pack_event_envelope,
    )

    from trl_grpo_ext.pytrio_server.events import EventRecord

    waiting = threading.Event()
    wait = EventRecord.wait

    async def wait_and_tell(self, *args):
        waiting.set()
        await wait(self, *args)

    monkeypatch.setattr(EventRecord, "wait", wait_and_tell)
    server = make_server(api_key="k")
    auth = {"Authorization": "Bearer k"}
    lora = {"train_mlp": True, "train_attn": True, "train_unembed": True}
    with httpx.Client(base_url=server.base_url, timeout=60) as client, ThreadPoolExecutor(1) as pool:
        sid = client.post("/api/openapi/v1/service-sessions", json={"sdk_version": "x"}, headers=auth).json()
        run = client.post(f"/api/openapi/v1/service-sessions/{sid['service_session_cuid']}/training-runs",
                          json={"base_model": server.model_alias, "lora_rank": 4, **lora}, headers=auth).json()  # fmt: skip
        token = {"Authorization": f"Bearer {run['actor_jwt']['token']}", "Accept": "application/msgpack"}
        metadata = EventMetadata(index=1, step=0, timestamp=0, sdk="pytrio", sdk_version="0.2.9",
                                 run_id=run["training_run_cuid"])  # fmt: skip
        envelope = EventEnvelope(event_id=generate_event_id(), type=EventType.TRAINER_INIT_RUN, metadata=metadata,
                                 payload={"base_model": server.model_alias, "lora_config": {"rank": 4, **lora}})  # fmt: skip
        with engine.lock:  # the event waits for the model
            submitted = client.post("/actor/v1/events", content=pack_event_envelope(envelope),
                                    headers={**token, "Content-Type": "application/msgpack"})  # fmt: skip
            assert submitted.status_code == 202
            poll = pool.submit(
                client.get, f"/actor/v1/events/{envelope.event_id}", headers={**token, "Prefer": "wait=60"}
            )
            assert waiting.wait(60)
            server.stop()
        answer = poll.result(timeout=60)
    assert answer.status_code == 200 and msgpack.unpackb(answer.content)["status"] in ("accepted", "running")
