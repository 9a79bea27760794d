"""`recipes/gsm8k/tools.yaml` through `recipes/gsm8k_grpo.py`: two offline steps with real tool calls on the tiny
scripted tool model, the `environments` key and its checks, the tool chat template for a ChatML model."""

import importlib.util
import json
from pathlib import Path

import pytest
from tool_model import build_tool_model

from trl_grpo_ext.environments.data import TOOL_HINT, with_environments
from trl_grpo_ext.environments.metrics import TOOL_METRIC_KEYS

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "recipes" / "gsm8k" / "tools.yaml"


def _recipe_main():
    spec = importlib.util.spec_from_file_location("gsm8k_grpo", ROOT / "recipes" / "gsm8k_grpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def _parse(argv):
    from trl_grpo_ext.trl.script_args import parse_recipe_args

    return parse_recipe_args(argv, default_config=TOOLS)


def test_environments_key_is_checked_in_one_line(capsys):
    script_args, training_args, _ = _parse(["--config", str(TOOLS), "--use_cpu", "true", "--bf16", "false"])
    assert script_args.environments == ["calculator", "retrieval"] and training_args.max_tool_calling_iterations == 2
    assert _parse(["--config", str(TOOLS), "--environments", "calculator"])[0].environments == ["calculator"]
    with pytest.raises(ValueError, match=r"environments: unknown \['search'\]; choose from \['calculator'"):
        _parse(["--config", str(TOOLS), "--environments", "calculator,search"])
    assert _recipe_main()(["--config", str(TOOLS), "--environments", "search"]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0


def test_mixed_rows_name_their_environment():
    from datasets import Dataset

    from trl_grpo_ext.task.data.prompts import build_prompt

    rows = [{"prompt": build_prompt(f"What is {i} + 1?"), "question": f"What is {i} + 1?", "answer": f"#### {i + 1}"}
            for i in range(6)]  # fmt: skip
    mixed = with_environments(Dataset.from_list(rows), ["calculator", "retrieval"], seed=1).to_list()
    assert [r["environment"] for r in mixed] == ["calculator", "retrieval"] * 3
    assert [r["fact"] is None for r in mixed] == [True, False] * 3
    assert mixed[0]["answer"] == "#### 1" and "Look up" in mixed[1]["question"]
    assert all(r["prompt"][0]["content"].endswith(TOOL_HINT) for r in mixed)
    # the one-shot example shows the row's tool called, and ends there (the model copies the last turn it saw)
    calculator_example = [(m["role"], m["content"]) for m in mixed[0]["prompt"][1:]]
    assert calculator_example[1:] == [
        ("assistant", '<tool_call>\n{"name": "calculate", "arguments": {"expression": "3 * 4 - 2"}}\n</tool_call>'),
        ("user", rows[0]["question"]),
    ]
    retrieval_example = [(m["role"], m["content"]) for m in mixed[1]["prompt"][1:]]
    assert [role for role, _ in retrieval_example] == ["user", "assistant", "user"]
    assert retrieval_example[0][1].startswith("There are 2 weeks") and retrieval_example[1][1] == (
        '<tool_call>\n{"name": "lookup", "arguments": {"topic": "days in a week"}}\n</tool_call>'
    )
    assert mixed[0]["prompt"][-1]["content"] == rows[0]["question"]
    alone = with_environments(Dataset.from_list(rows), ["calculator"]).to_list()
    assert "environment" not in alone[0] and alone[3]["answer"] == "#### 4"
    with pytest.raises(ValueError, match="environments need chat prompts"):
        with_environments(Dataset.from_list([{**rows[0], "prompt": "text"}]), ["calculator"])


def test_a_chatml_model_gets_the_tool_template(tiny_model_path, capsys):
    from transformers import AutoTokenizer
    from trl.chat_template_utils import supports_tool_calling

    from trl_grpo_ext.environments.chat import use_tool_chat_template

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    assert not supports_tool_calling(tokenizer)
    use_tool_chat_template(tokenizer)
    assert supports_tool_calling(tokenizer)
    assert "using TRL's ChatML tool template (qwen2_5)" in capsys.readouterr().out


@pytest.mark.slow
def test_tools_recipe_runs_two_steps_with_tool_calls(tmp_path):
    model = build_tool_model(tmp_path / "tool-model")
    out = tmp_path / "run"
    code = _recipe_main()(["--config", str(TOOLS), "--model_name_or_path", model, "--output_dir", str(out),
                           "--max_steps", "2", "--bf16", "false", "--max_completion_length", "96"])  # fmt: skip
    assert code == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert set(TOOL_METRIC_KEYS) <= set(row)
        assert row["tools/calls_per_completion"] > 0 and row["tools/token_fraction"] > 0
        assert "rewards/RetrievalEnvironment/mean" in row
    # the scripted model calls `calculate` in every row: the retrieval rows have no such tool (an error, counted)
    assert sum(r["tools/errors"] for r in rows) > 0
