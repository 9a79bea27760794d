"""`trl_grpo_ext.GRPOTrainer` against TRL's trainer on the tiny model: delegation, new losses, degenerate groups."""

import math
from pathlib import Path

import pytest
import torch
import transformers
import trl
from datasets import Dataset
from packaging.version import Version

from trl_grpo_ext.grpo.losses import group_advantages
from trl_grpo_ext.trl.config import TRL_LOSS_TYPES, GRPOConfig
from trl_grpo_ext.trl.trainer import GRPOTrainer

pytestmark = pytest.mark.slow

PROMPTS = [[{"role": "user", "content": f"What is {i} + 4?"}] for i in range(8)]
COMMON = dict(
    report_to="none",
    use_cpu=True,
    bf16=False,
    per_device_train_batch_size=4,
    num_generations=4,
    max_completion_length=8,
    logging_steps=1,
    save_strategy="no",
    disable_tqdm=True,
    seed=0,
)
NEW_METRICS = ("train_tokens", "frac_degenerate", "ratio_mean")
CLIP_METRICS = ("clip_low_frac", "clip_high_frac", "clipped_ratio_mean")


def length_reward(completions, **kwargs):
    return [float(len(c[0]["content"])) for c in completions]


def one_reward(completions, **kwargs):
    return [1.0] * len(completions)


def format_point_three(completions, **kwargs):
    return [0.3] * len(completions)


def dataset():
    return Dataset.from_dict({"prompt": PROMPTS})


def make_trainer(path, tmp_path, cls=GRPOTrainer, config_cls=GRPOConfig, rewards=(length_reward,), **kwargs):
    args = config_cls(output_dir=str(tmp_path / "out"), **{**COMMON, **kwargs})
    trainer = cls(path, list(rewards), args=args, train_dataset=dataset())
    trainer.model.train()
    # set by the training loop; _compute_loss reads it
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps
    return trainer


def generation_inputs(n_prompts=2, group=4):
    return [{"prompt": PROMPTS[i]} for i in range(n_prompts) for _ in range(group)]


def off_policy_inputs(trainer, seed=0):
    """A scored generation batch with old log-probs moved off the current policy, so ratios are clipped."""
    torch.manual_seed(seed)
    inputs = trainer._generate_and_score_completions(generation_inputs())
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, attn, inputs["completion_ids"].size(1)
        )
    g = torch.Generator().manual_seed(seed)
    inputs["old_per_token_logps"] = logps + torch.randn(logps.shape, generator=g) * 0.5
    inputs["advantages"] = torch.randn(inputs["advantages"].shape, generator=g)
    return inputs


def loss_and_grads(trainer, inputs):
    trainer.model.zero_grad()
    loss = trainer._compute_loss(trainer.model, dict(inputs))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def add_ref_logps(trainer, inputs):
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        ref, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.ref_model, ids, attn, inputs["completion_ids"].size(1)
        )
    inputs["ref_per_token_logps"] = ref - 0.1


