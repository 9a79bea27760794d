"""Local PyTRIO server: memory admission (context length, a budget admitted work never exceeds, queueing) and
log-probs without full-vocabulary copies (chunked output layer, recomputed layers) equal to the plain computation."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

trio = pytest.importorskip("pytrio")
httpx = pytest.importorskip("httpx")

import msgpack  # noqa: E402
import torch  # noqa: E402
from precision_tolerance import assert_grads_close, tolerance  # noqa: E402
from pytrio.errors.actor import ActorAPIError  # noqa: E402
from pytrio.errors.event import EventFailedError  # noqa: E402

from trl_grpo_ext.pytrio_server.adapters import LoraSettings  # noqa: E402
from trl_grpo_ext.pytrio_server.forward import ForwardDatum  # noqa: E402
from trl_grpo_ext.pytrio_server.loss_fns import parse_loss  # noqa: E402

KEY = {"Authorization": "Bearer k"}


def _datum(n: int):
    tokens = [(7 * i) % 390 + 3 for i in range(n + 1)]
    return trio.Datum(model_input=trio.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:]})


def test_items_longer_than_the_context_and_work_beyond_the_budget_are_refused(make_server, engine):
    # the tiny model's context is 512 tokens; the budget admits a 100-token forward_backward, not a 400-token one
    budget = (engine.forward_bytes([100], True) + engine.forward_bytes([400], True)) // 2
    server = make_server(api_key="k", memory_budget_bytes=budget)
    service = trio.ServiceClient()
    try:
        tc = service.create_lora_training_client(base_model=server.model_alias, rank=4, seed=0)
        assert tc.forward_backward([_datum(100)], "cross_entropy").result().metrics["token_count"] == 100
        answer = _raw_forward_backward(server, 600)  # the client itself refuses it: sent by hand
        body = msgpack.unpackb(answer.content)  # refused before it is queued, as a failed event
        assert answer.status_code == 202 and body["status"] == "failed", body
        assert body["error"]["code"] == "sequence_too_long"
        assert "600 tokens" in body["error"]["message"] and "512" in body["error"]["message"]
        with pytest.raises(EventFailedError) as error:
            tc.forward_backward([_datum(400)], "cross_entropy").result()
        message = str(error.value)
        assert error.value.code == "exceeds_memory_budget"
        assert f"{budget / 1024**3:.2f} GiB" in message and "--memory-budget-gb" in message
        assert tc.forward([_datum(400)], "cross_entropy").result().metrics["token_count"] == 400  # no backward: fits
        sampler = service.create_sampling_client(base_model=server.model_alias)
        prompt = trio.ModelInput.from_ints([1, 2, 3])
        with pytest.raises(ActorAPIError) as error:  # 128 rows x 500 tokens of KV cache
            sampler.sample(prompt, num_samples=128, sampling_params=trio.SamplingParams(max_tokens=500)).result()
        assert error.value.status_code == 413 and error.value.code == "exceeds_memory_budget"
        assert server.memory.used == 0 and server.memory.peak <= budget
    finally:
        service._runtime.shutdown()


def _raw_forward_backward(server, n: int):
    """A ``trainer.forward_backward`` event of one `n`-token item, submitted over HTTP without the client's checks."""
    from pytrio.protocol.actor.events.event import EventEnvelope, EventMetadata, EventType, generate_event_id

    lora = {"train_mlp": True, "train_attn": True, "train_unembed": True}
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        sid = client.post("/api/openapi/v1/service-sessions", json={"sdk_version": "x"}, headers=KEY).json()
        run = client.post(f"/api/openapi/v1/service-sessions/{sid['service_session_cuid']}/training-runs",
                          json={"base_model": server.model_alias, "lora_rank": 4, **lora}, headers=KEY).json()  # fmt: skip
        metadata = EventMetadata(index=1, step=0, timestamp=0, sdk="pytrio", sdk_version="0.2.9",
                                 run_id=run["training_run_cuid"])  # fmt: skip
        envelope = EventEnvelope(event_id=generate_event_id(), type=EventType.TRAINER_FORWARD_BACKWARD,
                                 metadata=metadata, payload={}).model_dump(mode="json")  # fmt: skip
        tokens = [(7 * i) % 390 + 3 for i in range(n)]
        envelope["payload"] = {
            "data": [{"model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens}]}, "target_ids": tokens}],
            "loss": {"type": "cross_entropy", "config": {}},
            "gradient_accumulation": {"total_samples": 1, "total_active_tokens": n, "total_advantage_tokens": 0},
        }
        headers = {"Authorization": f"Bearer {run['actor_jwt']['token']}", "Content-Type": "application/msgpack",
                   "Accept": "application/msgpack"}  # fmt: skip
        return client.post("/actor/v1/events", content=msgpack.packb(envelope), headers=headers)


def _sampling_run(server, client):
    sid = client.post("/api/openapi/v1/service-sessions", json={"sdk_version": "x"}, headers=KEY).json()
    run = client.post(f"/api/openapi/v1/service-sessions/{sid['service_session_cuid']}/sampling-runs",
                      json={"base_model": server.model_alias}, headers=KEY).json()  # fmt: skip
    token = {"Authorization": f"Bearer {run['actor_jwt']['token']}", "Content-Type": "application/json"}
    return f"/actor/v1/sampling-runs/{run['sampling_run_cuid']}/sample", token


def _request(seed: int) -> dict:
    return {"request_id": f"r{seed}", "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 5, 9, seed]}]},
            "sampling_params": {"max_tokens": 12, "seed": seed}, "num_samples": 2}  # fmt: skip


def test_work_that_does_not_fit_now_waits_for_running_work(make_server, engine):
    """The budget fits one request at a time: concurrent ones decode one after another (never together), each
    answer the same as alone; a request waits while other work holds the budget, and runs once it is released."""
    cost = engine.memory_model.sample_bytes(4, 2, 12)
    server = make_server(api_key="k", memory_budget_bytes=cost * 3 // 2)
    with httpx.Client(base_url=server.base_url, timeout=60) as client, ThreadPoolExecutor(4) as pool:
        url, token = _sampling_run(server, client)
        alone = [client.post(url, json=_request(s), headers=token).json()["sequences"] for s in range(3)]
        # all three arrive while sampling is busy: without the budget they would share a batch
        with engine.for_sampling.lock:
            futures = [pool.submit(client.post, url, json=_request(s), headers=token) for s in range(3)]
            deadline = time.monotonic() + 30
            while len(server.sampler._pending) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
        together = [f.result(timeout=60).json()["sequences"] for f in futures]
        assert together == alone
        assert server.sampler.max_requests_in_batch == 1 and server.memory.peak <= server.memory.budget
        # other work holds the whole budget: the request is queued, not refused, and runs once it is released
        server.memory.acquire(server.memory.budget)
        waiting = pool.submit(client.post, url, json=_request(7), headers=token)
        time.sleep(1.0)
        assert not waiting.done()
        server.memory.release(server.memory.budget)
        assert waiting.result(timeout=60).status_code == 200
    deadline = time.monotonic() + 10
    while server.memory.used and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.memory.used == 0


def test_a_training_event_waits_for_the_budget_in_its_run(make_server, engine):
    server = make_server(api_key="k")
    service = trio.ServiceClient()
    try:
        tc = service.create_lora_training_client(base_model=server.model_alias, rank=4, seed=0)
        server.memory.acquire(server.memory.budget)
        released = threading.Timer(1.0, server.memory.release, [server.memory.budget])
        start = time.monotonic()
        released.start()
        assert tc.forward_backward([_datum(50)], "cross_entropy").result().metrics["token_count"] == 50
        assert time.monotonic() - start >= 0.9  # it ran only once the budget was free
    finally:
        service._runtime.shutdown()


def test_a_batch_larger_than_the_budget_runs_in_smaller_chunks(make_server, engine):
    """Only an item alone above the budget is refused: a batch of many runs in chunks cut to fit, same results."""
    data = [_datum(100 + i) for i in range(6)]
    budget = engine.forward_bytes([106, 106], True) * 11 // 10  # two items per chunk at most
    assert engine.forward_bytes([100 + i for i in range(6)], True) > budget  # as one chunk it would not fit
    results = []
    for options in ({}, {"memory_budget_bytes": budget}):
        server = make_server(api_key="k", **options)
        service = trio.ServiceClient()
        try:
            tc = service.create_lora_training_client(base_model=server.model_alias, rank=4, seed=0)
            results.append(tc.forward_backward(data, "cross_entropy").result())
            assert server.memory.peak <= server.memory.budget
        finally:
            service._runtime.shutdown()
    assert results[1].metrics["token_count"] == sum(100 + i for i in range(6))
    assert results[1].metrics["loss_sum"] == pytest.approx(results[0].metrics["loss_sum"], rel=1e-5)


def _reference_logprobs(engine, tokens, targets):
    """log_softmax over the model's full logits, gathered: what the chunked computation must equal."""
    logits = engine.peft(input_ids=torch.tensor([tokens])).logits.float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor([targets]).unsqueeze(-1)).squeeze(-1)[0]


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_chunked_logprobs_and_recomputed_layers_change_nothing(engine, tiny_model_path, bf16):
    """An item longer than one logit chunk, with and without recomputed layers: log-probs equal the full-vocabulary
    computation (in the engine's precision), gradients equal each other; to float rounding in fp32, to bf16 rounding
    (`precision_tolerance.BF16`) in bf16 autocast."""
    from trl_grpo_ext.pytrio_server.engine import ModelEngine
    from trl_grpo_ext.pytrio_server.logprobs import LOGIT_CHUNK

    if bf16:
        engine = ModelEngine(tiny_model_path, bf16=True)
    tol = tolerance(bf16)

    n = LOGIT_CHUNK + 60
    tokens = [(11 * i) % 390 + 3 for i in range(n)]
    targets = tokens[1:] + [4]
    engine.create_run("memory-test", LoraSettings(4, 0, True, True, True))
    try:
        run = engine.runs["memory-test"]
        grads, logprobs = [], []
        for checkpoint_tokens in (10**9, 8):
            engine.checkpoint_tokens = checkpoint_tokens
            out, _ = engine.forward("memory-test", [ForwardDatum(tokens, targets, [1.0] * n)],
                                    parse_loss("cross_entropy", {}), backward=True, auto_shift=False)  # fmt: skip
            logprobs.append(out[0]["logprobs"])
            grads.append([p.grad.clone() for _, p in run.params])
            run.optimizer.zero_grad(set_to_none=True)
        assert engine.can_checkpoint and engine.split_head
        with torch.no_grad(), engine._autocast():
            engine._activate(run.adapter, trainable=False)
            reference = _reference_logprobs(engine, tokens, targets).numpy()
        worst = 1e-5 if not bf16 else tol.logprob
        assert abs(logprobs[0] - reference).max() < worst and abs(logprobs[1] - reference).max() < worst
        if not bf16:
            for a, b in zip(*grads, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        else:
            assert_grads_close(dict(enumerate(grads[1])), dict(enumerate(grads[0])), tol)
    finally:
        engine.checkpoint_tokens = 1024
        engine.drop_run("memory-test")


def test_estimates_follow_the_model_shape(engine):
    """Costs grow with tokens, samples and max_tokens; on the embedded model's shape (SmolLM2-135M) a 2,048-token
    forward_backward item is estimated above what it measured (0.35 GB peak, recomputed layers) and below 1 GB,
    and kept activations above what they measured (2.9 GB of saved tensors)."""
    from trl_grpo_ext.pytrio_server.memory import GIB, MemoryModel

    model = engine.memory_model
    assert engine.forward_bytes([400], True) > engine.forward_bytes([100], True) > engine.forward_bytes([100], False)
    assert model.sample_bytes(10, 8, 100) > model.sample_bytes(10, 4, 100) > model.sample_bytes(10, 4, 10)
    smol = MemoryModel(layers=30, hidden=576, intermediate=1536, heads=9, kv_heads=3, head_dim=64, vocab=49152,
                       dtype_bytes=4, logit_chunk=256)  # fmt: skip
    assert 0.35 * GIB < smol.chunk_bytes(2048, True, recomputed=True) < 1 * GIB
    assert smol.chunk_bytes(2048, True, recomputed=False) > 2.9 * GIB
    assert json.dumps(engine.forward_bytes([], True)) == "0"


def test_freed_memory_is_handed_back_once_the_server_is_idle(monkeypatch):
    """When admitted work drops to 0 and stays there a moment, gc + malloc_trim run (once per idle spell)."""
    from trl_grpo_ext.pytrio_server import memory

    real, calls, timer_threads = memory.release_freed_memory, [], set()
    gate = memory.MemoryGate(100)
    trim_if_idle = gate._trim_if_idle

    def this_gates_trim():  # the timers this gate starts run this; other gates' (earlier tests' servers) do not
        timer_threads.add(threading.get_ident())
        trim_if_idle()

    gate._trim_if_idle = this_gates_trim
    monkeypatch.setattr(
        memory,
        "release_freed_memory",
        lambda: calls.append(time.monotonic()) if threading.get_ident() in timer_threads else None,
    )
    gate.acquire(60)
    assert gate.try_acquire(40) and not gate.try_acquire(1)  # the budget is full
    gate.release(40)
    time.sleep(memory.IDLE_TRIM_SECONDS * 2)
    assert calls == []  # work still admitted: nothing trimmed
    gate.release(60)
    gate.acquire(10)  # new work and its end within the idle delay: one trim, when the delay is over
    gate.release(10)
    deadline = time.monotonic() + 10
    while not calls and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(calls) == 1 and gate.used == 0 and gate.peak == 100
    real()  # the real one (gc, then malloc_trim where glibc) runs without error
    with pytest.raises(Exception, match="exceeds_memory_budget|needs about"):
        gate.refuse_beyond(101, "this request")
