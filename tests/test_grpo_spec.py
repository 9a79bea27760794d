"""The one GRPO spec: fields declared once, one loss table, one validator, one reward-option check, on both paths."""

import dataclasses
import warnings

import pytest
import trl

from trl_grpo_ext.errors import ConfigError
from trl_grpo_ext.grpo.loss_table import (
    LOCAL_LOSS_TYPES,
    LOSS_TYPES,
    PYTRIO,
    TRL,
    TRL_LOSS_TYPES,
    WIRE_CLIP_KEYS,
    ratio_bounds,
    valid_loss_types,
)
from trl_grpo_ext.grpo.spec import GRPOSpec, reward_option_problems
from trl_grpo_ext.pytrio.config import PyTrioGRPOConfig
from trl_grpo_ext.runs.tracking import SWANLAB_MODES
from trl_grpo_ext.task.rewards import reward_index, reward_names
from trl_grpo_ext.trl.config import VALID_LOSS_TYPES, GRPOConfig
from trl_grpo_ext.trl.script_args import ScriptArguments


def trl_config(**kwargs):
    return GRPOConfig(output_dir="unused", report_to="none", use_cpu=True, bf16=False, **kwargs)


def pytrio_config(**kwargs):
    base = dict(num_generations=4, per_device_train_batch_size=8, max_steps=2, reward_funcs=["boxed"])
    return PyTrioGRPOConfig(**{**base, **kwargs})


PATHS = {TRL: trl_config, PYTRIO: pytrio_config}
SPEC_FIELDS = [f.name for f in dataclasses.fields(GRPOSpec)]
TRL_DECLARED = set(trl.GRPOConfig.__dataclass_fields__)

# Several shared settings wrong at once, and the YAML key each problem must start with.
BAD = {
    "loss_type": "cispo",
    "epsilon_high": 0.3,  # no effect with cispo
    "temperature": 0.0,
    "cispo_clip_low": -1.0,
    "degenerate_tol": float("nan"),
    "curriculum_ema": 2.0,
    "max_generation_batches": 0,
}
BAD_KEYS = [
    "epsilon_high",
    "temperature",
    "cispo_clip_low",
    "degenerate_tol",
    "max_generation_batches",
    "curriculum_ema",
]


@pytest.mark.parametrize("path", [TRL, PYTRIO])
def test_every_problem_is_reported_at_once_with_its_yaml_key(path):
    with pytest.raises(ConfigError) as caught:
        PATHS[path](**BAD)
    problems = caught.value.problems
    assert [p.split("=")[0] for p in problems] == BAD_KEYS, problems
    assert isinstance(caught.value, ValueError) and len(str(caught.value).splitlines()) == 1
    assert all(p in str(caught.value) for p in problems)


def test_both_paths_report_the_same_problems_for_the_shared_settings():
    found = {}
    for path, make in PATHS.items():
        with pytest.raises(ConfigError) as caught:
            make(**BAD)
        found[path] = [p.replace(" (or use loss_type='trl_cispo' for TRL's cispo)", "") for p in caught.value.problems]
    assert found[TRL] == found[PYTRIO]


def test_the_pytrio_path_applies_the_loss_rules_it_used_to_skip():
    # epsilon_high with cispo (bounds are cispo_clip_*) and ppo with epsilon > 1: refused on both paths now
    for make in PATHS.values():
        with pytest.raises(ValueError, match="epsilon_high=0.28 has no effect with loss_type='cispo'"):
            make(loss_type="cispo", epsilon_high=0.28)
        with pytest.raises(ValueError, match=r"epsilon must be in \[0, 1\]"):
            make(loss_type="ppo", epsilon=1.5)
        with pytest.raises(ValueError, match=r"top_p=0 is not valid"):
            make(top_p=0)


