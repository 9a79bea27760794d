"""Recipes: every YAML parses into the real config classes, strict keys, CLI overrides, accelerate configs,
and real runs (tiny model end to end with SwanLab offline and LoRA, the embedded default).
Kill + resume: tests/test_kill_resume.py."""

import glob
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(glob.glob(str(ROOT / "recipes" / "gsm8k" / "*.yaml")))
ACCELERATE_CONFIGS = sorted(glob.glob(str(ROOT / "accelerate_configs" / "*.yaml")))
CPU_OVERRIDES = ["--use_cpu", "true", "--bf16", "false"]  # the GPU recipes, validated on this CPU machine


def _parse(argv):
    from trl_grpo_ext.trl.script_args import parse_recipe_args

    return parse_recipe_args(argv, default_config=ROOT / "recipes" / "gsm8k" / "embedded.yaml")


def _recipe_main():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gsm8k_grpo", ROOT / "recipes" / "gsm8k_grpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_expected_recipes_exist():
    names = {Path(p).stem for p in RECIPES}
    assert {"embedded", "grpo", "dr_grpo", "dapo", "cispo", "importance_sampling", "multi_iteration", "gspo"} <= names


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: Path(p).stem)
def test_every_recipe_parses_into_the_real_classes(path):
    import trl

    from trl_grpo_ext.task.rewards import REWARD_REGISTRY
    from trl_grpo_ext.trl.config import GRPOConfig
    from trl_grpo_ext.trl.script_args import ScriptArguments

    text = Path(path).read_text()
    assert text.lstrip().startswith("#"), "each recipe starts with a comment saying what it runs"
    raw = yaml.safe_load(text)
    assert "torch_dtype" not in raw and "max_prompt_length" not in raw  # TRL 1.16 schema
    script_args, training_args, model_args = _parse(["--config", path, *CPU_OVERRIDES])
    assert isinstance(script_args, ScriptArguments)
    assert type(training_args) is GRPOConfig
    assert isinstance(model_args, trl.ModelConfig)
    assert all(name in REWARD_REGISTRY for name in script_args.reward_funcs)
    for key, value in raw.items():  # nothing in the YAML is silently dropped
        obj = next(o for o in (script_args, training_args, model_args) if hasattr(o, key))
        if key not in ("report_to", "save_strategy", "lr_scheduler_type", "use_cpu", "bf16"):
            assert getattr(obj, key) == value, key
    # hybrid_judge, opd, tools: the embedded model on CPU; embedded_vllm: the embedded default sampled by vLLM;
    # embedded_async: the embedded default, asynchronous
    if Path(path).stem not in ("embedded", "hybrid_judge", "opd", "tools", "embedded_vllm", "embedded_async"):
        assert model_args.model_name_or_path == "Qwen/Qwen2.5-0.5B-Instruct" and model_args.use_peft
        assert script_args.dataset_name == "openai/gsm8k"


def test_recipes_encode_their_methods():
    def load(name):
        return _parse(["--config", str(ROOT / "recipes" / "gsm8k" / f"{name}.yaml"), *CPU_OVERRIDES])[1]

    grpo = load("grpo")
    assert (grpo.loss_type, grpo.beta, grpo.scale_rewards) == ("grpo", 0.04, "group")
    dr = load("dr_grpo")
    assert (dr.loss_type, dr.scale_rewards) == ("dr_grpo", "none")
    assert load("dapo").loss_type == "dapo" and load("dapo").beta == 0.0
    assert load("cispo").loss_type == "cispo"
    assert load("importance_sampling").loss_type == "importance_sampling"
    assert load("multi_iteration").num_iterations == 4
    assert load("gspo").importance_sampling_level == "sequence"
    vllm = load("embedded_vllm")
    assert (vllm.use_vllm, vllm.vllm_mode, vllm.vllm_importance_sampling_correction) == (True, "colocate", True)


