"""TRL's tool loop through `trl_grpo_ext.GRPOTrainer` on a tiny model that calls a tool (`tool_model`): tool tokens
out of the loss and in the attention, the sampler's log-probs on the tokens sampled, TRL's loss on the same batch."""

import logging
from types import SimpleNamespace

import pytest
import torch
import transformers
import trl
from datasets import Dataset
from multiprocess_grpo import CPU_RUN  # the CPU trainer options the tests share
from packaging.version import Version
from tool_model import build_tool_model

from trl_grpo_ext.environments import CalculatorEnvironment, environment_factory
from trl_grpo_ext.errors import ConfigError
from trl_grpo_ext.trl.config import GRPOConfig
from trl_grpo_ext.trl.trainer import GRPOTrainer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        Version(transformers.__version__) < Version("5.2.0"), reason="TRL 1.16 runs tools on transformers >= 5.2"
    ),
]

PROMPTS = [[{"role": "user", "content": f"What is {i} * 4?"}] for i in range(4)]
COMMON = dict(
    **CPU_RUN,
    per_device_train_batch_size=8,
    num_generations=4,
    max_completion_length=96,
    max_tool_calling_iterations=2,
    seed=0,
)
TOOL_RESULT = "<tool_response>\n12\n</tool_response>"
TOOL_TURN = f"\n<|im_start|>user\n{TOOL_RESULT}<|im_end|>\n<|im_start|>assistant\n"  # Qwen 2.5's template


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The expression, e.g. "3 * 4".
    """
    return "12"


def length_reward(completions, **kwargs):
    return [float(sum(len(m.get("content") or "") for m in c)) for c in completions]


@pytest.fixture(scope="module")
def tool_model_path(tmp_path_factory):
    return build_tool_model(tmp_path_factory.mktemp("tool-model"))


def make_trainer(path, tmp_path, cls=GRPOTrainer, config_cls=GRPOConfig, **kwargs):
    args = config_cls(output_dir=str(tmp_path / "out"), **{**COMMON, **kwargs})
    trainer = cls(path, [length_reward], args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                  tools=[calculate])  # fmt: skip
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps
    return trainer


def generation_inputs(n_prompts=2, group=4):
    return [{"prompt": PROMPTS[i]} for i in range(n_prompts) for _ in range(group)]


def scored_batch(trainer, seed=0):
    torch.manual_seed(seed)
    inputs = trainer._generate_and_score_completions(generation_inputs())
    assert "tool_mask" in inputs
    return inputs


def logps_of(trainer, inputs, **overrides):
    batch = {**inputs, **overrides}
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attn = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, attn, batch["completion_ids"].size(1)
        )
    return logps


def tool_positions(inputs):
    return (inputs["completion_mask"] == 1) & (inputs["tool_mask"] == 0)


def test_tool_calls_run_and_their_results_are_masked(tool_model_path, tmp_path):
    trainer = make_trainer(tool_model_path, tmp_path)
    inputs = scored_batch(trainer)
    tokenizer = trainer.processing_class
    tools = tool_positions(inputs)
    rows_with_tool = tools.any(1)
    assert 0 < int(rows_with_tool.sum()) < len(rows_with_tool)  # the model both calls and answers
    for row in range(inputs["completion_ids"].size(0)):
        ids = inputs["completion_ids"][row]
        tool_text = tokenizer.decode(ids[tools[row]])
        model_text = tokenizer.decode(ids[(inputs["completion_mask"][row] == 1) & ~tools[row]])
        # what the mask hides is exactly the tool turns TRL appended; the model's own tokens stay in the loss
        results = tool_text.count(TOOL_RESULT)
        assert tool_text == TOOL_TURN * results
        assert TOOL_RESULT not in model_text and results <= model_text.count("</tool_call>")
    assert trainer._metrics["train"]["tools/call_frequency"][-1] > 0


def test_tool_tokens_are_attended(tool_model_path, tmp_path):
    trainer = make_trainer(tool_model_path, tmp_path)
    inputs = scored_batch(trainer)
    tools = tool_positions(inputs)
    logps = logps_of(trainer, inputs)
    # the tool's answer changed in the context: the model's tokens after it read other log-probs
    changed = inputs["completion_ids"].clone()
    changed[tools] = trainer.processing_class.encode("7", add_special_tokens=False)[0]
    moved = (logps_of(trainer, inputs, completion_ids=changed) - logps).abs()
    after_tool = (tools.int().cumsum(1) > 0) & ~tools & (inputs["completion_mask"] == 1)
    assert bool(after_tool.any())
    assert float(moved[after_tool].max()) > 1e-3
    before_tool = (tools.int().cumsum(1) == 0) & (inputs["completion_mask"] == 1)
    assert float(moved[before_tool].max()) == 0.0  # causal: nothing before the first tool turn moves


@pytest.mark.parametrize("loss_type", ["dapo", "ppo", "cispo", "importance_sampling"])
def test_tool_tokens_get_no_gradient(tool_model_path, tmp_path, loss_type, monkeypatch):
    trainer = make_trainer(tool_model_path, tmp_path, loss_type=loss_type)
    inputs = scored_batch(trainer)
    inputs["advantages"] = torch.linspace(-1, 1, inputs["advantages"].numel())
    probe = {}
    forward = GRPOTrainer._get_per_token_logps_and_entropies

    def probed(self, *args, **kwargs):
        logps, entropies, aux = forward(self, *args, **kwargs)
        if torch.is_grad_enabled():
            probe["leaf"] = torch.zeros_like(logps, requires_grad=True)
            logps = logps + probe["leaf"]
        return logps, entropies, aux

    monkeypatch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies", probed)
    trainer._compute_loss(trainer.model, dict(inputs)).backward()
    grad = probe["leaf"].grad
    tools = tool_positions(inputs)
    assert bool(tools.any())
    assert float(grad[tools].abs().max()) == 0.0
    model_tokens = (inputs["completion_mask"] * inputs["tool_mask"]).bool()
    assert float(grad[model_tokens].abs().min()) > 0.0


@pytest.mark.parametrize("share", [True, False])
def test_sampler_logprobs_line_up_with_the_tokens_across_turns(tool_model_path, tmp_path, share, monkeypatch):
    """The sampler's log-prob recorder (bf16 sampler) on multi-turn rows, forced on in fp32 so the numbers compare:
    each model token's recorded log-prob is the trainer's for that token; tool tokens carry 0 and no weight."""
    monkeypatch.setattr(GRPOTrainer, "_keeps_sampler_logprobs", lambda self: True)
    trainer = make_trainer(tool_model_path, tmp_path, share_prompt_prefix=share)
    inputs = scored_batch(trainer)
    sampled = inputs["sampling_per_token_logps"]
    model_tokens = (inputs["completion_mask"] * inputs["tool_mask"]).bool()
    tools = tool_positions(inputs)
    assert bool(tools.any())
    trainer_logps = logps_of(trainer, inputs)
    torch.testing.assert_close(sampled[model_tokens], trainer_logps[model_tokens], atol=1e-4, rtol=0)
    assert float(sampled[tools].abs().max()) == 0.0
    assert float(trainer_logps[model_tokens].min()) < -0.1  # the comparison has something to compare


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo", "dr_grpo"])
def test_loss_equals_trl_on_a_multi_turn_batch(tool_model_path, tmp_path, loss_type):
    ours = make_trainer(tool_model_path, tmp_path, loss_type=loss_type)
    vanilla = make_trainer(tool_model_path, tmp_path, cls=trl.GRPOTrainer, config_cls=trl.GRPOConfig,
                           loss_type=loss_type)  # fmt: skip
    vanilla.model.load_state_dict(ours.model.state_dict())
    inputs = scored_batch(ours)
    assert bool(tool_positions(inputs).any())
    inputs["advantages"] = torch.linspace(-1, 1, inputs["advantages"].numel())
    losses, grads = [], []
    for trainer in (ours, vanilla):
        trainer.model.zero_grad()
        loss = trainer._compute_loss(trainer.model, dict(inputs))
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None})
    torch.testing.assert_close(losses[0], losses[1], atol=1e-6, rtol=1e-5)
    for name, grad in grads[1].items():
        torch.testing.assert_close(grads[0][name], grad, atol=1e-6, rtol=1e-4)


def test_train_steps_with_tools_and_our_features(tool_model_path, tmp_path):
    trainer = make_trainer(tool_model_path, tmp_path, loss_type="ppo", max_steps=2, dynamic_sampling=True,
                           max_generation_batches=2, gradient_accumulation_steps=1)  # fmt: skip
    trainer.train()
    logs = [row for row in trainer.state.log_history if "loss" in row]
    assert len(logs) == 2
    assert all(row["tools/call_frequency"] > 0 for row in logs)


def test_rollout_dispatch_needs_no_precision_config():
    """TRL's rollout dispatch on a bare trainer (plain-namespace args, as TRL's own test builds it): a rollout_func
    missing keys is TRL's ValueError, not an attribute our sampler hooks read."""
    trainer = object.__new__(GRPOTrainer)
    trainer.args = SimpleNamespace()
    trainer.accelerator = SimpleNamespace(device=torch.device("cpu"))
    trainer.model = SimpleNamespace(training=True)
    trainer.use_vllm = False
    trainer.state = SimpleNamespace(global_step=0)
    trainer.rollout_func = lambda prompts, trainer: {"prompt_ids": [[1]], "completion_ids": [[2]]}
    with pytest.raises(ValueError, match=r"rollout_func must return keys \['logprobs'\]"):
        trainer._generate([[{"role": "user", "content": "hi"}]])


