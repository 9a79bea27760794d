"""Local PyTRIO server on hybrid linear-attention models (tiny random Qwen3.5 and Qwen3-Next): groups of samples
(`num_samples` > 1) against plain `generate` / a full forward, and LoRA on every projection of every layer type."""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_model

trio = pytest.importorskip("pytrio")

FAMILIES = ["qwen3_5", "qwen3_next"]
PROMPT = [5, 9, 14, 3, 7]
SIZES = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
    linear_conv_kernel_dim=4, max_position_embeddings=512, tie_word_embeddings=False,
)  # fmt: skip


def _build(family, path):
    """A tiny random model of `family` (3 linear-attention layers, then a full-attention one) with the tests'
    tokenizer, saved to `path`."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(path))
    ids = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, vocab_size=len(tokenizer))
    torch.manual_seed(0)
    if family == "qwen3_5":
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**SIZES, **ids))
    else:
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        config = Qwen3NextConfig(**SIZES, **ids, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                 shared_expert_intermediate_size=16)  # fmt: skip
        model = Qwen3NextForCausalLM(config)
    assert model.config.layer_types.count("linear_attention") == 3
    model.save_pretrained(path)
    return model.eval()


@pytest.fixture(scope="module", params=FAMILIES)
def hybrid(request, tmp_path_factory):
    from trl_grpo_ext.pytrio_server.engine import ModelEngine

    path = tmp_path_factory.mktemp(request.param)
    model = _build(request.param, path)
    return model, ModelEngine(str(path), bf16=False)


def test_a_group_of_samples_is_what_the_plain_model_generates(hybrid):
    model, engine = hybrid
    greedy = engine.sample(None, PROMPT, num_samples=3, max_tokens=8, temperature=0.0)
    with torch.no_grad():
        plain = model.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False)[0, len(PROMPT) :].tolist()
    for row in greedy:
        assert row.tokens == plain[: len(row.tokens)] and len(row.tokens) >= 1
    # sampled rows diverge after the first token: each row's recurrent state must be its own
    sampled = engine.sample(None, PROMPT, num_samples=4, max_tokens=10, temperature=1.0, seed=4)
    assert len({tuple(r.tokens) for r in sampled}) > 1
    for row in sampled:
        ids = torch.tensor([PROMPT + row.tokens])
        with torch.no_grad():
            logps = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        expected = logps[len(PROMPT) - 1 : -1].gather(-1, torch.tensor(row.tokens)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(row.logprobs), expected, atol=1e-4, rtol=1e-4)


def test_lora_trains_every_layer_type_and_the_trained_sampler_samples_groups(hybrid, tmp_path):
    from trl_grpo_ext.pytrio_server import LocalPyTrioServer, ServerConfig

    model, engine = hybrid
    server = LocalPyTrioServer(ServerConfig(model=engine.model_path, ephemeral_storage=True), engine=engine).start()
    service = None
    try:
        server.configure_client(home=str(tmp_path / "home"), retry_initial_delay_seconds=0.05)
        service = trio.ServiceClient()
        tc = service.create_lora_training_client(base_model=server.model_alias, rank=4, seed=1)
        tokens = PROMPT + [11, 12, 13, 14]
        datum = trio.Datum(model_input=trio.ModelInput.from_ints(tokens[:-1]),
                           loss_fn_inputs={"target_tokens": tokens[1:]})  # fmt: skip
        tc.forward_backward([datum], "cross_entropy").result()
        params = dict(server.engine.runs[tc.training_run_cuid].params)
        linear = [i for i, t in enumerate(model.config.layer_types) if t == "linear_attention"]
        projections = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in params}
        assert {"q_proj", "k_proj", "v_proj", "o_proj", "out_proj"} <= projections
        assert {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"} <= projections or {
            "in_proj_qkvz",
            "in_proj_ba",
        } <= projections
        for i in linear:  # every linear-attention layer's projections carry a trained adapter
            names = [n for n in params if f"layers.{i}.linear_attn." in n and "lora_B" in n]
            assert names and all(params[n].grad is not None and params[n].grad.abs().sum() > 0 for n in names)
        tc.optim_step(trio.AdamParams(learning_rate=5e-2)).result()
        sampler = tc.save_weights_and_get_sampling_client()
        params = trio.SamplingParams(max_tokens=6, seed=2, temperature=1.0)
        group = sampler.sample(trio.ModelInput.from_ints(PROMPT), num_samples=4, sampling_params=params).result()
        assert len(group.sequences) == 4
        for seq in group.sequences:  # the sampler's log-probs are the trained policy's
            full = PROMPT + seq.tokens
            check = tc.forward(
                [
                    trio.Datum(
                        model_input=trio.ModelInput.from_ints(full[:-1]), loss_fn_inputs={"target_tokens": full[1:]}
                    )
                ],
                "cross_entropy",
            ).result()
            logprobs = check.loss_fn_outputs[0]["logprobs"].to_numpy()[len(PROMPT) - 1 :]
            torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(seq.logprobs), atol=1e-4, rtol=1e-4)
    finally:
        if service is not None:
            service._runtime.shutdown()
        server.stop()