def test_trl_help_lists_the_loss_types_we_delegate():
    help_text = trl.GRPOConfig.__dataclass_fields__["loss_type"].metadata["help"]
    listed = help_text.split("Supported values are ")[1].split(". ")[0]
    assert sorted(listed.replace("and ", "").replace("'", "").split(", ")) == sorted(TRL_LOSS_TYPES)


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_trl_loss_types_are_delegated_unchanged(tiny_model_path, tmp_path, beta):
    inputs = None
    for loss_type in TRL_LOSS_TYPES:
        kwargs = dict(loss_type=loss_type, beta=beta, epsilon_high=0.28)
        if loss_type == "luspo":
            kwargs["importance_sampling_level"] = "sequence"
        vanilla = make_trainer(tiny_model_path, tmp_path, trl.GRPOTrainer, trl.GRPOConfig, **kwargs)
        ours_type = "trl_cispo" if loss_type == "cispo" else loss_type
        # bit for bit needs TRL's own log-prob forward; prefix sharing (tests/test_prefix.py) rounds differently
        ours = make_trainer(
            tiny_model_path, tmp_path, **{**kwargs, "loss_type": ours_type, "share_prompt_prefix": False}
        )
        assert ours.ext_loss_type is None and ours.loss_type == loss_type
        if inputs is None:
            inputs = off_policy_inputs(vanilla)
            if beta:
                add_ref_logps(vanilla, inputs)
        loss_vanilla, grads_vanilla = loss_and_grads(vanilla, inputs)
        loss_ours, grads_ours = loss_and_grads(ours, inputs)
        assert torch.equal(loss_vanilla, loss_ours), loss_type
        assert grads_vanilla.keys() == grads_ours.keys()
        for name in grads_vanilla:
            assert torch.equal(grads_vanilla[name], grads_ours[name]), (loss_type, name)
        # Our shared metrics are logged next to TRL's own, on TRL's loss types too.
        metrics = ours._metrics["train"]
        assert math.isfinite(metrics["ratio_mean"][-1]) and metrics["ratio_mean"][-1] != 1.0
        assert metrics["train_tokens"][-1] > 0
        if loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo"):
            assert all(name in metrics for name in CLIP_METRICS), loss_type


# Each new loss equals a TRL loss for some settings: our cispo with an open lower bound is TRL's cispo with
# epsilon_high = the upper bound; importance_sampling is TRL's dapo with bounds that never bind (r in [0, 1e9]);
# ppo (Tinker's name) is TRL's dapo.
# Comparing the two through every surrounding option checks that our loss path keeps TRL's machinery.
EQUIVALENT = {
    "cispo": (
        dict(loss_type="cispo", cispo_clip_low=0.0, cispo_clip_high=1.1),
        dict(loss_type="cispo", epsilon_high=1.1),
    ),
    "importance_sampling": (
        dict(loss_type="importance_sampling"),
        dict(loss_type="dapo", epsilon=1.0, epsilon_high=1e9),
    ),
    "ppo": (dict(loss_type="ppo", epsilon_high=0.28), dict(loss_type="dapo", epsilon_high=0.28)),
}
SURROUNDINGS = {
    "plain": {},
    "kl": {"beta": 0.04},
    "kl_bias_corrected": {"beta": 0.04, "use_bias_correction_kl": True},
    "entropy": {"top_entropy_quantile": 0.5, "entropy_coef": 0.01},
    "sequence_level": {"importance_sampling_level": "sequence"},
    "off_policy_mask": {"off_policy_mask_threshold": 0.05},
    "vllm_is_correction": {},
    # normaliser rescaled to one accumulation window: num_items_in_batch * 2 / 4
    "accumulation": {"gradient_accumulation_steps": 2, "steps_per_generation": 4, "entropy_coef": 0.01},
}


@pytest.mark.parametrize("surrounding", sorted(SURROUNDINGS))
@pytest.mark.parametrize("loss_type", sorted(EQUIVALENT))
def test_new_losses_keep_trl_surroundings(tiny_model_path, tmp_path, loss_type, surrounding):
    ours_kwargs, trl_kwargs = EQUIVALENT[loss_type]
    extra = SURROUNDINGS[surrounding]
    reference = make_trainer(tiny_model_path, tmp_path, trl.GRPOTrainer, trl.GRPOConfig, **trl_kwargs, **extra)
    ours = make_trainer(tiny_model_path, tmp_path, **ours_kwargs, **extra)
    assert ours.ext_loss_type == loss_type
    inputs = off_policy_inputs(reference, seed=1)
    if extra.get("beta"):
        add_ref_logps(reference, inputs)
    if surrounding == "vllm_is_correction":  # no vLLM here: feed the ratio TRL would have computed
        for trainer in (reference, ours):
            trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
        inputs["importance_sampling_ratio"] = torch.rand(inputs["completion_ids"].shape) + 0.5
    loss_trl, grads_trl = loss_and_grads(reference, inputs)
    loss_ours, grads_ours = loss_and_grads(ours, inputs)
    torch.testing.assert_close(loss_ours, loss_trl, rtol=1e-5, atol=1e-7)
    assert grads_trl.keys() == grads_ours.keys()
    for name in grads_trl:
        torch.testing.assert_close(grads_ours[name], grads_trl[name], rtol=1e-4, atol=1e-7)
    metrics = ours._metrics["train"]
    assert math.isfinite(metrics["ratio_mean"][-1]) and metrics["ratio_mean"][-1] != 1.0
    if loss_type != "importance_sampling" and surrounding != "sequence_level":
        assert metrics["clip_high_frac"][-1] > 0  # the cap was active
    for name in ("kl", "entropy_coef", "policy_loss"):
        assert (name in metrics) == (name in reference._metrics["train"]), name


