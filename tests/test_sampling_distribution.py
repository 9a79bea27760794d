"""The distribution a sampler draws from, defined once (`trl_grpo_ext.grpo.sampling_distribution`): transformers'
warpers to the bit, the trainer's truncated log-probs (and TRL's fused head patched to give them), and generation
through the recorder drawing the tokens transformers' own warpers draw."""

import inspect
import math

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from trl_grpo_ext.grpo.sampling_distribution import (
    SamplingSettings,
    processed_logits,
    processed_logprobs,
    support_logprobs,
)

SETTINGS = [
    SamplingSettings(),
    SamplingSettings(temperature=0.7),
    SamplingSettings(temperature=0.7, top_p=0.9),
    SamplingSettings(temperature=1.3, top_k=7),
    SamplingSettings(temperature=0.5, top_k=20, top_p=0.8, min_p=0.05),
    SamplingSettings(min_p=0.1),
]


def _warpers(s: SamplingSettings) -> LogitsProcessorList:
    """transformers' own warpers for `s`, in generate's order."""
    out = LogitsProcessorList()
    if s.temperature != 1.0:
        out.append(TemperatureLogitsWarper(s.temperature))
    if s.top_k > 0:
        out.append(TopKLogitsWarper(s.top_k))
    if s.top_p < 1.0:
        out.append(TopPLogitsWarper(s.top_p))
    if s.min_p is not None:
        out.append(MinPLogitsWarper(s.min_p))
    return out


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: s.describe())
def test_the_processed_scores_are_transformers_warpers_to_the_bit(settings):
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(0)) * 3
    ids = torch.zeros(6, 1, dtype=torch.long)
    assert torch.equal(processed_logits(logits, settings), _warpers(settings)(ids, logits.clone()))


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: s.describe())
def test_the_trainers_log_probs_are_the_samplers_on_the_kept_tokens(settings):
    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(1)) * 3
    sampler = processed_logprobs(logits, settings)
    tokens = torch.multinomial(sampler.exp(), 1, generator=torch.Generator().manual_seed(2)).squeeze(-1)
    tempered = logits / settings.temperature
    trainer, entropy = support_logprobs(tempered, tokens, settings, with_entropy=True)
    assert torch.allclose(trainer, sampler.gather(-1, tokens[:, None]).squeeze(-1), atol=1e-6)
    p = sampler.exp()
    expected_entropy = -(p * sampler.nan_to_num(neginf=0.0)).sum(-1)
    assert torch.allclose(entropy, expected_entropy, atol=1e-5)


def test_a_token_the_trainers_rule_would_cut_keeps_a_finite_log_prob_and_gradient():
    """A stale sample's token outside the trainer's top-p set: kept on the trainer's side (finite log-prob, finite
    gradient), never -inf."""
    settings = SamplingSettings(top_p=0.5)
    logits = torch.tensor([[5.0, 4.0, 0.0, -1.0]], requires_grad=True)
    token = torch.tensor([3])
    logp, _ = support_logprobs(logits, token, settings)
    assert math.isfinite(logp.item())
    # renormalised over the kept token (0) and the token itself (3)
    assert logp.item() == pytest.approx(-1.0 - math.log(math.exp(5.0) + math.exp(-1.0)), abs=1e-6)
    logp.sum().backward()
    assert torch.isfinite(logits.grad).all() and logits.grad[0, 1] == 0 and logits.grad[0, 2] == 0


def test_the_truncated_entropy_has_a_finite_gradient():
    """TRL differentiates through the entropy (entropy bonus): the cut tokens' 0 * -inf terms must not reach it."""
    logits = (torch.randn(6, 40, generator=torch.Generator().manual_seed(3)) * 3).requires_grad_(True)
    tokens = torch.zeros(6, dtype=torch.long)
    _, entropy = support_logprobs(logits / 0.7, tokens, SamplingSettings(0.7, top_k=5, top_p=0.9), with_entropy=True)
    entropy.sum().backward()
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0


def test_truncated_fused_head_scores_the_processed_distribution_with_its_gradient(tiny_model_path):
    from trl.trainer.utils import add_fused_lm_head

    from trl_grpo_ext.trl.internals import add_truncated_lm_head

    settings = SamplingSettings(temperature=0.7, top_p=0.9, top_k=50)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    add_fused_lm_head(model, temperature=settings.temperature, outputs=("log_probs", "entropy"))
    add_truncated_lm_head(model, settings.temperature, settings)
    ids = torch.randint(0, model.config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(4))
    labels = ids.clone()
    labels[:, :6] = -100
    out = model(input_ids=ids, labels=labels, fused_lm_head=True)
    out.log_probs.sum().backward()
    # the reference: the model's own logits, tempered, and the trainer's support log-probs of the labels
    logits = reference(input_ids=ids).logits[:, :-1] / settings.temperature
    targets = labels[:, 1:]
    mask = targets != -100
    expected, entropy = support_logprobs(logits[mask], targets[mask], settings, with_entropy=True)
    assert torch.allclose(out.log_probs[mask], expected, atol=1e-5)
    assert torch.allclose(out.entropy[mask], entropy, atol=1e-4)
    assert (out.log_probs[~mask] == 0).all()
    expected.sum().backward()
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.allclose(ours.grad, theirs.grad, atol=1e-5)
    # without fused_lm_head the model's own forward answers (generation is unchanged), under its own signature
    assert torch.allclose(model(input_ids=ids).logits, reference(input_ids=ids).logits)
    assert {"position_ids", "logits_to_keep"} <= set(inspect.signature(model.forward).parameters)


@pytest.mark.parametrize("settings", SETTINGS[1:4], ids=lambda s: s.describe())
def test_generation_through_the_recorder_draws_transformers_tokens(tiny_model_path, settings):
    from trl_grpo_ext.trl.sampler_precision import SampledTokenLogprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    prompt = torch.tensor([[1, 5, 9, 12], [1, 7, 3, 2]])
    kwargs = dict(do_sample=True, max_new_tokens=10, pad_token_id=0, eos_token_id=None)
    native = dict(temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p, min_p=settings.min_p)
    torch.manual_seed(11)
    plain = model.generate(prompt, **kwargs, **native)
    recorder = SampledTokenLogprobs(settings)
    torch.manual_seed(11)
    recorded = model.generate(prompt, **{**kwargs, **native, **recorder.generate_kwargs()})
    assert torch.equal(plain, recorded)
    # the recorded log-prob of each drawn token is its log-prob under the processed distribution
    completions = recorded[:, prompt.shape[1] :].tolist()
    logps = recorder.per_row(completions)
    logits = model(recorded).logits[:, prompt.shape[1] - 1 : -1]
    expected = processed_logprobs(logits, settings).gather(-1, recorded[:, prompt.shape[1] :, None]).squeeze(-1)
    assert torch.allclose(torch.tensor(logps), expected, atol=1e-4)
