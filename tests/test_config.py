"""`trl_grpo_ext.GRPOConfig`: defaults, help texts, validation at config time, YAML parsing."""

import dataclasses

import pytest
import torch
import trl

from trl_grpo_ext.grpo.loss_table import DEFAULT_CLIP, ratio_bounds
from trl_grpo_ext.grpo.losses import degenerate_group_mask
from trl_grpo_ext.trl.config import EXTRA_LOSS_TYPES, VALID_LOSS_TYPES, GRPOConfig, trl_loss_type

NEW_FIELDS = (
    "cispo_clip_low",
    "cispo_clip_high",
    "degenerate_tol",
    "zero_degenerate_advantages",
    "degenerate_reward",
    "dynamic_sampling",
    "max_generation_batches",
    "curriculum",
    "share_prompt_prefix",
    "share_prompt_prefix_across_microbatches",
    "max_packed_tokens",
)


def make(**kwargs):
    return GRPOConfig(output_dir="unused", report_to="none", use_cpu=True, bf16=False, **kwargs)


def test_a_config_that_sets_none_of_our_options_trains_as_trl_does():
    config = make()
    plain = trl.GRPOConfig(output_dir="unused", report_to="none", use_cpu=True, bf16=False)
    assert isinstance(config, trl.GRPOConfig)
    for f in dataclasses.fields(trl.GRPOConfig):  # every TRL field keeps TRL's default (the loss type among them)
        assert getattr(config, f.name) == getattr(plain, f.name), f.name
    # CISPO's default bounds are the ones the loss applies when given none
    assert ratio_bounds(make(loss_type="cispo")) == DEFAULT_CLIP["cispo"]
    # the default degenerate rule: a group flat within float noise is degenerate (zero advantage), one that differs
    # by a reward of 0.001 is not; no named reward decides it
    rewards = torch.tensor([1.0, 1.0 + 1e-7, 1.0, 1.001])
    mask = degenerate_group_mask(rewards, 2, config.degenerate_tol)
    assert mask.tolist() == [True, False] and config.zero_degenerate_advantages and config.degenerate_reward is None


def test_help_shows_every_option_of_ours():
    from transformers import HfArgumentParser

    shown = "".join(HfArgumentParser(GRPOConfig).format_help().split())  # argparse re-wraps: compare without spaces
    fields = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    for name in NEW_FIELDS + ("loss_type",):
        text = "".join(fields[name].metadata["help"].split()).replace("%%", "%")
        assert f"--{name}" in shown and len(text) > 20 and text[:60] in shown, name
    assert "trl_cispo" in " ".join(fields["loss_type"].metadata["help"].split())


def test_trl_field_order_first_so_positional_arguments_land_where_trl_puts_them():
    ours = [f.name for f in dataclasses.fields(GRPOConfig)]
    trls = [f.name for f in dataclasses.fields(trl.GRPOConfig)]
    assert ours[: len(trls)] == trls  # TRL's order first, then the spec's and this path's own fields
    assert set(NEW_FIELDS) <= set(ours[len(trls) :])
    config = GRPOConfig("some-output-dir", 4, report_to="none", use_cpu=True, bf16=False, num_generations=4)
    assert (config.output_dir, config.per_device_train_batch_size) == ("some-output-dir", 4)  # TRL's first two
    assert config.loss_type == "dapo"


def test_fields_trl_declares_keep_trls_declaration():
    """The spec re-declares TRL's sampling fields (for the PyTRIO path); this path keeps TRL's type, default, help."""
    from trl_grpo_ext.grpo.spec import GRPOSpec

    ours, trls = GRPOConfig.__dataclass_fields__, trl.GRPOConfig.__dataclass_fields__
    shared = [name for name in GRPOSpec.__dataclass_fields__ if name in trls]
    assert {"num_generations", "max_completion_length", "temperature", "reward_weights"} <= set(shared)
    for name in shared:
        if name == "loss_type":  # the spec's help (both paths' names), TRL's default
            assert ours[name].default == trls[name].default == "dapo"
        else:
            assert ours[name] is trls[name], name
    assert make().max_completion_length == trls["max_completion_length"].default != GRPOSpec.max_completion_length