def test_two_sided_cispo_differs_from_trl_cispo(tiny_model_path, tmp_path):
    reference = make_trainer(
        tiny_model_path, tmp_path, trl.GRPOTrainer, trl.GRPOConfig, loss_type="cispo", epsilon_high=1.1
    )
    two_sided = make_trainer(tiny_model_path, tmp_path, loss_type="cispo", cispo_clip_low=0.9, cispo_clip_high=1.1)
    inputs = off_policy_inputs(reference, seed=1)
    assert not torch.allclose(loss_and_grads(two_sided, inputs)[0], loss_and_grads(reference, inputs)[0])
    assert two_sided._metrics["train"]["clip_low_frac"][-1] > 0


def test_default_trl_cispo_scales_on_policy_gradient_ours_does_not(tiny_model_path, tmp_path):
    trl_default = make_trainer(tiny_model_path, tmp_path, trl.GRPOTrainer, trl.GRPOConfig, loss_type="cispo")
    ours = make_trainer(tiny_model_path, tmp_path, loss_type="cispo")
    importance = make_trainer(tiny_model_path, tmp_path, loss_type="importance_sampling")
    torch.manual_seed(2)
    inputs = trl_default._generate_and_score_completions(generation_inputs())
    inputs["advantages"] = torch.linspace(-1, 1, inputs["advantages"].numel())  # on-policy: no old log-probs
    _, g_trl = loss_and_grads(trl_default, inputs)
    _, g_ours = loss_and_grads(ours, inputs)
    _, g_is = loss_and_grads(importance, inputs)
    for name in g_ours:
        torch.testing.assert_close(g_ours[name], g_is[name], rtol=1e-5, atol=1e-8)
        torch.testing.assert_close(g_trl[name], 0.2 * g_ours[name], rtol=1e-4, atol=1e-8)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_matches_trl(tiny_model_path, tmp_path, scale):
    trainer = make_trainer(tiny_model_path, tmp_path, trl.GRPOTrainer, trl.GRPOConfig, scale_rewards=scale)
    captured = {}
    original = trainer._calculate_rewards

    def capture(*args, **kwargs):
        captured["rewards"] = original(*args, **kwargs)
        return captured["rewards"]

    trainer._calculate_rewards = capture
    torch.manual_seed(3)
    out = trainer._generate_and_score_completions(generation_inputs())
    expected, _ = group_advantages(captured["rewards"].nansum(1), 4, scale_rewards=scale, zero_degenerate=False)
    assert torch.count_nonzero(expected) > 0
    torch.testing.assert_close(out["advantages"], expected, rtol=0, atol=0)


