"""The register of code copied from TRL: `mirrors` marks a copy, `MIRRORS` lists every copy (this package's and
`MIRRORED_ELSEWHERE`'s), each with the TRL function's source hash per TRL version that the copy was checked against
(``tests/test_trl_internals.py``)."""

from __future__ import annotations

from dataclasses import dataclass

TRL_GRPO = "trl.trainer.grpo_trainer.GRPOTrainer"
VLLM_GENERATION = "trl.generation.vllm_generation.VLLMGeneration"


@dataclass(frozen=True)
class Mirror:
    """A copy of TRL code: ``trl`` the dotted name of the TRL function, ``ours`` the dotted name of the copy,
    ``source_hashes`` TRL version -> hash of that TRL function's normalised source the copy was checked against."""

    trl: str
    ours: str
    source_hashes: dict[str, str]
    part: str = ""  # which part of the TRL function is copied, when not all of it


MIRRORS: list[Mirror] = []


def mirrors(trl_function: str, source_hashes: dict[str, str], part: str = ""):
    """Decorator: the function copies (a part of) `trl_function`, checked against the TRL sources `source_hashes`."""

    def record(func):
        MIRRORS.append(Mirror(trl_function, f"{func.__module__}.{func.__qualname__}", source_hashes, part))
        return func

    return record


# Code elsewhere that mirrors TRL, checked by the same test: copies in the layers below the TRL path (the PyTRIO
# loop imports them without TRL, so they cannot live here), the recipe parser's steps of TrlParser (it runs before
# any trainer exists), and the TRL path's hooks that follow a TRL function's layout without copying it (the
# curriculum's sampler, the shared-prefix log-prob forward's chunks).
_OUR_GRPO = "trl_grpo_ext.grpo"
MIRRORED_ELSEWHERE = (
    Mirror("trl.trainer.utils.nanstd", f"{_OUR_GRPO}.losses.nanstd", {"1.16.0": "5e4d28a84a305003"}),
    Mirror(
        "trl.trainer.utils.get_callable_name",
        f"{_OUR_GRPO}.reward_aggregation.reward_func_name",
        {"1.16.0": "ce2d9044d283ec91"},
    ),
    Mirror(
        "trl.trainer.utils.is_async_callable",
        f"{_OUR_GRPO}.reward_aggregation.is_async_callable",
        {"1.16.0": "4105f7551123308e"},
    ),
    Mirror(
        "trl.trainer.utils.start_event_loop_in_daemon",
        f"{_OUR_GRPO}.reward_aggregation.start_event_loop_in_daemon",
        {"1.16.0": "5acf290758dd8f7f"},
    ),
    Mirror(
        f"{TRL_GRPO}._generate_and_score_completions",
        f"{_OUR_GRPO}.losses.group_advantages",
        {"1.16.0": "5f6267d35c18c248"},
        part="advantages (sum_then_normalize)",
    ),
    Mirror(
        f"{TRL_GRPO}._generate_and_score_completions",
        f"{_OUR_GRPO}.reward_aggregation.weighted_rewards",
        {"1.16.0": "5f6267d35c18c248"},
        part="weighted NaN-sum of the rewards",
    ),
    Mirror(
        f"{TRL_GRPO}._generate_and_score_completions",
        f"{_OUR_GRPO}.reward_aggregation.frac_reward_zero_std",
        {"1.16.0": "5f6267d35c18c248"},
        part="frac_reward_zero_std",
    ),
    Mirror(
        f"{TRL_GRPO}._generate_and_score_completions",
        f"{_OUR_GRPO}.reward_aggregation.reward_metrics",
        {"1.16.0": "5f6267d35c18c248"},
        part="rewards/<name>/mean and /std",
    ),
    Mirror(
        f"{TRL_GRPO}._generate_and_score_completions",
        f"{_OUR_GRPO}.losses.sampler_correction",
        {"1.16.0": "5f6267d35c18c248"},
        part="vLLM importance-sampling ratio: its four modes and clamp",
    ),
    Mirror(
        f"{TRL_GRPO}._calculate_rewards",
        f"{_OUR_GRPO}.reward_aggregation.score_completions",
        {"1.16.0": "f9363c3464c1c018"},
    ),
    Mirror(
        f"{TRL_GRPO}._calculate_rewards",
        f"{_OUR_GRPO}.reward_aggregation.reward_kwargs",
        {"1.16.0": "f9363c3464c1c018"},
        part="dataset columns as reward keyword arguments",
    ),
    Mirror(
        f"{TRL_GRPO}.__init__",
        "trl_grpo_ext.task.rewards.reward_model.RewardModelReward.load",
        {"1.16.0": "14a358d3b256d96a"},
        part="a reward model given by path",
    ),
    Mirror(
        f"{TRL_GRPO}._calculate_rewards",
        "trl_grpo_ext.task.rewards.reward_model.RewardModelReward.__call__",
        {"1.16.0": "f9363c3464c1c018"},
        part="the nn.Module reward branch",
    ),
    Mirror(
        "trl.scripts.utils.TrlParser.parse_args_and_config",
        "trl_grpo_ext.trl.script_args.parse_recipe_args",
        {"1.16.0": "d2352633503fea9a"},
        part="the config file's env and values applied as defaults, then the command line",
    ),
    Mirror(
        "trl.trainer.utils.RepeatSampler.__iter__",
        "trl_grpo_ext.trl.sampling.CurriculumSampler.__iter__",
        {"1.16.0": "8ec2a99455ecbf62"},
        part="the index layout",
    ),
    Mirror(
        f"{TRL_GRPO}._get_per_token_logps_and_entropies",
        "trl_grpo_ext.trl.prefix_mixin.PrefixSharingMixin._get_per_token_logps_and_entropies",
        {"1.16.0": "1ee7f136f4d322ce"},
        part="rows chunked by batch_size, each chunk's log-probs and entropies",
    ),
)
MIRRORS.extend(MIRRORED_ELSEWHERE)
