"""Data: prompt builder, reasoning-gym problems, GSM8K JSONL loading and malformed-row handling."""

import json
import logging

import pytest

from trl_grpo_ext.task.answers import parse_ground_truth
from trl_grpo_ext.task.data import (
    ARITHMETIC_ONE_SHOT_ANSWER,
    ARITHMETIC_ONE_SHOT_QUESTION,
    ONE_SHOT_ANSWER,
    ONE_SHOT_QUESTION,
    SYSTEM_PROMPT,
    TASKS,
    build_prompt,
    generate_problems,
    load_dataset_split,
    load_problems,
    parse_task_mix,
)
from trl_grpo_ext.task.data.gsm8k import load_gsm8k_rows
from trl_grpo_ext.task.data.prompts import ARITHMETIC_TASKS
from trl_grpo_ext.task.data.synthetic import evaluate_expression, is_eval_question

MIX = "chain_sum_easy:2,chain_sum:2,basic_arithmetic:1,gsm_symbolic:1"


def test_build_prompt_chat_one_shot():
    messages = build_prompt("What is 2 + 3?")
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"] == SYSTEM_PROMPT and "\\boxed{}" in SYSTEM_PROMPT
    assert messages[1]["content"] == ONE_SHOT_QUESTION
    assert messages[2]["content"] == ONE_SHOT_ANSWER and "\\boxed{10}" in ONE_SHOT_ANSWER
    assert messages[-1] == {"role": "user", "content": "What is 2 + 3?"}


def test_build_prompt_zero_shot_and_no_system():
    assert [m["role"] for m in build_prompt("Q?", one_shot=False)] == ["system", "user"]
    assert build_prompt("Q?", one_shot=False, system_prompt=None) == [{"role": "user", "content": "Q?"}]


def test_build_prompt_text_fallback():
    text = build_prompt("  What is 2 + 3?  ", chat=False)
    assert isinstance(text, str)
    assert text.startswith(SYSTEM_PROMPT)
    assert f"Question: {ONE_SHOT_QUESTION}\nAnswer: {ONE_SHOT_ANSWER}" in text
    assert text.endswith("Question: What is 2 + 3?\nAnswer:")
    assert ONE_SHOT_QUESTION not in build_prompt("Q?", one_shot=False, chat=False)


@pytest.mark.parametrize("bad", ["", "   ", None, 3])
def test_build_prompt_rejects_empty_question(bad):
    with pytest.raises(ValueError, match="question"):
        build_prompt(bad)


def test_generated_problems_have_gsm8k_schema_and_parse():
    rows = generate_problems(60, "train", MIX, seed=0)
    assert len(rows) == 60
    assert {r["task"] for r in rows} == {"chain_sum_easy", "chain_sum", "basic_arithmetic", "gsm_symbolic"}
    for row in rows:
        assert row["question"].strip()
        assert row["answer"].startswith("#### ")
        truth = parse_ground_truth(row["answer"])
        assert truth is not None and float(truth) == float(row["answer"][5:])
        assert "Give the result as your final answer" not in row["question"]
    assert len({r["question"] for r in rows}) == 60


def test_generated_problems_are_deterministic_and_seeded():
    assert generate_problems(20, "train", MIX, seed=3) == generate_problems(20, "train", MIX, seed=3)
    assert generate_problems(20, "train", MIX, seed=3) != generate_problems(20, "train", MIX, seed=4)


def test_train_and_eval_splits_are_disjoint_even_for_tiny_problem_spaces():
    # chain_sum_easy has only ~200 distinct problems: seeds alone would collide, the hash split cannot.
    train = generate_problems(150, "train", "chain_sum_easy", seed=0)
    test = generate_problems(15, "test", "chain_sum_easy", seed=0)
    assert not {r["question"] for r in train} & {r["question"] for r in test}
    assert all(is_eval_question(r["question"]) for r in test)
    assert not any(is_eval_question(r["question"]) for r in train)


def test_too_many_problems_from_a_tiny_space_is_a_clear_error():
    with pytest.raises(ValueError, match="distinct"):
        generate_problems(400, "test", "chain_sum_easy", seed=0)


def test_task_mix_parsing():
    assert parse_task_mix("chain_sum:3,gsm_symbolic:1") == {"chain_sum": 0.75, "gsm_symbolic": 0.25}
    assert parse_task_mix(["chain_sum", "chain_sum_easy"]) == {"chain_sum": 0.5, "chain_sum_easy": 0.5}
    with pytest.raises(ValueError, match="unknown synthetic task 'chain_summ'"):
        parse_task_mix("chain_summ")
    with pytest.raises(ValueError, match="> 0"):
        parse_task_mix("chain_sum:0")
    with pytest.raises(ValueError, match="split"):
        generate_problems(3, "dev")


def test_synthetic_dataset_split_has_trl_columns():
    ds = load_dataset_split("synthetic", "train", num_samples=8, tasks="chain_sum")
    assert {"prompt", "answer", "question", "task"} <= set(ds.column_names)
    assert len(ds) == 8
    assert ds[0]["prompt"][-1]["content"] == ds[0]["question"]
    text_ds = load_dataset_split("synthetic", "test", num_samples=4, tasks="chain_sum", chat=False, one_shot=False)
    assert text_ds[0]["prompt"].endswith("Answer:")


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


GOOD = [
    {
        "question": "Natalia sold 48 clips in April and half as many in May. How many in total?",
        "answer": "48/2 = 24\n#### 72",
    },
    {"question": "What is 1,000 + 80?", "answer": "#### 1,080"},
]


