"""Sampling beside training on the local PyTRIO server (`model_sides`), over sockets with the real client: a sample
request completes while a training run's forward_backward is held inside the model (and not with
``concurrent_sampling=False``); the tokens, log-probs and gradients are the single-lock server's, bit for bit, at the
same thread count, also when sampling and training overlap; the sampling side shares the base weights' tensors and
each side runs on its share of the threads."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

trio = pytest.importorskip("pytrio")

from pytrio_versions import run_id  # noqa: E402

from trl_grpo_ext.pytrio_server import LocalPyTrioServer, ServerConfig  # noqa: E402
from trl_grpo_ext.pytrio_server.engine import ModelEngine  # noqa: E402

pytestmark = pytest.mark.slow

KEY = "concurrency-key-3c9d"
SEQUENCES = [[1, 5, 9, 14, 3, 7, 8, 11, 4], [1, 2, 3, 6, 10, 13], [1, 7, 7, 12, 5, 9, 20, 21]]
PROMPT = [1, 5, 9, 14]


@pytest.fixture
def one_thread():
    """Both servers at one torch thread (each side's share of one), so their numbers compare bit for bit."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _server(model, tmp_path, concurrent: bool) -> LocalPyTrioServer:
    config = ServerConfig(model=model, api_key=KEY, bf16=False, ephemeral_storage=True, concurrent_sampling=concurrent)
    server = LocalPyTrioServer(config).start()
    server.configure_client(home=str(tmp_path / f"home-{concurrent}"), retry_initial_delay_seconds=0.05)
    return server


def _data(loss="cross_entropy"):
    return [
        trio.Datum(model_input=trio.ModelInput.from_ints(s[:-1]), loss_fn_inputs={"target_tokens": s[1:]})
        for s in SEQUENCES
    ]


def _grads(server, tc) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in server.engine.runs[run_id(tc)].params if p.grad is not None}


def _script(server, overlap: bool) -> dict:
    """One client's session; with `overlap`, sample requests run while forward_backward does."""
    service = trio.ServiceClient()
    tc = service.create_lora_training_client(base_model=server.model_alias, rank=4, seed=3)
    tc.forward_backward(_data(), "cross_entropy").result()
    tc.optim_step(trio.AdamParams(learning_rate=0.05)).result()
    sampler = tc.save_weights_and_get_sampling_client()
    base = service.create_sampling_client(base_model=server.model_alias)
    params = trio.SamplingParams(max_tokens=8, seed=4, temperature=1.0)
    out = {}
    with ThreadPoolExecutor(2) as pool:
        pending = tc.forward_backward(_data(), "cross_entropy")
        if not overlap:
            pending.result()
        samples = [pool.submit(lambda c=c: c.sample(trio.ModelInput.from_ints(PROMPT), 3, params).result())
                   for c in (sampler, base)]  # fmt: skip
        prompt_logprobs = sampler.compute_logprobs(trio.ModelInput.from_ints(SEQUENCES[0])).result()
        trained = pending.result()
        for name, future in zip(("sampler", "base"), samples, strict=True):
            result = future.result(timeout=120)
            out[f"{name} tokens"] = [s.tokens for s in result.sequences]
            out[f"{name} logprobs"] = np.array([lp for s in result.sequences for lp in s.logprobs])
    out["prompt logprobs"] = np.array(prompt_logprobs[1:])
    out["trained logprobs"] = np.concatenate([o["logprobs"].to_numpy() for o in trained.loss_fn_outputs])
    out["grads"] = _grads(server, tc)
    return out


