"""The real `pytrio==0.2.9` client against the local PyTRIO server on the tiny model.

One server per module (model loading dominates), in fp32 whatever the CPU (its tests compare numbers exactly); every
test opens its own `ServiceClient` and training runs. The properties that must hold in bf16 too run again on a bf16
server (`precision_server`), to bf16 rounding (`precision_tolerance`).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

trio = pytest.importorskip("pytrio")

import pytrio_versions  # noqa: E402
from precision_tolerance import assert_grads_close, tolerance  # noqa: E402
from pytrio.errors.actor import ActorEventSubmitError  # noqa: E402
from pytrio.errors.control import ControlAPIError  # noqa: E402
from pytrio.errors.event import EventFailedError  # noqa: E402
from pytrio.protocol.actor.events.event import (  # noqa: E402
    EventEnvelope,
    EventMetadata,
    EventType,
    generate_event_id,
)
from pytrio_faults import FaultInjector  # noqa: E402
from pytrio_versions import on_client_loop, run_id  # noqa: E402

from trl_grpo_ext.compat import pytrio_settings  # noqa: E402
from trl_grpo_ext.grpo import losses  # noqa: E402
from trl_grpo_ext.pytrio_server import LocalPyTrioServer, ServerConfig  # noqa: E402
from trl_grpo_ext.pytrio_server.registry import safe_name  # noqa: E402

TEXT = "What is 3 + 4? The answer is \\boxed{7}. Solve the problem step by step."


@pytest.fixture(scope="module")
def served(tiny_model_path, tmp_path_factory):
    """The module's server and its fault injector (installed before the first request: Starlette builds its
    middleware stack then)."""
    srv = LocalPyTrioServer(
        ServerConfig(model=tiny_model_path, storage_dir=str(tmp_path_factory.mktemp("ckpt")), bf16=False)
    )
    faults = FaultInjector().install(srv)
    with srv:
        srv.configure_client(home=str(tmp_path_factory.mktemp("trio-home")), retry_initial_delay_seconds=0.05)
        yield srv, faults


@pytest.fixture(scope="module")
def server(served):
    return served[0]


@pytest.fixture(scope="module")
def bf16_server(server, tiny_model_path):
    """A second server, on an engine of its own in bf16 autocast, answering `server`'s key."""
    config = ServerConfig(model=tiny_model_path, bf16=True, api_key=server.api_key, ephemeral_storage=True)
    with LocalPyTrioServer(config) as srv:
        yield srv


@pytest.fixture(params=[False, True], ids=["fp32", "bf16"])
def precision_server(request, server):
    """`server`, then `bf16_server` with the process's client pointed at it for the test."""
    if not request.param:
        yield server
        return
    srv = request.getfixturevalue("bf16_server")
    srv.configure_client()
    try:
        yield srv
    finally:
        server.configure_client()


@pytest.fixture
def faults(served):
    yield served[1]
    served[1].clear()


@pytest.fixture
def service(server):
    client = trio.ServiceClient()
    yield client
    client._runtime.shutdown()


def _datum(tokens, loss="cross_entropy", old=None, adv=None, weights=None):
    inputs, targets = tokens[:-1], tokens[1:]
    loss_inputs = {"target_tokens": targets}
    if loss == "cross_entropy":
        if weights is not None:
            loss_inputs["weights"] = weights
    else:
        loss_inputs["logprobs"] = old
        loss_inputs["advantages"] = adv
    return trio.Datum(model_input=trio.ModelInput.from_ints(inputs), loss_fn_inputs=loss_inputs)


def _tokens(training_client, text=TEXT):
    return training_client.get_tokenizer().encode(text)


def _grads(server, run_id):
    return {n: p.grad.detach().clone() for n, p in server.engine.runs[run_id].params if p.grad is not None}


def _run_loop(client):
    return lambda value: on_client_loop(client, value)


