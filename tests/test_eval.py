"""`trl-grpo-ext eval`: scoring with a fake generator (exact numbers), and one real tiny-model generation."""

import json

import pytest

from trl_grpo_ext.evaluation import (
    EvalRun,
    HFGenerator,
    Problem,
    evaluate,
    format_summary,
    majority_vote,
    problems_from_rows,
    run_eval,
    summary_path_for,
)

ROWS = [
    {"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"},
    {"question": "What is 10 * 10?", "answer": "#### 100"},
    {"question": "Natalia sold 48 clips and then half as many. How many in total?", "answer": "48 + 24 = 72 #### 72"},
    {"question": "What is 1,000 + 80?", "answer": "#### 1,080"},
]

# question -> (greedy completion, k=4 sampled completions)
SCRIPT = {
    "What is 2 + 3?": ("So \\boxed{5}", ["\\boxed{5}", "\\boxed{5.0}", "\\boxed{6}", "no box 5"]),
    "What is 10 * 10?": ("It is 100", ["\\boxed{10}", "\\boxed{10}", "\\boxed{100}", "\\boxed{1000}"]),
    ROWS[2]["question"]: ("\\boxed{24} wait \\boxed{72}", ["\\boxed{70}", "\\boxed{71}", "\\boxed{73}", "\\boxed{74}"]),
    "What is 1,000 + 80?": ("\\boxed{1080}", ["\\boxed{1,080}", "\\boxed{8}", "\\boxed{1080}", "\\boxed{9}"]),
}


class FakeGenerator:
    """Returns scripted completions for each prompt's last user message; records calls."""

    def __init__(self, script=SCRIPT):
        self.script = script
        self.calls = []

    def generate(self, prompts, num_samples, greedy):
        self.calls.append((len(prompts), num_samples, greedy))
        out = []
        for prompt in prompts:
            question = prompt[-1]["content"] if isinstance(prompt, list) else prompt
            greedy_text, samples = self.script[question]
            out.append([greedy_text] if greedy else list(samples[:num_samples]))
        return out


def test_problems_use_training_prompt_and_parsed_truth():
    problems = problems_from_rows(ROWS)
    assert [p.answer for p in problems] == ["5", "100", "72", "1080"]
    assert problems[0].prompt[-1] == {"role": "user", "content": "What is 2 + 3?"}
    assert any("boxed" in m["content"] for m in problems[0].prompt[:-1])  # system / one-shot example
    with pytest.raises(ValueError, match="answer"):
        problems_from_rows([{"question": "q?"}])


def test_majority_vote_groups_equivalent_answers_and_breaks_ties_by_first_seen():
    assert majority_vote(["5", "5.0", "6", None]) == ("5", 2)
    assert majority_vote(["10", "100", "100", "10"]) == ("10", 2)
    assert majority_vote([None, None]) == (None, 0)
    assert majority_vote(["1,080", "1080", "9"]) == ("1,080", 2)


def test_pass1_majk_passk_exact_numbers():
    gen = FakeGenerator()
    results, summary = evaluate(problems_from_rows(ROWS), gen, k=4, batch_size=3, progress=False)
    # greedy: 5 right, "It is 100" has no box (wrong), last box 72 right, 1080 right -> 3/4
    assert [r.greedy_correct for r in results] == [True, False, True, True]
    assert results[2].greedy_pred == "72"
    # maj@4: {5,5.0} wins -> right; 10 wins the 10/100 tie? no: 10 has 2 votes -> wrong; all different,
    # first (70) wins -> wrong; {1,080, 1080} wins -> right
    assert [r.maj_pred for r in results] == ["5", "10", "70", "1,080"]
    assert [r.maj_correct for r in results] == [True, False, False, True]
    assert [r.pass_at_k for r in results] == [True, True, False, True]
    assert summary["pass@1"] == 0.75
    assert summary["maj@k"] == 0.5
    assert summary["pass@k"] == 0.75
    assert summary["mean@k"] == pytest.approx((2 / 4 + 1 / 4 + 0 + 2 / 4) / 4)
    assert summary["boxed_rate"] == 0.75
    assert summary["n"] == 4 and summary["k"] == 4
    # batches of 3 then 1, each with one greedy and one sampled call
    assert gen.calls == [(3, 1, True), (3, 4, False), (1, 1, True), (1, 4, False)]


def test_k1_is_greedy_only():
    gen = FakeGenerator()
    _, summary = evaluate(problems_from_rows(ROWS), gen, k=1, batch_size=8, progress=False)
    assert summary["pass@1"] == 0.75 and "maj@k" not in summary
    assert gen.calls == [(4, 1, True)]


def test_generator_returning_wrong_shape_is_an_error():
    class Short:
        def generate(self, prompts, num_samples, greedy):
            return [["\\boxed{1}"]]

    with pytest.raises(RuntimeError, match="completions"):
        evaluate([Problem("q", "1", "q"), Problem("r", "2", "r")], Short(), progress=False)


