"""bench/trl_conformance: the comparison of the two JUnit reports, the offline stand-ins, the testing_utils stand-in.

The whole run (TRL's test file against both variants) takes minutes and needs TRL's file: `bench/trl_conformance.sh`.
"""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "bench" / "trl_conformance"


def load(name):
    spec = importlib.util.spec_from_file_location(f"trl_conformance_{name}", HARNESS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def junit(path, cases):
    """A pytest-style JUnit report: {name: outcome}, outcome one of passed, failed, error, skipped, xfailed."""
    children = {
        "passed": "",
        "failed": '<failure message="AssertionError: boom">trace</failure>',
        "error": '<error message="RuntimeError: setup">trace</error>',
        "skipped": '<skipped type="pytest.skip" message="no vllm"/>',
        "xfailed": '<skipped type="pytest.xfail" message="known"/>',
    }
    body = "".join(
        f'<testcase classname="tests.test_grpo_trainer.TestGRPOTrainer" name="{name}">{children[outcome]}</testcase>'
        for name, outcome in cases.items()
    )
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{body}</testsuite></testsuites>')
    return str(path)


def test_compare_lists_what_passes_with_trl_only_and_exits_1(tmp_path, capsys):
    compare = load("compare")
    theirs = {"test_a": "passed", "test_b": "passed", "test_c": "failed", "test_d": "skipped", "test_e": "xfailed"}
    ours = {"test_a": "passed", "test_b": "failed", "test_c": "failed", "test_d": "skipped", "test_e": "xfailed"}
    code = compare.main(junit(tmp_path / "trl.xml", theirs), junit(tmp_path / "ours.xml", ours))
    out = capsys.readouterr().out
    assert code == 1
    assert "TRL (trl.GRPOTrainer, trl.GRPOConfig): 2 passed, 1 failed, 0 error, 1 skipped, 1 xfailed (5 tests)" in out
    assert "pass with TRL, not with ours (1):\n  tests.test_grpo_trainer.TestGRPOTrainer::test_b: failed" in out
    assert "fail with both (1):\n  tests.test_grpo_trainer.TestGRPOTrainer::test_c: AssertionError: boom" in out


def test_compare_passes_on_the_same_set_and_refuses_a_missing_report(tmp_path, capsys):
    compare = load("compare")
    same = {"test_a": "passed", "test_b": "error"}
    assert compare.main(junit(tmp_path / "trl.xml", same), junit(tmp_path / "ours.xml", same)) == 0
    assert "pass with TRL, not with ours (0)" in capsys.readouterr().out
    # a test missing from our report (collection failed there) counts as not passing
    assert compare.main(str(tmp_path / "trl.xml"), junit(tmp_path / "short.xml", {"test_b": "error"})) == 1
    assert compare.main(str(tmp_path / "trl.xml"), str(tmp_path / "absent.xml")) == 2


def test_stand_ins_load_offline_from_the_hub_cache(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    monkeypatch.syspath_prepend(str(HARNESS))
    fixtures = load("fixtures")
    test_file = tmp_path / "test_x.py"
    test_file.write_text(
        'load_dataset("trl-internal-testing/zen")\nm = "trl-internal-testing/tiny-Qwen3ForCausalLM"\n'
        "r = 'trl-internal-testing/tiny-Qwen2ForSequenceClassification-2.5'\nv = \"org/tiny-FooForConditionalGeneration\"\n"
    )
    ids = fixtures.hub_ids(test_file)
    assert ids[0] == "trl-internal-testing/zen" and len(ids) == 4
    cache = tmp_path / "hub"
    assert [fixtures.build_model(i, cache) for i in ids[1:]] == [True, True, False]
    model = AutoModelForCausalLM.from_pretrained(ids[1], cache_dir=cache, local_files_only=True)
    reward = AutoModelForSequenceClassification.from_pretrained(ids[2], cache_dir=cache, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(ids[1], cache_dir=cache, local_files_only=True)
    assert type(model).__name__ == "Qwen3ForCausalLM" and reward.config.num_labels == 1
    assert model.config.vocab_size == len(tokenizer) and "<tool_call>" in tokenizer.get_vocab()
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Flat is"}], tokenize=False)
    assert "<|im_start|>user\nFlat is<|im_end|>" in text


def test_zen_stand_in_has_the_prompts_trl_tests_expect():
    zen = load("fixtures").zen_dataset
    standard, conversational = zen("standard_prompt_only"), zen("conversational_prompt_only")
    assert (len(standard["train"]), len(standard["test"])) == (17, 2)
    assert standard["train"]["prompt"][:3] == ["Beautiful is better than", "Explicit is", "Simple is better"]
    assert conversational["train"][11]["prompt"] == [{"role": "user", "content": "In the face of ambiguity, refuse"}]
    with pytest.raises(ValueError, match="no offline stand-in for the 'standard_preference'"):
        zen("standard_preference")


def test_testing_utils_stand_in_skips_what_is_missing():
    utils = load("testing_utils")
    assert utils.require_peft.args == (False,)  # peft is a dependency
    assert utils.require_vllm.args == (importlib.util.find_spec("vllm") is None,)
    assert utils.require_torch_accelerator.kwargs["reason"].endswith("no CUDA device")
    assert utils.require_something_new.name == "skip"  # no rule: skipped for both variants
    with pytest.raises(AttributeError, match="no 'TrlHelper'"):
        utils.TrlHelper  # noqa: B018