def test_rollout_rows_step_out_of_the_sampler_correction(tool_model_path, tmp_path, monkeypatch, caplog):
    """A rollout_func's log-probs are its own sampler's: the bf16 correction steps aside (logged once), the loss is
    TRL's; its env_mask is the tool mask."""
    monkeypatch.setattr(GRPOTrainer, "_keeps_sampler_logprobs", lambda self: True)

    def rollout(prompts, trainer):
        tokenizer = trainer.processing_class
        prompt_ids = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False)
                      for p in prompts]  # fmt: skip
        completion = tokenizer.encode("The answer is 7 and 5", add_special_tokens=False) + [tokenizer.eos_token_id]
        env = [1] * 4 + [0] * (len(completion) - 4)
        return {"prompt_ids": prompt_ids, "completion_ids": [completion] * len(prompts),
                "logprobs": [[-5.0] * len(completion)] * len(prompts), "env_mask": [env] * len(prompts)}  # fmt: skip

    args = GRPOConfig(output_dir=str(tmp_path / "out"), **{**COMMON, "max_tool_calling_iterations": None})
    trainer = GRPOTrainer(tool_model_path, [length_reward], args=args, rollout_func=rollout,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}))  # fmt: skip
    trainer.model.train()
    inputs = trainer._generate_and_score_completions(generation_inputs())
    assert inputs["tool_mask"][0].tolist()[:6] == [1, 1, 1, 1, 0, 0]
    inputs["advantages"] = torch.linspace(-1, 1, inputs["advantages"].numel())
    with caplog.at_level(logging.WARNING, logger="trl_grpo_ext.trl.sampler_precision"):
        corrected = trainer._with_sampler_correction(dict(inputs))
        trainer._with_sampler_correction(dict(inputs))
    assert corrected["advantages"] is inputs["advantages"]  # untouched: no correction weights
    assert sum("rollout_func" in r.getMessage() for r in caplog.records) == 1


