"""Local PyTRIO server: a bad request fails alone, at admission, beside in-flight good ones (real sockets, tiny model).

Each bad sampling request is sent while three good requests are queued for one decode batch (the model held busy,
so they are in flight): it must be answered 400 at once, and the good ones' answers must be identical, byte for
byte, to the same three requests without it. Non-finite numbers anywhere in a request are refused the same way.
"""

from __future__ import annotations

import json
import math
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("pytrio")


from trl_grpo_ext.pytrio_server import LocalPyTrioServer, ServerConfig  # noqa: E402

KEY = {"Authorization": "Bearer k"}
GOOD = [  # (prompt, sampling params, num_samples)
    ([1, 5, 9, 14, 3, 7, 8], {"max_tokens": 10, "seed": 3}, 3),
    ([2, 3], {"max_tokens": 8, "seed": 4, "temperature": 0.7, "top_k": 20}, 2),
    (list(range(10, 30)), {"max_tokens": 9, "seed": 5, "top_p": 0.9, "stop": ["\n"]}, 2),
]
BASE = {"max_tokens": 6, "seed": 1}
BAD = {  # name: (changes to a good request body, the code answered)
    "temperature NaN": ({"sampling_params": {**BASE, "temperature": math.nan}}, "non_finite_number"),
    "temperature inf": ({"sampling_params": {**BASE, "temperature": math.inf}}, "non_finite_number"),
    "temperature string": ({"sampling_params": {**BASE, "temperature": "hot"}}, "invalid_sampling_params"),
    "temperature negative": ({"sampling_params": {**BASE, "temperature": -1}}, "invalid_sampling_params"),
    "temperature 1e-300": ({"sampling_params": {**BASE, "temperature": 1e-300}}, "invalid_sampling_params"),
    "seed 2**70": ({"sampling_params": {**BASE, "seed": 2**70}}, "invalid_sampling_params"),
    "seed float": ({"sampling_params": {**BASE, "seed": 1.5}}, "invalid_sampling_params"),
    "stop [123]": ({"sampling_params": {**BASE, "stop": [123]}}, "invalid_sampling_params"),
    "stop nested": ({"sampling_params": {**BASE, "stop": [["x"]]}}, "invalid_sampling_params"),
    "stop too long": ({"sampling_params": {**BASE, "stop": ["x" * 100_000]}}, "invalid_sampling_params"),
    "stop_token_ids out of vocab": ({"sampling_params": {**BASE, "stop_token_ids": [10**9]}}, "token_out_of_range"),
    "top_p 0": ({"sampling_params": {**BASE, "top_p": 0}}, "invalid_sampling_params"),
    "top_k -5": ({"sampling_params": {**BASE, "top_k": -5}}, "invalid_sampling_params"),
    "top_k 2.5": ({"sampling_params": {**BASE, "top_k": 2.5}}, "invalid_sampling_params"),
    "unknown param": ({"sampling_params": {**BASE, "min_p": 0.1}}, "invalid_sampling_params"),
    "prompt out of vocab": (
        {"prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 10**6]}]}},
        "token_out_of_range",
    ),  # fmt: skip
    "prompt negative": ({"prompt": {"chunks": [{"type": "encoded_text", "tokens": [-1, 2]}]}}, "token_out_of_range"),
    "longer than the context": ({"sampling_params": {**BASE, "max_tokens": 10**9}}, "sequence_too_long"),
    "num_samples": ({"num_samples": 10**6}, "too_many_samples"),
    "topk logprobs": ({"topk_prompt_logprobs": 49152, "return_prompt_logprobs": True}, "topk_too_large"),
}


def _body(prompt, params, n, rid="r"):
    return {"request_id": rid, "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
            "sampling_params": params, "num_samples": n}  # fmt: skip


@pytest.fixture(scope="module")
def served(engine, tiny_model_path):
    """(server, client, sample URL, actor headers): one sampling run on the tiny model."""
    server = LocalPyTrioServer(ServerConfig(model=tiny_model_path, api_key="k", ephemeral_storage=True), engine)
    server.start()
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        sid = client.post("/api/openapi/v1/service-sessions", json={"sdk_version": "x"}, headers=KEY).json()
        run = client.post(f"/api/openapi/v1/service-sessions/{sid['service_session_cuid']}/sampling-runs",
                          json={"base_model": server.model_alias}, headers=KEY).json()  # fmt: skip
        token = {"Authorization": f"Bearer {run['actor_jwt']['token']}", "Content-Type": "application/json"}
        yield server, client, f"/actor/v1/sampling-runs/{run['sampling_run_cuid']}/sample", token
    server.stop()


def _post(client, url, headers, body) -> httpx.Response:
    return client.post(url, content=json.dumps(body).encode(), headers=headers)  # json.dumps writes NaN/Infinity


def _wait_for(condition, what: str):
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def _good_batch(served, pool, bad: dict | None = None, joins: bool = False):
    """The three good requests queued behind a busy model in a fixed order (so they decode as one batch, rows in
    the same order every time), `bad` sent while they wait; returns (good answers, bad answer, its seconds).

    `joins`: the bad request passes admission and queues to join the batch (answered once the model is free).
    """
    server, client, url, headers = served
    sampler = server.sampler
    bad_answer = seconds = None
    with server.engine.for_sampling.lock:  # sampling is busy: the good requests are in flight, waiting in the batcher
        batches = sampler.batches
        futures = []
        for i, (prompt, params, n) in enumerate(GOOD):
            futures.append(pool.submit(_post, client, url, headers, _body(prompt, params, n, f"good{i}")))
            if i == 0:  # the worker took it and waits for the model
                _wait_for(lambda: sampler.batches > batches, "the first request never started a batch")
            else:
                _wait_for(lambda i=i: len(sampler._pending) == i, "a good request never reached the queue")
        if bad is not None and joins:
            pending = pool.submit(_post, client, url, headers, bad)
            _wait_for(lambda: len(sampler._pending) == len(GOOD), "the bad request never reached the queue")
        elif bad is not None:
            start = time.monotonic()
            with httpx.Client(base_url=server.base_url, timeout=30) as other:  # another client, another socket
                bad_answer = _post(other, url, headers, bad)
            seconds = time.monotonic() - start
    answers = [f.result(timeout=120) for f in futures]
    if joins:
        bad_answer = pending.result(timeout=120)
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    return [a.json()["sequences"] for a in answers], bad_answer, seconds


def test_each_bad_sampling_request_fails_alone_at_admission(served):
    with ThreadPoolExecutor(5) as pool:
        baseline, _, _ = _good_batch(served, pool)
        assert any(len(s["tokens"]) > 2 for seqs in baseline for s in seqs)
        for name, (changes, code) in BAD.items():
            good, answer, seconds = _good_batch(served, pool, {**_body([1, 2, 3], BASE, 1, "bad"), **changes})
            assert answer.status_code == 400, (name, answer.status_code, answer.text)
            assert answer.json()["code"] == code, (name, answer.json())
            assert seconds < 10, (name, seconds)  # answered while the model was still busy
            assert good == baseline, name  # identical: same tokens, same logprobs, same text


def test_stop_token_ids_and_stop_strings_of_the_right_types_are_taken(served):
    _server, client, url, headers = served
    params = {"max_tokens": 12, "seed": 3}
    first = _post(client, url, headers, _body([1, 5, 9], params, 1)).json()["sequences"][0]
    assert len(first["tokens"]) >= 2
    stop_at = first["tokens"][1]
    stopped = _post(client, url, headers, _body([1, 5, 9], {**params, "stop_token_ids": [stop_at]}, 1))
    assert stopped.status_code == 200
    tokens = stopped.json()["sequences"][0]["tokens"]
    assert tokens == first["tokens"][: first["tokens"].index(stop_at) + 1]
    for seed in (0, 2**64 - 1, -(2**63)):  # torch's whole seed range is taken
        assert _post(client, url, headers, _body([1, 5, 9], {**params, "seed": seed}, 1)).status_code == 200


def test_a_request_failing_inside_its_batch_fails_alone(served, monkeypatch):
    """With the admission checks switched off, bad requests reach the decode batch: each fails alone (400 with the
    cause), the good ones of the batch finish with the same tokens as without it."""
    from trl_grpo_ext.pytrio_server import actor, decoding

    server = served[0]
    with ThreadPoolExecutor(5) as pool:
        baseline, _, _ = _good_batch(served, pool)

        def unchecked(prompt, n, params, limits, return_text=True):
            return decoding.SampleSpec(prompt, n, return_text=return_text, **params)

        monkeypatch.setattr(actor, "sample_spec", unchecked)
        monkeypatch.setattr(server.sampler.engine, "check_sample", lambda spec: spec, raising=False)
        for changes in ({"seed": 2**70}, {"temperature": 1e-300}, {"stop": [123]}):
            good, answer, _ = _good_batch(served, pool, _body([1, 2, 3], {**BASE, **changes}, 2, "bad"), joins=True)
            assert answer.status_code == 400 and answer.json()["code"] == "sampling_failed", answer.text
            for mine, theirs in zip(good, baseline, strict=True):
                assert [s["tokens"] for s in mine] == [s["tokens"] for s in theirs], changes
                for a, b in zip(mine, theirs, strict=True):  # the batch's padding changed: float rounding only
                    assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-5)