def test_unknown_yaml_key_names_it_with_a_suggestion(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("model_name_or_path: embedded\nlearning_rat: 1.0e-5\nreward_func: [boxed]\nzzz_nothing: 1\n")
    with pytest.raises(ValueError) as err:
        _parse(["--config", str(path)])
    message = str(err.value)
    assert "'learning_rat' (did you mean 'learning_rate'?)" in message
    assert "'reward_func' (did you mean 'reward_funcs' or 'reward_model'?)" in message
    assert "'zzz_nothing'" in message and str(path) in message


def test_unknown_cli_flag_and_bad_values_fail_early(tmp_path):
    with pytest.raises(ValueError, match="unknown flag\\(s\\) '--no_such_flag'$"):
        _parse(["--no_such_flag", "1"])
    with pytest.raises(ValueError, match="'--learning_rat' \\(did you mean '--learning_rate'"):
        _parse(["--learning-rat=1e-5"])
    with pytest.raises(ValueError, match="on_malformed"):
        _parse(["--on_malformed", "ignore"])
    with pytest.raises(ValueError, match="loss_type"):
        _parse(["--loss_type", "ppo2"])


def test_bad_cli_value_is_a_value_error_not_usage_text():
    with pytest.raises(ValueError, match="argument --learning_rate.*: invalid float value: 'fast'"):
        _parse(["--learning_rate", "fast"])
    with pytest.raises(ValueError, match="--loss_type"):
        _parse(["--loss_type"])  # value missing


def test_cli_overrides_yaml_and_no_config_means_embedded():
    script_args, training_args, model_args = _parse(
        ["--max_steps", "3", "--learning_rate", "0.5", "--reward_funcs", "boxed"]
    )
    assert model_args.model_name_or_path == "embedded" and script_args.dataset_name == "synthetic"
    assert training_args.max_steps == 3 and training_args.learning_rate == 0.5
    assert script_args.reward_funcs == ["boxed"]
    default = _parse([])[1]
    assert default.max_steps > 3 and default.use_cpu


def test_unknown_reward_name_is_a_clear_error():
    from trl_grpo_ext.trl.recipe import reward_functions

    with pytest.raises(ValueError, match="boxd"):
        reward_functions(["boxd"])


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=lambda p: Path(p).stem)
def test_accelerate_configs_parse(path):
    from accelerate.commands.config.config_args import load_config_from_file

    text = Path(path).read_text()
    assert text.lstrip().startswith("#")
    config = load_config_from_file(path)
    stem = Path(path).stem
    expected = {"cpu": "NO", "ddp": "MULTI_GPU", "zero2": "DEEPSPEED", "zero3": "DEEPSPEED", "fsdp": "FSDP"}
    assert config.distributed_type.value == expected[stem]
    if stem == "cpu":
        assert config.use_cpu and config.num_processes == 1
    if stem.startswith("zero"):
        assert config.deepspeed_config["zero_stage"] == int(stem[-1])
    if stem == "fsdp":
        assert config.fsdp_config["fsdp_version"] == 2


@pytest.mark.parametrize("stem", ["zero2", "zero3"])
def test_deepspeed_configs_build_a_plugin(stem):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(ROOT / "accelerate_configs" / f"{stem}.yaml"))
    pytest.importorskip("deepspeed")  # only this part needs deepspeed installed
    from accelerate.utils import DeepSpeedPlugin

    plugin = DeepSpeedPlugin(
        **{k: v for k, v in config.deepspeed_config.items() if k != "deepspeed_multinode_launcher"}
    )
    assert plugin.zero_stage == int(stem[-1])


def _tiny_argv(model, out, *extra):
    return [
        "--model_name_or_path", model, "--output_dir", str(out), "--max_completion_length", "8",
        "--per_device_train_batch_size", "4", "--num_generations", "2", "--eval_num_samples", "2",
        "--synthetic_tasks", "chain_sum", *extra,
    ]  # fmt: skip


@pytest.mark.slow
def test_tiny_run_end_to_end_with_swanlab_offline(tiny_model_path, tmp_path, monkeypatch):
    monkeypatch.delenv("SWANLAB_MODE", raising=False)
    out = tmp_path / "run"
    _recipe_main()(
        _tiny_argv(tiny_model_path, out, "--max_steps", "2", "--report_to", "swanlab", "--swanlab_mode", "offline")
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("reward", "frac_reward_zero_std", "rewards/hybrid_reward/mean", "entropy", "step_time", "loss"):
        assert key in rows[0], key
    evals = json.loads((out / "eval_before_after.json").read_text())
    assert evals["before"]["step"] == 0 and evals["after"]["step"] == 2 and evals["after"]["n"] == 2
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["logged_steps"] == 2 and summary["peak_rss_gb"] > 0
    saved = yaml.safe_load((out / "config.yaml").read_text())  # what `compare` groups and diffs runs by
    assert (saved["backend"], saved["max_steps"], saved["report_to"]) == ("trl", 2, ["swanlab"])
    tables = [json.loads(p.read_text()) for p in (out / "swanlog").rglob("media/echarts/*.json")]
    assert tables, "offline SwanLab logs (with the completions table) live under the output dir"
    columns = [c["field"] for c in tables[0]["colDefs"]]
    assert tables[0]["_swanLab"] == "table" and columns[:2] == ["prompt", "completion"]
    assert "hybrid_reward" in columns and len(tables[0]["rowData"]) >= 4  # one generation batch
    assert (out / "model.safetensors").exists()
    import swanlab

    swanlab.finish()


@pytest.mark.slow
def test_tiny_lora_run_on_jsonl_data(tiny_model_path, tmp_path):
    data = tmp_path / "gsm8k"
    data.mkdir()
    rows = [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in range(8)]
    for split in ("train", "test"):
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "lora"
    argv = _tiny_argv(tiny_model_path, out, "--max_steps", "1", "--dataset_name", str(data), "--use_peft", "true",
                      "--lora_r", "4", "--lora_target_modules", "q_proj", "v_proj", "--report_to", "none")  # fmt: skip
    _recipe_main()(argv)
    assert (out / "adapter_config.json").exists() and not (out / "model.safetensors").exists()
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1]