def test_results_are_the_single_lock_servers_bit_for_bit(tiny_model_path, tmp_path, one_thread):
    """The same session on a server with sampling beside training and on one with a single lock, at one thread: the
    same sampled tokens and log-probs, prompt log-probs, trained log-probs and gradients, to the bit; also when the
    sample requests run during the forward_backward."""
    single = _server(tiny_model_path, tmp_path, concurrent=False)
    try:
        assert single.engine.for_sampling is single.engine
        expected = _script(single, overlap=False)
    finally:
        single.stop()
    beside = _server(tiny_model_path, tmp_path, concurrent=True)
    try:
        assert beside.engine.for_sampling is not beside.engine
        for overlap in (False, True):
            got = _script(beside, overlap)
            for key, value in expected.items():
                if key == "grads":
                    assert value.keys() == got[key].keys()
                    assert all(torch.equal(value[n], got[key][n]) for n in value), overlap
                elif isinstance(value, np.ndarray):
                    np.testing.assert_array_equal(got[key], value, err_msg=f"{key}, overlap={overlap}")
                else:
                    assert got[key] == value, (key, overlap)
    finally:
        beside.stop()


@pytest.mark.parametrize("concurrent", [True, False], ids=["beside", "single-lock"])
def test_a_sample_completes_while_forward_backward_is_held_in_the_model(tiny_model_path, tmp_path, concurrent):
    """A hook holds the training run's forward inside the model until released: with sampling beside training a
    sample request (its own snapshot and the base model) is answered meanwhile; with one lock it waits."""
    server = _server(tiny_model_path, tmp_path, concurrent)
    entered, release = threading.Event(), threading.Event()

    def hold(_module, _args):
        if threading.current_thread().name.startswith("pytrio-events"):  # the training run's worker only
            entered.set()
            assert release.wait(120)

    try:
        service = trio.ServiceClient()
        tc = service.create_lora_training_client(base_model=server.model_alias, rank=4, seed=1)
        sampler = tc.save_weights_and_get_sampling_client()
        handle = server.engine.base.get_decoder().register_forward_pre_hook(hold)
        try:
            training = tc.forward_backward(_data(), "cross_entropy")
            assert entered.wait(120), "the forward_backward never reached the model"
            params = trio.SamplingParams(max_tokens=4, seed=0)
            sampled = sampler.sample(trio.ModelInput.from_ints(PROMPT), 2, params)
            if concurrent:
                assert len(sampled.result(timeout=120).sequences) == 2
                assert not release.is_set() and not training.done()  # answered while training was held
                assert sampler.compute_logprobs(trio.ModelInput.from_ints(PROMPT)).result(timeout=120)[1] is not None
            else:
                with pytest.raises(TimeoutError):
                    sampled.result(timeout=2)  # the single lock: it waits for the forward_backward
        finally:
            release.set()
            handle.remove()
        assert training.result(timeout=120).metrics["token_count"] > 0
        assert len(sampled.result(timeout=120).sequences) == 2
    finally:
        server.stop()


def test_the_sampling_side_shares_the_weights_and_takes_its_share_of_the_threads(tiny_model_path):
    """No second copy of the base weights: the sampling side's parameters and buffers are the training side's
    tensors (its modules, LoRA layers and lock its own); on a CPU of 3 threads sampling runs on 1, training on 2,
    each set in the thread that holds the side; with the option off there is one side."""
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        engine = ModelEngine(tiny_model_path, bf16=False)
    finally:
        torch.set_num_threads(before)
    side = engine.for_sampling
    assert side.base is not engine.base and side.lock is not engine.lock
    pairs = zip(engine.base.named_parameters(), side.base.named_parameters(), strict=True)
    assert all(a is b and na == nb for (na, a), (nb, b) in pairs)
    assert all(a is b for a, b in zip(engine.base.buffers(), side.base.buffers(), strict=True))
    seen = {}

    def hold(name, lock):
        with lock:
            seen[name] = torch.get_num_threads()

    for name, lock in (("sampling", side.lock), ("training", engine.lock)):
        thread = threading.Thread(target=hold, args=(name, lock))
        thread.start()
        thread.join()
    assert seen == {"sampling": 1, "training": 2}
    single = ModelEngine(tiny_model_path, bf16=False, concurrent_sampling=False)
    assert single.for_sampling is single