def test_help_is_declared_once_and_defaults_stay_per_path():
    trl_fields = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    pytrio_fields = {f.name: f for f in dataclasses.fields(PyTrioGRPOConfig)}
    for name in SPEC_FIELDS:
        spec = GRPOSpec.__dataclass_fields__[name]
        assert pytrio_fields[name] is spec, name  # the PyTRIO config re-declares nothing
        assert len(spec.metadata["help"]) > 20, name
        if name not in TRL_DECLARED:
            assert trl_fields[name] is spec, name  # fields TRL lacks come from the spec
    # fields TRL declares keep TRL's declaration on the TRL path, except loss_type (our names, our help)
    assert trl_fields["temperature"] is trl.GRPOConfig.__dataclass_fields__["temperature"]
    assert trl_fields["loss_type"].metadata["help"] is pytrio_fields["loss_type"].metadata["help"]
    defaults = {TRL: trl_config(), PYTRIO: PyTrioGRPOConfig()}
    assert (defaults[TRL].loss_type, defaults[PYTRIO].loss_type) == ("dapo", "importance_sampling")
    assert (defaults[TRL].max_completion_length, defaults[PYTRIO].max_completion_length) == (512, 256)
    for name in SPEC_FIELDS:
        if name not in ("loss_type", "max_completion_length"):
            assert getattr(defaults[TRL], name) == getattr(defaults[PYTRIO], name), name


def test_yaml_and_cli_parse_the_shared_keys_on_both_paths(tmp_path):
    recipe = tmp_path / "shared.yaml"
    recipe.write_text(
        "loss_type: cispo\ncispo_clip_high: 2.0\ndegenerate_reward: boxed\nnum_generations: 4\n"
        "per_device_train_batch_size: 8\nscale_rewards: 'false'\ndynamic_sampling: true\n"
    )
    argv = ["--config", str(recipe), "--cispo_clip_low", "0.5", "--curriculum_ema", "0.5"]
    trl_args = ["--output_dir", str(tmp_path / "out"), "--use_cpu", "true", "--report_to", "none", "--bf16", "false"]
    (via_trl,) = trl.TrlParser((GRPOConfig,)).parse_args_and_config(argv + trl_args)
    (via_pytrio,) = trl.TrlParser((PyTrioGRPOConfig,)).parse_args_and_config(argv)
    for config in (via_trl, via_pytrio):
        assert (config.loss_type, config.cispo_clip_low, config.cispo_clip_high) == ("cispo", 0.5, 2.0)
        assert (config.scale_rewards, config.dynamic_sampling, config.curriculum_ema) == ("none", True, 0.5)
        assert config.degenerate_reward == "boxed" and ratio_bounds(config) == (0.5, 2.0)


def test_one_loss_table_drives_both_paths_the_losses_and_the_server():
    from trl_grpo_ext.grpo.losses import LOSS_FUNCTIONS
    from trl_grpo_ext.pytrio.loss import builtin_loss_config
    from trl_grpo_ext.pytrio_server.loss_fns import BUILTIN_LOSSES, parse_loss

    assert VALID_LOSS_TYPES == valid_loss_types(TRL)
    assert set(LOSS_FUNCTIONS) == set(LOCAL_LOSS_TYPES)
    assert set(TRL_LOSS_TYPES) == {"grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"}
    for loss in LOSS_TYPES:
        for path, make in PATHS.items():
            extra = {"epsilon_high": 4.0} if loss.name == "trl_cispo" else {}
            if path in loss.paths:
                assert make(loss_type=loss.name, **extra).loss_type == loss.name
            else:
                with pytest.raises(ValueError, match=f"loss_type='{loss.name}' is not valid"):
                    make(loss_type=loss.name, **extra)
        assert (loss.name in BUILTIN_LOSSES) is (loss.server_config is not None)
        if loss.service_builtin:  # what the loop sends, the server parses back into the config's ratio bounds
            config = pytrio_config(loss_type=loss.name, epsilon=0.1, epsilon_high=0.3 if loss.bounds else None)
            assert config.uses_builtin_loss
            sent = builtin_loss_config(config)
            assert sent is None or set(sent) == set(WIRE_CLIP_KEYS) == set(loss.server_config)
            parsed = parse_loss(loss.name, sent)
            assert (parsed.clip_low, parsed.clip_high) == pytest.approx(ratio_bounds(config))
        elif PYTRIO in loss.paths:
            assert not pytrio_config(loss_type=loss.name).uses_builtin_loss