@pytest.mark.slow
def test_embedded_default_runs_for_real(tmp_path):
    """The offline default recipe itself (SmolLM2-135M, reasoning-gym data), cut to one tiny step."""
    out = tmp_path / "embedded"
    _recipe_main()(["--output_dir", str(out), "--max_steps", "1", "--max_completion_length", "8",
                    "--per_device_train_batch_size", "4", "--num_generations", "2", "--eval_num_samples", "2"])  # fmt: skip
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]
    assert rows[0]["completions/max_length"] <= 8
    summary = json.loads((out / "run_summary.json").read_text())
    assert {"before", "after", "paired"} <= set(summary["eval"])
    paired = summary["eval"]["paired"]
    assert paired["n"] == 2 and {"accuracy_any_format", "accuracy", "boxed_rate"} <= set(paired["metrics"])
    assert summary["heldout_gain"] == paired["metrics"]
    assert (out / "model.safetensors").exists() and (out / "tokenizer_config.json").exists()


def test_yaml_value_of_the_wrong_type_names_key_and_file(tmp_path):
    path = tmp_path / "bad_type.yaml"
    path.write_text("model_name_or_path: embedded\nlearning_rate: fast\n")
    with pytest.raises(ValueError, match=f"{path}: learning_rate: expected float, got str 'fast'"):
        _parse(["--config", str(path)])
    path.write_text("max_steps: [1, 2]\n")
    with pytest.raises(ValueError, match="max_steps: expected int, got list"):
        _parse(["--config", str(path)])
    path.write_text(
        "learning_rate: 4e-5\nreport_to: none\nmax_completion_length: 16\nuse_cpu: true\nbf16: false\n"
    )  # YAML 1.1 strings argparse takes
    assert _parse(["--config", str(path)])[1].learning_rate == 4e-5


def test_malformed_yaml_names_the_file(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("max_steps: 3\nreward_funcs: [boxed\n")
    with pytest.raises(ValueError, match=f"{path} is not valid YAML"):
        _parse(["--config", str(path)])


def _recipe_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gsm8k_grpo_checks", ROOT / "recipes" / "gsm8k_grpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--temperature", "0"], "temperature=0.0 is not valid"),
        (["--beta", "-0.1"], "beta=-0.1 is not valid"),
        (["--max_completion_length", "0"], "max_completion_length=0 is not valid"),
        (["--reward_funcs", "boxd"], "boxd"),
        (["--dataset_name", "{data}"], "not UTF-8 text"),
        (["--model_name_or_path", "./no/such/model"], "does not exist"),
        (["--resume_from_checkpoint", "{out}/checkpoint-4"], "checkpoint-4 is incomplete"),
        (["--degenerate_reward", "boxd_reward"], "degenerate_reward='boxd_reward' is not one of"),
        (["--reward_weights", "1", "2", "3"], "reward_weights has 3 entries for 1 reward functions"),
        (["--model_name_or_path", "nobody-xyz/not-cached"], "could not load the tokenizer of model"),
    ],
    ids=["temperature", "beta", "length", "reward", "data", "model", "checkpoint", "degenerate", "weights", "hub"],
)
def test_failing_rerun_prints_one_error_exits_2_and_keeps_the_previous_files(
    tiny_model_path, tmp_path, monkeypatch, capsys, extra, message
):
    out = tmp_path / "run"
    (out / "checkpoint-4").mkdir(parents=True)  # a save killed before trainer_state.json
    previous = {"metrics.jsonl": '{"step": 1, "reward": 0.5}\n', "eval_before_after.json": '{"before": {}}\n'}
    previous["config.yaml"] = "max_steps: 1\n"
    for name, text in previous.items():
        (out / name).write_text(text)
    data = tmp_path / "latin1.jsonl"
    data.write_bytes('{"question": "caf\u00e9", "answer": "#### 1"}\n'.encode("latin-1"))
    module = _recipe_module()

    def no_model(*args, **kwargs):
        raise AssertionError("the model loaded before the inputs were checked")

    monkeypatch.setattr(module, "load_model", no_model)
    extra = [e.format(data=data, out=out) for e in extra]
    argv = _tiny_argv(tiny_model_path, out, "--max_steps", "2", "--report_to", "none", *extra)
    assert module.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert {p.name: p.read_text() for p in out.iterdir() if p.is_file()} == previous
    assert sorted(p.name for p in out.iterdir()) == sorted([*previous, "checkpoint-4"])


