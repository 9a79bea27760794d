"""Parity of the local PyTRIO server with the TRL path on one batch: three distinct prompts (each row alone), and
a GRPO group (one prompt, three completions), which the server runs through the prefix engine's packed forward.

Reference ("TRL path"): the same LoRA weights on a freshly loaded transformers model, a padded batch forward as
TRL's GRPOTrainer does it, per-token logprobs of the completion tokens, `trl_grpo_ext.grpo.losses.policy_loss`, and the
masked sum (the server's reduction; TRL's token mean is that sum over the token count). Both precisions run: fp32,
where server and reference must agree on the loss and on every LoRA gradient to 1e-5, and bf16 autocast (the
reference's forward in the autocast TRL's bf16 runs under), to bf16 rounding (`precision_tolerance.BF16`); the
client-side custom-loss path must give the built-in gradient.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

trio = pytest.importorskip("pytrio")

from precision_tolerance import assert_grads_close, tolerance  # noqa: E402

from trl_grpo_ext.cpu.precision import bf16_autocast  # noqa: E402
from trl_grpo_ext.grpo import losses  # noqa: E402
from trl_grpo_ext.pytrio_server import running_server  # noqa: E402

PROMPTS = ["What is 3 + 4?", "Natalia sold 48 clips in April", "Solve the problem step by step."]
COMPLETIONS = [" The answer is \\boxed{7}.", " and half as many in May. #### 72", " so x = 18"]
# a GRPO group: every completion follows one prompt, whose tokens the server encodes once
GROUP_PROMPT = "Natalia sold 48 clips in April, and half as many in May. How many clips in all?"
PARITY_LOSSES = ("importance_sampling", "ppo", "cispo")
# ppo runs on the defaults (0.8 / 1.2); cispo through Tinker's config keys, tight enough that the batch clips
LOSS_CONFIG = {
    "importance_sampling": None,
    "ppo": None,
    "cispo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
}


def _bounds(loss_type):
    config = LOSS_CONFIG[loss_type] or {}
    return config.get("clip_low_threshold"), config.get("clip_high_threshold")


@pytest.fixture(scope="module", params=[False, True], ids=["fp32", "bf16"])
def server(tiny_model_path, tmp_path_factory, request):
    # the loop normalises its advantages itself and expects the plain sum, as the recipe's own server runs it
    with running_server(tiny_model_path, ephemeral_storage=True, bf16=request.param, loss_normalization="sum") as srv:
        srv.configure_client(home=str(tmp_path_factory.mktemp("trio-home")), retry_initial_delay_seconds=0.05)
        yield srv


@pytest.fixture(scope="module")
def service(server):
    client = trio.ServiceClient()
    yield client
    client._runtime.shutdown()


@pytest.fixture(scope="module", params=["distinct", "group"])
def batch(service, server, request):
    """Token rows with prompt/completion split, sampling logprobs off-policy enough to clip, mixed advantages."""
    tok = service.create_sampling_client(base_model=server.model_alias).get_tokenizer()
    rng = np.random.default_rng(0)
    rows = []
    prompts = PROMPTS if request.param == "distinct" else [GROUP_PROMPT] * len(COMPLETIONS)
    for i, (prompt, completion) in enumerate(zip(prompts, COMPLETIONS, strict=True)):
        p, c = tok.encode(prompt), tok.encode(completion)
        advantage = [1.3, -0.7, 0.4][i]
        rows.append({"prompt": p, "completion": c, "advantage": advantage, "noise": rng.normal(0, 0.4, len(c))})
    return rows


@pytest.fixture(scope="module")
def trained_state(service, server, batch):
    """A checkpoint one SFT step away from the LoRA init, so lora_B is non-zero and every gradient matters."""
    tc = service.create_lora_training_client(base_model=server.model_alias, rank=8, seed=0)
    data = [_datum(r["prompt"] + r["completion"], weights=None) for r in batch]
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(trio.AdamParams(learning_rate=5e-2)).result()
    current = tc.forward(data, "cross_entropy").result()
    old_logprobs = []
    for r, out in zip(batch, current.loss_fn_outputs, strict=True):
        lp = out["logprobs"].to_numpy()[len(r["prompt"]) - 1 :]
        old_logprobs.append((lp + r["noise"]).astype(np.float32))
    return tc.save_state("parity").result().path, old_logprobs


def _datum(tokens, weights=None, old=None, adv=None):
    inputs = {"target_tokens": tokens[1:]}
    if old is not None:
        inputs.update(logprobs=old, advantages=adv)
    elif weights is not None:
        inputs["weights"] = weights
    return trio.Datum(model_input=trio.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def _policy_data(batch, old_logprobs):
    """Datums for the policy losses: prompt positions carry advantage 0 and logprob 0."""
    data = []
    for r, old in zip(batch, old_logprobs, strict=True):
        n_prompt = len(r["prompt"]) - 1  # target positions that predict prompt tokens
        old_full = [0.0] * n_prompt + old.tolist()
        adv_full = [0.0] * n_prompt + [r["advantage"]] * len(r["completion"])
        data.append(_datum(r["prompt"] + r["completion"], old=old_full, adv=adv_full))
    return data


def _server_grads(server, run_id):
    return {name: p.grad.detach().clone() for name, p in server.engine.runs[run_id].params}


def _reference(server, tiny_model_path, run_id, batch, old_logprobs, loss_type):
    """Loss and LoRA gradients computed directly with transformers + PEFT, TRL-style padded batch."""
    from peft import get_peft_model
    from peft.utils import set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    snapshot = server.engine.snapshot(run_id, with_optimizer=False)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    model.eval()
    peft_model = get_peft_model(model, server.engine.peft_config(snapshot.lora))
    set_peft_model_state_dict(peft_model, snapshot.weights)

    prompt_len = max(len(r["prompt"]) for r in batch)
    completion_len = max(len(r["completion"]) for r in batch)
    pad = model.config.pad_token_id
    # TRL layout: left-padded prompts, right-padded completions, one forward over the concatenation
    ids = torch.full((len(batch), prompt_len + completion_len), pad)
    attention = torch.zeros_like(ids)
    completion_mask = torch.zeros(len(batch), completion_len)
    old = torch.zeros(len(batch), completion_len)
    for i, r in enumerate(batch):
        p, c = r["prompt"], r["completion"]
        ids[i, prompt_len - len(p) : prompt_len] = torch.tensor(p)
        ids[i, prompt_len : prompt_len + len(c)] = torch.tensor(c)
        attention[i, prompt_len - len(p) : prompt_len + len(c)] = 1
        completion_mask[i, : len(c)] = 1
        old[i, : len(c)] = torch.from_numpy(old_logprobs[i])
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    with bf16_autocast(server.engine.autocast_bf16):
        logits = peft_model(input_ids=ids, attention_mask=attention, position_ids=position_ids).logits
    logits = logits[:, prompt_len - 1 : -1].float()  # positions predicting the completion tokens
    targets = ids[:, prompt_len:]
    logp = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    advantages = torch.tensor([r["advantage"] for r in batch])
    per_token, _ = losses.policy_loss(loss_type, logp, old, advantages, completion_mask, *_bounds(loss_type))
    loss = (per_token * completion_mask).sum()
    loss.backward()
    grads = {
        name.replace(".default.", "."): p.grad.detach().clone()
        for name, p in peft_model.named_parameters()
        if p.grad is not None
    }
    return float(loss), grads


@pytest.mark.usefixtures("packed_layout")  # the group's rows packed at the tiny model's shapes too
@pytest.mark.parametrize("loss_type", PARITY_LOSSES)
def test_builtin_loss_and_gradients_match_the_trl_path(
    server, service, batch, trained_state, tiny_model_path, loss_type, prefix_engine_calls
):
    path, old_logprobs = trained_state
    tc = service.create_training_client_from_state(path)
    out = tc.forward_backward(_policy_data(batch, old_logprobs), loss_type, LOSS_CONFIG[loss_type]).result()
    grouped = len({tuple(r["prompt"]) for r in batch}) == 1
    assert prefix_engine_calls["packed"] == int(grouped)  # the group through the prefix engine, once
    ref_loss, ref_grads = _reference(server, tiny_model_path, tc.training_run_cuid, batch, old_logprobs, loss_type)
    tol = tolerance(server.engine.autocast_bf16)
    assert out.metrics["loss_sum"] == pytest.approx(ref_loss, rel=tol.loss_sum, abs=tol.loss_sum)
    grads = _server_grads(server, tc.training_run_cuid)
    assert any(g.abs().max() > 1e-3 for g in grads.values())  # the comparison is not between zeros
    assert_grads_close(grads, ref_grads, tol)
    if loss_type in ("ppo", "cispo"):  # the batch exercises the clipped branch
        ratio = torch.exp(torch.from_numpy(np.concatenate([-r["noise"] for r in batch])))
        low, high = _bounds(loss_type)
        low, high = losses.DEFAULT_CLIP["ppo"] if low is None else (low, high)
        assert bool(((ratio < low) | (ratio > high)).any())


@pytest.mark.usefixtures("packed_layout")
@pytest.mark.parametrize("loss_type", PARITY_LOSSES)
def test_custom_loss_path_gives_the_builtin_gradient(server, service, batch, trained_state, loss_type):
    path, old_logprobs = trained_state
    data = _policy_data(batch, old_logprobs)
    builtin = service.create_training_client_from_state(path)
    custom = service.create_training_client_from_state(path)
    builtin_out = builtin.forward_backward(data, loss_type, LOSS_CONFIG[loss_type]).result()

    def loss_fn(data, logprobs):
        total = 0.0
        for datum, lp in zip(data, logprobs, strict=True):
            old = torch.tensor(datum.loss_fn_inputs["logprobs"].data)
            adv = torch.tensor(datum.loss_fn_inputs["advantages"].data)
            per_token, _ = losses.policy_loss(loss_type, lp, old, adv, None, *_bounds(loss_type))
            total = total + per_token.sum()
        return total, {"custom_loss": float(total)}

    custom_out = custom.forward_backward_custom(data, loss_fn).result()
    assert custom_out.metrics["custom_loss"] == pytest.approx(builtin_out.metrics["loss_sum"], rel=1e-5, abs=1e-5)
    want, got = _server_grads(server, builtin.training_run_cuid), _server_grads(server, custom.training_run_cuid)
    assert want.keys() == got.keys()
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, atol=1e-5, rtol=1e-5, msg=name)