def test_training_round_trip_every_builtin_loss(server, service):
    tc = service.create_lora_training_client(base_model=server.model_alias, rank=8, seed=0)
    assert tc.model_id == server.model_id
    tokens = _tokens(tc)
    n = len(tokens) - 1
    weights = [0.0] * 5 + [1.0] * (n - 5)
    ce = tc.forward_backward([_datum(tokens, weights=weights)], "cross_entropy").result()
    logprobs = ce.loss_fn_outputs[0]["logprobs"].to_numpy()
    assert logprobs.shape == (n,) and np.all(logprobs <= 0)
    # Tinker's reduction: the plain sum of -w * logp over the weighted tokens
    assert ce.metrics["loss_sum"] == pytest.approx(-(logprobs[5:]).sum(), rel=1e-5)
    assert ce.metrics["token_count"] == n - 5

    rng = np.random.default_rng(0)
    old = (logprobs + rng.normal(0, 0.3, n)).tolist()
    adv = [0.0] * 5 + [1.5] * (n - 5)
    for loss in ("importance_sampling", "ppo", "cispo", "dro"):
        out = tc.forward_backward([_datum(tokens, loss, old, adv)], loss).result()
        new = torch.tensor(out.loss_fn_outputs[0]["logprobs"].to_numpy())
        assert torch.allclose(new, torch.tensor(logprobs), atol=1e-5)  # no step yet: same policy
        per_token, _ = losses.policy_loss(loss, new, torch.tensor(old), torch.tensor(adv))
        mask = torch.tensor(adv) != 0 if loss == "dro" else torch.ones(n, dtype=torch.bool)
        expected = float((per_token * mask).sum())
        assert out.metrics["loss_sum"] == pytest.approx(expected, rel=1e-5, abs=1e-5), loss

    step = tc.optim_step(trio.AdamParams(learning_rate=1e-2, grad_clip_norm=1.0)).result()
    assert step.metrics["grad_norm"] > 0 and step.metrics["step"] == 1
    after = tc.forward([_datum(tokens, weights=weights)], "cross_entropy").result()
    assert not np.allclose(after.loss_fn_outputs[0]["logprobs"].to_numpy(), logprobs)


