"""The local PyTRIO server's storage folder as untrusted input, over real sockets: a `pytrio-serve` process and
in-process servers share one storage folder, as two servers on one ``--storage-dir`` do, while the test plays a user
who can write that folder (planted and edited records, links, half-deleted checkpoints, optimizer pickles that expand).

What holds: a record proves nothing by itself (it is signed with the folder's key and must agree with where it lies);
deletes, the ttl sweep and a server's stop remove exactly the checkpoints they mean, never another server's, never
through a link; archives hold the server's own files; error answers name checkpoints, never paths; old optimizer
pickles are bounded; the base model's fingerprint covers the config and buffers; malformed download URLs are 403.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import logging
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
import torch

trio = pytest.importorskip("pytrio")

from pytrio.errors.base import PyTrioError  # noqa: E402
from pytrio_versions import configure, run_id  # noqa: E402

from trl_grpo_ext.pytrio.connection import close_service_client  # noqa: E402
from trl_grpo_ext.pytrio_server import LocalPyTrioServer, ServerConfig  # noqa: E402
from trl_grpo_ext.pytrio_server.base_model import weights_fingerprint  # noqa: E402
from trl_grpo_ext.pytrio_server.clients import owner_id  # noqa: E402
from trl_grpo_ext.pytrio_server.optimizer_state import load_optimizer  # noqa: E402
from trl_grpo_ext.pytrio_server.registry import RECORD_FILE  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
KEY_A, KEY_B = "storage-client-a-41c7e2", "storage-client-b-93e2f0"
API = "/api/openapi/v1"
TOKENS = [1, 5, 9, 14, 3, 7, 11, 2, 8, 6]


class ServerProcess:
    """`trl-grpo-ext pytrio-serve` in a subprocess on the shared storage folder (keys A and B), stopped with SIGTERM."""

    def __init__(self, model: str, storage: Path, folder: Path):
        self.model, self.storage, self.folder = model, storage, folder
        (folder / "keys").write_text(f"{KEY_A}\n{KEY_B}\n")
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.starts = 0

    def start(self) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.starts += 1
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-c", "import sys; from trl_grpo_ext.cli import main; sys.exit(main())",
               "pytrio-serve", "--model", self.model, "--port", str(port), "--api-key-file", str(self.folder / "keys"),
               "--storage-dir", str(self.storage), "--bf16", "false"]  # fmt: skip
        log = open(self.log_file, "w")  # noqa: SIM115 - the process writes it
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(f"{self.url}{API}/api-key/verify", headers=_auth(KEY_A), timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log()
            time.sleep(0.2)

    @property
    def log_file(self) -> Path:
        return self.folder / f"server-{self.starts}.log"

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.running():
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(60)

    def log(self) -> str:
        return self.log_file.read_text(errors="replace")


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Path:
    """The storage folder every server of this module shares."""
    return tmp_path_factory.mktemp("shared") / "storage"


@pytest.fixture(scope="module")
def process(tiny_model_path, shared, tmp_path_factory):
    shared.mkdir(exist_ok=True)
    served = ServerProcess(tiny_model_path, shared, tmp_path_factory.mktemp("process"))
    served.start()
    yield served
    served.stop()


@pytest.fixture
def other(process) -> ServerProcess:
    """The server process on the shared folder, running (a test before may have stopped it)."""
    if not process.running():
        process.start()
    return process


@pytest.fixture
def local(make_server, shared):
    """``local(**ServerConfig options)``: an in-process server on the shared folder (keys A and B), the process's
    pytrio client pointed at it (conftest's `make_server`: stopped after the test)."""
    return lambda **options: make_server(
        **{"api_key": KEY_A, "api_keys": (KEY_B,), "storage_dir": str(shared), **options}
    )


def _trainer(model: str, key: str = KEY_A, seed: int = 0):
    service = trio.ServiceClient(api_key=key)
    return service, service.create_lora_training_client(base_model=model, rank=4, seed=seed)


def _folder(shared: Path, uri: str) -> Path:
    run, kind, name = uri.removeprefix("trio://").split("/")
    return shared / run / kind / name


def _record(folder: Path) -> dict:
    return json.loads((folder / RECORD_FILE).read_text())


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def _plant(shared: Path, run: str, kind: str, name: str, record: dict, files_from: Path | None = None) -> Path:
    """A checkpoint folder written by someone else than a server: `record` as its record, beside copies of the files
    of `files_from`."""
    folder = shared / run / kind / name
    folder.mkdir(parents=True)
    if files_from is not None:
        for file in files_from.iterdir():
            if file.name != RECORD_FILE:
                shutil.copy(file, folder / file.name)
    (folder / RECORD_FILE).write_text(json.dumps(record))
    return folder


def _unsigned(record: dict, **changes) -> dict:
    """`record` as the server's previous version wrote it (no signature, the folder in ``path``), with `changes`."""
    old = {k: v for k, v in record.items() if k not in ("signature", "format", "server")}
    old["path"] = os.path.join(record["run"], "sampler_weights" if record["kind"] == "sampler" else "weights",
                               record["name"])  # fmt: skip
    return {**old, **changes}


def _lookup(url: str, key: str, uri: str) -> httpx.Response:
    return httpx.get(f"{url}{API}/training-runs/by-checkpoint-uri", params={"checkpoint_uri": uri},
                     headers=_auth(key), timeout=60)  # fmt: skip


def _listed(url: str, key: str) -> dict[str, dict]:
    answer = httpx.get(f"{url}{API}/checkpoints", headers=_auth(key), timeout=60)
    assert answer.status_code == 200, answer.text
    return {c["checkpoint_uri"]: c for c in answer.json()["checkpoints"]}


def _sampling_run(url: str, key: str, model: str, uri: str) -> httpx.Response:
    with httpx.Client(base_url=f"{url}{API}", headers=_auth(key), timeout=60) as http:
        sid = http.post("/service-sessions", json={"sdk_version": "raw"}).json()["service_session_cuid"]
        return http.post(f"/service-sessions/{sid}/sampling-runs", json={"base_model": model,
                                                                        "source_checkpoint_uri": uri})  # fmt: skip


# ---------------------------------------------------------------------------------------------------- item 1
def test_a_planted_or_edited_record_is_refused_by_every_server_on_the_folder(other, local, shared, tiny_model_path):
    """A record planted beside another key's checkpoint (pointing at its folder, as the previous version's records
    could), a signed record edited (owner, expiry, fingerprint) or copied to another place: neither the server
    process (looking the URI up) nor a server starting on the folder adopts it; the victim's files stay as they were."""
    a = local()
    _, tc = _trainer(a.model_alias)
    victim = tc.save_weights_for_sampler("k1-weights").result().path
    folder = _folder(shared, victim)
    before, signed = _files(folder), _record(folder)
    thief = owner_id(KEY_B)
    planted = {
        "pointing": _plant(shared, "tr_planted0000000001", "sampler_weights", "stolen",
                           _unsigned(signed, uri="trio://tr_planted0000000001/sampler_weights/stolen",
                                     run="tr_planted0000000001", name="stolen", owner=thief,
                                     path=os.path.relpath(folder, shared))),
        "edited owner": _plant(shared, "tr_planted0000000002", "sampler_weights", "stolen",
                               {**signed, "uri": "trio://tr_planted0000000002/sampler_weights/stolen",
                                "run": "tr_planted0000000002", "name": "stolen", "owner": thief}, folder),
        "copied as it is": _plant(shared, "tr_planted0000000003", "sampler_weights", "stolen", signed, folder),
        "no fingerprint": _plant(shared, "tr_planted0000000004", "sampler_weights", "stolen",
                                 {**signed, "uri": "trio://tr_planted0000000004/sampler_weights/stolen",
                                  "run": "tr_planted0000000004", "name": "stolen", "base_model_fingerprint": ""},
                                 folder),
    }  # fmt: skip
    uris = {what: "trio://" + str(f.relative_to(shared)) for what, f in planted.items()}
    for what, uri in uris.items():  # the server process looks them up on disk (saved by "another server")
        for key in (KEY_A, KEY_B):
            answer = _lookup(other.url, key, uri)
            assert (answer.status_code, answer.json().get("code")) == (404, "checkpoint_not_found"), (
                what,
                answer.text,
            )
        chat = httpx.post(f"{other.url}/api/openai/v1/chat/completions", headers=_auth(KEY_B), timeout=60,
                          json={"model": uri, "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
        assert chat.status_code == 404, (what, chat.text)
    assert not set(uris.values()) & set(_listed(other.url, KEY_B))
    fresh = local()  # a server starting on the folder registers what holds, and only that
    assert victim in fresh.registry.checkpoints and not set(uris.values()) & set(fresh.registry.checkpoints)
    # the victim's checkpoint is intact and still its owner's alone
    assert _files(folder) == before and victim in _listed(fresh.base_url, KEY_A)
    assert _lookup(other.url, KEY_B, victim).status_code == 404
    log = other.log()  # each refusal in the log with its file and reason (an unsigned one: counted at a start)
    for what, reason in (("edited owner", "signature does not hold"), ("no fingerprint", "signature does not hold"),
                         ("copied as it is", "disagree with the place it lies")):  # fmt: skip
        assert f"refusing checkpoint record {planted[what] / RECORD_FILE}: its" in log and reason in log, what


def test_an_expired_planted_record_deletes_nothing(other, local, shared):
    """An expired record whose path is the storage root, and a checkpoint whose own record was edited to be expired:
    the ttl sweep of a server starting on the folder deletes neither the folder nor the checkpoint."""
    a = local()
    _, tc = _trainer(a.model_alias, seed=1)
    kept = tc.save_weights_for_sampler("kept").result().path
    edited = tc.save_weights_for_sampler("edited").result().path
    record = _record(_folder(shared, kept))
    _plant(shared, "tr_planted0000000010", "weights", "everything",
           _unsigned(record, uri="trio://tr_planted0000000010/weights/everything", run="tr_planted0000000010",
                     name="everything", kind="state", expires=1, path="."))  # fmt: skip
    edited_record = _record(_folder(shared, edited))
    (_folder(shared, edited) / RECORD_FILE).write_text(json.dumps({**edited_record, "expires": 1}))
    everything = sorted(str(p.relative_to(shared)) for p in shared.rglob("*"))
    local()  # loads the folder's records and sweeps the expired ones at start
    assert _files(_folder(shared, kept)) and _files(_folder(shared, edited))
    assert sorted(str(p.relative_to(shared)) for p in shared.rglob("*")) == everything
    assert _lookup(other.url, KEY_A, kept).status_code == 200


# ---------------------------------------------------------------------------------------------------- item 2
def test_a_servers_stop_removes_its_own_hand_offs_only_in_either_order(other, local, shared, tiny_model_path):
    """Sampler hand-offs (TEMPORARY) of the server process and of an in-process server on one folder: stopping the
    in-process one keeps the process's (its sampler samples on), stopping the process keeps the other's."""
    configure(base_url=other.url, api_key=KEY_A, retry_initial_delay_seconds=0.05)
    service, tc = _trainer(tiny_model_path, seed=2)
    theirs = tc.save_weights_and_get_sampling_client()
    their_folder = next((shared / run_id(tc) / "sampler_weights").iterdir())
    prompt, params = trio.ModelInput.from_ints(TOKENS[:5]), trio.SamplingParams(max_tokens=3, seed=1)
    first = theirs.sample(prompt, sampling_params=params).result()

    a = local()  # registers the process's hand-off at start, as any server on the folder
    assert _record(their_folder)["uri"] in a.registry.checkpoints
    _, tc_a = _trainer(a.model_alias, seed=3)
    tc_a.save_weights_and_get_sampling_client()
    mine = next((shared / run_id(tc_a) / "sampler_weights").iterdir())
    a.stop()
    assert not mine.exists()  # its own: removed
    assert (their_folder / RECORD_FILE).is_file() and (their_folder / "adapter_model.safetensors").is_file()
    again = theirs.sample(prompt, sampling_params=params).result()
    assert [s.tokens for s in again.sequences] == [s.tokens for s in first.sequences]

    b = local()
    _, tc_b = _trainer(b.model_alias, seed=4)
    tc_b.save_weights_and_get_sampling_client()
    b_folder = next((shared / run_id(tc_b) / "sampler_weights").iterdir())
    b_uri = _record(b_folder)["uri"]
    assert _lookup(other.url, KEY_A, b_uri).status_code == 200  # the process now knows b's hand-off too
    close_service_client(service)
    other.stop()
    assert not their_folder.exists()  # the process's own: removed at its stop
    assert (b_folder / RECORD_FILE).is_file() and (b_folder / "adapter_model.safetensors").is_file()
    b._snapshot_cache.clear()  # from disk
    sampler = trio.ServiceClient().create_sampling_client(b.model_alias, model_path=b_uri)
    assert sampler.sample(prompt, sampling_params=params).result().sequences


def test_deletes_and_the_ttl_sweep_never_follow_a_link(local, shared, tmp_path):
    """A kind folder of a run replaced by a link to someone's folder holding a folder of the checkpoint's name: the
    owner's delete and the ttl sweep of a server starting on the folder leave that folder alone."""
    a = local()
    service, tc = _trainer(a.model_alias, seed=5)
    uri = tc.save_weights_for_sampler("mine").result().path
    tc.save_weights_for_sampler("short", ttl_seconds=1).result()
    run = shared / run_id(tc)
    precious = tmp_path / "someone" / "sampler_weights"
    for name in ("mine", "short"):
        (precious / name).mkdir(parents=True)
        (precious / name / "precious.txt").write_text("keep me")
    (run / "sampler_weights").rename(run / "moved-aside")
    (run / "sampler_weights").symlink_to(precious, target_is_directory=True)

    rest = service.create_rest_client()
    ids = {c["checkpoint_uri"]: c["cuid"] for c in _listed(a.base_url, KEY_A).values()}
    rest.delete_checkpoint(run_id(tc), ids[uri]).result()
    time.sleep(1.1)
    assert a.expire_checkpoints() == 0  # the sweep refuses the link as the delete did
    local()  # and so does a server starting on the folder
    assert (precious / "mine" / "precious.txt").read_text() == "keep me"
    assert (precious / "short" / "precious.txt").read_text() == "keep me"
    assert (run / "moved-aside" / "mine" / RECORD_FILE).is_file()


# ---------------------------------------------------------------------------------------------------- item 3
def test_archives_hold_the_servers_own_files_only(other, local, shared, tmp_path):
    """A checkpoint's file replaced by a link to a file elsewhere, and a checkpoint whose adapter weights are gone:
    both are refused with 409 naming the checkpoint, at the download URL and at the archive, never served."""
    a = local()
    secret = tmp_path / "secret.txt"
    secret.write_text("SECRET of the server's user")
    service, tc = _trainer(a.model_alias, key=KEY_B, seed=6)
    linked = tc.save_weights_for_sampler("linked").result().path
    halved = tc.save_weights_for_sampler("halved").result().path
    rest = service.create_rest_client()
    ids = {c.path: c.checkpoint_id for c in rest.list_user_checkpoints().result().checkpoints}
    url = rest.get_checkpoint_archive_url(ids[halved]).result().url  # obtained before the delete cut short
    config = _folder(shared, linked) / "adapter_config.json"
    config.unlink()
    config.symlink_to(secret)
    (_folder(shared, halved) / "adapter_model.safetensors").unlink()

    for uri, code in ((linked, "checkpoint_unreadable"), (halved, "checkpoint_incomplete")):
        answer = httpx.get(f"{a.base_url}{API}/checkpoints/{ids[uri]}/download-url", headers=_auth(KEY_B))
        assert (answer.status_code, answer.json().get("code")) == (409, code), answer.text
        assert ids[uri] in answer.json()["message"] and str(shared) not in answer.text
    archive = httpx.get(url, timeout=60)
    assert archive.status_code == 409 and archive.json()["code"] == "checkpoint_incomplete"
    assert b"SECRET" not in archive.content and ids[halved] in archive.json()["message"]
    with pytest.raises(PyTrioError):
        rest.download_checkpoint(ids[linked], str(tmp_path / "linked.tar")).result()
    assert not (tmp_path / "linked.tar").exists() or b"SECRET" not in (tmp_path / "linked.tar").read_bytes()

    # a planted record naming a checkpoint "../../../evil" (a tar-slip archive and file name): never listed
    record = _record(_folder(shared, linked))
    _plant(shared, "tr_planted0000000020", "sampler_weights", "evil",
           _unsigned(record, uri="trio://tr_planted0000000020/sampler_weights/evil", run="tr_planted0000000020",
                     name="../../../evil", path="tr_planted0000000020/sampler_weights/evil"),
           _folder(shared, halved))  # fmt: skip
    fresh = local()
    assert not any("evil" in uri for uri in _listed(fresh.base_url, KEY_B))
    assert not any("evil" in uri for uri in _listed(other.url, KEY_B))


# ---------------------------------------------------------------------------------------------------- item 4
def test_error_answers_name_the_checkpoint_never_a_path(other, local, shared, tiny_model_path):
    """A load racing a delete (a file gone, the folder gone) on the server process that never loaded the checkpoint:
    a sampling run and a chat completion answer a code and the checkpoint, and no path of the server's disk."""
    a = local()
    _, tc = _trainer(a.model_alias, seed=7)
    racing = tc.save_weights_for_sampler("racing").result().path
    gone = tc.save_weights_for_sampler("gone").result().path
    assert _lookup(other.url, KEY_A, gone).status_code == 200  # the process knows it before its folder goes
    (_folder(shared, racing) / "adapter_model.safetensors").unlink()
    shutil.rmtree(_folder(shared, gone))
    for uri, status, code in ((racing, 409, "checkpoint_incomplete"), (gone, 404, "checkpoint_not_found")):
        answer = _sampling_run(other.url, KEY_A, tiny_model_path, uri)
        assert (answer.status_code, answer.json().get("code")) == (status, code), answer.text
        assert uri in answer.json()["message"] and str(shared.parent) not in answer.text
        chat = httpx.post(f"{other.url}/api/openai/v1/chat/completions", headers=_auth(KEY_A), timeout=60,
                          json={"model": uri, "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
        error = chat.json()["error"]
        assert uri in error["message"] and str(shared.parent) not in chat.text, chat.text
        assert (chat.status_code, error["code"]) in ((status, code), (404, "checkpoint_not_found")), chat.text


# ---------------------------------------------------------------------------------------------------- item 5
def _expanding_pickle(depth: int) -> bytes:
    """An optimizer pickle of a few hundred bytes whose param group holds 2**depth values once written out (each list
    named twice by the next)."""
    tower: list = [0]
    for _ in range(depth):
        tower = [tower, tower]
    state = {"state_dict": {"state": {}, "param_groups": [{"params": [], "lr": 0.1, "tower": tower}]},
             "param_names": []}  # fmt: skip
    payload = io.BytesIO()
    torch.save(state, payload)
    return payload.getvalue()


def _as_legacy(folder: Path, pickle: bytes | None = None, size: int | None = None) -> None:
    """Make the state checkpoint in `folder` one of before: an ``optimizer.pt`` in place of the two files."""
    for name in ("optimizer.json", "optimizer.safetensors"):
        (folder / name).unlink()
    with open(folder / "optimizer.pt", "wb") as file:
        if pickle is not None:
            file.write(pickle)
        if size is not None:
            file.truncate(size)


def test_legacy_optimizer_pickles_are_bounded(other, local, shared, engine, tiny_model_path):
    """An old ``optimizer.pt`` that expands, one larger than any optimizer state of its adapter, and one whose
    conversion exceeds the memory budget: each answers 409 ``checkpoint_unreadable`` at once, nothing converted."""
    a = local()
    service, tc = _trainer(a.model_alias, seed=8)
    bomb = tc.save_state("bomb").result().path
    huge = tc.save_state("huge").result().path
    plain = tc.save_state("plain").result().path
    _as_legacy(_folder(shared, bomb), _expanding_pickle(21))
    _as_legacy(_folder(shared, huge), size=64 * 1024 * 1024)
    for uri in (bomb, huge):  # on the server process, which finds them on disk
        assert _lookup(other.url, KEY_A, uri).status_code == 200
        cid = _listed(other.url, KEY_A)[uri]["cuid"]
        started = time.monotonic()
        answer = httpx.get(f"{other.url}{API}/checkpoints/{cid}/download-url", headers=_auth(KEY_A), timeout=120)
        assert (answer.status_code, answer.json().get("code")) == (409, "checkpoint_unreadable"), answer.text
        assert time.monotonic() - started < 30 and uri in answer.json()["message"]
        folder = _folder(shared, uri)
        assert (folder / "optimizer.pt").is_file() and not (folder / "optimizer.json").exists()  # left as it was
    legit = io.BytesIO()  # a pickle as the previous version saved it
    with a.checkpoint_files(a.registry.checkpoint(plain)) as files:
        torch.save(load_optimizer(files, plain), legit)
    _as_legacy(_folder(shared, plain), legit.getvalue())
    small = LocalPyTrioServer(ServerConfig(model=tiny_model_path, api_key=KEY_A, storage_dir=str(shared),
                                           memory_budget_bytes=len(legit.getvalue())), engine=engine).start()  # fmt: skip
    try:
        cid = _listed(small.base_url, KEY_A)[plain]["cuid"]
        answer = httpx.get(f"{small.base_url}{API}/checkpoints/{cid}/download-url", headers=_auth(KEY_A))
        assert (answer.status_code, answer.json().get("code")) == (409, "checkpoint_unreadable"), answer.text
        assert "memory budget" in answer.json()["message"]
    finally:
        small.stop()
    cid = _listed(a.base_url, KEY_A)[plain]["cuid"]
    answer = httpx.get(f"{a.base_url}{API}/checkpoints/{cid}/download-url", headers=_auth(KEY_A))
    assert answer.status_code == 200 and (_folder(shared, plain) / "optimizer.json").is_file()  # within the budget


# ---------------------------------------------------------------------------------------------------- item 6
def _variant(tiny_model_path: str, folder: Path, **text_config) -> str:
    """A copy of the tiny model with the same weights and `text_config` changes in its config."""
    shutil.copytree(tiny_model_path, folder)
    config = json.loads((folder / "config.json").read_text())
    for key, value in text_config.items():
        if key == "rope_theta":
            config["rope_parameters"]["rope_theta"] = value
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_the_fingerprint_covers_the_config_and_the_buffers(local, shared, tiny_model_path, tmp_path):
    """The same weights under another ``rope_theta`` or ``rms_norm_eps`` (other logits) fingerprint apart, and a
    server on them refuses the tiny model's checkpoints; a changed buffer changes it too; float32 and bfloat16 loads
    still fingerprint alike."""
    from transformers import AutoModelForCausalLM

    from trl_grpo_ext.pytrio_server.engine import ModelEngine

    a = local()
    _, tc = _trainer(a.model_alias, seed=9)
    weights = tc.save_weights_for_sampler("on-tiny").result().path
    rope = _variant(tiny_model_path, tmp_path / "rope", rope_theta=500000.0)
    b = LocalPyTrioServer(ServerConfig(model=rope, api_key=KEY_A, storage_dir=str(shared)),
                          engine=ModelEngine(rope, bf16=False)).start()  # fmt: skip
    try:
        answer = _sampling_run(b.base_url, KEY_A, b.model_alias, weights)
        assert (answer.status_code, answer.json().get("code")) == (409, "base_model_mismatch"), answer.text
        assert not _listed(b.base_url, KEY_A)[weights]["base_model_served"]
    finally:
        b.stop()

    from trl_grpo_ext.pytrio_server.base_model import model_fingerprint

    eps = _variant(tiny_model_path, tmp_path / "eps", rms_norm_eps=1e-2)
    fingerprints = {model_fingerprint(AutoModelForCausalLM.from_pretrained(p)) for p in (tiny_model_path, rope, eps)}
    assert len(fingerprints) == 3
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    same = model_fingerprint(model)
    assert model_fingerprint(AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16)) == same
    model.model.rotary_emb.inv_freq.mul_(3)
    assert model_fingerprint(model) != same


# ---------------------------------------------------------------------------------------------------- item 7
def test_every_malformed_download_url_is_403(local, caplog):
    a = local()
    service, tc = _trainer(a.model_alias, seed=10)
    uri = tc.save_weights_for_sampler("signed").result().path
    cid = _listed(a.base_url, KEY_A)[uri]["cuid"]
    url = service.create_rest_client().get_checkpoint_archive_url(cid).result().url
    base, query = url.split("?")
    good = dict(part.split("=") for part in query.split("&"))
    variants = {
        "non-ASCII signature": {"signature": quote("é" * 64)},
        "short signature": {"signature": good["signature"][:10]},
        "upper-case signature": {"signature": good["signature"].upper()},
        "superscript expiry": {"expires": quote("²")},
        "Arabic-Indic expiry": {"expires": quote("١٢٣٤٥٦٧٨٩٠")},
        "5000-digit expiry": {"expires": "9" * 5000},
        "negative expiry": {"expires": "-1"},
        "empty": {"expires": "", "signature": ""},
    }
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="trl_grpo_ext.pytrio_server"):
        for what, change in variants.items():
            params = {**good, **change}
            answer = httpx.get(f"{base}?expires={params['expires']}&signature={params['signature']}", timeout=30)
            assert (answer.status_code, answer.json().get("code")) == (403, "download_url_invalid"), (
                what,
                answer.text,
            )
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # no traceback: a 403 is no failure
    assert httpx.get(url, timeout=60).status_code == 200


# ---------------------------------------------------------------------------------------------------- the key, migration
def test_the_storage_key_is_the_users_own(tmp_path):
    """Created 0600 and shared by servers on the folder; a key file that is a link, readable by others, or not a key
    is refused with one line saying what to do (`pytrio-serve`: one ``error:`` line, exit status 2, before the model
    loads)."""
    from trl_grpo_ext.pytrio_server.storage import KEY_FILE, StorageError, StorageKey

    folder = tmp_path / "store"
    folder.mkdir()
    key = StorageKey.of(folder)
    assert stat.S_IMODE((folder / KEY_FILE).stat().st_mode) == 0o600
    assert StorageKey.of(folder).sign({"a": 1}) == key.sign({"a": 1}) != StorageKey.of(tmp_path).sign({"a": 1})
    (folder / KEY_FILE).chmod(0o644)
    with pytest.raises(StorageError, match="chmod 600"):
        StorageKey.of(folder)
    elsewhere = tmp_path / "elsewhere"
    (folder / KEY_FILE).rename(elsewhere)
    elsewhere.chmod(0o600)
    (folder / KEY_FILE).symlink_to(elsewhere)
    with pytest.raises(StorageError, match="symbolic link"):
        StorageKey.of(folder)
    (folder / KEY_FILE).unlink()
    (folder / KEY_FILE).write_text("not a key\n")
    (folder / KEY_FILE).chmod(0o600)
    with pytest.raises(StorageError, match="does not hold a key"):
        StorageKey.of(folder)

    (folder / KEY_FILE).chmod(0o640)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TRL_GRPO_EXT_PYTRIO_API_KEY": KEY_A}
    cmd = [sys.executable, "-c", "import sys; from trl_grpo_ext.cli import main; sys.exit(main())", "pytrio-serve",
           "--model", str(tmp_path / "no-model-needed"), "--storage-dir", str(folder)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and len(lines) == 1 and "chmod 600" in lines[0], done.stderr[-2000:]


def _base(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path)


def test_unsigned_records_of_before_are_refused_unless_adopted(local, shared, tiny_model_path, caplog):
    """A record of the previous version (no signature): not loaded, with one line naming the option that adopts it;
    adopted (and signed) by a start with the option, then loaded by every later start."""
    a = local()
    _, tc = _trainer(a.model_alias, seed=11)
    uri = tc.save_weights_for_sampler("of-before").result().path
    folder = _folder(shared, uri)
    # as the previous version wrote it: no signature, and the fingerprint of its scheme (the weights alone)
    earlier = _unsigned(_record(folder), base_model_fingerprint=weights_fingerprint(_base(tiny_model_path)))
    (folder / RECORD_FILE).write_text(json.dumps(earlier))
    with caplog.at_level(logging.WARNING, logger="trl_grpo_ext.pytrio_server"):
        assert uri not in local().registry.checkpoints
    assert "--adopt-unsigned-checkpoints" in caplog.text and "unsigned" in caplog.text
    adopting = local(adopt_unsigned_checkpoints=True)
    assert adopting.registry.checkpoints[uri].owner == owner_id(KEY_A)
    assert _record(folder)["signature"].startswith("hmac-sha256:")
    assert adopting.registry.checkpoints[uri].base == a.engine.base_model  # the same weights: today's fingerprint
    later = local()
    assert uri in later.registry.checkpoints and _listed(later.base_url, KEY_A)[uri]["base_model_served"]
    assert later.registry.checkpoints[uri].owner == owner_id(KEY_A)


# ---------------------------------------------------------------------------------------------------- review fixes
def _release(fifo: Path) -> None:
    """Let a reader blocked opening `fifo` go on (open it for writing, which fails at once when no one reads)."""
    with contextlib.suppress(OSError):
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def test_records_the_json_reader_chokes_on_are_refused(local, shared):
    """Records nested deeper than the JSON parser goes, holding NaN, or (unsigned, adopted) an integer beyond a float's
    range: a server starts on the folder, lookups answer them as missing, a delete and a stop meeting them in place of
    a checkpoint's record leave that folder and go on; the other checkpoints are untouched."""
    a = local()
    _, tc = _trainer(a.model_alias, seed=12)
    kept = tc.save_weights_for_sampler("chokes-kept").result().path
    nan = tc.save_weights_for_sampler("chokes-nan").result().path
    signed = _record(_folder(shared, kept))
    nested = _plant(shared, "tr_planted0000000030", "sampler_weights", "nested", {})
    (nested / RECORD_FILE).write_text("[" * 5000)
    _plant(shared, "tr_planted0000000031", "sampler_weights", "huge",
           _unsigned(signed, uri="trio://tr_planted0000000031/sampler_weights/huge", run="tr_planted0000000031",
                     name="huge", path="tr_planted0000000031/sampler_weights/huge", created=10**400),
           _folder(shared, kept))  # fmt: skip
    # the server's own checkpoint and hand-offs, their records replaced (same id, URI and owner)
    nan_record = {**_record(_folder(shared, nan)), "created": float("nan")}
    (_folder(shared, nan) / RECORD_FILE).write_text(json.dumps(nan_record))
    for _ in range(3):
        tc.save_weights_and_get_sampling_client()
    hand_offs = sorted((shared / run_id(tc) / "sampler_weights").glob("temp-sampling-*"),
                       key=lambda folder: _record(folder)["created"])  # fmt: skip
    assert len(hand_offs) == 3
    nan_hand_off = json.dumps({**_record(hand_offs[1]), "created": float("nan")})
    (hand_offs[0] / RECORD_FILE).write_text("[" * 5000)
    (hand_offs[1] / RECORD_FILE).write_text(nan_hand_off)

    fresh = local(adopt_unsigned_checkpoints=True)  # starts, registering what holds
    assert kept in fresh.registry.checkpoints and nan not in fresh.registry.checkpoints
    assert not any("tr_planted000000003" in uri for uri in fresh.registry.checkpoints)
    for uri in ("trio://tr_planted0000000030/sampler_weights/nested", nan):
        assert _lookup(fresh.base_url, KEY_A, uri).status_code == 404, uri
    cid = _listed(a.base_url, KEY_A)[nan]["cuid"]
    deleted = httpx.delete(f"{a.base_url}{API}/checkpoints/{cid}", headers=_auth(KEY_A), timeout=60)
    assert deleted.status_code == 200, deleted.text
    a.stop()  # its hand-offs: the two whose records changed are left, the third removed
    assert [f.exists() for f in hand_offs] == [True, True, False]
    assert (_folder(shared, nan) / RECORD_FILE).is_file() and _lookup(fresh.base_url, KEY_A, kept).status_code == 200


def test_a_fifo_in_place_of_a_file_blocks_nothing(local, shared, tmp_path):
    """A FIFO planted as a checkpoint's record, as one of its files, or as the storage key: each is refused at once
    (an open would wait for a writer forever) and left as it is."""
    from trl_grpo_ext.pytrio_server.storage import KEY_FILE, StorageError, StorageKey

    a = local()
    _, tc = _trainer(a.model_alias, seed=13)
    in_files = tc.save_weights_for_sampler("fifo-file").result().path
    as_record = tc.save_weights_for_sampler("fifo-record").result().path
    ids = {uri: c["cuid"] for uri, c in _listed(a.base_url, KEY_A).items()}
    key_folder = tmp_path / "fifo-key"
    key_folder.mkdir()
    fifos = [_folder(shared, in_files) / "adapter_config.json", _folder(shared, as_record) / RECORD_FILE]
    for fifo in fifos:
        fifo.unlink()
    for fifo in [*fifos, key_folder / KEY_FILE]:
        os.mkfifo(fifo, 0o600)
    refused: list[str] = []
    reading = threading.Thread(target=lambda: refused.append(_refusal(StorageKey.of, key_folder, StorageError)))
    reading.start()
    try:
        answer = httpx.get(f"{a.base_url}{API}/checkpoints/{ids[in_files]}/download-url", headers=_auth(KEY_A),
                           timeout=10)  # fmt: skip
        assert (answer.status_code, answer.json().get("code")) == (409, "checkpoint_unreadable"), answer.text
        deleted = httpx.delete(f"{a.base_url}{API}/checkpoints/{ids[as_record]}", headers=_auth(KEY_A), timeout=10)
        assert deleted.status_code == 200 and _lookup(a.base_url, KEY_A, as_record).status_code == 404
        reading.join(10)
        assert refused and "not a regular file" in refused[0], refused
    finally:
        for fifo in [*fifos, key_folder / KEY_FILE]:
            _release(fifo)
        reading.join(10)
    assert all(stat.S_ISFIFO(fifo.lstat().st_mode) for fifo in fifos)  # left as they were


def _refusal(call, argument, error_type) -> str:
    try:
        call(argument)
    except error_type as error:
        return str(error)
    return "not refused"


def test_servers_starting_together_share_one_key(tmp_path, monkeypatch):
    """A server that finds the key file another one created and has not written yet waits for the key (briefly); a
    key whose write fails leaves no empty key file to refuse every later start."""
    from trl_grpo_ext.pytrio_server.storage import KEY_FILE, StorageError, StorageKey

    folder = tmp_path / "together"
    folder.mkdir()
    fd = os.open(folder / KEY_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # created, not yet written
    secret = "5e" * 32
    writer = threading.Timer(0.3, lambda: (os.write(fd, f"{secret}\n".encode()), os.close(fd)))
    writer.start()
    key = StorageKey.of(folder)
    writer.join()
    assert key.sign({"a": 1}) == StorageKey(bytes.fromhex(secret)).sign({"a": 1})

    (folder / KEY_FILE).unlink()

    def full(_fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(StorageError, match="No space left"):
        StorageKey.of(folder)
    monkeypatch.undo()
    assert not (folder / KEY_FILE).exists()
    StorageKey.of(folder)  # the next start makes the key
    assert len((folder / KEY_FILE).read_text().strip()) == 64


def test_adopting_signs_only_records_that_agree_with_their_place(local, shared, caplog):
    """With ``adopt_unsigned_checkpoints`` a record of before is signed only where it agrees with its place: one
    pointing at another checkpoint's folder, one whose folder is the storage root (expired, for the ttl sweep), and
    one whose name climbs out of its folder are refused and left as they are, while one that agrees is adopted."""
    a = local()
    _, tc = _trainer(a.model_alias, seed=14)
    victim = _folder(shared, tc.save_weights_for_sampler("adopt-victim").result().path)
    record, victim_files = _record(victim), _files(victim)

    def plant(run: str, folder: str, **changes) -> Path:
        old = _unsigned(record, uri=f"trio://{run}/sampler_weights/{folder}", run=run, name=folder,
                        path=f"{run}/sampler_weights/{folder}")  # fmt: skip
        return _plant(shared, run, "sampler_weights", folder, {**old, **changes}, victim)

    bad = {
        "pointing": (plant("tr_planted0000000040", "stolen", path=os.path.relpath(victim, shared)), "its path"),
        "the root": (plant("tr_planted0000000041", "everything", path=".", expires=1), "its path"),
        "climbing": (plant("tr_planted0000000042", "evil", name="../../../evil"), "its name"),
    }
    agrees = plant("tr_planted0000000043", "agrees")
    before = {what: _files(folder) for what, (folder, _) in bad.items()}
    with caplog.at_level(logging.WARNING, logger="trl_grpo_ext.pytrio_server"):
        adopting = local(adopt_unsigned_checkpoints=True)
    assert "trio://tr_planted0000000043/sampler_weights/agrees" in adopting.registry.checkpoints  # adoption is on
    assert _record(agrees)["signature"].startswith("hmac-sha256:")
    lines = [r.getMessage() for r in caplog.records]
    for what, (folder, reason) in bad.items():
        assert "trio://" + str(folder.relative_to(shared)) not in adopting.registry.checkpoints, what
        assert _files(folder) == before[what], what  # unsigned still, nothing deleted
        refusal = f"refusing checkpoint record {folder / RECORD_FILE}: {reason} disagree with the place it lies"
        assert any(line.startswith(refusal) for line in lines), (what, lines)
    assert _files(victim) == victim_files


def test_converting_a_legacy_optimizer_writes_into_its_folder_only(local, shared, tmp_path, monkeypatch):
    """An old ``optimizer.pt`` beside a link named ``optimizer.safetensors``: the conversion replaces the link, never
    writes through it (even with a safetensors that writes into the file a name opens; 0.8 replaces it); a load that
    saw the pickle just before another load converted it reads the converted files."""
    import safetensors.torch

    def in_place(tensors, filename, metadata=None):
        with open(filename, "wb") as handle:
            handle.write(safetensors.torch.save(tensors, metadata))

    monkeypatch.setattr(safetensors.torch, "save_file", in_place)
    a = local()
    _, tc = _trainer(a.model_alias, seed=15)
    uri = tc.save_state("linked-optimizer").result().path
    folder = _folder(shared, uri)
    legit = io.BytesIO()
    with a.checkpoint_files(a.registry.checkpoint(uri)) as files:
        torch.save(load_optimizer(files, uri), legit)
    _as_legacy(folder, legit.getvalue())
    outside = tmp_path / "someone.safetensors"
    outside.write_bytes(b"someone's file")
    (folder / "optimizer.safetensors").symlink_to(outside)
    with a.checkpoint_files(a.registry.checkpoint(uri)) as files:
        state = load_optimizer(files, uri)
    assert outside.read_bytes() == b"someone's file"
    assert not (folder / "optimizer.safetensors").is_symlink() and (folder / "optimizer.json").is_file()
    assert not (folder / "optimizer.pt").exists()
    with a.checkpoint_files(a.registry.checkpoint(uri)) as files:
        real, first = files.entry, {"optimizer.json": None, "optimizer.pt": outside.stat()}  # as seen before
        files.entry = lambda name: first.pop(name) if name in first else real(name)
        raced = load_optimizer(files, uri)
    assert raced["param_names"] == state["param_names"]