def test_non_finite_numbers_are_refused_in_every_request(served, engine):
    """NaN or infinite numbers: a Control body, an event's payload (AdamW parameters) are 400 at once."""
    import msgpack
    from pytrio.protocol.actor.events.event import EventEnvelope, EventMetadata, EventType, generate_event_id

    server, client, _, _ = served
    sid = client.post("/api/openapi/v1/service-sessions", json={"sdk_version": "x"}, headers=KEY).json()
    sessions = f"/api/openapi/v1/service-sessions/{sid['service_session_cuid']}"
    lora = {"train_mlp": True, "train_attn": True, "train_unembed": True}
    bad_control = json.dumps({"base_model": server.model_alias, "lora_rank": 4, **lora, "x": math.nan})
    answer = client.post(f"{sessions}/training-runs", content=bad_control, headers=KEY)
    assert answer.status_code == 400 and answer.json()["code"] == "non_finite_number"
    run = client.post(f"{sessions}/training-runs", json={"base_model": server.model_alias, "lora_rank": 4, **lora},
                      headers=KEY).json()  # fmt: skip
    token = {"Authorization": f"Bearer {run['actor_jwt']['token']}", "Content-Type": "application/msgpack",
             "Accept": "application/msgpack"}  # fmt: skip

    def event(kind, payload, index):
        metadata = EventMetadata(index=index, step=0, timestamp=0, sdk="pytrio", sdk_version="0.2.9",
                                 run_id=run["training_run_cuid"])  # fmt: skip
        envelope = EventEnvelope(event_id=generate_event_id(), type=kind, metadata=metadata, payload={})
        data = envelope.model_dump(mode="json")
        data["payload"] = payload
        return client.post("/actor/v1/events", content=msgpack.packb(data), headers=token), envelope.event_id

    for bad_lora in ({"rank": 10**6}, {"rank": 0}):  # the event's own copy of the LoRA settings
        submitted, event_id = event(EventType.TRAINER_INIT_RUN, {"base_model": server.model_alias,
                                                                 "lora_config": {**lora, **bad_lora}}, 1)  # fmt: skip
        status = client.get(f"/actor/v1/events/{event_id}", headers={**token, "Prefer": "wait=30"})
        result = msgpack.unpackb(status.content)
        assert result["status"] == "failed" and result["error"]["code"] == "invalid_payload", result
    submitted, init = event(EventType.TRAINER_INIT_RUN, {"base_model": server.model_alias,
                                                         "lora_config": {"rank": 4, **lora}}, 1)  # fmt: skip
    assert submitted.status_code == 202
    adam = {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0,
            "grad_clip_norm": 0.0}  # fmt: skip
    for field, value in (("learning_rate", math.nan), ("weight_decay", math.nan), ("eps", math.inf),
                         ("beta1", -math.inf)):  # fmt: skip
        # refused before it is queued, as a failed event: pytrio's training client would stop the whole run on a
        # refused submission, while a failed event fails this call only
        answer, _ = event(EventType.TRAINER_OPTIMIZE_STEP, {"adam_params": {**adam, field: value}}, 2)
        body = msgpack.unpackb(answer.content)
        assert answer.status_code == 202 and body["status"] == "failed", (field, body)
        assert body["error"]["code"] == "non_finite_number" and field in body["error"]["message"], body
    # a finite but invalid value fails the event with the reason (the run's weights untouched)
    answer, event_id = event(EventType.TRAINER_OPTIMIZE_STEP, {"adam_params": {**adam, "beta2": 1.5}}, 2)
    assert answer.status_code == 202
    status = client.get(f"/actor/v1/events/{event_id}", headers={**token, "Prefer": "wait=30"})
    result = msgpack.unpackb(status.content)
    assert result["status"] == "failed" and "beta2=1.5" in str(result), result
    answer, event_id = event(EventType.TRAINER_OPTIMIZE_STEP, {"adam_params": adam}, 2)  # the run goes on
    status = client.get(f"/actor/v1/events/{event_id}", headers={**token, "Prefer": "wait=30"})
    assert msgpack.unpackb(status.content)["status"] == "succeeded"


def test_a_nan_learning_rate_from_the_real_client_fails_that_call_only(served):
    import pytrio as trio
    from pytrio.errors.event import EventFailedError

    server = served[0]
    server.configure_client(retry_initial_delay_seconds=0.05)
    service = trio.ServiceClient()
    try:
        tc = service.create_lora_training_client(base_model=server.model_alias, rank=4, seed=0)
        tokens = [1, 5, 9, 14, 3, 7]
        datum = trio.Datum(model_input=trio.ModelInput.from_ints(tokens[:-1]),
                           loss_fn_inputs={"target_tokens": tokens[1:]})  # fmt: skip
        tc.forward_backward([datum], "cross_entropy").result()
        with pytest.raises(EventFailedError) as error:
            tc.optim_step(trio.AdamParams(learning_rate=math.nan)).result()
        assert error.value.code == "non_finite_number" and "learning_rate" in str(error.value)
        tc.optim_step(trio.AdamParams(learning_rate=1e-3)).result()
        loss = tc.forward([datum], "cross_entropy").result().metrics["loss_sum"]
        assert math.isfinite(loss)
    finally:
        service._runtime.shutdown()
