"""`trl_grpo_ext.cpu.autocast_weights`: bf16 autocast training without the weights' bf16 copies held for backward --
the same gradients to the bit, less memory. The TRL path's bf16 CPU loss forward inside it: tests/test_precision.py."""

import contextlib

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trl_grpo_ext.cpu.autocast_weights import recast_weights


def _model(tied=True, hidden=128, vocab=2048, seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(config).train()


def _batch(vocab=2048, rows=2, length=24):
    ids = torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(1))
    return ids


def _context(recast):
    """`recast_weights`, or autograd as it is."""
    return recast_weights() if recast else contextlib.nullcontext()


def _grads(model, ids, recast, checkpointing=None):
    """Loss and gradients of one bf16 autocast forward/backward on the CPU, with or without `recast_weights`."""
    model.zero_grad(set_to_none=True)
    if checkpointing is None:
        model.gradient_checkpointing_disable()
    else:
        model.gradient_checkpointing_enable({"use_reentrant": checkpointing})
    with _context(recast), torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("checkpointing", [None, False, True], ids=["plain", "checkpoint", "reentrant"])
def test_the_same_loss_and_gradients_to_the_bit(tied, checkpointing):
    model, ids = _model(tied), _batch()
    loss, grads = _grads(model, ids, recast=False, checkpointing=checkpointing)
    loss_recast, grads_recast = _grads(model, ids, recast=True, checkpointing=checkpointing)
    assert torch.equal(loss, loss_recast)
    assert grads.keys() == grads_recast.keys() == {n for n, p in model.named_parameters()}
    for name in grads:
        assert torch.equal(grads[name], grads_recast[name]), name


def test_frozen_weights_are_saved_as_before():
    """A frozen weight's copy cannot be traced to its parameter: autograd keeps it, the trainable ones are recast."""
    model, ids = _model(), _batch()
    for layer in model.model.layers:
        for p in layer.self_attn.parameters():
            p.requires_grad_(False)
    loss, grads = _grads(model, ids, recast=False)
    loss_recast, grads_recast = _grads(model, ids, recast=True)
    assert torch.equal(loss, loss_recast) and grads.keys() == grads_recast.keys()
    assert not any("self_attn" in name for name in grads)
    assert all(torch.equal(grads[n], grads_recast[n]) for n in grads)


def test_a_graph_the_loss_does_not_reach_is_freed():
    """A tensor an op saves of its own output (exp) on a branch the backward pass never runs (a logged metric) is
    freed with its graph: the hook must not hold it in a cycle with its node that Python's collector cannot see."""
    import gc
    import weakref

    x = torch.randn(1000, requires_grad=True)
    with recast_weights():
        y = x.exp()
        loss = (x * 2).sum()
    alive = weakref.ref(y)
    loss.backward()
    del y
    gc.collect()
    assert alive() is None


def _held_for_backward(model, ids, recast) -> int:
    """Bytes of CPU tensors a bf16 autocast forward leaves alive for its backward (torch's profiler events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with _context(recast), torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
    held = sum(e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    loss.backward()  # and the recast copies are read back
    return held


def test_the_weights_bf16_copies_are_not_held_for_backward():
    model, ids = _model(hidden=256, vocab=4096), _batch(vocab=4096, rows=1, length=8)
    copies = sum(p.numel() for p in model.parameters()) * 2  # bf16 bytes of every weight
    before = _held_for_backward(model, ids, recast=False)
    after = _held_for_backward(model, ids, recast=True)
    # without: one bf16 copy of every weight (the tied embedding's for the output layer) from the forward on
    assert before - after > 0.95 * copies, (before, after, copies)


def test_the_autocast_cache_is_off_inside_and_restored_after():
    assert torch.is_autocast_cache_enabled()
    with recast_weights():
        assert not torch.is_autocast_cache_enabled()
        with torch.autocast("cpu", dtype=torch.bfloat16):  # built inside: its cache off too
            assert not torch.is_autocast_cache_enabled()
    assert torch.is_autocast_cache_enabled()
    with pytest.raises(RuntimeError, match="boom"), recast_weights():
        raise RuntimeError("boom")
    assert torch.is_autocast_cache_enabled()
