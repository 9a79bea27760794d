"""Local PyTRIO server with several API keys: each key a client that sees and touches only its own objects.

Client A trains with the real pytrio client; client B, with its own valid key, tries every route on A's objects over
raw HTTP (Control and actor) and gets the answers a missing object gets. A's run ends bit-identical to the same run
trained without B's attempts. Also: idle sessions reclaimed after `session_timeout_seconds`, and a checkpoint save
on a full storage disk (tests/pytrio_faults.py) failing as ``insufficient_storage`` with nothing left behind.
All servers of this module share one `ModelEngine` on the tiny model.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

trio = pytest.importorskip("pytrio")

import httpx  # noqa: E402
import msgpack  # noqa: E402
from pytrio.errors.event import EventFailedError  # noqa: E402
from pytrio.protocol.actor.events.event import generate_event_id  # noqa: E402
from pytrio_faults import full_storage  # noqa: E402

from trl_grpo_ext.pytrio_server import LocalPyTrioServer, ServerConfig  # noqa: E402
from trl_grpo_ext.pytrio_server.clients import KeyRing, owner_id  # noqa: E402

KEY_A, KEY_B, ADMIN = "client-a-key-5d1e", "client-b-key-9c2f", "admin-key-77aa"
API = "/api/openapi/v1"
TOKENS = [1, 5, 9, 14, 3, 7, 11, 2, 8, 6]


def _datum(tokens=TOKENS):
    return trio.Datum(model_input=trio.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:]})


def _train(tc, steps: int) -> None:
    for _ in range(steps):
        tc.forward_backward([_datum()], "cross_entropy").result()
        tc.optim_step(trio.AdamParams(learning_rate=5e-2)).result()


def _probe(tc) -> np.ndarray:
    return tc.forward([_datum()], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()


class Raw:
    """A client speaking HTTP itself, with its own (valid) key: every answer is kept for the path-leak check."""

    def __init__(self, server: LocalPyTrioServer, key: str):
        self.http = httpx.Client(base_url=server.base_url, timeout=30)
        self.key = key
        self.bodies: list[str] = []

    def call(self, method: str, path: str, token: str | None = None, **kwargs) -> tuple[int, dict]:
        headers = {"Authorization": f"Bearer {token or self.key}", **kwargs.pop("headers", {})}
        answer = self.http.request(method, path, headers=headers, **kwargs)
        self.bodies.append(answer.text)
        body = answer.json() if "json" in answer.headers.get("content-type", "") else msgpack.unpackb(answer.content)
        return answer.status_code, body

    def event(self, token: str, run: str, kind: str, payload: dict) -> tuple[int, dict]:
        metadata = {"index": 1, "step": 0, "timestamp": 0, "sdk": "pytrio", "sdk_version": "0.2.9", "run_id": run}
        envelope = {"version": 1, "event_id": generate_event_id(), "type": kind, "metadata": metadata,
                    "payload": payload}  # fmt: skip
        status, body = self.call(
            "POST", "/actor/v1/events", token, content=msgpack.packb(envelope, use_bin_type=True),
            headers={"Content-Type": "application/msgpack", "Accept": "application/msgpack"},
        )  # fmt: skip
        if status != 202:
            return status, body
        return self.call("GET", f"/actor/v1/events/{envelope['event_id']}", token, headers={"Prefer": "wait=20"})


def _not_found(answer, code: str, missing_answer) -> None:
    """`answer` is the 404 a missing object gets: same status, code and message (up to the id asked for)."""
    (status, body), (missing_status, missing_body) = answer, missing_answer
    assert (status, body["code"]) == (404, code) == (missing_status, missing_body["code"]), body


@pytest.mark.slow
def test_another_key_can_neither_see_nor_touch_a_clients_objects(make_server, tmp_path):
    server = make_server(api_keys=(KEY_A, KEY_B), admin_keys=(ADMIN,), storage_dir=str(tmp_path / "storage"))
    a = trio.ServiceClient(api_key=KEY_A)
    tc = a.create_lora_training_client(base_model=server.model_alias, rank=4, seed=3)
    _train(tc, 1)
    saved = tc.save_state("a-step-1").result().path
    sampler_saved = tc.save_weights_for_sampler("a-sampler").result().path
    a_run, a_session = tc.training_run_cuid, a.service_session_cuid
    own = Raw(server, KEY_A)
    status, listed = own.call("GET", f"{API}/checkpoints")
    a_checkpoint = next(c for c in listed["checkpoints"] if c["checkpoint_uri"] == saved)
    assert status == 200 and {c["checkpoint_uri"] for c in listed["checkpoints"]} == {saved, sampler_saved}
    assert all(c["path"] == c["checkpoint_uri"] for c in listed["checkpoints"])  # a URI, not a folder

    b = Raw(server, KEY_B)
    # listings: none of A's objects
    assert b.call("GET", f"{API}/checkpoints")[1]["checkpoints"] == []
    assert b.call("GET", f"{API}/training-runs")[1]["training_runs"] == []
    assert b.call("GET", f"{API}/service-sessions")[1]["service_sessions"] == []
    # each of A's objects answers as a missing one does
    for path, code in [
        (f"{API}/training-runs/{a_run}", "training_run_not_found"),
        (f"{API}/training-runs/{a_run}/checkpoints", "training_run_not_found"),
        (f"{API}/service-sessions/{a_session}", "service_session_not_found"),
        (f"{API}/checkpoints/{a_checkpoint['checkpoint_cuid']}/download-url", "checkpoint_not_found"),
    ]:
        missing = path.replace(a_run, "tr_0000000000000000").replace(a_session, "ss_0000000000000000")
        missing = missing.replace(a_checkpoint["checkpoint_cuid"], "ckpt_0000000000000000")
        _not_found(b.call("GET", path), code, b.call("GET", missing))
    _not_found(
        b.call("GET", f"{API}/training-runs/by-checkpoint-uri", params={"checkpoint_uri": saved}),
        "checkpoint_not_found",
        b.call("GET", f"{API}/training-runs/by-checkpoint-uri", params={"checkpoint_uri": saved + "x"}),
    )
    missing_run = b.call("POST", f"{API}/training-runs/tr_0000000000000000/renew")
    _not_found(b.call("POST", f"{API}/training-runs/{a_run}/renew"), "training_run_not_found", missing_run)
    missing_session = b.call("POST", f"{API}/service-sessions/ss_0000000000000000/close", json={"status": "ENDED"})
    _not_found(
        b.call("POST", f"{API}/service-sessions/{a_session}/close", json={"status": "ENDED"}),
        "service_session_not_found",
        missing_session,
    )
    _not_found(
        b.call("DELETE", f"{API}/checkpoints/{a_checkpoint['checkpoint_cuid']}"),
        "checkpoint_not_found",
        b.call("DELETE", f"{API}/checkpoints/ckpt_0000000000000000"),
    )
    # B's own session and runs: none may start from A's checkpoint, none may carry A's run id
    status, session = b.call("POST", f"{API}/service-sessions", json={"sdk_version": "0.2.9"})
    b_session = session["service_session_cuid"]
    lora = {"lora_rank": 4, "train_mlp": True, "train_attn": True, "train_unembed": True}
    status, answer = b.call("POST", f"{API}/service-sessions/{b_session}/training-runs",
                            json={"base_model": "", "source_checkpoint_uri": saved, **lora})  # fmt: skip
    assert (status, answer["code"]) == (404, "checkpoint_not_found")
    status, answer = b.call("POST", f"{API}/service-sessions/{b_session}/sampling-runs",
                            json={"base_model": server.model_alias, "source_checkpoint_uri": sampler_saved})  # fmt: skip
    assert (status, answer["code"]) == (404, "checkpoint_not_found")
    status, created = b.call("POST", f"{API}/service-sessions/{b_session}/training-runs",
                             json={"base_model": server.model_alias, **lora})  # fmt: skip
    assert status == 200
    b_run, b_token = created["training_run_cuid"], created["actor_jwt"]["token"]
    status, answer = b.call("PATCH", f"{API}/service-sessions/{b_session}/training-runs/{a_run}",
                            json={"source_checkpoint_uri": saved, "restore_optimizer": True})  # fmt: skip
    assert (status, answer["code"]) == (404, "training_run_not_found")
    status, answer = b.call("PATCH", f"{API}/service-sessions/{b_session}/training-runs/{b_run}",
                            json={"source_checkpoint_uri": saved, "restore_optimizer": True})  # fmt: skip
    assert (status, answer["code"]) == (404, "checkpoint_not_found")
    batch = {"data": [{"model_input": {"chunks": [{"type": "encoded_text", "tokens": TOKENS[:-1]}]},
                       "target_ids": TOKENS[1:]}], "loss": {"type": "cross_entropy"}}  # fmt: skip
    status, answer = b.event(b_token, a_run, "trainer.forward_backward", batch)  # B's token, A's run
    assert (status, answer["code"]) == (404, "training_run_not_found")
    lora_config = {"rank": 4, "seed": 3, "train_mlp": True, "train_attn": True, "train_unembed": True}
    status, answer = b.event(b_token, b_run, "trainer.init_run",
                             {"base_model": server.model_alias, "lora_config": lora_config, "checkpoint_uri": saved,
                              "load_optimizer": True})  # fmt: skip
    assert status == 200 and answer["status"] == "failed" and answer["error"]["code"] == "checkpoint_not_found"
    assert b_run not in server.engine.runs  # nothing of A's was loaded for B

    # the admin sees everyone's; A still has all its objects, and none of B's
    admin = Raw(server, ADMIN)
    assert {saved, sampler_saved} <= {
        c["checkpoint_uri"] for c in admin.call("GET", f"{API}/checkpoints")[1]["checkpoints"]
    }
    assert admin.call("GET", f"{API}/training-runs/{a_run}")[0] == 200
    runs = {r["training_run_cuid"] for r in own.call("GET", f"{API}/training-runs")[1]["training_runs"]}
    assert a_run in runs and b_run not in runs
    # no answer to anyone holds a folder of the server's disk
    for body in own.bodies + b.bodies + admin.bodies:
        assert str(server.storage) not in body and str(tmp_path) not in body

    # A's run goes on as if B had never tried: bit-identical to the same run without B
    _train(tc, 1)
    after = _probe(tc)
    reference = a.create_lora_training_client(base_model=server.model_alias, rank=4, seed=3)
    _train(reference, 2)
    np.testing.assert_array_equal(after, _probe(reference))
    assert tc.save_state("a-step-2").result().path  # A's own save still works: nothing of it was deleted
    a._runtime.shutdown()

    # a restart with the same keys (in another order) gives A its checkpoints back, B still none
    server.stop()
    again = make_server(api_key=KEY_B, api_keys=(KEY_A,), storage_dir=str(tmp_path / "storage"))
    uris = {c["checkpoint_uri"] for c in Raw(again, KEY_A).call("GET", f"{API}/checkpoints")[1]["checkpoints"]}
    assert {saved, sampler_saved} <= uris
    assert Raw(again, KEY_B).call("GET", f"{API}/checkpoints")[1]["checkpoints"] == []
    status, answer = Raw(again, "not-a-key").call("GET", f"{API}/checkpoints")
    assert (status, answer["code"]) == (401, "unauthorized")


def test_key_ring_identifies_each_key_and_keeps_no_key():
    ring = KeyRing([KEY_A, KEY_B], [ADMIN])
    assert ring.identify(KEY_A).owner == owner_id(KEY_A) != ring.identify(KEY_B).owner
    assert ring.identify(ADMIN).admin and not ring.identify(KEY_A).admin
    assert ring.identify(KEY_A + "x") is None and ring.identify("") is None and ring.identify(None) is None
    assert KEY_A not in owner_id(KEY_A) and ring.legacy_owner == "local"  # several clients: old records admin-only
    assert KeyRing([KEY_A]).legacy_owner == owner_id(KEY_A)  # one client: its own records of before
    generated = KeyRing.generate()
    assert generated.identify(generated.primary).owner == "local"  # a fresh key each start, the same client
    with pytest.raises(ValueError, match="both a client key and an admin key"):
        ServerConfig(model="embedded", api_keys=(KEY_A,), admin_keys=(KEY_A,))
    with pytest.raises(ValueError, match="session_timeout_seconds"):
        ServerConfig(model="embedded", session_timeout_seconds=1.0, heartbeat_ms=1000)


def _session(server, key, sid) -> dict:
    return Raw(server, key).call("GET", f"{API}/service-sessions/{sid}")[1]


@pytest.mark.slow
def test_a_session_whose_client_stopped_heartbeating_is_reclaimed(make_server):
    server = make_server(api_key=KEY_A, heartbeat_ms=500, session_timeout_seconds=2.5)
    trio.configure(actor_heartbeat_enabled=False)  # a client killed right after it started its run
    try:
        dead = trio.ServiceClient(api_key=KEY_A)
        dead_tc = dead.create_lora_training_client(base_model=server.model_alias, rank=4, seed=0)
    finally:
        trio.configure(actor_heartbeat_enabled=True)
    _train(dead_tc, 1)  # its adapter and optimizer now hold memory on the server
    alive = trio.ServiceClient(api_key=KEY_A)
    alive_tc = alive.create_lora_training_client(base_model=server.model_alias, rank=4, seed=0)
    _train(alive_tc, 1)  # pytrio heartbeats from a training client's first call on
    assert dead_tc.training_run_cuid in server.engine.runs
    time.sleep(4.5)  # > timeout + the reaper's period; the live client beats every second meanwhile
    assert _session(server, KEY_A, dead.service_session_cuid)["status"] == "EXPIRED"
    run = Raw(server, KEY_A).call("GET", f"{API}/training-runs/{dead_tc.training_run_cuid}")[1]
    assert run["status"] == "CANCELLED" and dead_tc.training_run_cuid not in server.engine.runs  # memory freed
    assert _session(server, KEY_A, alive.service_session_cuid)["status"] == "ACTIVE"
    _train(alive_tc, 1)  # the live client trains on
    for client in (dead, alive):
        client._runtime.configuration.control_retry_timeout_seconds = 0
        client._runtime.shutdown()


@pytest.mark.slow
def test_a_save_on_a_full_storage_disk_fails_clearly_and_leaves_nothing(make_server, monkeypatch):
    server = make_server(api_key=KEY_A)
    tc = trio.ServiceClient(api_key=KEY_A).create_lora_training_client(base_model=server.model_alias, rank=4, seed=1)
    _train(tc, 1)
    kept = tc.save_state("kept").result().path
    folder = server.registry.checkpoint(kept).path
    before = sorted(p.name for p in folder.iterdir())
    _train(tc, 1)
    for mode in ("mid-write", "no-room"):  # the disk fills while writing; the disk is already full
        with full_storage(monkeypatch, mode):
            for name in ("kept", "new"):  # overwriting a checkpoint, and a new one
                with pytest.raises(EventFailedError) as error:
                    tc.save_state(name, overwrite=True).result()
                assert error.value.code == "insufficient_storage" or "insufficient_storage" in str(error.value)
                assert "no space left" in str(error.value) and str(server.storage) not in str(error.value)
        leftovers = [p for p in (server.storage / tc.training_run_cuid).rglob("*") if "new" in p.name]
        assert leftovers == [] and not list(folder.parent.glob(".*"))  # no partial folder, no staging folder
        assert sorted(p.name for p in folder.iterdir()) == before  # the overwritten checkpoint is intact
        assert json.loads((folder / "trio_record.json").read_text())["step"] == 1
    assert tc.save_state("new").result().path.endswith("/new")  # room again: saves work
