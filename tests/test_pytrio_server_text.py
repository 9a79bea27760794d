"""Local PyTRIO server: sampled ``text`` as the hosted service returns it (special tokens skipped, the stop token
and a matched stop string left out), while ``tokens``, ``logprobs`` and ``stop_reason`` stay as sampled."""

from __future__ import annotations

import pytest
from conftest import build_tiny_model

trio = pytest.importorskip("pytrio")

PROMPT = [5, 9, 14, 3]


@pytest.fixture(scope="module")
def uniform_engine(tmp_path_factory):
    """An engine on a tiny model whose output layer is zero: every token equally likely, so samples draw the
    tokenizer's special tokens (``<|pad|>``, ``<|im_start|>``) mid-sequence and end on ``<|im_end|>`` (EOS)."""
    import torch
    from transformers import AutoModelForCausalLM

    from trl_grpo_ext.pytrio_server.engine import ModelEngine

    path = build_tiny_model(tmp_path_factory.mktemp("uniform-model"), vocab_size=64)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        model.lm_head.weight.zero_()
    model.save_pretrained(path)
    return ModelEngine(path, bf16=False)


@pytest.fixture
def sampler(uniform_engine, tmp_path):
    from trl_grpo_ext.pytrio_server import LocalPyTrioServer, ServerConfig

    config = ServerConfig(model=uniform_engine.model_path, ephemeral_storage=True)
    server = LocalPyTrioServer(config, engine=uniform_engine).start()
    try:
        server.configure_client(home=str(tmp_path / "home"), retry_initial_delay_seconds=0.05)
        yield trio.ServiceClient().create_sampling_client(base_model=server.model_alias)
    finally:
        server.stop()


def _sample(sampler, **params):
    params = trio.SamplingParams(max_tokens=24, seed=11, **params)
    prompt = trio.ModelInput.from_ints(PROMPT)
    return sampler.sample(prompt, num_samples=16, sampling_params=params).result().sequences


def test_text_skips_special_tokens_and_the_eos_that_stopped_it(sampler, uniform_engine):
    tok = uniform_engine.tokenizer
    specials = set(tok.all_special_ids)
    sequences = _sample(sampler)
    alone = uniform_engine.sample(None, PROMPT, num_samples=16, max_tokens=24, seed=11)
    assert [s.tokens for s in sequences] == [r.tokens for r in alone]  # tokens as sampled, EOS included
    assert [s.stop_reason for s in sequences] == [r.stop_reason for r in alone]
    for seq, ref in zip(sequences, alone, strict=True):
        assert seq.logprobs == pytest.approx(ref.logprobs, abs=1e-6)
    eos_ended = [s for s in sequences if s.stop_reason == "stop"]
    with_specials = [s for s in sequences if specials & set(s.tokens[:-1])]
    assert eos_ended and with_specials  # the cases under test occur at this seed
    for seq in eos_ended:
        assert seq.tokens[-1] == tok.eos_token_id
    for seq in sequences:
        kept = seq.tokens[:-1] if seq.stop_reason == "stop" else seq.tokens
        assert seq.text == tok.decode(kept, skip_special_tokens=True)
        assert not any(t in seq.text for t in tok.all_special_tokens)
    # a tool call ends the text: nothing follows it
    seq = eos_ended[0]
    assert tok.decode(seq.tokens).endswith("<|im_end|>") and not seq.text.endswith("<|im_end|>")


def test_a_matched_stop_string_is_left_out_of_text(sampler, uniform_engine):
    tok = uniform_engine.tokenizer
    free = _sample(sampler)
    plain = [tok.decode(s.tokens, skip_special_tokens=True) for s in free]
    stop = plain[0][3:5]  # two characters that occur in the first sample
    assert len(stop) == 2
    sequences = _sample(sampler, stop=[stop])
    alone = uniform_engine.sample(None, PROMPT, num_samples=16, max_tokens=24, seed=11, stop=[stop])
    assert [s.tokens for s in sequences] == [r.tokens for r in alone]
    by_string = [s for s in sequences if s.stop_reason == "stop" and s.tokens[-1] != tok.eos_token_id]
    assert by_string
    for seq in by_string:
        full = tok.decode(seq.tokens, skip_special_tokens=True)
        assert stop in full and stop not in seq.text
        assert seq.text == full[: full.index(stop)]
        # stop_reason and tokens as before: the stop string's tokens are still in `tokens`
        assert tok.decode(seq.tokens).find(stop) >= 0


def test_stop_token_ids_end_the_tokens_but_not_the_text(sampler, uniform_engine):
    tok = uniform_engine.tokenizer
    free = _sample(sampler)
    stop_id = next(t for t in free[0].tokens[2:] if t not in tok.all_special_ids)
    sequences = _sample(sampler, stop=[stop_id])
    hit = [s for s in sequences if s.stop_reason == "stop" and s.tokens[-1] == stop_id]
    assert hit
    for seq in hit:
        assert seq.text == tok.decode(seq.tokens[:-1], skip_special_tokens=True)
