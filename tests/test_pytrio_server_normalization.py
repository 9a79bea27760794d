"""Local PyTRIO server: loss normalisation from the client's ``gradient_accumulation`` totals.

One logical ``forward_backward`` gives the same gradient whether the client sends it as one event or splits it into
micro-batches (``max_batch_size=1``), and that gradient is the plain sum's divided by the logical batch's count of
the tokens the loss counts (docs/pytrio_server.md, "Loss normalisation"). A request without totals keeps the sum;
totals no honest client sends fail the event.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

trio = pytest.importorskip("pytrio")

from pytrio.errors.event import EventFailedError  # noqa: E402
from pytrio.protocol.actor.events.event import (  # noqa: E402
    EventEnvelope,
    EventMetadata,
    EventType,
    generate_event_id,
)

from trl_grpo_ext.pytrio_server import LocalPyTrioServer, ServerConfig  # noqa: E402

LOSSES = ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro"]
SEQUENCES = [[1, 5, 9, 14, 3, 7, 8, 11, 4], [2, 3, 6, 10], [7, 7, 12, 5, 9, 20, 21]]


@pytest.fixture(scope="module")
def fp32_engine(tiny_model_path):
    from trl_grpo_ext.pytrio_server.engine import ModelEngine

    return ModelEngine(tiny_model_path, bf16=False)  # gradients compared to float rounding: no bf16


@pytest.fixture(scope="module")
def servers(fp32_engine, tiny_model_path, tmp_path_factory):
    """Three servers on one engine: whole events, split events (one datum per event), the plain sum."""
    made = {}
    for name, options in {
        "whole": {},
        "split": {"max_batch_size": 1},
        "sum": {"loss_normalization": "sum"},
    }.items():
        config = ServerConfig(model=tiny_model_path, ephemeral_storage=True, api_key="k" * 24, **options)
        made[name] = LocalPyTrioServer(config, engine=fp32_engine).start()
    home = str(tmp_path_factory.mktemp("trio-home"))
    yield made, home
    for server in made.values():
        server.stop()


def _data(loss):
    """Three datums of different lengths: a -100 target, zero weights (cross_entropy) / zero advantages (others)."""
    rng = np.random.default_rng(0)
    data = []
    for k, seq in enumerate(SEQUENCES):
        n = len(seq) - 1
        targets = list(seq[1:])
        if k == 0:
            targets[2] = -100
        inputs = {"target_tokens": np.array(targets, dtype=np.int64)}
        if loss == "cross_entropy":
            weights = rng.uniform(0.5, 1.5, n).astype(np.float32)
            weights[: k + 1] = 0.0  # prompt-like tokens
            inputs["weights"] = weights
        else:
            adv = np.full(n, [1.5, -0.7, 0.9][k], dtype=np.float32)
            adv[: k + 1] = 0.0
            inputs["logprobs"] = rng.normal(-2.5, 0.3, n).astype(np.float32)
            inputs["advantages"] = adv
        data.append(trio.Datum(model_input=trio.ModelInput.from_ints(seq[:-1]), loss_fn_inputs=inputs))
    return data


def _denominator(loss, data):
    """The logical batch's count of the tokens `loss` counts, from the data (not from the server)."""
    count = 0
    for d in data:
        valid = d.loss_fn_inputs["target_tokens"].to_numpy() != -100
        if loss == "cross_entropy":
            valid &= d.loss_fn_inputs["weights"].to_numpy() != 0
        elif loss == "dro":
            valid &= d.loss_fn_inputs["advantages"].to_numpy() != 0
        count += int(valid.sum())
    return count


def _close(actual, expected):
    """Equal to float rounding (the scale is applied before the backward, or the rows summed in another order)."""
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5 * float(expected.abs().max()) + 1e-12)


def _gradient(server, home, loss, data):
    server.configure_client(home=home, retry_initial_delay_seconds=0.05)
    service = trio.ServiceClient()
    try:
        tc = service.create_lora_training_client(base_model=server.model_alias, rank=4, seed=5)
        out = tc.forward_backward(data, loss).result()
        params = server.engine.runs[tc.training_run_cuid].params
        grads = {n: p.grad.detach().clone() for n, p in params if p.grad is not None}
        return out, grads
    finally:
        service._runtime.shutdown()


