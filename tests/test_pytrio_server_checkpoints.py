"""Local PyTRIO server checkpoints, over sockets with the real pytrio client: the base model each records (two servers
of different bases on one storage folder), downloads (``download_checkpoint`` round trip: PEFT loads the archive on
the base and gives the server's log-probs), optimizer state without pickle, and ``ttl_seconds``."""

from __future__ import annotations

import io
import json
import os
import tarfile
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from conftest import build_tiny_model

trio = pytest.importorskip("pytrio")

from pytrio.errors.base import PyTrioError  # noqa: E402
from pytrio.errors.control import ControlAPIError  # noqa: E402
from pytrio_versions import run_id  # noqa: E402

from trl_grpo_ext.pytrio_server import LocalPyTrioServer, ServerConfig  # noqa: E402
from trl_grpo_ext.pytrio_server.errors import without_paths  # noqa: E402
from trl_grpo_ext.pytrio_server.registry import RECORD_FILE  # noqa: E402

pytestmark = pytest.mark.slow

KEY_A, KEY_B = "ckpt-client-a-2b7e", "ckpt-client-b-6f0d"
TOKENS = [1, 5, 9, 14, 3, 7, 11, 2, 8, 6]
API = "/api/openapi/v1"


@pytest.fixture(scope="module")
def other_base_path(tmp_path_factory):
    """A base model of the same shapes and tokenizer as the tiny one, with other weights (another seed)."""
    return build_tiny_model(tmp_path_factory.mktemp("other-base") / "tiny-other", seed=1)


def _datum(tokens=TOKENS):
    return trio.Datum(model_input=trio.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:]})


def _train(tc, steps=2, lr=5e-2):
    for _ in range(steps):
        tc.forward_backward([_datum()], "cross_entropy").result()
        tc.optim_step(trio.AdamParams(learning_rate=lr)).result()