def test_sampler_snapshot_stays_frozen_while_training_continues(server, service):
    tc = service.create_lora_training_client(base_model=server.model_alias, rank=8, seed=1)
    tokens = _tokens(tc)
    datum = _datum(tokens)
    tc.forward_backward([datum], "cross_entropy").result()
    tc.optim_step(trio.AdamParams(learning_rate=5e-2)).result()
    sampler = tc.save_weights_and_get_sampling_client()
    prompt = trio.ModelInput.from_ints(tokens[:8])
    params = trio.SamplingParams(max_tokens=6, seed=123, temperature=1.0)
    first = sampler.sample(prompt, num_samples=3, sampling_params=params).result()
    assert len(first.sequences) == 3
    for seq in first.sequences:
        assert 1 <= len(seq.tokens) <= 6 and len(seq.logprobs) == len(seq.tokens)
        assert seq.stop_reason in ("length", "stop")
        kept = seq.tokens[:-1] if seq.stop_reason == "stop" else seq.tokens  # the EOS that stopped it left out
        assert seq.text == tc.get_tokenizer().decode(kept, skip_special_tokens=True)
        assert all(lp <= 0 for lp in seq.logprobs)
    # sampler logprobs (temperature 1) are the snapshot policy's logprobs of the sampled tokens
    seq = first.sequences[0]
    full = tokens[:8] + seq.tokens
    check = tc.forward([_datum(full)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_allclose(check[7 : 7 + len(seq.tokens)], seq.logprobs, atol=1e-4)

    for _ in range(2):  # keep training: the snapshot must not move
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(trio.AdamParams(learning_rate=5e-2)).result()
    again = sampler.sample(prompt, num_samples=3, sampling_params=params).result()
    assert [s.tokens for s in again.sequences] == [s.tokens for s in first.sequences]
    fresh = tc.save_weights_and_get_sampling_client()
    moved = fresh.compute_logprobs(trio.ModelInput.from_ints(full)).result()
    frozen = sampler.compute_logprobs(trio.ModelInput.from_ints(full)).result()
    assert frozen[0] is None and len(frozen) == len(full)
    assert not np.allclose(moved[1:], frozen[1:])


def test_sampling_stop_conditions_and_base_model(server, service):
    sampler = service.create_sampling_client(base_model=server.model_alias)
    tok = sampler.get_tokenizer()
    prompt = trio.ModelInput.from_ints(tok.encode("What is 3 + 4?"))
    greedy = trio.SamplingParams(max_tokens=5, temperature=0.0)
    base = sampler.sample(prompt, sampling_params=greedy).result().sequences[0]
    assert len(base.tokens) == 5 and base.stop_reason == "length"
    assert all(lp == 0.0 for lp in base.logprobs)  # greedy: a point mass
    stop_tok = base.tokens[2]
    by_token = sampler.sample(
        prompt, sampling_params=trio.SamplingParams(max_tokens=5, temperature=0.0, stop=[stop_tok])
    )
    seq = by_token.result().sequences[0]
    assert seq.tokens == base.tokens[: base.tokens.index(stop_tok) + 1] and seq.stop_reason == "stop"
    text = tok.decode(base.tokens)
    stop_str = text.strip()[-2:] or text
    by_string = sampler.sample(
        prompt, sampling_params=trio.SamplingParams(max_tokens=5, temperature=0.0, stop=stop_str)
    )
    seq = by_string.result().sequences[0]
    assert seq.stop_reason == "stop" and len(seq.tokens) <= 5
    assert stop_str in tok.decode(seq.tokens) and stop_str not in seq.text  # the matched stop string left out
    seeded = trio.SamplingParams(max_tokens=6, seed=7)
    a = sampler.sample(prompt, num_samples=2, sampling_params=seeded).result()
    b = sampler.sample(prompt, num_samples=2, sampling_params=seeded).result()
    assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
    assert a.input_tokens == len(prompt) and a.output_tokens == sum(len(s.tokens) for s in a.sequences)


def test_save_state_and_load_state_restore_adapter_and_optimizer(server, service):
    tc = service.create_lora_training_client(base_model=server.model_alias, rank=8, seed=2)
    tokens = _tokens(tc)
    datum = _datum(tokens)
    adam = trio.AdamParams(learning_rate=2e-2)
    tc.forward_backward([datum], "cross_entropy").result()
    tc.optim_step(adam).result()
    saved = tc.save_state("after-one").result()
    assert saved.path.startswith("trio://") and saved.size > 0
    with pytest.raises(EventFailedError, match="exists"):
        tc.save_state("after-one").result()
    assert tc.save_state("after-one", overwrite=True).result().path == saved.path

    restored = service.create_lora_training_client(base_model=server.model_alias, rank=8)
    restored.load_state_with_optimizer(saved.path).result()
    from_state = service.create_training_client_from_state_with_optimizer(saved.path)
    reference = tc.forward([datum], "cross_entropy").result().metrics["loss_sum"]
    for client in (restored, from_state):
        assert client.forward([datum], "cross_entropy").result().metrics["loss_sum"] == pytest.approx(reference)
    # identical optimizer state: one more identical step lands on identical weights
    for client in (tc, restored, from_state):
        client.forward_backward([datum], "cross_entropy").result()
        client.optim_step(adam).result()
    losses_after = [
        c.forward([datum], "cross_entropy").result().metrics["loss_sum"] for c in (tc, restored, from_state)
    ]
    assert losses_after[1] == pytest.approx(losses_after[0], rel=1e-6)
    assert losses_after[2] == pytest.approx(losses_after[0], rel=1e-6)
    # weights only: the Adam moments start from zero, so the same step differs
    weights_only = service.create_training_client_from_state(saved.path)
    weights_only.forward_backward([datum], "cross_entropy").result()
    weights_only.optim_step(adam).result()
    assert weights_only.forward([datum], "cross_entropy").result().metrics["loss_sum"] != pytest.approx(
        losses_after[0], rel=1e-6
    )
    sampler_path = tc.save_weights_for_sampler("for-sampler").result().path
    assert (
        tc.create_sampling_client(sampler_path)
        .sample(trio.ModelInput.from_ints(tokens[:5]), sampling_params=trio.SamplingParams(max_tokens=2))
        .result()
        .sequences
    )
    with pytest.raises(ControlAPIError) as error:
        service.create_lora_training_client(base_model=server.model_alias, rank=8).load_state("trio://nope/weights/x")
    assert error.value.status_code == 404


def test_auto_shift_drops_the_first_label(server, service):
    tc = service.create_lora_training_client(base_model=server.model_alias, rank=8, seed=3)
    tokens = _tokens(tc)
    shifted = tc.forward([_datum(tokens)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    full = trio.Datum(model_input=trio.ModelInput.from_ints(tokens), loss_fn_inputs={"target_tokens": tokens})
    auto = tc.forward([full], "cross_entropy", auto_shift=True).result()
    values = auto.loss_fn_outputs[0]["logprobs"].to_numpy()
    assert values[0] == 0.0 and auto.metrics["token_count"] == len(tokens) - 1
    np.testing.assert_allclose(values[1:], shifted, atol=1e-5)


def test_transient_500_is_retried(server, service, faults):
    tc = service.create_lora_training_client(base_model=server.model_alias, rank=8, seed=4)
    datum = _datum(_tokens(tc))
    tc.forward([datum], "cross_entropy").result()  # initialise first, so the fault hits a training event
    submit_fault = faults.add("/actor/v1/events", status=500, times=1, method="POST")
    poll_fault = faults.add("/actor/v1/events/", status=503, times=1, method="GET")
    control_fault = faults.add("/sampling-runs", status=502, times=1, method="POST")
    out = tc.forward_backward([datum], "cross_entropy").result()
    assert out.metrics["token_count"] > 0
    sampler = tc.save_weights_and_get_sampling_client()
    assert submit_fault.hits == 1 and poll_fault.hits == 1 and control_fault.hits == 1
    assert sampler.sample(trio.ModelInput.from_ints([1, 2]), sampling_params=trio.SamplingParams(max_tokens=1))


def test_failed_event_surfaces_as_client_error_and_run_continues(server, service):
    tc = service.create_lora_training_client(base_model=server.model_alias, rank=8, seed=5)
    tokens = _tokens(tc)
    n = len(tokens) - 1
    datum = _datum(tokens, "ppo", [-1.0] * n, [1.0] * n)
    with pytest.raises(EventFailedError) as error:
        tc.forward_backward([datum], "ppo", loss_fn_config={"clip_low_threshold": "tight"}).result()
    assert error.value.code == "invalid_loss_config" and "finite number" in str(error.value)
    with pytest.raises(EventFailedError, match="not accepted"):
        tc.forward_backward([datum], "importance_sampling", loss_fn_config={"beta": 0.1}).result()
    config = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
    assert tc.forward_backward([datum], "ppo", loss_fn_config=config).result().metrics["token_count"] == n


def test_actor_token_renewed_after_401(server, service):
    tc = service.create_lora_training_client(base_model=server.model_alias, rank=8, seed=6)
    datum = _datum(_tokens(tc))
    tc.forward([datum], "cross_entropy").result()
    before, rejected = set(server.registry.tokens), server.registry.rejected_tokens
    with server.registry.lock:  # every actor token invalidated, as a restart or an expiry would
        server.registry.tokens.clear()
    assert len(before) >= 1
    assert tc.forward_backward([datum], "cross_entropy").result().metrics["token_count"] > 0
    # the old token got a 401, the client renewed it through Control and retried with the new one
    assert server.registry.rejected_tokens > rejected
    assert server.registry.tokens and set(server.registry.tokens).isdisjoint(before)


def test_unknown_event_type_and_malformed_payload_are_client_errors(server, service):
    import msgpack

    tc = service.create_lora_training_client(base_model=server.model_alias, rank=8, seed=7)
    tc.forward([_datum(_tokens(tc))], "cross_entropy").result()
    coordinator = pytrio_versions.coordinator(tc)
    actor = coordinator.actor_client
    run = _run_loop(service)
    metadata = {"index": 99, "step": 0, "timestamp": 0, "sdk": "pytrio", "sdk_version": "0.2.9",
                "run_id": run_id(tc)}  # fmt: skip
    raw = msgpack.packb(
        {
            "version": 1,
            "event_id": generate_event_id(),
            "type": "trainer.teleport",
            "metadata": metadata,
            "payload": {},
        },  # fmt: skip
        use_bin_type=True,
    )
    with pytest.raises(ActorEventSubmitError) as error:
        run(
            actor._request_with_actor_jwt(
                "POST",
                "v1/events",
                content=raw,
                headers={"Content-Type": "application/msgpack"},
                error_cls=ActorEventSubmitError,
            )  # fmt: skip
        )
    assert error.value.status_code == 400 and error.value.code == "unknown_event_type"
    with pytest.raises(ActorEventSubmitError) as error:
        run(
            actor._request_with_actor_jwt("POST", "v1/events", content=b"\xc1garbage", error_cls=ActorEventSubmitError)
        )
    assert error.value.code == "invalid_envelope"

    envelope = EventEnvelope(
        event_id=generate_event_id(),
        type=EventType.TRAINER_FORWARD,
        metadata=EventMetadata(**{**metadata, "index": 100}),
        payload={"data": "not a list", "loss": {"type": "cross_entropy"}},
    )
    accepted = run(actor.submit_event(envelope))
    assert accepted.status.value == "accepted"

    async def poll_like_the_client():  # the coordinator's own path from a submit answer to the user's future
        return coordinator._future_for_response(accepted)

    with pytest.raises(EventFailedError) as error:
        run(poll_like_the_client()).result(timeout=30)
    assert error.value.code == "invalid_payload" and "data" in str(error.value)


def test_a_client_collected_on_the_servers_event_loop_closes_without_stalling_it(server):
    """A `ServiceClient` that only the cyclic collector frees, collected on the server's own event-loop thread (any
    allocation there may run a collection): its session close, a request to this same server, runs on a thread of
    its own (`inprocess.defer_client_closes`). Run on the loop, it would wait on itself, the server answering nothing,
    until the client's request timeout: the collection would return only then."""
    import asyncio
    import gc
    import time

    timeout = 10  # the client's; a close that waits on the loop holds it this long at least
    with pytrio_settings(request_timeout_seconds=timeout, retry_max_attempts=1, control_retry_timeout_seconds=timeout):
        client = trio.ServiceClient()
    session = client.service_session_cuid
    client.itself = client  # a reference cycle: refcounting alone never frees it
    del client

    async def collect() -> float:
        started = time.monotonic()
        gc.collect()
        return time.monotonic() - started

    loop = server._http._server.servers[0].get_loop()
    gc.disable()  # no collection on another thread first
    try:
        held = asyncio.run_coroutine_threadsafe(collect(), loop).result(timeout=10 * timeout)
    finally:
        gc.enable()
    assert held < timeout
    deadline = time.monotonic() + 30
    while server.registry.sessions[session].status == "ACTIVE" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.registry.sessions[session].status == "ENDED"  # the close, made from elsewhere, reached the server


def test_wrong_api_key_is_an_auth_error(server):
    with pytest.raises(ControlAPIError) as error:
        trio.ServiceClient(api_key="not-the-key")
    assert error.value.status_code == 401 and error.value.code == "unauthorized"
    assert server.api_key not in str(error.value)


def test_split_batches_accumulate_like_one_event(precision_server, tiny_model_path):
    server = precision_server
    split = LocalPyTrioServer(ServerConfig(model=tiny_model_path, max_batch_size=1, api_key=server.api_key,
                                           ephemeral_storage=True), engine=server.engine)  # fmt: skip
    try:
        with split:
            split.configure_client()
            split_service = trio.ServiceClient()
            one = split_service.create_lora_training_client(base_model=split.model_alias, rank=4, seed=11)
            tokens = _tokens(one)
            data = [_datum(tokens), _datum(tokens[:9]), _datum(tokens[3:])]
            out = one.forward_backward(data, "cross_entropy").result()
            assert len(out.loss_fn_outputs) == 3
            split_grads = _grads(split, run_id(one))
    finally:
        server.configure_client()
    whole = trio.ServiceClient().create_lora_training_client(base_model=server.model_alias, rank=4, seed=11)
    ref = whole.forward_backward(data, "cross_entropy").result()
    tol = tolerance(server.engine.autocast_bf16)
    assert out.metrics["loss_sum"] == pytest.approx(ref.metrics["loss_sum"], rel=tol.loss_sum)
    assert_grads_close(split_grads, _grads(server, run_id(whole)), tol)


def test_cli_arguments():
    import argparse

    from trl_grpo_ext.cli import pytrio_serve

    parser = argparse.ArgumentParser()
    pytrio_serve.add_arguments(parser)
    args = parser.parse_args(["--model", "embedded"])
    assert args.host == "127.0.0.1" and args.api_key == [] and math.isfinite(args.port)


def test_pytrio_serve_command_serves_checks_the_key_and_stops(tiny_model_path):
    """`trl-grpo-ext pytrio-serve` in a subprocess: one command, 127.0.0.1, bearer check, key never printed."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    import httpx

    secret = "cli-secret-0b9e7d"
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRL_GRPO_EXT_PYTRIO_API_KEY": secret, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-c", "import sys; from trl_grpo_ext.cli import main; sys.exit(main())"]
    proc = subprocess.Popen(
        [*cmd, "pytrio-serve", "--model", tiny_model_path, "--port", "0"],
        cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines = []
    try:
        deadline = time.time() + 120
        base_url = None
        while base_url is None and time.time() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "export PYTRIO_BASE_URL=" in line:
                base_url = line.split("=", 1)[1].strip()
        assert base_url and base_url.startswith("http://127.0.0.1:"), "".join(lines)
        verify = f"{base_url}/api/openapi/v1/api-key/verify"
        assert httpx.get(verify, headers={"Authorization": f"Bearer {secret}"}).status_code == 200
        denied = httpx.get(verify, headers={"Authorization": "Bearer wrong"})
        assert denied.status_code == 401 and denied.json()["code"] == "unauthorized"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        lines.append(out)
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert secret not in "".join(lines)


def test_old_sampler_hand_offs_are_pruned_and_snapshots_reload_from_disk(server, tiny_model_path):
    from pytrio.errors.actor import ActorAPIError

    small = LocalPyTrioServer(
        ServerConfig(
            model=tiny_model_path,
            api_key=server.api_key,
            snapshot_cache_size=1,
            max_temporary_checkpoints=2,
            ephemeral_storage=True,
        ),
        engine=server.engine,
    )
    try:
        with small:
            small.configure_client()
            tc = trio.ServiceClient().create_lora_training_client(base_model=small.model_alias, rank=4, seed=12)
            datum = _datum(_tokens(tc))
            prompt = trio.ModelInput.from_ints(_tokens(tc)[:6])
            params = trio.SamplingParams(max_tokens=4, seed=5)
            samplers, first = [], []
            for _ in range(3):
                tc.forward_backward([datum], "cross_entropy").result()
                tc.optim_step(trio.AdamParams(learning_rate=5e-2)).result()
                samplers.append(tc.save_weights_and_get_sampling_client())
                first.append(samplers[-1].sample(prompt, num_samples=2, sampling_params=params).result())
            temporary = [c for c in small.registry.checkpoints.values() if c.visibility == "TEMPORARY"]
            assert len(temporary) == 2 and len(small._snapshot_cache) == 1
            with pytest.raises(ActorAPIError) as error:
                samplers[0].sample(prompt, sampling_params=params).result()
            assert error.value.code == "checkpoint_not_found"
            # the second hand-off was evicted from memory: it reloads from disk and samples the same tokens
            again = samplers[1].sample(prompt, num_samples=2, sampling_params=params).result()
            assert [s.tokens for s in again.sequences] == [s.tokens for s in first[1].sequences]
    finally:
        server.configure_client()


def test_keys_and_tokens_never_reach_the_logs(server, service, caplog):
    import logging

    caplog.set_level(logging.DEBUG)
    tc = service.create_lora_training_client(base_model=server.model_alias, rank=4, seed=13)
    tc.forward_backward([_datum(_tokens(tc))], "cross_entropy").result()
    tokens = list(server.registry.tokens)
    assert tokens and caplog.records
    assert server.api_key not in caplog.text and not any(t in caplog.text for t in tokens)


def test_rest_client_metadata_and_checkpoint_listing(server, service):
    tc = service.create_lora_training_client(base_model=server.model_alias, rank=4, seed=14)
    datum = _datum(_tokens(tc))
    tc.forward_backward([datum], "cross_entropy").result()
    saved = tc.save_state("listed").result()
    rest = service.create_rest_client()
    run = rest.get_training_run(run_id(tc)).result()
    assert run.training_run_id == run_id(tc) and run.lora_rank == 4
    assert any(r.training_run_id == run_id(tc) for r in rest.list_training_runs().result().training_runs)
    checkpoints = rest.list_checkpoints(run_id(tc)).result().checkpoints
    assert [c.checkpoint_type for c in checkpoints if c.path == saved.path] == ["training"]
    session = rest.get_session(service.service_session_cuid).result()
    assert run_id(tc) in session.training_run_ids
    assert service.get_supported_models() == [server.model_id]
    capabilities = service.get_server_capabilities().supported_models[0]
    assert capabilities.training.available and capabilities.max_context_length == server.engine.max_seq_len
    heartbeat = _run_loop(service)(pytrio_versions.coordinator(tc).actor_client.heartbeat())
    assert heartbeat["heartbeat_ms"] == server.config.heartbeat_ms
    sampler = tc.save_weights_and_get_sampling_client()
    info = rest.get_sampler(run_id(sampler)).result()
    assert info.model_path.startswith("trio://") and info.base_model == server.model_id
    listed = {c.path: c for c in rest.list_user_checkpoints().result().checkpoints}
    assert listed[info.model_path].checkpoint_type == "sampler" and listed[info.model_path].expires_at is not None
    rest.delete_checkpoint(run_id(tc), listed[saved.path].checkpoint_id).result()
    assert saved.path not in {c.path for c in rest.list_user_checkpoints().result().checkpoints}


def _logprobs(client, datum):
    return client.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()


def test_new_server_process_loads_state_saved_by_an_earlier_one(server, tiny_model_path, tmp_path):
    """Checkpoint records persist under the storage root: a fresh server (own engine, empty memory) restores."""
    root = tmp_path / "root"

    def fresh_server():
        return LocalPyTrioServer(ServerConfig(model=tiny_model_path, api_key=server.api_key, storage_dir=str(root)))

    adam = trio.AdamParams(learning_rate=2e-2)
    try:
        with fresh_server() as first:
            first.configure_client()
            tc = trio.ServiceClient().create_lora_training_client(base_model=first.model_alias, rank=4, seed=21)
            datum = _datum(_tokens(tc))
            tc.forward_backward([datum], "cross_entropy").result()
            tc.optim_step(adam).result()
            saved = tc.save_state("before-restart").result().path
            tc.save_weights_and_get_sampling_client()  # a TEMPORARY hand-off: removed when the server stops
            before = _logprobs(tc, datum)
            tc.forward_backward([datum], "cross_entropy").result()
            tc.optim_step(adam).result()
            after_step = _logprobs(tc, datum)
        with fresh_server() as second:
            assert second.engine is not first.engine and not second.engine.runs
            assert saved in second.registry.checkpoints
            assert not [c for c in second.registry.checkpoints.values() if c.visibility == "TEMPORARY"]
            second.configure_client()
            service = trio.ServiceClient()
            listed = {c.path: c for c in service.create_rest_client().list_user_checkpoints().result().checkpoints}
            assert listed[saved].checkpoint_type == "training"
            restored = service.create_training_client_from_state_with_optimizer(saved)
            np.testing.assert_allclose(_logprobs(restored, datum), before, rtol=0, atol=1e-6)
            # the optimizer moments came back too: the same step lands on the same weights
            restored.forward_backward([datum], "cross_entropy").result()
            restored.optim_step(adam).result()
            np.testing.assert_allclose(_logprobs(restored, datum), after_step, rtol=0, atol=1e-6)
            # a record written by another process after this one started is found on first use
            second.registry.checkpoints.clear()
            assert second.registry.checkpoint(saved).step == 1
            with pytest.raises(Exception, match="not found"):
                second.registry.checkpoint(saved.replace("before-restart", "..%2F.."))
            # names become folder names (the client checks them too; the server does not rely on it)
            assert safe_name("step_000010") and not safe_name("../escape") and not safe_name("a/b")
    finally:
        server.configure_client()


def test_padded_batches_match_one_datum_at_a_time(precision_server):
    """forward_backward runs right-padded batches; chunked one datum per call it must give the same numbers."""
    server = precision_server
    service = trio.ServiceClient()
    tc = service.create_lora_training_client(base_model=server.model_alias, rank=4, seed=22)
    tokens = _tokens(tc)
    rng = np.random.default_rng(0)
    data, lengths = [], []
    for cut in (len(tokens), 7, len(tokens) - 4):  # three lengths: the shorter rows are padded
        n = cut - 1
        lengths.append(n)
        data.append(_datum(tokens[:cut], "ppo", old=list(rng.normal(-2.0, 0.3, n)), adv=list(rng.normal(0, 1, n))))

    def run_once(max_batch_tokens):
        server.engine.max_batch_tokens = max_batch_tokens
        try:
            out = tc.forward_backward(data, "ppo").result()
        finally:
            server.engine.max_batch_tokens = 4096
        grads = _grads(server, run_id(tc))
        for _, p in server.engine.runs[run_id(tc)].params:
            p.grad = None
        return out, grads

    batched, batched_grads = run_once(4096)
    single, single_grads = run_once(1)
    service._runtime.shutdown()
    tol = tolerance(server.engine.autocast_bf16)
    assert batched.metrics["loss_sum"] == pytest.approx(single.metrics["loss_sum"], rel=tol.loss_sum)
    assert batched.metrics["token_count"] == single.metrics["token_count"] == sum(lengths)
    for a, b in zip(batched.loss_fn_outputs, single.loss_fn_outputs, strict=True):
        for key in ("logprobs", "elementwise_loss"):
            assert a[key].to_numpy().shape == b[key].to_numpy().shape
            assert abs(a[key].to_numpy() - b[key].to_numpy()).max() <= tol.logprob
    assert_grads_close(batched_grads, single_grads, tol)