@pytest.mark.parametrize("loss", LOSSES)
def test_one_logical_batch_gives_the_normalised_gradient_however_it_is_split(servers, loss):
    made, home = servers
    data = _data(loss)
    whole, whole_grads = _gradient(made["whole"], home, loss, data)
    split, split_grads = _gradient(made["split"], home, loss, data)
    plain, sum_grads = _gradient(made["sum"], home, loss, data)
    denominator = _denominator(loss, data)
    assert 0 < denominator < sum(len(s) - 1 for s in SEQUENCES)  # the masks matter for this data
    # the metrics stay the plain sum and its count (the client adds them up over micro-batches)
    for out in (whole, split):
        assert out.metrics["token_count"] == denominator == plain.metrics["token_count"]
        assert out.metrics["loss_sum"] == pytest.approx(plain.metrics["loss_sum"], rel=1e-5)
    assert whole_grads.keys() == split_grads.keys() == sum_grads.keys() and whole_grads
    moved = 0
    for name, grad in sum_grads.items():
        _close(whole_grads[name], grad / denominator)
        _close(split_grads[name], whole_grads[name])
        moved += int(grad.abs().max() > 1e-6)
    assert moved >= len(sum_grads) // 2  # every lora_B (lora_A's gradient is 0 while lora_B is 0)


def _raw_forward_backward(server, home, payload_totals):
    """A forward_backward event sent as the client would, with `payload_totals` as its ``gradient_accumulation``
    (omitted when None); returns the event's result or raises its `EventFailedError`."""
    server.configure_client(home=home, retry_initial_delay_seconds=0.05)
    service = trio.ServiceClient()
    try:
        tc = service.create_lora_training_client(base_model=server.model_alias, rank=4, seed=5)
        tc.forward([trio.Datum(model_input=trio.ModelInput.from_ints([1, 2]), loss_fn_inputs={"target_tokens": [2, 3]})],
                   "cross_entropy").result()  # fmt: skip
        coordinator = tc._actor_binding.coordinator
        payload = {
            "data": [{"model_input": {"chunks": [{"type": "encoded_text", "tokens": [1, 5, 9, 14]}]},
                      "target_ids": [5, 9, 14, 3], "weights": [1.0, 1.0, 0.0, 1.0]}],
            "auto_shift": False,
            "loss": {"type": "cross_entropy", "config": {}},
        }  # fmt: skip
        if payload_totals is not None:
            payload["gradient_accumulation"] = payload_totals
        metadata = EventMetadata(index=100, step=0, timestamp=0, sdk="pytrio", sdk_version="0.2.9",
                                 run_id=tc.training_run_cuid)  # fmt: skip
        envelope = EventEnvelope(event_id=generate_event_id(), type=EventType.TRAINER_FORWARD_BACKWARD,
                                 metadata=metadata, payload=payload)  # fmt: skip
        run = service._runtime.event_loop.run_sync
        accepted = run(coordinator.actor_client.submit_event(envelope))

        async def poll():
            return coordinator._future_for_response(accepted)

        result = run(poll()).result(timeout=60)
        params = server.engine.runs[tc.training_run_cuid].params
        return result, {n: p.grad.detach().clone() for n, p in params if p.grad is not None}
    finally:
        service._runtime.shutdown()


def test_a_request_without_totals_keeps_the_plain_sum(servers):
    made, home = servers
    _, with_totals = _raw_forward_backward(
        made["whole"], home, {"total_samples": 1, "total_active_tokens": 3, "total_advantage_tokens": 0}
    )
    _, without = _raw_forward_backward(made["whole"], home, None)
    _, summed = _raw_forward_backward(made["sum"], home, None)
    for name, grad in without.items():
        _close(grad, summed[name])
        _close(with_totals[name], grad / 3)


@pytest.mark.parametrize(
    ("totals", "says"),
    [
        ({"total_samples": 0, "total_active_tokens": 3, "total_advantage_tokens": 0}, "total_samples"),
        ({"total_samples": 1, "total_active_tokens": -1, "total_advantage_tokens": 0}, "total_active_tokens"),
        ({"total_samples": 1, "total_active_tokens": 2**41, "total_advantage_tokens": 0}, "total_active_tokens"),
        ({"total_samples": 1, "total_active_tokens": 2.5, "total_advantage_tokens": 0}, "integer"),
        ({"total_samples": 1, "total_active_tokens": "3", "total_advantage_tokens": 0}, "integer"),
        ({"total_samples": 1, "total_active_tokens": 3}, "total_advantage_tokens"),
        ({"total_samples": 1, "total_active_tokens": 3, "total_advantage_tokens": 0, "x": 1}, "unknown"),
        ({"total_samples": 1, "total_active_tokens": 2, "total_advantage_tokens": 0}, "below the 3 tokens"),
        ({"total_samples": 1, "total_active_tokens": 0, "total_advantage_tokens": 0}, "below the 3 tokens"),
        ([1, 2, 3], "map"),
    ],
)
def test_totals_no_honest_client_sends_fail_the_event(servers, totals, says):
    made, home = servers
    with pytest.raises(EventFailedError) as error:
        _raw_forward_backward(made["whole"], home, totals)
    assert error.value.code == "invalid_gradient_accumulation" and says in str(error.value), str(error.value)