def test_loss_type_names():
    assert set(EXTRA_LOSS_TYPES) == {"importance_sampling", "cispo", "ppo"}
    assert trl_loss_type("trl_cispo") == "cispo"
    assert trl_loss_type("cispo") is None and trl_loss_type("importance_sampling") is None
    assert trl_loss_type("dapo") == "dapo"
    for loss_type in VALID_LOSS_TYPES:
        extra = {"epsilon_high": 4.0} if loss_type == "trl_cispo" else {}
        assert make(loss_type=loss_type, **extra).loss_type == loss_type


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"loss_type": "reinforce"}, r"loss_type='reinforce' is not valid; valid values: .*importance_sampling"),
        ({"cispo_clip_low": 2.0, "cispo_clip_high": 1.0}, r"cispo_clip_low \(2.0\) must be <= cispo_clip_high"),
        ({"cispo_clip_low": -0.5}, r"cispo_clip_low=-0.5 is not valid"),
        ({"cispo_clip_high": float("inf")}, r"cispo_clip_high=inf is not valid"),
        ({"degenerate_tol": -1e-6}, r"degenerate_tol=-1e-06 is not valid"),
        ({"degenerate_reward": " "}, r"degenerate_reward=' ' must be a reward function name"),
        ({"scale_rewards": "std"}, r"scale_rewards='std' is not valid; valid values: group, batch, none"),
        # TRL's cispo silently caps every ratio at epsilon_high (0.2 unless set): refuse the unset default.
        ({"loss_type": "trl_cispo"}, r"Set epsilon_high explicitly"),
        ({"loss_type": "cispo", "epsilon_high": 0.28}, r"epsilon_high=0.28 has no effect with loss_type='cispo'"),
        ({"loss_type": "importance_sampling", "epsilon_high": 0.28}, r"no clipping"),
        ({"loss_type": "importance_sampling", "delta": 2.0}, r"delta=2.0 .* does not apply"),
        ({"loss_type": "ppo", "delta": 2.0}, r"delta=2.0 .* does not apply"),
        ({"loss_type": "ppo", "epsilon": 1.5}, r"epsilon must be in \[0, 1\]"),
    ],
)
def test_invalid_values_fail_at_config_time(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make(**kwargs)


def test_scale_rewards_strings_and_bools():
    assert make(scale_rewards="false").scale_rewards == "none"
    assert make(scale_rewards=True).scale_rewards == "group"
    assert make(scale_rewards="batch").scale_rewards == "batch"


def test_yaml_recipe_parses(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        "output_dir: out\nloss_type: cispo\ncispo_clip_low: 0.5\ncispo_clip_high: 2.0\n"
        "degenerate_reward: boxed_reward\nzero_degenerate_advantages: false\nuse_cpu: true\nbf16: false\n"
        "report_to: none\n"
    )
    (config,) = trl.TrlParser((GRPOConfig,)).parse_args_and_config(["--config", str(recipe)])
    assert (config.loss_type, config.cispo_clip_low, config.cispo_clip_high) == ("cispo", 0.5, 2.0)
    assert config.degenerate_reward == "boxed_reward" and config.zero_degenerate_advantages is False
    bad = tmp_path / "bad.yaml"
    bad.write_text("output_dir: out\nloss_type: cispo\ncispo_clip_low: 3\ncispo_clip_high: 1\nuse_cpu: true\n")
    with pytest.raises(ValueError, match="cispo_clip_low"):
        trl.TrlParser((GRPOConfig,)).parse_args_and_config(["--config", str(bad)])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"beta": -0.01}, "beta=-0.01 is not valid"),
        ({"temperature": 0.0}, "temperature=0.0 is not valid; it must be a finite number > 0"),
        ({"temperature": -1.0}, "temperature=-1.0"),
        ({"temperature": float("nan")}, "temperature=nan"),
        ({"max_completion_length": 0}, "max_completion_length=0 is not valid"),
        ({"max_completion_length": -8}, "max_completion_length=-8"),
        ({"learning_rate": -1e-5}, "learning_rate=-1e-05"),
    ],
)
def test_generation_numbers_are_checked_at_config_time(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make(**kwargs)


def test_generation_numbers_edge_values_are_accepted():
    config = make(beta=0.0, temperature=1e-3, max_completion_length=1, learning_rate=0.0)
    assert (config.beta, config.temperature, config.max_completion_length) == (0.0, 1e-3, 1)


def test_extension_options_come_from_our_config_or_take_its_defaults():
    from trl_grpo_ext.trl.config import ExtensionOptions

    plain = trl.GRPOConfig(output_dir="unused", report_to="none", use_cpu=True, bf16=False)
    defaults = ExtensionOptions.of(plain)
    for f in dataclasses.fields(ExtensionOptions):
        assert not hasattr(plain, f.name), f.name  # TRL's config has none of them
        assert getattr(defaults, f.name) == getattr(make(), f.name), f.name  # ours by default
    ours = ExtensionOptions.of(make(degenerate_tol=0.5, share_prompt_prefix=False, max_packed_tokens=64))
    assert (ours.degenerate_tol, ours.share_prompt_prefix, ours.max_packed_tokens) == (0.5, False, 64)