def test_ratio_bounds_are_translated_in_one_place():
    cases = [
        (dict(loss_type="ppo", epsilon=0.1, epsilon_high=0.3), (0.9, 1.3)),
        (dict(loss_type="ppo", epsilon=0.2), (0.8, 1.2)),
        (dict(loss_type="cispo", cispo_clip_low=0.5, cispo_clip_high=2.0), (0.5, 2.0)),
        (dict(loss_type="importance_sampling"), (None, None)),
    ]
    for kwargs, bounds in cases:
        for make in PATHS.values():
            assert ratio_bounds(make(**kwargs)) == pytest.approx(bounds), kwargs
    assert ratio_bounds(trl_config(loss_type="trl_cispo", epsilon_high=4.0)) == (None, 4.0)
    assert ratio_bounds(trl_config(loss_type="dapo", epsilon_high=0.28)) == pytest.approx((0.8, 1.28))
    plain = trl.GRPOConfig(output_dir="unused", report_to="none", use_cpu=True, loss_type="cispo", epsilon_high=5.0)
    assert ratio_bounds(plain, "trl_cispo") == (None, 5.0)  # TRL's own cispo, as the trainer reads a plain config


def test_reward_options_take_either_spelling_on_both_paths():
    names = reward_names(["boxed", "format"])
    assert names == [("boxed_reward", "boxed"), ("format_reward", "format")]
    assert reward_index("boxed", names) == reward_index("boxed_reward", names) == 0
    for spelling in ("format", "format_reward"):
        config = pytrio_config(
            reward_funcs=["boxed", "format"], degenerate_reward=spelling, curriculum_reward=spelling
        )
        assert config.reward_column(spelling) == 1
    with pytest.raises(ConfigError) as caught:
        pytrio_config(reward_weights=[1.0, 2.0], degenerate_reward="length", curriculum_reward="nope")
    assert [p.split(" ")[0].split("=")[0] for p in caught.value.problems] == [
        "reward_weights",
        "degenerate_reward",
        "curriculum_reward",
    ]
    # the TRL recipe's check before the model loads is the same function
    from trl_grpo_ext.task.rewards import get_reward_funcs
    from trl_grpo_ext.trl.recipe import check_reward_options

    funcs = get_reward_funcs(["boxed", "format"])
    check_reward_options(trl_config(degenerate_reward="boxed"), funcs, ["boxed", "format"])
    check_reward_options(trl_config(degenerate_reward="format_reward"), funcs, ["boxed", "format"])
    with pytest.raises(ValueError, match="degenerate_reward='hybrid' is not one of the reward functions"):
        check_reward_options(trl_config(degenerate_reward="hybrid"), funcs, ["boxed", "format"])
    assert reward_option_problems(trl_config(reward_weights=[1.0]), names) == [
        "reward_weights has 1 entries for 2 reward functions (['boxed_reward/boxed', 'format_reward/format'])"
    ]
    # TRL weighs the reward_funcs it was given; a reward an environment owns comes after them, with weight 1
    with_env = [*names, ("DummyEnvironment",)]
    assert (
        reward_option_problems(
            trl_config(reward_weights=[1.0, 0.5], degenerate_reward="DummyEnvironment"), with_env, 2
        )
        == []
    )
    assert reward_option_problems(trl_config(reward_weights=[1.0, 0.5, 1.0]), with_env, 2) == [
        "reward_weights has 3 entries for 2 reward functions (['boxed_reward/boxed', 'format_reward/format'])"
    ]


def test_swanlab_modes_agree_and_the_old_value_is_an_alias_that_warns():
    for make in (lambda **kw: ScriptArguments(**kw), pytrio_config):
        for mode in SWANLAB_MODES:
            assert make(swanlab_mode=mode).swanlab_mode == mode
        with pytest.warns(FutureWarning, match="swanlab_mode: 'cloud' is deprecated, use 'online'"):
            assert make(swanlab_mode="cloud").swanlab_mode == "online"
        with pytest.raises(ValueError, match="swanlab_mode='cluod' is not valid; valid values: online"):
            make(swanlab_mode="cluod")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the current names do not warn
            make(swanlab_mode="offline")
