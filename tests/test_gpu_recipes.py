"""GPU recipes (recipes/gsm8k/gpu_*.yaml): parsed into the real config classes and checked for what a TRL user on
GPUs expects -- vLLM generation (colocated, with and without sleep mode, or on a server), bf16, LoRA, one of our
loss types with TRL's vLLM importance-sampling correction, and batch/length settings that fit together.
(tests/test_recipes.py also parses them with every other recipe: strict keys, nothing dropped.)"""

import glob
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
GPU_RECIPES = sorted(glob.glob(str(ROOT / "recipes" / "gsm8k" / "gpu_*.yaml")))
CPU_OVERRIDES = ["--use_cpu", "true", "--bf16", "false"]  # parsed on this CPU machine; the YAML says bf16
MAX_PROMPT_TOKENS = 256  # the one-shot GSM8K prompt, chat template included (~200 at most on GSM8K test)


def _parse(path, *extra):
    from trl_grpo_ext.script_args import parse_recipe_args

    return parse_recipe_args(["--config", path, *CPU_OVERRIDES, *extra])


def test_the_gpu_recipes_cover_colocate_sleep_and_server():
    modes = {}
    for path in GPU_RECIPES:
        raw = yaml.safe_load(Path(path).read_text())
        modes[Path(path).stem] = (raw["vllm_mode"], raw.get("vllm_enable_sleep_mode", False))
    assert ("colocate", False) in modes.values()
    assert ("colocate", True) in modes.values()
    assert any(mode == "server" for mode, _ in modes.values())


@pytest.mark.parametrize("path", GPU_RECIPES, ids=lambda p: Path(p).stem)
def test_gpu_recipe_parses_and_uses_vllm_bf16_lora(path):
    from trl_grpo_ext.config import EXTRA_LOSS_TYPES, GRPOConfig

    raw = yaml.safe_load(Path(path).read_text())
    script_args, args, model_args = _parse(path)
    assert type(args) is GRPOConfig
    assert raw["bf16"] is True and raw["dtype"] == "bfloat16"
    assert (
        model_args.use_peft and model_args.lora_r > 0 and model_args.model_name_or_path == "Qwen/Qwen2.5-0.5B-Instruct"
    )
    assert args.use_vllm and args.vllm_mode in ("colocate", "server")
    assert args.loss_type in EXTRA_LOSS_TYPES
    # Our loss types multiply by TRL's `importance_sampling_ratio` (tests/test_trainer.py checks the arithmetic).
    assert args.vllm_importance_sampling_correction
    assert args.vllm_importance_sampling_mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
    assert args.vllm_importance_sampling_clip_max is not None and args.vllm_importance_sampling_clip_max > 1
    if args.vllm_mode == "colocate":
        assert 0 < args.vllm_gpu_memory_utilization <= 0.9
        assert args.vllm_max_model_length >= MAX_PROMPT_TOKENS + args.max_completion_length
    else:
        assert args.vllm_server_base_url.startswith("http") and args.vllm_server_timeout > 0
        assert "trl vllm-serve" in Path(path).read_text()  # the header says how to start the server
    assert script_args.eval_num_samples >= 200
    completions_per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps
    assert completions_per_step % args.num_generations == 0
    assert args.generation_batch_size % args.num_generations == 0


@pytest.mark.parametrize("path", GPU_RECIPES, ids=lambda p: Path(p).stem)
def test_gpu_recipe_runs_offline_on_local_gsm8k(path, tmp_path):
    """The overrides gpu_check.sh passes: local JSONL data and a local model folder parse like the hub names."""
    data = tmp_path / "gsm8k"
    data.mkdir()
    script_args, args, model_args = _parse(
        path, "--dataset_name", str(data), "--model_name_or_path", str(tmp_path), "--max_steps", "5"
    )
    assert script_args.dataset_name == str(data) and model_args.model_name_or_path == str(tmp_path)
    assert args.max_steps == 5 and args.use_vllm


def test_a_bad_vllm_setting_fails_at_parse_time(tmp_path):
    """TRL's own validation runs when the recipe is parsed, before any model or vLLM engine is built."""
    path = tmp_path / "bad.yaml"
    text = Path(GPU_RECIPES[0]).read_text()
    assert "vllm_importance_sampling_clip_max: 3.0\n" in text
    path.write_text(
        text.replace(
            "vllm_importance_sampling_clip_max: 3.0\n",
            "vllm_importance_sampling_clip_max: 3.0\nvllm_importance_sampling_clip_min: 4.0\n",
        )
    )
    with pytest.raises(ValueError, match="vllm_importance_sampling_clip_min"):
        _parse(str(path))
