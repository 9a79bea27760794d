"""`trl_grpo_ext.cpu.token_draws`: torch.multinomial's one-sample draws, vectorised, with torch's results."""

import threading

import pytest
import torch

from trl_grpo_ext.cpu import token_draws
from trl_grpo_ext.cpu.token_draws import draw_tokens, fast_token_draws, multinomial


def _probs(rows, vocab, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=g) * 3).softmax(-1).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(24, 49152), (3, 7), (1, 2)])
def test_same_tokens_and_generator_state_as_torch(dtype, shape):
    probs = _probs(*shape, dtype=dtype)
    for seed in range(20):
        theirs = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(seed))
        g = torch.Generator().manual_seed(seed)
        ours = draw_tokens(probs, g)
        assert ours.dtype == theirs.dtype == torch.long and ours.shape == (shape[0], 1)
        assert torch.equal(ours, theirs), seed
    # the global generator: the same draws, and the stream continues where torch's leaves it
    torch.manual_seed(5)
    theirs, after = torch.multinomial(probs, 1), torch.rand(4)
    torch.manual_seed(5)
    ours, ours_after = draw_tokens(probs), torch.rand(4)
    assert torch.equal(ours, theirs) and torch.equal(ours_after, after)


def test_the_identity_is_checked_once_and_torchs_draws_kept_where_it_fails(monkeypatch):
    assert token_draws.matches_torch()  # this torch: the same draws
    calls = []
    monkeypatch.setattr(token_draws, "draw_tokens", lambda p, g=None: calls.append(1))
    monkeypatch.setattr(token_draws, "matches_torch", lambda: False)  # a torch that draws otherwise
    probs = _probs(4, 100)
    with fast_token_draws():
        assert torch.equal(
            torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(1)),
            token_draws._torch_multinomial(probs, 1, generator=torch.Generator().manual_seed(1)),
        )
    assert calls == []


def test_unnormalised_weights_and_zero_weights_as_torch():
    weights = torch.tensor([[0.0, 2.0, 0.0, 6.0], [1.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.0, 3.0]])
    drawn = torch.cat([multinomial(weights, 1, generator=torch.Generator().manual_seed(s)) for s in range(300)], 1)
    assert (drawn[1] == 0).all()  # the only token with weight
    assert not torch.isin(drawn, torch.tensor([2])).any() and not (drawn[0] == 0).any()  # zero weights never drawn
    torch_drawn = torch.cat(
        [torch.multinomial(weights, 1, generator=torch.Generator().manual_seed(s)) for s in range(300)], 1
    )
    assert torch.equal(drawn, torch_drawn)


def test_frequencies_follow_the_weights():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).expand(100_000, 4).contiguous()
    counts = torch.bincount(draw_tokens(probs, torch.Generator().manual_seed(0)).squeeze(1), minlength=4)
    assert torch.allclose(counts / 100_000, probs[0], atol=0.006)


def test_fast_token_draws_routes_torch_multinomial_in_its_thread_only(monkeypatch):
    calls = []
    real = token_draws.draw_tokens
    monkeypatch.setattr(token_draws, "draw_tokens", lambda p, g=None: calls.append(p.shape) or real(p, g))
    probs = _probs(4, 100)
    torch.multinomial(probs, 1)
    assert calls == []  # outside a block: torch's own
    seen_in_thread = []
    with fast_token_draws():
        with fast_token_draws():  # nests
            torch.multinomial(probs, num_samples=1)
        torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(0))
        thread = threading.Thread(target=lambda: seen_in_thread.append(torch.multinomial(probs, 1)))
        thread.start()
        thread.join()
    assert calls == [(4, 100), (4, 100)]  # the other thread's call went to torch's function
    assert len(seen_in_thread) == 1
    torch.multinomial(probs, 1)
    assert len(calls) == 2


def test_other_calls_go_to_torch(monkeypatch):
    calls = []
    monkeypatch.setattr(token_draws, "draw_tokens", lambda p, g=None: calls.append(1))
    probs = _probs(4, 100)
    with fast_token_draws():
        assert torch.multinomial(probs, 3).shape == (4, 3)  # several samples
        assert torch.multinomial(probs[0], 1).shape == (1,)  # one row, 1-D
        assert torch.multinomial(probs.to(torch.bfloat16), 1).shape == (4, 1)
        out = torch.empty(4, 1, dtype=torch.long)
        torch.multinomial(probs, 1, out=out)
        # torch's own errors for what it would refuse
        for bad in (probs.clone().fill_(0), torch.full_like(probs, float("nan")), probs - 0.5):
            with pytest.raises(RuntimeError):
                torch.multinomial(bad, 1)
    assert calls == []


def test_generate_samples_the_same_tokens(tiny_model_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    calls = []
    real = token_draws.draw_tokens
    monkeypatch.setattr(token_draws, "draw_tokens", lambda p, g=None: calls.append(p.shape) or real(p, g))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    kwargs = dict(do_sample=True, max_new_tokens=12, min_new_tokens=12, top_k=0, temperature=1.0, pad_token_id=0)
    torch.manual_seed(3)
    theirs = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
    torch.manual_seed(3)
    with fast_token_draws():
        ours = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
    assert torch.equal(ours, theirs)
    assert len(calls) == 12  # every token drawn here
