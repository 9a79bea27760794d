"""The multi-turn driver for other samplers (`environments.rollout`, the PyTRIO path's building block) against
TRL's tool loop through our trainer, on scripted turns: the same completion ids, tool masks, log-probs, messages,
rewards and tool metrics; the PyTRIO datum gives the tool tokens no weight."""

import pytest
import torch
import transformers
from datasets import Dataset
from packaging.version import Version
from tool_model import ANSWER, CALL_CLOSE, CALL_JSON, CALL_OPEN, build_tool_model
from trl.chat_template_utils import parse_response

from trl_grpo_ext.environments import CalculatorEnvironment, tool_metrics
from trl_grpo_ext.environments.rollout import multi_turn_rollouts, tool_suffix_ids
from trl_grpo_ext.pytrio.datums import shifted_sequences
from trl_grpo_ext.trl.config import GRPOConfig
from trl_grpo_ext.trl.trainer import GRPOTrainer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        Version(transformers.__version__) < Version("5.2.0"), reason="TRL 1.16 runs tools on transformers >= 5.2"
    ),
]

PROMPTS = [[{"role": "user", "content": f"What is {i} * 4?"}] for i in range(8)]
CAP, BUDGET = 2, 120


def reward(completions, **kwargs):
    return [float(sum(len(m.get("content") or "") for m in c)) for c in completions]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tool_model(tmp_path_factory.mktemp("tool-model"))


def scripted_sampler(tokenizer):
    """Turns chosen from the sequence so far (the same ids give the same turn on both sides): call the calculator,
    call a tool that does not exist, answer, or ramble past the budget."""
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (CALL_OPEN, CALL_CLOSE, CALL_JSON, ANSWER)}
    eos = tokenizer.eos_token_id
    bad_call = tokenizer.encode('\n{"name": "search", "arguments": {"q": "x"}}\n', add_special_tokens=False)
    turns = [
        [ids[CALL_OPEN], ids[CALL_JSON], ids[CALL_CLOSE], eos],
        [ids[CALL_OPEN], *bad_call, ids[CALL_CLOSE], eos],
        [ids[ANSWER], eos],
        tokenizer.encode("3 " * 40, add_special_tokens=False),
    ]

    def sample(prompts):
        chosen = [turns[(sum(p) * 31 + len(p)) % len(turns)] for p in prompts]
        return [list(t) for t in chosen], [[-0.25 - 0.01 * k for k in range(len(t))] for t in chosen]

    return sample


def test_driver_matches_trls_tool_loop(model_path, tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True, bf16=False,
                      per_device_train_batch_size=8, num_generations=4, max_completion_length=BUDGET,
                      max_tool_calling_iterations=CAP, save_strategy="no", disable_tqdm=True)  # fmt: skip
    trainer = GRPOTrainer(model_path, [reward], args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                          environment_factory=CalculatorEnvironment)  # fmt: skip
    trainer.model.train()
    tokenizer = trainer.processing_class
    sample = scripted_sampler(tokenizer)
    trainer._generate_single_turn = lambda prompt_ids, *a, **k: sample(prompt_ids)
    inputs = [{"prompt": PROMPTS[i]} for i in range(8)]
    trainer._metrics["train"].clear()
    scored = trainer._generate_and_score_completions(inputs)
    trl_out = trainer._generate([x["prompt"] for x in inputs])  # the same batch again, unscored, as lists
    prompt_ids, trl_ids, trl_mask, trl_completions, trl_logprobs = trl_out[:5]

    environments = [CalculatorEnvironment() for _ in inputs]
    tools = [{"calculate": env.calculate} for env in environments]
    calculate_schema = [CalculatorEnvironment.calculate]
    rollouts = multi_turn_rollouts(
        prompt_ids,
        sample(prompt_ids),
        sample,
        lambda ids, prefix, row: parse_response(tokenizer, ids, prefix=prefix, tools=calculate_schema),
        lambda messages: tool_suffix_ids(tokenizer, messages),
        tools,
        CAP,
        BUDGET,
        trainer.model.config.max_position_embeddings,
    )
    assert [r.completion_ids for r in rollouts] == trl_ids
    assert [r.tool_mask for r in rollouts] == trl_mask
    assert [r.logprobs for r in rollouts] == trl_logprobs
    assert [r.messages for r in rollouts] == trl_completions
    # the batch covers what the loop can meet: results, errors, a cap, a length cut, plain answers
    metrics = tool_metrics([r.messages for r in rollouts], [r.tool_mask for r in rollouts], CAP)
    assert metrics["tools/calls_per_completion"] > 0 and metrics["tools/errors"] > 0
    assert metrics["tools/cut_by_cap"] + metrics["tools/cut_by_length"] > 0
    assert any(sum(m) == len(m) for m in trl_mask)
    logged = {key: trainer._metrics["train"][key][0] for key in metrics}
    assert logged == metrics  # the TRL path logged the same tool metrics for the scored batch
    rewards = reward([r.messages for r in rollouts])
    assert trainer._metrics["train"]["rewards/reward/mean"][0] == pytest.approx(sum(rewards) / len(rewards))

    for rollout in rollouts:  # the PyTRIO datum: tool tokens attended (in the input) but with no weight
        seq = shifted_sequences(rollout.prompt_ids, rollout.completion_ids, rollout.logprobs, 1.5, rollout.tool_mask)
        pad = len(rollout.prompt_ids) - 1
        assert seq["input"][pad + 1 :] == rollout.completion_ids[:-1]
        assert seq["mask"][pad:] == [float(m) for m in rollout.tool_mask]
        assert seq["advantages"][pad:] == [1.5 * m for m in rollout.tool_mask]
    assert torch.equal(scored["tool_mask"][:, : len(trl_mask[0])][0], torch.tensor(trl_mask[0]))


def test_datum_tool_mask_is_checked():
    with pytest.raises(ValueError, match="tool_mask must be 0/1, one per completion token"):
        shifted_sequences([1, 2], [3, 4], [-0.1, -0.1], 1.0, [1])
    plain = shifted_sequences([1, 2], [3, 4], [-0.1, -0.1], -2.0)
    assert shifted_sequences([1, 2], [3, 4], [-0.1, -0.1], -2.0, [1, 1]) == plain