def _listing(server, key=KEY_A) -> dict[str, dict]:
    """The raw Control listing (the client's `Checkpoint` type keeps no base model) by checkpoint URI."""
    answer = httpx.get(f"{server.base_url}{API}/checkpoints", headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert answer.status_code == 200, answer.text
    return {c["checkpoint_uri"]: c for c in answer.json()["checkpoints"]}


def test_two_bases_on_one_storage_folder(tiny_model_path, other_base_path, tmp_path):
    """Server A (the tiny model) saves checkpoints; server B (same shapes, other weights) on the same storage folder
    lists them with A's base and refuses to resume, sample from, load or chat with them (one line naming both bases)
    while A still uses them; a checkpoint without a recorded base is refused too (it cannot be checked)."""
    storage = str(tmp_path / "shared-storage")

    def start(model, home, **options):
        config = ServerConfig(model=model, api_key=KEY_A, storage_dir=storage, bf16=False, **options)
        server = LocalPyTrioServer(config).start()
        server.configure_client(home=str(tmp_path / home))
        return server

    a = start(tiny_model_path, "home-a")
    try:
        tc = trio.ServiceClient().create_lora_training_client(base_model=a.model_alias, rank=4, seed=0)
        _train(tc)
        state = tc.save_state("on-a").result().path
        weights = tc.save_weights_for_sampler("on-a-weights").result().path
        mine = _listing(a)[state]
        assert mine["base_model"] == a.model_id and mine["base_model_served"]
        assert mine["base_model_fingerprint"] == a.engine.base_model.fingerprint

        b = start(other_base_path, "home-b")  # registers what the folder holds, as any server starting on it
        try:
            assert b.engine.base_model.fingerprint != a.engine.base_model.fingerprint
            listed = _listing(b)[state]
            assert (listed["base_model"], listed["base_model_fingerprint"]) == (
                a.model_id,
                mine["base_model_fingerprint"],
            )
            assert not listed["base_model_served"]
            service = trio.ServiceClient()
            attempts = {
                "resume with optimizer": lambda: service.create_training_client_from_state_with_optimizer(state),
                "resume": lambda: service.create_training_client_from_state(state),
                "sample from": lambda: service.create_sampling_client(b.model_alias, model_path=weights),
                "load_state": lambda: (
                    service.create_lora_training_client(base_model=b.model_alias, rank=4).load_state(state).result()
                ),
            }
            for what, attempt in attempts.items():
                with pytest.raises(PyTrioError) as refused:
                    attempt()
                # load_state: the client compares the checkpoint's base (as the server reports it) itself first
                codes = {"base_model_mismatch"} | (
                    {"validation.checkpoint_config_mismatch"} if what == "load_state" else set()
                )
                assert refused.value.code in codes, (what, refused.value)
                message = refused.value.message
                assert "\n" not in message, (what, message)
                if refused.value.code == "base_model_mismatch":  # the server's answer: models by name, never a path
                    names = (Path(a.model_id).name, Path(b.model_id).name)
                    assert all(n in message for n in names) and without_paths(message) == message, (what, message)
                else:  # the client's own comparison of the names the server reported
                    assert a.model_id in message and b.model_id in message, (what, message)
            auth = {"Authorization": f"Bearer {KEY_A}"}
            with httpx.Client(base_url=f"{b.base_url}/api/openapi/v1", headers=auth, timeout=30) as http:
                sid = http.post("/service-sessions", json={"sdk_version": "raw"}).json()["service_session_cuid"]
                lora = {"lora_rank": 4, "train_mlp": True, "train_attn": True, "train_unembed": True}
                created = http.post(
                    f"/service-sessions/{sid}/training-runs", json={"base_model": b.model_alias, **lora}
                )
                run = created.json()["training_run_cuid"]
                patched = http.patch(f"/service-sessions/{sid}/training-runs/{run}",
                                     json={"source_checkpoint_uri": state, "restore_optimizer": True})  # fmt: skip
            assert patched.status_code == 409 and patched.json()["code"] == "base_model_mismatch", patched.text
            assert without_paths(patched.json()["message"]) == patched.json()["message"], patched.text
            chat = httpx.post(f"{b.base_url}/api/openai/v1/chat/completions", headers=auth, timeout=60,
                              json={"model": weights, "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
            assert chat.status_code == 409 and chat.json()["error"]["code"] == "base_model_mismatch"
            models = httpx.get(f"{b.base_url}/api/openai/v1/models", headers=auth, timeout=30).json()["data"]
            assert weights not in {m["id"] for m in models}  # not a model B can serve
        finally:
            b.stop()

        a.configure_client(home=str(tmp_path / "home-a"))  # A still resumes it
        restored = trio.ServiceClient().create_training_client_from_state_with_optimizer(state)
        assert restored.forward([_datum()], "cross_entropy").result().metrics["token_count"] == len(TOKENS) - 1
    finally:
        a.stop()

    # a checkpoint saved before checkpoints recorded their base (an earlier version's record, adopted): it cannot be
    # checked against a base, so it is refused as another base's checkpoint is
    record_file = Path(storage) / run_id(tc) / "sampler_weights" / "on-a-weights" / RECORD_FILE
    unsigned = ("signature", "format", "server", "base_model", "base_model_fingerprint")
    legacy = {k: v for k, v in json.loads(record_file.read_text()).items() if k not in unsigned}
    legacy["path"] = os.path.join(run_id(tc), "sampler_weights", "on-a-weights")
    record_file.write_text(json.dumps(legacy))
    c = start(other_base_path, "home-c", adopt_unsigned_checkpoints=True)
    try:
        assert _listing(c)[weights]["base_model"] == "" and not _listing(c)[weights]["base_model_served"]
        with pytest.raises(PyTrioError) as refused:
            trio.ServiceClient().create_sampling_client(c.model_alias, model_path=weights)
        assert refused.value.code == "base_model_mismatch" and "records no base model" in refused.value.message
        assert without_paths(refused.value.message) == refused.value.message, refused.value.message
    finally:
        c.stop()


def _download(rest, cid, path, **kwargs):
    return rest.download_checkpoint(cid, path, **kwargs).result()


def _logprobs(model, tokens=TOKENS) -> np.ndarray:
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None]).squeeze(-1).numpy()


def _base(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def test_download_round_trip_loads_in_peft_with_the_servers_logprobs(make_server, tiny_model_path, tmp_path):
    server = make_server(api_key=KEY_A, api_keys=(KEY_B,), max_request_bytes=4096)
    service = trio.ServiceClient()
    tc = service.create_lora_training_client(base_model=server.model_alias, rank=4, seed=5)
    _train(tc, steps=3, lr=0.1)
    sampler_path = tc.save_weights_for_sampler("take-home").result().path
    state_path = tc.save_state("take-home-state").result().path
    rest = service.create_rest_client()
    ids = {c.path: c.checkpoint_id for c in rest.list_user_checkpoints().result().checkpoints}

    archive = tmp_path / "take-home.tar"
    result = _download(rest, ids[sampler_path], archive)
    assert result.bytes_written == result.file_size_bytes == archive.stat().st_size > 0 and not result.resumed
    with tarfile.open(archive) as tar:
        assert tar.getnames() == ["take-home/adapter_config.json", "take-home/adapter_model.safetensors",
                                  "take-home/trio_checkpoint.json"]  # fmt: skip
        tar.extractall(tmp_path / "home", filter="data")
    from peft import PeftModel

    local = _logprobs(PeftModel.from_pretrained(_base(tiny_model_path), tmp_path / "home" / "take-home"))
    served = service.create_sampling_client(server.model_alias, model_path=sampler_path)
    remote = np.asarray(served.compute_logprobs(trio.ModelInput.from_ints(TOKENS)).result()[1:], dtype=np.float64)
    np.testing.assert_allclose(local, remote, rtol=0, atol=1e-5)
    assert not np.allclose(local, _logprobs(_base(tiny_model_path)), atol=1e-3)  # the trained adapter, not the base
    assert server.memory.peak >= 1  # the reads were admitted against the working-memory budget

    # resumed: a partial file is completed with a range request; a complete one is left as it is (416)
    whole = archive.read_bytes()
    archive.write_bytes(whole[:1000])
    resumed = _download(rest, ids[sampler_path], archive)
    assert resumed.resumed and resumed.status_code == 206 and archive.read_bytes() == whole
    done = _download(rest, ids[sampler_path], archive)
    assert done.bytes_written == 0 and done.status_code == 416 and archive.read_bytes() == whole
    # the archive URL serves the same bytes to anyone holding it, until it expires
    url = rest.get_checkpoint_archive_url(ids[sampler_path]).result().url
    assert httpx.get(url, timeout=60).content == whole
    source = rest.get_checkpoint_download_url(ids[sampler_path]).result()
    assert source.url.startswith(server.base_url) and source.checkpoint_status == "LOCAL"

    # a state checkpoint: the adapter and its AdamW state, no pickle
    state_archive = tmp_path / "state.tar"
    _download(rest, ids[state_path], state_archive)
    with tarfile.open(state_archive) as tar:
        names = tar.getnames()
        meta = json.load(tar.extractfile("take-home-state/optimizer.json"))
    assert "take-home-state/optimizer.safetensors" in names and not any(n.endswith(".pt") for n in names)
    assert meta["param_names"] and meta["state"]

    # another key: its download of A's checkpoint is the answer a missing one gets
    other = trio.ServiceClient(api_key=KEY_B).create_rest_client()
    with pytest.raises(ControlAPIError) as theirs:
        other.get_checkpoint_download_url(ids[sampler_path]).result()
    with pytest.raises(ControlAPIError) as missing:
        other.get_checkpoint_download_url("ckpt_0000000000000000").result()
    assert (theirs.value.status_code, theirs.value.code) == (missing.value.status_code, missing.value.code)
    assert theirs.value.code == "checkpoint_not_found" and theirs.value.message.endswith("not found")
    # the URL's credential: a changed signature or a past expiry is refused before anything is read; so is a body
    # above the request limit
    forged = url.replace("signature=", "signature=0")
    assert httpx.get(forged).status_code == 403
    expired = url.split("?")[0] + f"?expires=1&signature={server._sign(ids[sampler_path], 1)}"
    answer = httpx.get(expired)
    assert answer.status_code == 403 and answer.json()["code"] == "download_url_expired"
    big = httpx.request("GET", url, content=b"x" * 5000)
    assert big.status_code == 413 and big.json()["code"] == "request_too_large"
    # a deleted checkpoint's URL no longer serves it
    rest.delete_checkpoint(run_id(tc), ids[sampler_path]).result()
    assert httpx.get(url).status_code == 404


class _Planted:
    """What a file planted in a shared storage folder could hold: unpickling it would run code (it leaves a mark)."""

    def __init__(self, mark: str):
        self.mark = mark

    def __reduce__(self):
        return (os.mkdir, (self.mark,))


def test_optimizer_state_is_stored_without_pickle_and_old_pickles_convert_or_are_refused(make_server, tmp_path):
    from trl_grpo_ext.pytrio_server.optimizer_state import load_optimizer

    server = make_server()
    service = trio.ServiceClient()
    tc = service.create_lora_training_client(base_model=server.model_alias, rank=4, seed=8)
    _train(tc)
    state = tc.save_state("plain").result().path
    folder = server.registry.checkpoint(state).path
    assert {"optimizer.json", "optimizer.safetensors"} <= {p.name for p in folder.iterdir()}
    assert not (folder / "optimizer.pt").exists()

    def next_step(path):
        restored = service.create_training_client_from_state_with_optimizer(path)
        _train(restored, steps=1)
        return restored.forward([_datum()], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()

    expected = next_step(state)
    # the format of checkpoints saved before: one pickle, converted on first load to the same optimizer
    legacy = tc.save_state("legacy").result().path
    legacy_folder = server.registry.checkpoint(legacy).path
    with server.checkpoint_files(server.registry.checkpoint(legacy)) as folder:
        torch.save(load_optimizer(folder, legacy), legacy_folder / "optimizer.pt")
    for name in ("optimizer.json", "optimizer.safetensors"):
        (legacy_folder / name).unlink()
    server._snapshot_cache.clear()
    np.testing.assert_array_equal(next_step(legacy), expected)
    assert (legacy_folder / "optimizer.json").is_file() and not (legacy_folder / "optimizer.pt").exists()

    # a pickle that would run code is refused with one clear line, runs nothing, and stays as it was
    planted = tc.save_state("planted").result().path
    planted_folder = server.registry.checkpoint(planted).path
    mark = tmp_path / "code-ran"
    payload = io.BytesIO()
    torch.save({"state_dict": _Planted(str(mark)), "param_names": []}, payload)
    (planted_folder / "optimizer.pt").write_bytes(payload.getvalue())
    for name in ("optimizer.json", "optimizer.safetensors"):
        (planted_folder / name).unlink()
    server._snapshot_cache.clear()
    with pytest.raises(PyTrioError) as refused:
        next_step(planted)
    assert refused.value.code == "checkpoint_unreadable" and "planted" in str(refused.value)
    assert str(planted_folder) not in str(refused.value)  # the folder on the server's disk is no client's business
    assert not mark.exists() and (planted_folder / "optimizer.pt").read_bytes() == payload.getvalue()
    # its weights alone still load
    assert service.create_training_client_from_state(planted).forward([_datum()], "cross_entropy").result()


def test_ttl_seconds_expires_a_checkpoint(make_server):
    server = make_server()
    service = trio.ServiceClient()
    tc = service.create_lora_training_client(base_model=server.model_alias, rank=4, seed=9)
    short = tc.save_weights_for_sampler("short-lived", ttl_seconds=1).result().path
    kept = tc.save_weights_for_sampler("kept").result().path
    record = server.registry.checkpoint(short)
    rest = service.create_rest_client()
    listed = {c.path: c for c in rest.list_user_checkpoints().result().checkpoints}
    assert listed[short].expires_at is not None and listed[kept].expires_at is None
    time.sleep(max(0.0, record.expires - time.time()) + 0.05)
    # past its ttl it answers as a missing checkpoint at once; its files go at the next sweep
    assert short not in {c.path for c in rest.list_user_checkpoints().result().checkpoints}
    with pytest.raises(ControlAPIError) as gone:
        service.create_sampling_client(server.model_alias, model_path=short)
    assert gone.value.code == "checkpoint_not_found"
    assert record.path.is_dir() and server.expire_checkpoints() == 1 and not record.path.exists()
    assert server.registry.checkpoint(kept).path.is_dir()  # no ttl: kept
    with pytest.raises(PyTrioError) as bad:
        tc.save_weights_for_sampler("never", ttl_seconds=-5).result()
    assert "ttl_seconds" in str(bad.value)
