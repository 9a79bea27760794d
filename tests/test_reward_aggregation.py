"""`trl_grpo_ext.grpo.reward_aggregation`: TRL 1.16's reward aggregation, checked against a real `trl.GRPOTrainer`."""

import functools
import math

import pytest
import torch
import trl
from datasets import Dataset

from trl_grpo_ext.grpo.reward_aggregation import (
    RewardFunctionError,
    RewardMetricLog,
    frac_reward_zero_std,
    reward_func_name,
    reward_kwargs,
    reward_metrics,
    reward_weight_tensor,
    score_completions,
    weighted_rewards,
)

NAN = float("nan")


def test_score_completions_none_is_nan_and_errors_name_the_function():
    def a(completions, **kw):
        return [1.0, None, 0.0, None]

    def b(completions, answer, **kw):
        assert answer == ["x"] * 4  # dataset columns arrive as keyword arguments
        return [0.5, 0.5, None, None]

    per_func = score_completions([a, b], ["a", "b"], ["p"] * 4, ["c"] * 4, [[1]] * 4, {"answer": ["x"] * 4})
    assert per_func.dtype == torch.float32 and per_func.shape == (4, 2)
    assert math.isnan(per_func[1, 0]) and math.isnan(per_func[3, 1])
    totals = weighted_rewards(per_func, reward_weight_tensor([1.0, 2.0], 2))
    assert totals[:3].tolist() == [2.0, 1.0, 0.0]
    assert math.isnan(totals[3])  # unscored by every function: NaN, not 0

    def short(completions, **kw):
        return [1.0]

    def boom(completions, **kw):
        raise KeyError("answer")

    def text(completions, **kw):
        return ["high"] * 4

    for func, match in (
        (short, "'short' returned 1 rewards for 4"),
        (boom, "'boom' failed: KeyError"),
        (text, "'text' returned a non-number"),
    ):
        with pytest.raises(RewardFunctionError, match=match):
            score_completions([func], [func.__name__], ["p"] * 4, ["c"] * 4, [[1]] * 4, {})


def test_reward_kwargs_names_weights():
    inputs = [{"prompt": "p", "answer": "1", "completion": "c", "task": "t"}] * 2
    assert reward_kwargs(inputs) == {"answer": ["1", "1"], "task": ["t", "t"]}

    def boxed(completions, **kw):
        return []

    assert reward_func_name(functools.partial(boxed, x=1)) == "boxed"
    assert reward_weight_tensor(None, 3).tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="2 reward weights for 3"):
        reward_weight_tensor([1.0, 2.0], 3)


def test_frac_reward_zero_std_follows_trl():
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, NAN, NAN, 1.0, NAN, NAN, NAN])
    # group 1 flat (zero std), group 2 varied, group 3 one scored reward: std NaN, which TRL does not count as zero
    assert frac_reward_zero_std(rewards, 4, "group") == pytest.approx(1 / 3)
    assert frac_reward_zero_std(rewards, 4, "none") == pytest.approx(1 / 3)
    assert frac_reward_zero_std(rewards, 4, "batch") == 0.0
    assert frac_reward_zero_std(torch.ones(8), 4, "batch") == 1.0
    with pytest.raises(ValueError, match="scale_rewards"):
        frac_reward_zero_std(rewards, 4, "std")


def correct_or_none(completions, log_metric=None, **kwargs):
    """1/0 by content length parity, None for every fourth completion (unscorable by this function)."""
    values = [None if i % 4 == 3 else float(len(c[0]["content"]) % 2) for i, c in enumerate(completions)]
    log_metric("rewards/correct_or_none/odd", sum(v or 0.0 for v in values) / len(values))
    log_metric("rewards/correct_or_none/odd", 0.1)  # two values for one name: averaged, as TRL does
    return values


def half_unscored(completions, **kwargs):
    return [None if i % 8 >= 6 else len(c[0]["content"]) / 10 for i, c in enumerate(completions)]


@pytest.mark.slow
@pytest.mark.parametrize("scale", ["group", "batch"])
def test_metrics_equal_what_trl_logs(tiny_model_path, tmp_path, scale):
    """Same rewards -> the PyTRIO loop's reward metrics are bit-identical to the ones `trl.GRPOTrainer` logs
    (rows 7 of each group of 8 are unscored by both functions: NaN totals)."""
    prompts = [[{"role": "user", "content": f"What is {i} + 4?"}] for i in range(2)]
    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "out"),
        report_to="none",
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=8,
        num_generations=8,
        max_completion_length=8,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        reward_weights=[1.0, 0.5],
        scale_rewards=scale,
    )
    funcs = [correct_or_none, half_unscored]
    trainer = trl.GRPOTrainer(tiny_model_path, funcs, args=args, train_dataset=Dataset.from_dict({"prompt": prompts}))
    trainer.model.train()
    captured = {}
    original = trainer._calculate_rewards

    def capture(*a, **kw):
        captured["args"] = a
        captured["rewards_per_func"] = original(*a, **kw)
        return captured["rewards_per_func"]

    trainer._calculate_rewards = capture
    torch.manual_seed(0)
    trainer._generate_and_score_completions([{"prompt": p} for p in prompts for _ in range(8)])
    per_func = captured["rewards_per_func"]
    assert torch.isnan(per_func).all(dim=1).any() and not torch.isnan(per_func).all()

    names = [reward_func_name(f) for f in funcs]
    assert names == trainer.reward_func_names
    # the PyTRIO path's scoring of the same completions: same rewards, same log_metric values
    inputs, prompts, completions, completion_ids = captured["args"]
    log = RewardMetricLog()
    kwargs = {**reward_kwargs(inputs), "log_metric": log}
    torch.testing.assert_close(
        score_completions(funcs, names, prompts, completions, completion_ids, kwargs),
        per_func,
        rtol=0,
        atol=0,
        equal_nan=True,
    )
    rewards = weighted_rewards(per_func, reward_weight_tensor(args.reward_weights, 2))
    ours = reward_metrics(per_func, rewards, names)
    ours["frac_reward_zero_std"] = frac_reward_zero_std(rewards, 8, scale)
    ours.update(log.metrics())
    assert "rewards/correct_or_none/odd" in ours
    logged = {key: values[-1] for key, values in trainer._metrics["train"].items()}
    for key, value in ours.items():
        assert value == logged[key] or (math.isnan(value) and math.isnan(logged[key])), key