@pytest.mark.parametrize("zero", [True, False])
def test_float_noise_groups_are_degenerate(tiny_model_path, tmp_path, zero):
    # Groups of 8 (as measured with TRL 1.16): the float mean of eight 1.3's is one ulp off, std ~1.3e-7.
    trainer = make_trainer(
        tiny_model_path,
        tmp_path,
        rewards=(one_reward, format_point_three),
        zero_degenerate_advantages=zero,
        num_generations=8,
        per_device_train_batch_size=8,
    )
    out = trainer._generate_and_score_completions(generation_inputs(n_prompts=1, group=8))
    metrics = trainer._metrics["train"]
    assert metrics["frac_reward_zero_std"][-1] == 0.0  # TRL's exact test sees signal in rounding noise
    assert metrics["frac_degenerate"][-1] == 1.0
    if zero:
        assert torch.count_nonzero(out["advantages"]) == 0
        assert all(a == 0 for a in trainer._logs["advantages"])
    else:
        assert 1e-4 < out["advantages"].abs().max() < 1e-2  # TRL's ±1e-3 "signal from nothing"


def test_degenerate_reward_zeroes_groups_with_flat_correctness(tiny_model_path, tmp_path):
    plain = make_trainer(tiny_model_path, tmp_path, rewards=(one_reward, length_reward))
    torch.manual_seed(4)
    out = plain._generate_and_score_completions(generation_inputs())
    assert torch.count_nonzero(out["advantages"]) > 0 and plain._metrics["train"]["frac_degenerate"][-1] == 0.0

    gated = make_trainer(
        tiny_model_path, tmp_path, rewards=(one_reward, length_reward), degenerate_reward="one_reward"
    )
    torch.manual_seed(4)
    out = gated._generate_and_score_completions(generation_inputs())
    assert torch.count_nonzero(out["advantages"]) == 0
    assert gated._metrics["train"]["frac_degenerate"][-1] == 1.0
    gated._compute_loss(gated.model, out)
    assert gated._metrics["train"]["train_tokens"][-1] == 0


def test_degenerate_reward_name_is_checked(tiny_model_path, tmp_path):
    with pytest.raises(ValueError, match=r"degenerate_reward='boxed_reward' is not one of .*length_reward"):
        make_trainer(tiny_model_path, tmp_path, degenerate_reward="boxed_reward")


TRAIN_CASES = [
    # loss_type, beta, num_iterations, lora, extra: each new loss with beta 0 and > 0, 1 and 2 iterations, LoRA
    ("importance_sampling", 0.0, 1, False, {}),
    ("importance_sampling", 0.1, 2, False, {"importance_sampling_level": "sequence", "entropy_coef": 0.01}),
    ("importance_sampling", 0.0, 2, True, {"gradient_accumulation_steps": 2}),
    ("cispo", 0.1, 2, False, {"cispo_clip_low": 0.9, "cispo_clip_high": 1.05}),
    ("cispo", 0.05, 1, True, {"top_entropy_quantile": 0.5}),
    ("cispo", 0.0, 1, False, {}),
    ("ppo", 0.0, 2, False, {}),
    ("dapo", 0.0, 2, False, {}),
]


@pytest.mark.parametrize("loss_type, beta, num_iterations, lora, extra", TRAIN_CASES)
def test_train_steps(tiny_model_path, tmp_path, loss_type, beta, num_iterations, lora, extra):
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        **COMMON,
        loss_type=loss_type,
        beta=beta,
        num_iterations=num_iterations,
        max_steps=3,
        learning_rate=2e-2,
        **extra,
    )
    trainer = GRPOTrainer(
        tiny_model_path, [length_reward], args=args, train_dataset=dataset(), peft_config=peft_config
    )
    trainable = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert not lora or all("lora" in n for n in trainable)
    trainer.train()
    changed = [n for n, p in trainer.model.named_parameters() if n in trainable and not torch.equal(p, trainable[n])]
    assert changed, "no trainable weight moved"

    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 3
    for entry in logs:
        for name in ("train_tokens", "ratio_mean", "entropy") + (("kl",) if beta else ()):
            assert math.isfinite(entry[name]), (name, entry)
        if loss_type != "importance_sampling":
            assert all(math.isfinite(entry[name]) for name in CLIP_METRICS)
    assert all(name in logs[0] for name in NEW_METRICS)
    assert 0.0 <= logs[0]["frac_degenerate"] <= 1.0
    assert logs[0]["train_tokens"] > 0
    if num_iterations == 2:  # the second pass reuses the generation: old log-probs differ from the moved policy
        assert any(abs(entry["ratio_mean"] - 1.0) > 1e-6 for entry in logs)


