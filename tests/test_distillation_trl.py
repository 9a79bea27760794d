"""On-policy distillation on the TRL path (`trl_grpo_ext.trl.distillation`) on tiny models: the teacher's
log-probs in the advantages, its tokenizer checked, training steps."""

import math

import pytest
import torch
from conftest import build_tiny_model
from datasets import Dataset
from multiprocess_grpo import CPU_RUN  # the CPU trainer options the tests share

from trl_grpo_ext.errors import ConfigError
from trl_grpo_ext.trl.config import GRPOConfig
from trl_grpo_ext.trl.trainer import GRPOTrainer

pytestmark = pytest.mark.slow

PROMPTS = [[{"role": "user", "content": f"What is {i} + 4?"}] for i in range(8)]
COMMON = dict(
    **CPU_RUN,
    per_device_train_batch_size=4,
    num_generations=4,
    max_completion_length=8,
    seed=0,
    loss_type="importance_sampling",
)


def length_reward(completions, **kwargs):
    return [float(len(c[0]["content"])) for c in completions]


@pytest.fixture(scope="module")
def teacher_path(tmp_path_factory):
    """Another tiny model with the same tokenizer (the tokenizer's training is deterministic), other weights."""
    return build_tiny_model(tmp_path_factory.mktemp("teacher"), seed=1)


def make_trainer(student, tmp_path, distillation=None, **kwargs):
    args = GRPOConfig(output_dir=str(tmp_path / "out"), distillation=distillation, **{**COMMON, **kwargs})
    trainer = GRPOTrainer(student, [length_reward], args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS}))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps
    return trainer


def generation_inputs():
    return [{"prompt": PROMPTS[i]} for i in range(2) for _ in range(4)]


def completion_logps(model, inputs):
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    out = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    logits = out[:, -inputs["completion_ids"].size(1) :]
    return torch.log_softmax(logits, -1).gather(-1, inputs["completion_ids"].unsqueeze(-1)).squeeze(-1)


def test_teacher_equal_to_student_gives_zero_reverse_kl(tiny_model_path, tmp_path):
    trainer = make_trainer(tiny_model_path, tmp_path, {"teacher": tiny_model_path})
    torch.manual_seed(0)
    out = trainer._generate_and_score_completions(generation_inputs())
    metrics = trainer._metrics["train"]
    assert abs(metrics["distill/reverse_kl"][-1]) < 1e-5
    assert metrics["distill/teacher_logp"][-1] == pytest.approx(metrics["distill/student_logp"][-1], abs=1e-5)
    assert metrics["distill/teacher_logp"][-1] < 0
    assert out["advantages"].shape == out["completion_ids"].shape
    assert out["advantages"].abs().max() < 1e-5


def test_teacher_signal_moves_the_student_toward_the_teacher(tiny_model_path, teacher_path, tmp_path):
    trainer = make_trainer(tiny_model_path, tmp_path, {"teacher": teacher_path, "coef": 1.0})
    torch.manual_seed(0)
    inputs = trainer._generate_and_score_completions(generation_inputs())
    mask = inputs["completion_mask"].float()
    teacher = trainer.teacher_model
    with torch.no_grad():
        teacher_logps = completion_logps(teacher, inputs)
        student_logps = completion_logps(trainer.model, inputs)
    # the advantages are -(student - teacher) on the completion tokens (TRL's log-probs, float rounding apart)
    torch.testing.assert_close(inputs["advantages"], -(student_logps - teacher_logps) * mask, rtol=1e-4, atol=1e-4)
    reverse_kl = ((student_logps - teacher_logps) * mask).sum() / mask.sum()
    assert trainer._metrics["train"]["distill/reverse_kl"][-1] == pytest.approx(reverse_kl.item(), abs=1e-4)
    assert abs(reverse_kl.item()) > 1e-3  # different weights: a signal to learn from

    def gap():  # squared log-prob gap to the teacher on the sampled tokens
        with torch.no_grad():
            diff = completion_logps(trainer.model, inputs) - teacher_logps
        return ((diff**2) * mask).sum().item()

    before = gap()
    trainer.model.zero_grad()
    trainer._compute_loss(trainer.model, dict(inputs)).backward()
    assert not any(p.grad is not None for p in teacher.parameters())  # no teacher gradients
    with torch.no_grad():
        for p in trainer.model.parameters():
            if p.grad is not None:
                p -= 1e-2 * p.grad
    after = gap()
    assert after < before


def test_tokenizer_mismatch_is_one_line_naming_both(tiny_model_path, tmp_path):
    other = build_tiny_model(tmp_path / "other", vocab_size=300)
    with pytest.raises(ConfigError) as caught:
        make_trainer(tiny_model_path, tmp_path, {"teacher": other})
    text = str(caught.value)
    assert "\n" not in text and other in text and tiny_model_path in text and "tokenizer" in text
    with pytest.raises(ConfigError, match="cannot be loaded"):
        make_trainer(tiny_model_path, tmp_path, {"teacher": str(tmp_path / "missing")})


def test_two_distillation_steps(tiny_model_path, teacher_path, tmp_path):
    trainer = make_trainer(
        tiny_model_path,
        tmp_path,
        {"teacher": teacher_path, "reward_coef": 0.5, "discount": 0.9},
        max_steps=2,
        learning_rate=1e-2,
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2
    for entry in logs:
        for name in ("distill/reverse_kl", "distill/teacher_logp", "distill/student_logp", "reward"):
            assert math.isfinite(entry[name]), (name, entry)
        assert entry["distill/advantage_std"] > 0


def test_without_distillation_nothing_changes(tiny_model_path, tmp_path):
    trainer = make_trainer(tiny_model_path, tmp_path)
    assert trainer.teacher_model is None
    torch.manual_seed(0)
    out = trainer._generate_and_score_completions(generation_inputs())
    assert out["advantages"].dim() == 1
    assert not any(name.startswith("distill/") for name in trainer._metrics["train"])