def test_cpu_threads_after_accelerate_launch():
    from trl_grpo_ext.cpu.threads import cpu_threads_to_set

    child = {"ACCELERATE_DYNAMO_BACKEND": "NO", "OMP_NUM_THREADS": "1"}
    launcher = ({"PATH": "/usr/bin"}, ["python", "/venv/bin/accelerate", "launch", "recipes/gsm8k_grpo.py"])
    assert cpu_threads_to_set(child, launcher, 8, on_cpu=True) == 8  # accelerate chose 1: use the cores
    assert cpu_threads_to_set(child, launcher, 8, on_cpu=False) is None  # a GPU run keeps it
    assert cpu_threads_to_set({"OMP_NUM_THREADS": "1"}, None, 8, on_cpu=True) is None  # plain python: the user's
    assert cpu_threads_to_set(child, None, 8, on_cpu=True) is None  # launcher unknown: keep what is set
    user_env = ({"OMP_NUM_THREADS": "1"}, launcher[1])
    assert cpu_threads_to_set(child, user_env, 8, on_cpu=True) is None  # the user exported it
    for flag in (["--num_cpu_threads_per_process", "3"], ["--num_cpu_threads_per_process=3"]):
        assert cpu_threads_to_set(child, (launcher[0], [*launcher[1][:3], *flag]), 8, on_cpu=True) is None
    two = {**child, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    assert cpu_threads_to_set(two, launcher, 8, on_cpu=True) is None  # processes share the cores


def test_recipe_config_lets_compare_group_hand_launched_seeds(tmp_path):
    """Runs launched by hand (not by `sweep`) save config.yaml, so `compare` groups those differing only in seed."""
    from trl_grpo_ext.experiments.compare import IGNORED_CONFIG_KEYS, load_runs, summarize
    from trl_grpo_ext.experiments.seed_comparison import group_by_seed
    from trl_grpo_ext.trl.recipe import save_run_config

    class MainProcess:
        def is_world_process_zero(self):
            return True

    dirs = []
    for name, extra in (("a0", ["--seed", "0"]), ("a1", ["--seed", "1"]), ("b0", ["--learning_rate", "3e-5"])):
        out = tmp_path / name
        script_args, training_args, model_args = _parse(["--output_dir", str(out), *extra])
        save_run_config(MainProcess(), script_args, training_args, model_args)
        (out / "metrics.jsonl").write_text('{"step": 1, "reward": 0.5}\n')
        dirs.append(out)
    saved = yaml.safe_load((tmp_path / "a1" / "config.yaml").read_text())
    assert saved["backend"] == "trl" and saved["seed"] == 1 and saved["synthetic_tasks"]
    assert saved["model_name_or_path"] == "embedded" and saved["output_dir"] == str(tmp_path / "a1")
    runs = load_runs(dirs)
    groups = group_by_seed(runs, [summarize(r) for r in runs], IGNORED_CONFIG_KEYS)
    assert [g.seeds for g in groups] == [[0, 1], [0]]
    assert [r.path.name for r in groups[0].runs] == ["a0", "a1"] and "learning_rate=3e-05" in groups[1].label


# A parent that holds `held` MiB, then starts a run's process (as a bench starts recipes) and prints its peak_rss_gb.
LARGE_PARENT = r"""
import subprocess, sys
held = bytearray(int(sys.argv[1]) * 2**20)
held[:: 4096] = b"x" * len(held[:: 4096])  # touched: resident
child = "from trl_grpo_ext.trl.recipe import peak_rss_gb; print(peak_rss_gb())"
print(subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True).stdout.strip())
"""


def test_peak_rss_is_the_runs_own_not_its_starters():
    """getrusage's ru_maxrss keeps the forking parent's peak up to the exec; a run's peak RSS must not include it."""
    held_mib = 3072
    out = subprocess.run(
        [sys.executable, "-c", LARGE_PARENT, str(held_mib)], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    child_gb = float(out.strip().splitlines()[-1])
    # the child's own imports: well under the parent's 3.2 GB (ru_maxrss alone reports at least that)
    assert 0 < child_gb < held_mib * 2**20 / 1e9 / 2, child_gb
