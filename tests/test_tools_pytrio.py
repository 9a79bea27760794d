"""The PyTRIO loop with tools on the local server and the tiny scripted tool model: first turns continued through
their tool calls (`environments.rollout`), the calculator environment's results in the completions, the datums
with zero weight on tool tokens, the `tools/*` metrics."""

import json

import pytest
import transformers
from packaging.version import Version
from tool_model import build_tool_model

from trl_grpo_ext.environments.metrics import TOOL_METRIC_KEYS
from trl_grpo_ext.pytrio.config import PyTrioGRPOConfig

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(Version(transformers.__version__) < Version("5.2.0"), reason="tool parsing: transformers 5.2"),
]

ROWS = [
    {"prompt": [{"role": "user", "content": f"What is {a} * {b}?"}], "answer": f"#### {a * b}"}
    for a, b in [(3, 4), (6, 2), (2, 6), (4, 3)]
]


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    from trl_grpo_ext.pytrio_server import LocalPyTrioServer, ServerConfig

    model = build_tool_model(tmp_path_factory.mktemp("tool-model"))
    server = LocalPyTrioServer(ServerConfig(model=model, ephemeral_storage=True))
    with server:
        server.configure_client(home=str(tmp_path_factory.mktemp("pytrio-home")))
        server.model_path = model
        yield server


def test_config_checks_the_tool_keys(tmp_path):
    base = dict(base_model="tiny", output_dir=str(tmp_path / "run"))
    assert PyTrioGRPOConfig(**base, environments="calculator,retrieval").environments == ["calculator", "retrieval"]
    with pytest.raises(ValueError, match=r"environments: unknown \['search'\].*max_tool_calling_iterations must"):
        PyTrioGRPOConfig(**base, environments=["search"], max_tool_calling_iterations=0)


def test_loop_runs_tools_and_masks_their_tokens(tool_server, tmp_path, monkeypatch):
    from trl_grpo_ext.pytrio import loop as loop_module
    from trl_grpo_ext.pytrio.loop import GRPOLoop

    batches = []
    build = loop_module.build_train_batch

    def recorded(config, scored, step):
        batch = build(config, scored, step)
        batches.append((scored, batch))
        return batch

    monkeypatch.setattr(loop_module, "build_train_batch", recorded)
    config = PyTrioGRPOConfig(base_model=tool_server.model_path, lora_r=4, num_generations=4,
                              per_device_train_batch_size=8, max_completion_length=96, max_steps=2, save_every=1,
                              reward_funcs=["boxed"], environments=["calculator"], max_tool_calling_iterations=2,
                              learning_rate=1e-3, output_dir=str(tmp_path / "run"), seed=7)  # fmt: skip
    summary = GRPOLoop(config, rows=ROWS).run()
    assert summary["steps"] == 2
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert set(TOOL_METRIC_KEYS) <= set(row)
    assert sum(r["tools/calls_per_completion"] for r in rows) > 0
    scored, batch = batches[0]
    multi = [r for r in scored.rollouts if r.tool_mask is not None and 0 in r.tool_mask]
    assert multi, "the scripted model called the calculator"
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tool_server.model_path)
    stops = {tokenizer.eos_token_id, tokenizer.pad_token_id}
    for rollout in multi:
        assert any(m["role"] == "tool" and m["content"] == "12" for m in rollout.messages)  # our calculator ran
        # how the last turn ended, by TRL's rule (what completions/clipped_ratio counts), not the first turn's
        assert rollout.stop_reason == ("length" if rollout.completion_tokens[-1] not in stops else "stop")
        zero = [i for i, m in enumerate(rollout.tool_mask) if m == 0]
        assert all(rollout.completion_logprobs[i] == 0.0 for i in zero)
    trained = [r for r, a in zip(scored.rollouts, scored.advantages, strict=True) if r.completion_tokens]
    for rollout, mask in zip(trained, batch.token_rows.masks, strict=True):
        pad = len(rollout.prompt_tokens) - 1
        assert mask[pad:] == [float(m) for m in (rollout.tool_mask or [1] * len(rollout.completion_tokens))]
    assert batch.token_rows.completion_tokens == sum(sum(m) for m in batch.token_rows.masks)


def test_pytrio_tools_recipe_runs_two_steps_with_tool_calls(tool_server, tmp_path, capfd):
    """recipes/pytrio/tools.yaml through recipes/gsm8k_pytrio.py (its own local server), on the tool model: the
    mixed rows, real tool calls executed, the retrieval rows' call of a tool they lack counted as an error."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("gsm8k_pytrio", root / "recipes" / "gsm8k_pytrio.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    out = tmp_path / "run"
    args = ["--config", str(root / "recipes" / "pytrio" / "tools.yaml"), "--base_model", tool_server.model_path,
            "--lora_r", "4", "--max_steps", "2", "--max_completion_length", "96", "--num_train_samples", "16",
            "--output_dir", str(out)]  # fmt: skip
    assert recipe.main(args) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(set(TOOL_METRIC_KEYS) <= set(r) for r in rows)
    assert sum(r["tools/calls_per_completion"] for r in rows) > 0 and sum(r["tools/errors"] for r in rows) > 0