def env_trainer(path, tmp_path, factory, rows, **kwargs):
    args = GRPOConfig(output_dir=str(tmp_path / "out"), **{**COMMON, **kwargs})
    trainer = GRPOTrainer(path, [length_reward], args=args, train_dataset=Dataset.from_list(rows),
                          environment_factory=factory)  # fmt: skip
    trainer.model.train()
    return trainer


def test_calculator_environment_through_our_trainer(tool_model_path, tmp_path):
    rows = [{"prompt": p} for p in PROMPTS]
    trainer = env_trainer(tool_model_path, tmp_path, CalculatorEnvironment, rows)
    torch.manual_seed(0)
    inputs = trainer._generate_and_score_completions([rows[i // 4] for i in range(8)])
    texts = [
        trainer.processing_class.decode(ids[tool_positions(inputs)[i]])
        for i, ids in enumerate(inputs["completion_ids"])
    ]
    assert any(TOOL_RESULT in text for text in texts)  # the model's "3 * 4" went to our calculator: "12"
    metrics = {key: values[-1] for key, values in trainer._metrics["train"].items()}
    assert metrics["tools/calls_per_completion"] > 0 and metrics["tools/turns"] > 1
    assert 0 < metrics["tools/token_fraction"] < 1 and metrics["tools/errors"] == 0
    calls = sum(environment.tool_calls for environment in trainer.environments)
    assert calls == metrics["tools/calls_per_completion"] * 8


def test_two_environments_in_one_batch(tool_model_path, tmp_path):
    """A dict factory: each row picks its environment; the retrieval rows have no calculator (the model's call is
    TRL's "not found" error, counted); the retrieval environment's own reward scores only its rows."""
    rows = [{"prompt": PROMPTS[0], "environment": "calculator"}, {"prompt": PROMPTS[1], "environment": "retrieval",
            "fact": "days in a week"}]  # fmt: skip
    trainer = env_trainer(tool_model_path, tmp_path, environment_factory(["calculator", "retrieval"]), rows)
    assert trainer.reward_func_names == ["length_reward", "RetrievalEnvironment"]
    torch.manual_seed(0)
    inputs = trainer._generate_and_score_completions([rows[i // 4] for i in range(8)])
    metrics = {key: values[-1] for key, values in trainer._metrics["train"].items()}
    tool_rows = tool_positions(inputs).any(1).tolist()
    texts = [
        trainer.processing_class.decode(ids[tool_positions(inputs)[i]])
        for i, ids in enumerate(inputs["completion_ids"])
    ]
    assert any(tool_rows[:4]) and any(tool_rows[4:])
    assert all(TOOL_RESULT in text for text, used in zip(texts[:4], tool_rows[:4], strict=True) if used)
    assert all("Tool calculate not found" in text for text, used in zip(texts[4:], tool_rows[4:], strict=True) if used)
    assert metrics["tools/errors"] == sum(text.count("not found") for text in texts) > 0
    assert metrics["rewards/RetrievalEnvironment/mean"] == 0.0  # nothing looked up; the calculator rows: None


def test_bad_tool_definitions_are_one_line_before_the_model_loads(tmp_path):
    def undocumented(x: int) -> int:
        return x

    args = GRPOConfig(output_dir=str(tmp_path / "out"), **COMMON)
    with pytest.raises(ConfigError) as error:  # the model path does not exist: nothing was loaded
        GRPOTrainer(str(tmp_path / "no-model"), [length_reward], args=args, tools=[undocumented, calculate])
    assert str(error.value) == (
        "invalid tools: tool undocumented: no docstring (the model reads the tool's description and its Args: from it)"
    )


def test_hybrid_reward_grades_the_model_turns_of_multi_turn_rows(tool_model_path, tmp_path):
    """The hybrid reward (vetoes, then boxed + format) reads the assistant turns only: a row that called the tool
    and then answered is graded on its answer, never on the tool's output; the truncation veto reads TRL's ids."""
    from trl_grpo_ext.task.rewards import get_reward_funcs

    args = GRPOConfig(output_dir=str(tmp_path / "out"), **COMMON)
    tokenizer_eos = [build_eos(tool_model_path)]
    hybrid = get_reward_funcs(
        ["hybrid"], max_completion_length=args.max_completion_length, eos_token_ids=tokenizer_eos
    )
    rows = [{"prompt": p, "answer": "#### 12"} for p in PROMPTS]
    trainer = GRPOTrainer(tool_model_path, hybrid, args=args, train_dataset=Dataset.from_list(rows), tools=[calculate])
    trainer.model.train()
    torch.manual_seed(0)
    trainer._generate_and_score_completions([rows[i // 4] for i in range(8)])
    completions = trainer._generate([r["prompt"] for r in (rows[i // 4] for i in range(8))])[3]
    scores = hybrid[0](completions, answer=["#### 12"] * 8, completion_ids=[[tokenizer_eos[0]]] * 8)
    for messages, score in zip(completions, scores, strict=True):
        answered = messages[-1].get("content", "").startswith("The answer is")
        assert (score > 0) == answered  # an answer after tool turns counts; a last turn that only calls is no box
    assert any(len(m) > 1 and m[-1]["content"].startswith("The answer") for m in completions)
    assert trainer._metrics["train"]["rewards/hybrid_reward/mean"][-1] > 0


def build_eos(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path).eos_token_id
