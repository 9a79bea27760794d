"""On-policy distillation's advantage source (`trl_grpo_ext.grpo.distillation`): the spec block on both paths and
the per-token advantages against hand-computed values."""

import math

import pytest
import torch

from trl_grpo_ext.errors import ConfigError
from trl_grpo_ext.grpo.distillation import DistillationSpec, distillation_advantages, distillation_of
from trl_grpo_ext.pytrio.config import PyTrioGRPOConfig
from trl_grpo_ext.trl.config import GRPOConfig

STUDENT = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, 0.0]])
TEACHER = torch.tensor([[-1.5, -1.0, -0.5], [-0.3, -1.7, -9.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def trl_config(**kwargs):
    return GRPOConfig(output_dir="unused", report_to="none", use_cpu=True, bf16=False, **kwargs)


def pytrio_config(**kwargs):
    base = dict(num_generations=4, per_device_train_batch_size=8, max_steps=2, reward_funcs=["boxed"])
    return PyTrioGRPOConfig(**{**base, **kwargs})


def test_per_token_advantage_is_the_negative_reverse_kl():
    terms = distillation_advantages(STUDENT, TEACHER, MASK, DistillationSpec(teacher="t", coef=2.0))
    # -2 * (student - teacher) on the completion tokens, 0 on padding (whatever the padding holds)
    expected = torch.tensor([[-1.0, 2.0, 0.0], [0.0, -2.0, 0.0]])
    torch.testing.assert_close(terms.advantages, expected)
    assert terms.metrics["distill/reverse_kl"] == pytest.approx((0.5 - 1.0 + 0.0 + 0.0 + 1.0) / 5)
    assert terms.metrics["distill/teacher_logp"] == pytest.approx(-1.0)
    assert terms.metrics["distill/student_logp"] == pytest.approx(-0.9)
    assert terms.metrics["distill/advantage_mean"] == pytest.approx(-0.2)
    values = [-1.0, 2.0, 0.0, 0.0, -2.0]
    std = math.sqrt(sum((v + 0.2) ** 2 for v in values) / 5)
    assert terms.metrics["distill/advantage_std"] == pytest.approx(std)


def test_discount_and_reward_mix():
    spec = DistillationSpec(teacher="t", coef=2.0, reward_coef=0.5, discount=0.5)
    terms = distillation_advantages(STUDENT, TEACHER, MASK, spec, reward_advantages=torch.tensor([1.0, -1.0]))
    # row 0: terms -1, 2, 0 -> A2 = 0, A1 = 2, A0 = -1 + 0.5 * 2 = 0; + 0.5 * 1
    # row 1: terms 0, -2, (pad) -> A1 = -2, A0 = 0 + 0.5 * -2 = -1; + 0.5 * -1; padding stays 0
    expected = torch.tensor([[0.5, 2.5, 0.5], [-1.5, -2.5, 0.0]])
    torch.testing.assert_close(terms.advantages, expected)
    assert terms.metrics["distill/advantage_mean"] == pytest.approx(-0.1)
    assert terms.metrics["distill/advantage_std"] == pytest.approx(math.sqrt(15.2 / 5))


def test_teacher_equal_to_student_gives_zero():
    terms = distillation_advantages(STUDENT, STUDENT.clone(), MASK, DistillationSpec(teacher="t"))
    assert terms.metrics["distill/reverse_kl"] == 0.0
    assert torch.count_nonzero(terms.advantages) == 0


def test_bad_inputs_are_refused():
    spec = DistillationSpec(teacher="t", reward_coef=1.0)
    with pytest.raises(ValueError, match="reward advantages"):
        distillation_advantages(STUDENT, TEACHER, MASK, spec)
    with pytest.raises(ValueError, match="same"):
        distillation_advantages(STUDENT, TEACHER[:, :2], MASK, DistillationSpec(teacher="t"))
    bad = TEACHER.clone()
    bad[0, 1] = float("nan")
    with pytest.raises(ValueError, match="finite"):
        distillation_advantages(STUDENT, bad, MASK, DistillationSpec(teacher="t"))


def test_spec_validation_lists_every_problem():
    with pytest.raises(ConfigError) as caught:
        DistillationSpec(teacher="", coef=-1.0, discount=2.0)
    text = str(caught.value)
    assert "distillation.teacher" in text and "distillation.coef" in text and "distillation.discount" in text
    with pytest.raises(ConfigError, match="both 0"):
        DistillationSpec(teacher="t", coef=0.0)


@pytest.mark.parametrize("make", [trl_config, pytrio_config], ids=["trl", "pytrio"])
def test_block_in_both_configs(make):
    config = make(distillation={"teacher": "teacher-folder", "discount": 0.9})
    assert config.distillation == {
        "teacher": "teacher-folder",
        "teacher_model_path": None,
        "coef": 1.0,
        "reward_coef": 0.0,
        "discount": 0.9,
    }
    assert distillation_of(config) == DistillationSpec(teacher="teacher-folder", discount=0.9)
    assert distillation_of(make()) is None
    assert make().distillation is None  # no block: plain GRPO, nothing added to the config
    with pytest.raises(ConfigError, match="unknown key.*'teachr'"):
        make(distillation={"teachr": "x"})
    with pytest.raises(ConfigError, match="distillation.reward_coef"):
        make(distillation={"teacher": "x", "reward_coef": float("nan")})
    with pytest.raises(ConfigError, match="dynamic_sampling"):
        make(distillation={"teacher": "x"}, dynamic_sampling=True)


def test_command_line_json_block():
    config = trl_config(distillation='{"teacher": "t", "coef": 0.5}')
    assert distillation_of(config) == DistillationSpec(teacher="t", coef=0.5)
    with pytest.raises(ConfigError, match="not a mapping"):
        trl_config(distillation="{teacher")