def test_default_args_as_trl_builds_them(tiny_model_path, tmp_path, monkeypatch):
    """Without `args` TRL builds ``GRPOConfig(f"{model}-GRPO")`` (output_dir positional): ours gets that output_dir
    too. On a GPU machine TRL's does as well; on a CPU machine TRL stops at its bf16 default, where ours' `bf16: auto`
    (`trl_grpo_ext.cpu.precision`) chooses fp32, since transformers trains bf16 on the CPU only with `use_cpu`."""
    monkeypatch.chdir(tmp_path)

    def outcome(cls):
        try:
            return cls(tiny_model_path, length_reward, train_dataset=dataset()).args.output_dir
        except ValueError as error:
            return str(error)

    ours = outcome(GRPOTrainer)
    assert ours == f"{Path(tiny_model_path).name}-GRPO"
    if torch.cuda.is_available():
        assert ours == outcome(trl.GRPOTrainer)


class ScoredEnvironment:
    """An environment that owns its reward (TRL's ``get_reward``): TRL scores it as one more reward column."""

    def reset(self, **kwargs):
        return None

    def get_reward(self):
        return 0.5


def tool_calling_tokenizer(path):
    """The tiny model's tokenizer with a chat template TRL ships that renders tool calls (environments need one)."""
    from pathlib import Path

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
    return tokenizer


@pytest.mark.skipif(
    Version(transformers.__version__) < Version("5.2.0"),
    reason="TRL 1.16 itself refuses environment_factory below transformers 5.2 (the floor cell runs 5.0)",
)
def test_environment_owned_reward_is_weighted_as_trl_weighs_it(tiny_model_path, tmp_path):
    """TRL counts reward_weights against the reward_funcs given; the environment's reward follows with weight 1."""
    args = GRPOConfig(output_dir=str(tmp_path / "out"), **COMMON, reward_weights=[2.0])
    rewards = [length_reward]
    trainer = GRPOTrainer(
        tiny_model_path,
        rewards,
        args=args,
        train_dataset=dataset(),
        processing_class=tool_calling_tokenizer(tiny_model_path),
        environment_factory=ScoredEnvironment,
    )
    assert trainer.reward_func_names == ["length_reward", "ScoredEnvironment"]
    assert trainer.reward_weights.tolist() == [2.0, 1.0]
    # the environment's column can be named like any reward; a name that is no column is still refused
    named = GRPOConfig(output_dir=str(tmp_path / "out"), **COMMON, degenerate_reward="ScoredEnvironment")
    kwargs = dict(processing_class=tool_calling_tokenizer(tiny_model_path), environment_factory=ScoredEnvironment)
    trainer = GRPOTrainer(tiny_model_path, [length_reward], args=named, train_dataset=dataset(), **kwargs)
    assert trainer.mixin_state.degenerate_column == trainer.mixin_state.curriculum_column == 1
    for bad, message in (
        (
            {"reward_weights": [1.0, 1.0]},
            r"Number of reward weights \(2\) must match number of reward functions \(1\)",
        ),
        ({"degenerate_reward": "Environment"}, r"degenerate_reward='Environment' is not one of .*ScoredEnvironment"),
    ):
        args = GRPOConfig(output_dir=str(tmp_path / "out"), **COMMON, **bad)
        with pytest.raises(ValueError, match=message):
            GRPOTrainer(tiny_model_path, [length_reward], args=args, train_dataset=dataset(), **kwargs)