def test_run_eval_writes_results_and_before_after_comparison(tmp_path):
    data = tmp_path / "set.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    worse = {q: ("\\boxed{0}", ["\\boxed{0}"] * 4) for q in SCRIPT}
    worse["What is 10 * 10?"] = ("\\boxed{100}", ["\\boxed{100}"] * 4)  # the "before" model gets this one only

    def make(model, adapter):
        return FakeGenerator(SCRIPT if model == "after" else worse)

    out = tmp_path / "eval.jsonl"
    cfg = EvalRun(model="after", compare_model="before", data=str(data), k=4, out=str(out), progress=False)
    payload = run_eval(cfg, make_generator=make)
    assert summary_path_for(out) == tmp_path / "eval_summary.json"
    saved = json.loads((tmp_path / "eval_summary.json").read_text())
    assert saved["summary"]["pass@1"] == 0.75
    assert saved["compare_summary"]["pass@1"] == 0.25
    assert saved["delta"]["pass@1"] == pytest.approx(0.5)
    assert saved["flips"] == {"fixed": 3, "broken": 1, "net": 2}
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4 and rows[0]["greedy_pred"] == "5" and rows[0]["samples"][1] == "\\boxed{5.0}"
    assert len((tmp_path / "eval_compare.jsonl").read_text().splitlines()) == 4
    text = format_summary(payload)
    assert "pass@1" in text and "maj@4" in text and "+0.500" in text and "fixed: 3" in text


def test_limit_and_bad_data(tmp_path):
    data = tmp_path / "set.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    payload = run_eval(EvalRun(model="m", data=str(data), limit=2, out=str(tmp_path / "e.jsonl"), progress=False),
                       make_generator=lambda m, a: FakeGenerator())
    assert payload["summary"]["n"] == 2 and payload["summary"]["pass@1"] == 0.5
    with pytest.raises(FileNotFoundError, match="neither"):
        run_eval(EvalRun(model="m", data=str(tmp_path / "missing.jsonl")), make_generator=lambda m, a: FakeGenerator())


@pytest.mark.slow
def test_real_tiny_model_generation(tiny_model_path, tmp_path):
    gen = HFGenerator(tiny_model_path, max_new_tokens=6, temperature=1.0, seed=0)
    problems = problems_from_rows(ROWS[:3])
    results, summary = evaluate(problems, gen, k=2, batch_size=2, progress=False)
    assert len(results) == 3 and all(len(r.samples) == 2 for r in results)
    assert all(isinstance(r.greedy_completion, str) for r in results)
    # left padding: the same prompt alone and in a padded batch decodes to the same greedy text
    alone = gen.generate([problems[2].prompt], 1, True)[0][0]
    assert alone == results[2].greedy_completion
    assert 0.0 <= summary["pass@1"] <= 1.0


@pytest.mark.slow
def test_eval_cli_on_tiny_model(tiny_model_path, tmp_path, capsys):
    from trl_grpo_ext.cli import main

    data = tmp_path / "set.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:2]))
    out = tmp_path / "res.jsonl"
    rc = main(["eval", "--model", tiny_model_path, "--data", str(data), "--max_new_tokens", "4", "--k", "2",
               "--out", str(out), "--no-progress"])
    assert rc == 0
    assert "pass@1" in capsys.readouterr().out
    assert json.loads((tmp_path / "res_summary.json").read_text())["summary"]["n"] == 2
    assert main(["eval", "--model", str(tmp_path / "nope"), "--data", str(data), "--out", str(out)]) == 2


def test_scoring_agrees_with_boxed_reward():
    from trl_grpo_ext.rewards import boxed_reward

    results, _ = evaluate(problems_from_rows(ROWS), FakeGenerator(), k=4, progress=False)
    for row, r in zip(ROWS, results, strict=True):
        completions = [r.greedy_completion, *r.samples]
        rewards = boxed_reward(completions, answer=[row["answer"]] * len(completions))
        assert rewards == [float(c) for c in [r.greedy_correct, *r.sample_correct]]


def test_models_without_chat_template_get_text_prompts(tmp_path):
    seen = []

    class TextOnly:
        chat = False

        def generate(self, prompts, num_samples, greedy):
            seen.extend(prompts)
            return [["\\boxed{5}"] * num_samples for _ in prompts]

    data = tmp_path / "set.jsonl"
    data.write_text(json.dumps(ROWS[0]) + "\n")
    payload = run_eval(EvalRun(model="m", data=str(data), out=str(tmp_path / "e.jsonl"), progress=False),
                       make_generator=lambda m, a: TextOnly())
    assert payload["summary"]["pass@1"] == 1.0
    assert isinstance(seen[0], str) and seen[0].rstrip().endswith("Question: What is 2 + 3?\nAnswer:")


@pytest.mark.slow
def test_lora_adapter_is_applied(tiny_model_path, tmp_path):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    lora = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    lora.save_pretrained(tmp_path / "adapter")
    plain = HFGenerator(tiny_model_path, max_new_tokens=4)
    adapted = HFGenerator(tiny_model_path, adapter=str(tmp_path / "adapter"), max_new_tokens=4)
    assert not hasattr(adapted.model, "peft_config")  # merged into the weights
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(plain.model.state_dict()[name], adapted.model.state_dict()[name])
    prompts = problems_from_rows(ROWS[:2])
    assert len(adapted.generate([p.prompt for p in prompts], 2, False)) == 2