def test_jsonl_file_and_folder_sources(tmp_path):
    _write_jsonl(tmp_path / "train.jsonl", GOOD)
    ds = load_dataset_split(str(tmp_path / "train.jsonl"), "train")
    assert ds["answer"] == [r["answer"] for r in GOOD]
    assert ds[0]["prompt"][-1]["content"] == GOOD[0]["question"]
    # A folder holds one file per split, as ../shared/data/gsm8k does.
    assert [r["question"] for r in load_problems(str(tmp_path), "train")] == [r["question"] for r in GOOD]
    with pytest.raises(FileNotFoundError, match="test.jsonl"):
        load_problems(str(tmp_path), "test")
    with pytest.raises(FileNotFoundError, match="not found"):
        load_problems(str(tmp_path / "missing.jsonl"))


@pytest.mark.parametrize(
    "bad_row, message",
    [
        ({"answer": "#### 3"}, "row 1 has no question"),
        ({"question": "Q?"}, "row 1 has no answer"),
        ({"question": "Q?", "answer": "no number here ####"}, "row 1 has an unparseable answer"),
    ],
)
def test_malformed_rows_error_names_the_row(tmp_path, bad_row, message):
    path = _write_jsonl(tmp_path / "d.jsonl", [GOOD[0], bad_row, GOOD[1]])
    with pytest.raises(ValueError, match=message):
        load_problems(str(path))


def test_malformed_rows_can_be_dropped_with_a_count(tmp_path, caplog):
    path = _write_jsonl(tmp_path / "d.jsonl", [GOOD[0], {"question": "Q?"}, {"answer": "#### 1"}, GOOD[1]])
    with caplog.at_level(logging.WARNING):
        rows = load_problems(str(path), on_malformed="drop")
    assert [r["answer"] for r in rows] == [GOOD[0]["answer"], GOOD[1]["answer"]]
    assert "dropped 2 malformed row(s) of 4" in caplog.text
    with pytest.raises(ValueError, match="on_malformed"):
        load_problems(str(path), on_malformed="skip")


def test_bad_json_line_names_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(GOOD[0]) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"d.jsonl:2"):
        load_problems(str(path))


def test_hub_source_offline_gives_actionable_error(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="local JSONL"):
        load_gsm8k_rows("openai/this-dataset-does-not-exist-xyz", "train")


@pytest.mark.parametrize(
    "content, message",
    [
        (b'{"question": "q", "answer": "#### 1"}\n\x89PNG\r\n\x1a\n\x00\x00', r"rows\.jsonl: a binary file"),
        ('{"question": "caf\u00e9", "answer": "#### 1"}\n'.encode("latin-1"), r"rows\.jsonl:1: not UTF-8 text"),
        (b"", r"rows\.jsonl: no rows"),
    ],
)
def test_binary_non_utf8_and_empty_files_name_the_file(tmp_path, content, message):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message):
        load_gsm8k_rows(str(path))


def test_utf8_with_bom_reads(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes('\ufeff{"question": "caf\u00e9?", "answer": "#### 1"}\n'.encode())
    assert load_gsm8k_rows(str(path))[0]["question"] == "caf\u00e9?"


def test_basic_arithmetic_answers_follow_operator_precedence():
    # reasoning-gym folds "3 + 10 * 7" left to right (91); the label must be 73.
    assert evaluate_expression("3 + 10 * 7") == 73
    assert evaluate_expression("4 - 10 + 3") == -3 and evaluate_expression("2 * 3 - 4 * 5") == -14
    for bad in ("__import__('os')", "2 ** 8", "7 / 2", "1 +", ""):
        with pytest.raises(ValueError, match="not an integer"):
            evaluate_expression(bad)
    rows = generate_problems(300, "train", tasks="basic_arithmetic", seed=0)
    mixed = [r for r in rows if "*" in r["question"] and ("+" in r["question"] or " - " in r["question"])]
    assert len(mixed) >= 10
    for row in rows:
        expression = row["question"].removeprefix("Calculate ").removesuffix(".")
        assert parse_ground_truth(row["answer"]) == str(eval(expression))  # noqa: S307 - test oracle


def test_the_one_shot_example_is_of_the_questions_kind():
    arithmetic = build_prompt("Calculate 2 + 5.", task="basic_arithmetic")
    assert arithmetic[1]["content"] == ARITHMETIC_ONE_SHOT_QUESTION
    assert arithmetic[2]["content"] == ARITHMETIC_ONE_SHOT_ANSWER and "\\boxed{-3}" in ARITHMETIC_ONE_SHOT_ANSWER
    for task in (None, "gsm_symbolic", "gsm8k"):
        assert build_prompt("Q?", task=task)[1]["content"] == ONE_SHOT_QUESTION
    assert ARITHMETIC_ONE_SHOT_QUESTION in build_prompt("Calculate 1 - 1.", chat=False, task="chain_sum")
    assert ARITHMETIC_TASKS == set(TASKS) - {"gsm_symbolic"}
    # The example's answer is right, and is never one of the problems.
    assert evaluate_expression(ARITHMETIC_ONE_SHOT_QUESTION.removeprefix("Calculate ").removesuffix(".")) == -3
    ds = load_dataset_split("synthetic", "train", num_samples=40, tasks="chain_sum:1,gsm_symbolic:1", seed=0)
    for row in ds:
        want = ARITHMETIC_ONE_SHOT_QUESTION if row["task"] == "chain_sum" else ONE_SHOT_QUESTION
        assert row["prompt"][1]["content"] == want


def test_a_worked_example_question_is_never_drawn(monkeypatch):
    import trl_grpo_ext.task.data.synthetic as synthetic

    first = generate_problems(5, "train", tasks="chain_sum_easy", seed=0)[0]["question"]
    monkeypatch.setattr(synthetic, "_EXAMPLE_QUESTIONS", frozenset({first}))
    assert first not in {r["question"] for r in generate_problems(50, "train", tasks="chain_sum_easy", seed=0)}
