"""The decode engine (`trl_grpo_ext.decode`): the packed loop decodes what transformers' ``generate`` decodes (the
same tokens greedy and sampled from the same seed, on the tiny model, left padding, EOS, minimum lengths, a shared
prompt prefix), records the log-probs of the distribution each token was drawn from, follows weight changes, steps
aside with a reason where it does not apply, and is what the TRL sampler and the evaluator run when asked."""

from __future__ import annotations

import argparse
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from trl_grpo_ext import decode
from trl_grpo_ext.decode import engine as engine_module
from trl_grpo_ext.decode.engine import engine_unsupported_reason, packed_generate
from trl_grpo_ext.decode.weights import PackedWeights, packed_weights
from trl_grpo_ext.grpo.sampling_distribution import SamplingSettings
from trl_grpo_ext.prefix import shared_prefix_generate
from trl_grpo_ext.trl.sampler_precision import SampledTokenLogprobs


@pytest.fixture(scope="module")
def model(tiny_model_path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


def _batch(model, rows=6, length=9, seed=0):
    """Random prompts, some left-padded (pad id 0)."""
    ids = torch.randint(5, model.config.vocab_size - 1, (rows, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[1, :1] = 0
    return ids.masked_fill(mask == 0, 0), mask


def _config(model, **settings):
    base = dict(max_new_tokens=12, pad_token_id=0, eos_token_id=model.config.eos_token_id)
    return GenerationConfig(**{**base, **settings})


SETTINGS = [
    dict(do_sample=False),
    dict(do_sample=True, temperature=0.7, top_p=0.9, top_k=0),
    dict(do_sample=True, temperature=1.3, top_k=5, min_p=0.05),
    dict(do_sample=True, min_new_tokens=6),
]


@pytest.mark.parametrize("settings", SETTINGS, ids=["greedy", "top_p", "top_k_min_p", "min_new_tokens"])
def test_the_packed_loop_decodes_what_generate_decodes(model, settings):
    ids, mask = _batch(model)
    config = _config(model, **settings)
    assert engine_unsupported_reason(model, config, {"generation_config": config}) is None
    torch.manual_seed(3)
    theirs = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    torch.manual_seed(3)
    ours = packed_generate(model, ids, mask, config)
    assert torch.equal(ours, theirs)
    assert theirs.shape[1] > ids.shape[1]


def test_an_eos_ends_a_row_with_padding_and_the_batch_when_every_row_has_ended(model):
    ids, mask = _batch(model)
    config = _config(model, do_sample=False, max_new_tokens=20)
    greedy = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    # the token greedy decoding picks first in row 0 made the EOS: row 0 ends at once, the others run on
    eos = int(greedy[0, ids.shape[1]])
    config = _config(model, do_sample=False, max_new_tokens=20, eos_token_id=eos)
    theirs = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    ours = packed_generate(model, ids, mask, config)
    assert torch.equal(ours, theirs)
    assert (ours[0, ids.shape[1] + 1 :] == 0).all()


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_with_a_shared_prefix_and_the_samplers_recorder_both_engines_give_the_same_tokens_and_log_probs(model, sample):
    """`shared_prefix_generate`'s encoded prefix handed to the packed loop, with the TRL sampler's recorder: the
    tokens and recorded log-probs match generate's, and each recorded log-prob is the drawing distribution's."""
    prefix = list(range(10, 22))
    prompts = [prefix + [30 + g, 40 + g][: 1 + g % 2] for g in range(3) for _ in range(2)]
    settings = SamplingSettings(temperature=0.7, top_k=0, top_p=0.9, min_p=None)
    config = _config(model, do_sample=sample, max_new_tokens=8, eos_token_id=None)
    out, logprobs = {}, {}
    for engine in ("generate", "packed"):
        recorder = SampledTokenLogprobs(settings)
        torch.manual_seed(5)
        seqs = shared_prefix_generate(model, prompts, 0, config, engine=engine, **recorder.generate_kwargs())
        completions = seqs[:, -8:].tolist()
        out[engine], logprobs[engine] = seqs, recorder.per_row(completions)
    assert torch.equal(out["packed"], out["generate"])
    for ours, theirs in zip(logprobs["packed"], logprobs["generate"], strict=True):
        assert ours == pytest.approx(theirs, abs=1e-5)
    assert all(lp <= 0 for row in logprobs["packed"] for lp in row)


def test_the_packed_weights_follow_an_in_place_weight_change(model):
    ids, mask = _batch(model)
    config = _config(model, do_sample=False)
    first = packed_weights(model, ids.shape[0])
    assert packed_weights(model, ids.shape[0]) is first  # unchanged weights: packed once
    weight = model.model.layers[0].mlp.down_proj.weight
    saved = weight.detach().clone()
    try:
        with torch.no_grad():
            weight.mul_(-3.0)  # an optimizer step's in-place write
        assert packed_weights(model, ids.shape[0]) is not first
        theirs = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        assert torch.equal(packed_generate(model, ids, mask, config), theirs)
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    assert PackedWeights.version_key(model) != first.key[1]


def test_where_the_engine_does_not_apply_generate_decodes_and_the_reason_is_logged_once(model, caplog, monkeypatch):
    ids, mask = _batch(model)
    config = _config(model, do_sample=False)
    calls = []
    monkeypatch.setattr(engine_module, "packed_generate", lambda *a, **k: calls.append(1))
    monkeypatch.setattr(decode, "_logged", set())
    beams = _config(model, do_sample=False, num_beams=2)
    assert "beam search" in engine_unsupported_reason(model, beams, {"generation_config": beams})
    scores = _config(model, do_sample=False, return_dict_in_generate=True, output_scores=True)
    assert "scores" in engine_unsupported_reason(model, scores, {"generation_config": scores})
    assert "streamer" in engine_unsupported_reason(model, config, {"generation_config": config, "streamer": object()})
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert "autocast" in engine_unsupported_reason(model, config, {"generation_config": config})
    half = AutoModelForCausalLM.from_config(model.config, dtype=torch.bfloat16)
    assert "bfloat16" in engine_unsupported_reason(half, config, {"generation_config": config})
    with caplog.at_level(logging.WARNING, logger="trl_grpo_ext.decode"):
        for _ in range(2):
            out = decode.decode(model, "packed", ids, mask, generation_config=beams)
    assert calls == [] and out.shape[0] == ids.shape[0]
    assert sum("beam search" in r.getMessage() for r in caplog.records) == 1


def test_a_peft_model_is_decoded_by_generate(model):
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(
        AutoModelForCausalLM.from_config(model.config), LoraConfig(r=2, target_modules=["q_proj"])
    )
    config = _config(model, do_sample=False)
    assert "wrapped" in engine_unsupported_reason(peft_model, config, {"generation_config": config})
    merged_layers = engine_unsupported_reason(peft_model.base_model.model, config, {"generation_config": config})
    assert "not plain linear" in merged_layers


def test_an_unknown_engine_is_one_line_before_any_model_loads(tmp_path):
    from trl_grpo_ext.evaluation.options import EvalOptions
    from trl_grpo_ext.trl.config import GRPOConfig

    with pytest.raises(ValueError, match=r"decode_engine.*'fast'") as error:
        GRPOConfig(output_dir=str(tmp_path), use_cpu=True, decode_engine="fast")
    assert len(str(error.value).strip().splitlines()) == 1
    with pytest.raises(ValueError, match=r"--decode_engine must be one of generate, packed, got 'fast'"):
        EvalOptions(decode_engine="fast")
    with pytest.raises(ValueError, match="decode_engine must be one of"):
        shared_prefix_generate(None, [[1, 2]], 0, engine="fast")
    # the engine decodes after the shared prefill: without it TRL's generate would sample, whatever the setting said
    with pytest.raises(ValueError, match="decode_engine='packed' decodes after the shared prompt prefill") as error:
        GRPOConfig(output_dir=str(tmp_path), use_cpu=True, decode_engine="packed", share_prompt_prefix=False)
    assert len(str(error.value).strip().splitlines()) == 1


def test_the_sampler_line_and_the_run_summary_name_the_decode_engine(tmp_path, monkeypatch):
    from trl_grpo_ext.trl.config import GRPOConfig
    from trl_grpo_ext.trl.recipe import ENV_SAMPLER_REASON, run_sampler, sampler_line

    monkeypatch.delenv(ENV_SAMPLER_REASON, raising=False)

    reason = "use_vllm: false set in the config"
    for engine, name in (("generate", "transformers generate"), ("packed", "transformers, the packed decode engine")):
        args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, decode_engine=engine)
        assert sampler_line(args) == f"sampler: {name} ({reason}; decode_engine: {engine})"
        assert run_sampler(None, args) == {"name": "generate", "reason": reason, "decode_engine": engine}


def test_the_eval_command_decodes_packed_by_default_and_says_so_first(tmp_path, monkeypatch, capsys):
    """`trl-grpo-ext eval` runs the packed engine unless told otherwise, and its first line names the loop; the
    recipes' eval options keep following their config (generate unless it says packed)."""
    from types import SimpleNamespace

    from trl_grpo_ext.cli import evaluate as command
    from trl_grpo_ext.evaluation.options import EvalOptions, EvalRun, recipe_eval_options

    assert EvalRun(model="m").decode_engine == "packed"
    recipe = SimpleNamespace(eval_max_new_tokens=None)
    assert recipe_eval_options(recipe, SimpleNamespace(max_completion_length=8)).decode_engine == "generate"
    assert EvalOptions().decode_engine == "generate"  # the callbacks' own default (a recipe's config sets it)
    seen = []

    def run_eval(cfg):  # the settings the command hands on; no model is loaded
        seen.append(cfg.decode_engine)
        raise ValueError("stopped before any model loads")

    monkeypatch.setattr(command, "run_eval", run_eval)
    for flags, engine in (([], "packed"), (["--decode_engine", "generate"], "generate")):
        parser = argparse.ArgumentParser()
        command.add_arguments(parser)
        assert command.run(parser.parse_args(["--model", "m", *flags])) == 2
        first = capsys.readouterr().out.splitlines()[0]
        assert first.startswith(f"decode engine: {engine} (")
    assert seen == ["packed", "generate"]


def test_the_evaluator_decodes_with_the_engine_it_is_given(tiny_model_path, monkeypatch):
    from trl_grpo_ext.evaluation.generator import HFGenerator

    calls = []
    real = engine_module.packed_generate
    monkeypatch.setattr(engine_module, "packed_generate", lambda *a, **k: calls.append(1) or real(*a, **k))
    prompts = [f"What is {i} + 4?" for i in range(5)]
    answers = {}
    for engine in ("generate", "packed"):
        gen = HFGenerator(tiny_model_path, max_new_tokens=10, decode_engine=engine)
        answers[engine] = gen.generate(prompts, 1, True)
    assert calls  # the packed engine ran
    assert answers["packed"] == answers["generate"]


def test_a_packed_copy_is_freed_when_the_weights_will_change_or_the_model_is_given_back(
    tiny_model_path, tmp_path, monkeypatch
):
    """The on-policy trainer's generation (an optimizer step follows) and a borrowed eval model (training follows)
    keep no packed copy after: it would hold the weights a second time and be stale."""
    from test_async_trl import _train
    from transformers import AutoTokenizer

    from trl_grpo_ext.decode import weights
    from trl_grpo_ext.evaluation.generator import HFGenerator

    held = []
    real = engine_module.packed_generate

    def recording(model, *args, **kwargs):
        out = real(model, *args, **kwargs)
        held.append(model in weights._packed)  # the copy exists while the sampler decodes
        return out

    monkeypatch.setattr(engine_module, "packed_generate", recording)
    trainer, _ = _train(tiny_model_path, tmp_path, "on", async_sampling=False, max_steps=2, decode_engine="packed")
    assert held and all(held)
    assert trainer.model not in weights._packed
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    with HFGenerator.borrowing(model, tokenizer, 6, decode_engine="packed") as gen:
        gen.generate(["What is 2 + 2?"], 1, True)
        assert model in weights._packed  # kept across the eval's batches
    assert model not in weights._packed


@pytest.mark.slow
def test_the_async_samplers_packed_engine_keeps_every_ratio_1_at_staleness_0(tiny_model_path, tmp_path, monkeypatch):
    """The asynchronous TRL sampler on the packed engine at temperature 0.7 / top_p 0.9: its recorded log-probs are
    those of the distribution it drew from, so at step 1 the ratio to the trainer's is 1 to rounding."""
    from test_async_trl import _train

    calls = []
    real = engine_module.packed_generate
    monkeypatch.setattr(engine_module, "packed_generate", lambda *a, **k: calls.append(1) or real(*a, **k))
    _, rows = _train(
        tiny_model_path, tmp_path, "packed", temperature=0.7, top_p=0.9, max_steps=2, decode_engine="packed"
    )
    assert calls
    first = rows[0]
    assert first["sample/staleness_max"] == 0
    assert first["sampling/sampler_kl"] <= 1e-5
    assert 0.999 <= first["sampling/is_ratio_raw/min"] <= first["sampling/is_ratio_raw/max"] <= 1.001


def test_the_eval_cache_keeps_the_engines_apart_and_the_defaults_key_as_it_was(model):
    from trl_grpo_ext.evaluation.cache import live_model_settings

    default = live_model_settings(model, 8)
    assert default == {"max_new_tokens": 8, "device": "cpu", "dtype": "torch.float32"}
    assert live_model_settings(model, 8, "packed") == {**default, "decode_engine": "packed"}
