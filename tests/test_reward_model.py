"""Reward models in `reward_funcs`, as in TRL: a tiny sequence-classification model trained here with TRL's
`RewardTrainer` on correct-vs-wrong answers to the embedded tasks, then used by its folder on both paths."""

import pytest
import torch

from trl_grpo_ext.grpo.reward_aggregation import reward_func_name, score_completions
from trl_grpo_ext.task.rewards import (
    RewardModelReward,
    reward_functions,
    reward_names,
    trl_reward_inputs,
)
from trl_grpo_ext.task.rewards.reward_model import RewardModelOptions, check_reward_model

pytestmark = pytest.mark.slow


def _pairs(n: int, seed: int):
    """(prompt messages, correct completion, wrong completion) per embedded-style problem. The wrong answer is the
    right one times 37 plus 11: far off, so a 60k-parameter model learns to tell them apart in seconds (what is
    tested is the reward-model path, not a model that can do arithmetic)."""
    from trl_grpo_ext.task.answers import parse_ground_truth
    from trl_grpo_ext.task.data import load_dataset_split

    rows = load_dataset_split(
        "synthetic", "train", num_samples=n, tasks="chain_sum_easy:1", chat=True, one_shot=False, seed=seed
    )
    out = []
    for row in rows:
        right = int(float(parse_ground_truth(row["answer"])))
        wrong = right * 37 + 11
        out.append(
            (
                row["prompt"],
                [{"role": "assistant", "content": f"The answer is \\boxed{{{right}}}."}],
                [{"role": "assistant", "content": f"The answer is \\boxed{{{wrong}}}."}],
            )
        )
    return out


