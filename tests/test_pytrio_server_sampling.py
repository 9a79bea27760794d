"""Local PyTRIO server: concurrent sample requests share decode steps, and batching changes no request's samples."""

from __future__ import annotations

import time

import pytest

from trl_grpo_ext.pytrio_server.decoding import DecodeBatch, SampleSpec
from trl_grpo_ext.pytrio_server.engine import ModelEngine

SPECS = [
    SampleSpec([1, 5, 9, 14, 3, 7, 8], 4, 12, seed=3),
    SampleSpec([2, 3], 2, 9, seed=4, temperature=0.7, top_k=20),
    SampleSpec(list(range(10, 40)), 3, 15, seed=5, top_p=0.9),
    SampleSpec([7, 7, 7], 1, 5, temperature=0.0),
    SampleSpec([4, 8, 15, 16, 23], 2, 0, seed=6),  # max_tokens 0: nothing sampled
]


@pytest.fixture(scope="module", params=[False, True], ids=["fp32", "bf16"])
def engine(tiny_model_path, request):
    """Both answers of the precision: the server samples in fp32 either way (bf16 training does not change it)."""
    return ModelEngine(tiny_model_path, bf16=request.param)


def _alone(engine, spec):
    params = {k: getattr(spec, k) for k in ("max_tokens", "temperature", "top_k", "top_p", "seed")}
    return engine.sample(None, spec.prompt, num_samples=spec.num_samples, **params)


def _assert_same(alone, batched):
    assert [r.tokens for r in batched] == [r.tokens for r in alone]
    assert [r.stop_reason for r in batched] == [r.stop_reason for r in alone]
    for a, b in zip(alone, batched, strict=True):
        # the batched forward pads and stacks rows: float rounding only
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-5)


def test_a_request_samples_the_same_alone_and_in_any_batch(engine):
    alone = [_alone(engine, spec) for spec in SPECS]
    assert any(len(r.tokens) > 3 for r in alone[0])
    for order in ([0, 1, 2, 3, 4], [2, 4, 0, 3, 1]):
        batch = DecodeBatch(engine, None)
        handles = {}
        for step, i in enumerate(order):  # requests join at different decode steps, as they would arrive
            handles[i] = batch.admit(SPECS[i])
            if step % 2 == 1:
                batch.step()
        while batch.requests:
            batch.step()
        for i, rows in handles.items():
            _assert_same(alone[i], rows.results(engine.tokenizer))


def test_concurrent_requests_through_the_server_are_batched(tiny_model_path, engine, tmp_path):
    trio = pytest.importorskip("pytrio")
    from trl_grpo_ext.pytrio_server import LocalPyTrioServer, ServerConfig

    server = LocalPyTrioServer(ServerConfig(model=tiny_model_path, ephemeral_storage=True), engine=engine).start()
    try:
        server.configure_client(home=str(tmp_path / "home"), retry_initial_delay_seconds=0.05)
        service = trio.ServiceClient()
        sampler = service.create_sampling_client(base_model=server.model_alias)
        specs = SPECS[:3]
        requests = [
            (trio.ModelInput.from_ints(s.prompt), s.num_samples, trio.SamplingParams(
                max_tokens=s.max_tokens, seed=s.seed, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p))
            for s in specs
        ]  # fmt: skip
        alone = [sampler.sample(p, num_samples=n, sampling_params=sp).result() for p, n, sp in requests]
        assert server.sampler.max_requests_in_batch == 1
        # hold the model while all requests arrive (as the async loop sends them): they must share one batch
        with engine.lock:
            futures = [sampler.sample(p, num_samples=n, sampling_params=sp) for p, n, sp in requests]
            # until the worker waits for the model with the others queued behind it; at most 10 s: in a process
            # where another local server has stopped, they can reach this one only once the model is free (they
            # still share the first one's batch, as the asserts below check)
            for _ in range(1000):
                if len(server.sampler._pending) >= len(requests) - 1:
                    break
                time.sleep(0.01)
        together = [f.result() for f in futures]
        assert server.sampler.max_requests_in_batch == len(requests)
        for a, b in zip(alone, together, strict=True):
            assert [s.tokens for s in b.sequences] == [s.tokens for s in a.sequences]
            for x, y in zip(a.sequences, b.sequences, strict=True):
                assert y.logprobs == pytest.approx(x.logprobs, abs=1e-5)
        service._runtime.shutdown()
    finally:
        server.stop()
