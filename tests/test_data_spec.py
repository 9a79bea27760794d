"""The one data spec (`trl_grpo_ext.task.spec.DataSpec`): declared once for the TRL recipe, the PyTRIO config and
eval; validated in one place; old per-path spellings refused with the new key; one YAML reader for recipes and
sweeps."""

import dataclasses
from pathlib import Path

import pytest

from trl_grpo_ext.errors import ConfigError
from trl_grpo_ext.evaluation.options import EvalOptions
from trl_grpo_ext.pytrio.config import PyTrioGRPOConfig
from trl_grpo_ext.runs import load_yaml
from trl_grpo_ext.task.spec import DataSpec, prompt_pool_factor
from trl_grpo_ext.trl.script_args import ScriptArguments, parse_recipe_args

ROOT = Path(__file__).resolve().parents[1]
EMBEDDED_TRL = ROOT / "recipes" / "gsm8k" / "embedded.yaml"
EMBEDDED_PYTRIO = ROOT / "recipes" / "pytrio" / "embedded.yaml"


def _fields(cls) -> dict:
    return {f.name: f for f in dataclasses.fields(cls)}


def _default(f):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def test_both_paths_declare_each_data_option_once_with_one_default():
    spec = _fields(DataSpec)
    for cls in (ScriptArguments, PyTrioGRPOConfig):
        fields = _fields(cls)
        for name, f in spec.items():
            assert fields[name].metadata == f.metadata, (cls.__name__, name)
            assert _default(fields[name]) == _default(f), (cls.__name__, name)
    assert EvalOptions().one_shot is _default(spec["one_shot"])
    trl_defaults, pytrio_defaults = ScriptArguments(), PyTrioGRPOConfig()
    for name in spec:
        assert getattr(trl_defaults, name) == getattr(pytrio_defaults, name), name


def test_bad_data_options_are_one_error_listing_each_problem():
    with pytest.raises(ConfigError) as caught:
        DataSpec(on_malformed="skip", num_train_samples=0, synthetic_tasks="chain_sum:2,nope", reward_funcs="")
    message = str(caught.value)
    assert len(message.splitlines()) == 1 and message.startswith("invalid data options: ")
    assert [p.split("=")[0].split(" ")[0] for p in caught.value.problems] == [
        "num_train_samples",
        "synthetic_tasks",
        "on_malformed",
        "reward_funcs",
    ]
    for make in (lambda **kw: ScriptArguments(**kw), lambda **kw: PyTrioGRPOConfig(**kw)):
        with pytest.raises(ConfigError, match="synthetic_tasks='chain_sum:0'"):
            make(synthetic_tasks="chain_sum:0")
        assert make(reward_funcs="boxed, format").reward_funcs == ["boxed", "format"]


@pytest.mark.parametrize(
    "line,flag,new",
    [
        ("rewards_funcs: boxed", "--rewards-funcs", "reward_funcs"),
        ("lora_rank: 8", "--lora_rank=8", "lora_r"),
        ("num_train_sample: 8", "--num-train-sample", "num_train_samples"),
    ],
)
def test_a_misspelt_key_or_flag_names_the_closest_one_on_both_paths(tmp_path, line, flag, new):
    """An unknown key in a recipe, or an unknown flag, is one line naming the closest valid one (an old spelling of
    a renamed option, too), on both paths."""
    recipe = tmp_path / "old.yaml"
    recipe.write_text(f"max_steps: 2\n{line}\n")
    pytrio = (PyTrioGRPOConfig,)
    for classes in (None, pytrio):
        key = line.split(":")[0]
        with pytest.raises(
            ValueError, match=f"old.yaml: unknown key.* '{key}' \\(did you mean [^)]*'{new}'"
        ) as caught:
            parse_recipe_args(["--config", str(recipe)], dataclass_types=classes)
        assert len(str(caught.value).splitlines()) == 1
        field = flag.split("=")[0][2:].replace("-", "_")
        with pytest.raises(ValueError, match=f"unknown flag.* '--{field}' \\(did you mean [^)]*'--{new}'"):
            parse_recipe_args([flag, "1"] if "=" not in flag else [flag], dataclass_types=classes)


def test_one_yaml_reader_takes_4e_5_as_a_number_in_recipes_and_sweeps(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "learning_rate: 4e-5\nreward_funcs: [boxed, format]\nreward_weights: [1, 5e-1]\nrun_name: '1e3'\n"
        "num_train_samples: 8\n"
    )
    assert load_yaml(recipe)["learning_rate"] == 4e-5 and load_yaml(recipe)["run_name"] == "1e3"
    (config,) = parse_recipe_args(["--config", str(recipe)], dataclass_types=(PyTrioGRPOConfig,))
    assert config.learning_rate == 4e-5 and config.reward_weights == [1, 0.5] and config.run_name == "1e3"
    script_args, training_args, _ = parse_recipe_args(
        ["--config", str(recipe), "--use_cpu", "true", "--bf16", "false", "--output_dir", str(tmp_path / "o")]
    )
    assert training_args.learning_rate == 4e-5 and training_args.reward_weights == [1, 0.5]
    assert script_args.num_train_samples == 8 and training_args.run_name == "1e3"


def test_a_recipe_data_block_means_the_same_on_both_paths(tmp_path):
    """The embedded recipes of both paths train on the same synthetic mix; moved to the other path, the data block
    gives the same options, and the same number of training problems for the same prompts per run."""
    from trl_grpo_ext.trl.recipe import prompts_per_run

    script_args, training_args, _ = parse_recipe_args(["--output_dir", str(tmp_path / "trl")], EMBEDDED_TRL)
    data = {name: getattr(script_args, name) for name in _fields(DataSpec)}
    (pytrio,) = parse_recipe_args(["--output_dir", str(tmp_path / "pytrio")], EMBEDDED_PYTRIO, (PyTrioGRPOConfig,))
    moved = dataclasses.replace(pytrio, **data)
    assert {name: getattr(moved, name) for name in data} == data
    trl_prompts = prompts_per_run(training_args)
    assert trl_prompts == moved.max_steps * moved.prompts_per_step == 240  # both: 40 steps x 6 prompts
    assert script_args.train_samples(trl_prompts, training_args) == moved.train_samples(trl_prompts, moved) == 304
    # dynamic sampling may draw max_generation_batches generation batches a step: room for as many prompts
    sampled = dataclasses.replace(moved, dynamic_sampling=True, max_generation_batches=3)
    assert prompt_pool_factor(sampled) == 3 and sampled.train_samples(trl_prompts, sampled) == 3 * 240 + 64
    assert dataclasses.replace(moved, dataset_name="openai/gsm8k").train_samples(240, moved) is None  # all rows