@pytest.fixture(scope="module")
def reward_model_path(tiny_model_path, tmp_path_factory):
    """A reward model folder: the tiny Llama with a one-logit head, trained by TRL's RewardTrainer."""
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    out = tmp_path_factory.mktemp("reward-model")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_path, num_labels=1)
    model.config.pad_token_id = tokenizer.pad_token_id
    train = Dataset.from_list([{"prompt": p, "chosen": c, "rejected": r} for p, c, r in _pairs(96, seed=1)])
    args = RewardConfig(
        output_dir=str(out / "run"),
        per_device_train_batch_size=16,
        max_steps=30,
        learning_rate=3e-3,
        logging_steps=1000,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    RewardTrainer(model=model, args=args, train_dataset=train, processing_class=tokenizer).train()
    model.save_pretrained(out / "rm")
    tokenizer.save_pretrained(out / "rm")
    return str(out / "rm")


def test_reward_model_ranks_held_out_correct_answers_above_wrong_ones(reward_model_path):
    (reward,) = reward_functions([reward_model_path])
    assert isinstance(reward, RewardModelReward)
    held_out = _pairs(40, seed=12345)
    prompts = [p for p, _, _ in held_out]
    right = reward([c for _, c, _ in held_out], prompts=prompts)
    wrong = reward(prompts=prompts, completions=[r for _, _, r in held_out])
    wins = sum(a > b for a, b in zip(right, wrong, strict=True)) / len(held_out)
    # chance is 0.5; 40 pairs at 0.75 or better is p < 0.001 under chance
    assert wins >= 0.75, wins


@pytest.mark.parametrize("options", [{}, {"batch_size": 3, "max_length": 40, "dtype": "float32"}])
def test_both_paths_give_the_same_scores(reward_model_path, tiny_model_path, options):
    """TRL's own scoring of the model we hand it (`_calculate_rewards`' nn.Module branch) against the PyTRIO loop's
    (`score_completions` calling `RewardModelReward`), on the same completions, with and without the options."""
    from datasets import Dataset

    import trl_grpo_ext

    class Settings:
        reward_model = options

    held_out = _pairs(7, seed=777)
    prompts = [p for p, _, _ in held_out] * 2
    completions = [c for _, c, _ in held_out] + [r for _, _, r in held_out]
    args = trl_grpo_ext.GRPOConfig(
        output_dir="unused",
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=8,
        use_cpu=True,
        report_to="none",
    )
    funcs = reward_functions(["boxed", reward_model_path], args, settings=Settings)
    trl_funcs, classes = trl_reward_inputs(funcs)
    assert trl_funcs[1] is funcs[1].model and classes == [None, funcs[1].tokenizer]
    trainer = trl_grpo_ext.GRPOTrainer(
        model=tiny_model_path,
        reward_funcs=trl_funcs,
        reward_processing_classes=classes,
        args=args,
        train_dataset=Dataset.from_list([{"prompt": prompts[0], "answer": "#### 1"}] * 4),
    )
    inputs = [{"prompt": p, "answer": "#### 1"} for p in prompts]
    ids = [[1, 2]] * len(prompts)
    trl_scores = trainer._calculate_rewards(inputs, prompts, completions, ids)
    names = [reward_func_name(f) for f in funcs]
    assert names == trainer.reward_func_names  # rewards/<folder name>/mean on both paths
    ours = score_completions(funcs, names, prompts, completions, ids, {"answer": ["#### 1"] * len(prompts)})
    torch.testing.assert_close(ours, trl_scores.cpu(), rtol=1e-5, atol=1e-5)
    assert reward_names(["boxed", reward_model_path], names)[1][0] == reward_model_path.split("/")[-1]


def test_reward_model_options_change_what_it_reads(reward_model_path):
    """max_length truncates each row from the end, as a right-truncating tokenizer does: a row cut before the
    answer scores like the same row with another answer."""
    (full,) = reward_functions([reward_model_path])
    cut = RewardModelReward(reward_model_path, RewardModelOptions(max_length=8))
    prompt, right, wrong = _pairs(1, seed=3)[0]
    a, b = full(prompts=[prompt, prompt], completions=[right, wrong])
    assert a != pytest.approx(b, abs=1e-6)
    a, b = cut(prompts=[prompt, prompt], completions=[right, wrong])
    assert a == pytest.approx(b, abs=1e-6)


def test_a_reward_model_is_a_hybrid_term(reward_model_path):
    class Settings:
        hybrid = {"components": {"boxed": 1.0, reward_model_path: 0.5}, "vetoes": ["no_box"]}

    (rm,) = reward_functions([reward_model_path])
    (hybrid,) = reward_functions(["hybrid"], settings=Settings)
    prompt, right, wrong = _pairs(1, seed=5)[0]
    answer = f"#### {right[0]['content'].split('{')[1].split('}')[0]}"
    logged = {}
    scores = hybrid(
        [right, wrong, [{"role": "assistant", "content": "no box"}]],
        prompts=[prompt] * 3,
        answer=[answer] * 3,
        log_metric=logged.__setitem__,
    )
    model_scores = rm(prompts=[prompt] * 2, completions=[right, wrong])
    assert scores == [pytest.approx(1.0 + 0.5 * model_scores[0]), pytest.approx(0.5 * model_scores[1]), 0.0]
    assert f"rewards/hybrid_reward/{reward_model_path}" in logged


def test_bad_reward_model_entries_fail_with_one_line(tiny_model_path, tmp_path):
    with pytest.raises(ValueError, match="is not a sequence-classification reward model") as info:
        reward_functions([tiny_model_path])  # a causal LM: TRL would bolt a random head on it
    assert tiny_model_path in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ValueError, match="'no-such-org/no-such-rm' is not a reward name and its model cannot be read"):
        reward_functions(["boxed", "no-such-org/no-such-rm"])  # hub id form, offline
    with pytest.raises(ValueError, match="unknown reward 'boxd'.*reward model's folder or hub id"):
        reward_functions(["boxd"])
    with pytest.raises(ValueError, match="reward_model.batch_size=0"):
        RewardModelOptions.from_mapping({"batch_size": 0})
    with pytest.raises(ValueError, match="unknown key"):
        RewardModelOptions.from_mapping({"batchsize": 4})
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="cannot be read"):
        check_reward_model(str(tmp_path / "empty"))


@pytest.mark.parametrize("path", ["trl", "pytrio"])
def test_a_reward_model_folder_in_reward_funcs_trains_on_both_paths(
    reward_model_path, tiny_model_path, tmp_path, path
):
    """Two GRPO steps of each recipe with ``reward_funcs: [boxed, <folder>]``: TRL's metric name for the model on
    both paths (``rewards/rm/mean``)."""
    import importlib.util
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    name = "gsm8k_grpo" if path == "trl" else "gsm8k_pytrio"
    spec = importlib.util.spec_from_file_location(f"{name}_rm", root / "recipes" / f"{name}.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    out = tmp_path / "run"
    common = ["--output_dir", str(out), "--max_steps", "2", "--max_completion_length", "8", "--num_generations", "2",
              "--per_device_train_batch_size", "4", "--reward_funcs", "boxed", reward_model_path,
              "--reward_model", json.dumps({"batch_size": 2, "max_length": 256, "dtype": "float32"})]  # fmt: skip
    if path == "trl":
        argv = ["--model_name_or_path", tiny_model_path, "--eval_num_samples", "0", "--synthetic_tasks", "chain_sum"]
    else:
        argv = ["--base_model", tiny_model_path, "--lora_r", "4", "--num_train_samples", "16", "--save_every", "0"]
    assert recipe.main(argv + common) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(isinstance(r["rewards/rm/mean"], float) and r["rewards/rm/std"] >= 0 for r in rows)
