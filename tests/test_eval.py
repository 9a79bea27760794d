"""`trl-grpo-ext eval`: scoring with a fake generator (exact numbers), and one real tiny-model generation."""

import dataclasses
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
    summarize,
)
from trl_grpo_ext.runs import eval_summary_path as summary_path_for

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
    ROWS[2]["question"]: (
        "\\boxed{24} wait \\boxed{72}",
        ["\\boxed{70}", "\\boxed{71}", "\\boxed{73}", "\\boxed{74}"],
    ),
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
    payload = run_eval(
        EvalRun(model="m", data=str(data), limit=2, out=str(tmp_path / "e.jsonl"), progress=False),
        make_generator=lambda m, a: FakeGenerator(),
    )
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
    rc = main(
        [
            "eval",
            "--model",
            tiny_model_path,
            "--data",
            str(data),
            "--max_new_tokens",
            "4",
            "--k",
            "2",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0
    assert "pass@1" in capsys.readouterr().out
    assert json.loads((tmp_path / "res_summary.json").read_text())["summary"]["n"] == 2
    assert main(["eval", "--model", str(tmp_path / "nope"), "--data", str(data), "--out", str(out)]) == 2


def test_scoring_agrees_with_boxed_reward():
    from trl_grpo_ext.task.rewards import boxed_reward

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
    payload = run_eval(
        EvalRun(model="m", data=str(data), out=str(tmp_path / "e.jsonl"), progress=False),
        make_generator=lambda m, a: TextOnly(),
    )
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


# ---------------------------------------------------------------------- format-independent scoring


def test_format_independent_prediction_and_per_task_summary():
    from trl_grpo_ext.evaluation import extract_any_prediction, score_problem

    assert extract_any_prediction("so 3 + 4 = 7, then \\boxed{8} and 9") == "8"  # the box wins
    assert extract_any_prediction("so 3 + 4 = 7.") == "7"  # no box: the last number
    assert extract_any_prediction("no number") is None
    problems = [Problem("q1", "7", "q1", task="easy"), Problem("q2", "5", "q2", task="hard")]
    r = score_problem(0, problems[0], "3 + 4 = 7", [])
    assert (r.greedy_pred, r.greedy_correct, r.greedy_boxed, r.greedy_any_pred, r.greedy_any_correct) == (
        None,
        False,
        False,
        "7",
        True,
    )
    results = [r, score_problem(1, problems[1], "\\boxed{5}", [])]
    summary = summarize(results, 1)
    assert summary["pass@1"] == summary["accuracy"] == 0.5
    assert summary["accuracy_any_format"] == 1.0 and summary["boxed_rate"] == 0.5
    assert summary["per_task"]["easy"] == {"n": 1, "accuracy_any_format": 1.0, "accuracy": 0.0, "boxed_rate": 0.0}


def test_paired_gain_math():
    from trl_grpo_ext.evaluation import paired_gain

    g = paired_gain([1, 0, 0, 1, 0], [1, 1, 1, 0, 0])
    assert (g["before"], g["after"], g["fixed"], g["broken"]) == (0.4, 0.6, 2, 1)
    assert g["gain"] == pytest.approx(0.2)
    assert g["mcnemar_p"] == pytest.approx(1.0)  # 2 vs 1 discordant pairs: no evidence
    assert g["ci_low"] < 0 < g["ci_high"]
    big = paired_gain([0] * 100 + [1] * 20, [1] * 40 + [0] * 60 + [1] * 20)
    assert big["gain"] == pytest.approx(40 / 120) and big["ci_low"] > 0.2 and big["mcnemar_p"] < 1e-10


def test_paired_comparison_per_task_and_summary_line():
    from trl_grpo_ext.evaluation import format_gain, paired_comparison, score_problem

    problems = [Problem(f"q{i}", "1", f"q{i}", task="a" if i < 6 else "b") for i in range(10)]
    before = [score_problem(i, p, "1" if i < 2 else "0", []) for i, p in enumerate(problems)]
    after = [score_problem(i, p, "\\boxed{1}" if i < 8 else "0", []) for i, p in enumerate(problems)]
    paired = paired_comparison(before, after)
    m = paired["metrics"]
    assert (m["accuracy_any_format"]["before"], m["accuracy_any_format"]["after"]) == (0.2, 0.8)
    assert (m["accuracy"]["before"], m["accuracy"]["after"], m["boxed_rate"]["after"]) == (0.0, 0.8, 0.8)
    assert paired["per_task"]["a"]["n"] == 6 and paired["per_task"]["b"]["metrics"]["accuracy"]["after"] == 0.5
    line = format_gain("format-independent accuracy", m["accuracy_any_format"])
    assert line.startswith("format-independent accuracy 0.200 -> 0.800, paired gain +0.600 [+")
    assert line.endswith(f"(n=10, McNemar p={format_p_for(6, 0)})")
    with pytest.raises(ValueError, match="differ"):
        paired_comparison(before, after[::-1])


def format_p_for(fixed, broken):
    from trl_grpo_ext.report.stats import mcnemar_exact
    from trl_grpo_ext.report.text import format_p

    return format_p(mcnemar_exact(fixed, broken))


# ------------------------------------------------------------------------------- cached "before"


def _fake_model_folder(path, weights=b"w" * 10):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text('{"model_type": "llama"}')
    (path / "model.safetensors").write_bytes(weights)
    (path / "tokenizer_config.json").write_text(
        '{"chat_template": "{{ messages }}"}'
    )  # chat prompts, as FakeGenerator reads
    return path


def test_before_eval_cache_reused_and_invalidated(tmp_path, monkeypatch):
    from trl_grpo_ext.evaluation import cached_greedy_eval, model_identity

    monkeypatch.setenv("TRL_GRPO_EXT_CACHE", str(tmp_path / "cache"))
    folder = _fake_model_folder(tmp_path / "model")
    problems = problems_from_rows(ROWS)
    built = []

    def make():
        built.append(1)
        return FakeGenerator()

    settings = {"max_new_tokens": 8}
    first, info = cached_greedy_eval(problems, make, model_identity(str(folder)), settings, 2, progress=False)
    assert not info["cached"] and len(built) == 1 and [r.greedy_correct for r in first] == [True, False, True, True]
    again, info = cached_greedy_eval(problems, make, model_identity(str(folder)), settings, 2, progress=False)
    assert info["cached"] and len(built) == 1  # the generator was not even built
    assert [r.greedy_completion for r in again] == [r.greedy_completion for r in first]
    # verdicts are graded again from the cached completions: a change of the grading rules applies to them
    from trl_grpo_ext.evaluation import scoring

    monkeypatch.setattr(scoring, "is_correct", lambda pred, truth: False)
    regraded, info = cached_greedy_eval(problems, make, model_identity(str(folder)), settings, 2, progress=False)
    assert info["cached"] and len(built) == 1 and [r.greedy_correct for r in regraded] == [False] * 4
    monkeypatch.undo()
    monkeypatch.setenv("TRL_GRPO_EXT_CACHE", str(tmp_path / "cache"))
    # the eval set changes (one problem less, or another prompt): evaluated again
    cached_greedy_eval(problems[:3], make, model_identity(str(folder)), settings, 2, progress=False)
    assert len(built) == 2
    cached_greedy_eval(
        problems_from_rows(ROWS, one_shot=False), make, model_identity(str(folder)), settings, 2, progress=False
    )
    assert len(built) == 3
    # the generation settings change
    cached_greedy_eval(problems, make, model_identity(str(folder)), {"max_new_tokens": 9}, 2, progress=False)
    assert len(built) == 4
    # the model changes: new weights, or an edited config
    (folder / "model.safetensors").write_bytes(b"w" * 11)
    _, info = cached_greedy_eval(problems, make, model_identity(str(folder)), settings, 2, progress=False)
    assert not info["cached"] and len(built) == 5
    (folder / "config.json").write_text('{"model_type": "llama", "x": 1}')
    cached_greedy_eval(problems, make, model_identity(str(folder)), settings, 2, progress=False)
    assert len(built) == 6
    # unknown model identity, or caching off: always generated
    cached_greedy_eval(problems, make, None, settings, 2, progress=False)
    cached_greedy_eval(problems, make, model_identity(str(folder)), settings, 2, progress=False, use_cache=False)
    assert len(built) == 8
    assert model_identity("nobody/never-downloaded-model") is None  # a hub id not in the local cache


def test_cli_eval_caches_greedy_before_model(tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_GRPO_EXT_CACHE", str(tmp_path / "cache"))
    before_dir, after_dir = _fake_model_folder(tmp_path / "before"), _fake_model_folder(tmp_path / "after", b"x")
    data = tmp_path / "set.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    worse = {q: ("\\boxed{0}", []) for q in SCRIPT}
    built = []

    def make(model, adapter):
        built.append(model)
        return FakeGenerator(SCRIPT if model == str(after_dir) else worse)

    from trl_grpo_ext.evaluation import model_identity

    cfg = EvalRun(
        model=str(after_dir),
        compare_model=str(before_dir),
        data=str(data),
        out=str(tmp_path / "e.jsonl"),
        progress=False,
    )
    payload = run_eval(cfg, make_generator=make, identify=model_identity)
    assert built == [str(after_dir), str(before_dir)] and payload["compare_summary"]["cached"] is False
    paired = payload["paired"]["metrics"]["accuracy"]
    assert (paired["before"], paired["after"], paired["fixed"]) == (0.0, 0.75, 3)
    assert "paired gain +0.750" in format_summary(payload)
    payload = run_eval(cfg, make_generator=make, identify=model_identity)
    assert len(built) == 2 and payload["compare_summary"]["cached"] and payload["summary"]["cached"]
    # another decode engine is another key (a near tie can go the other way): generated, then cached in turn
    other = dataclasses.replace(cfg, decode_engine="generate" if cfg.decode_engine == "packed" else "packed")
    payload = run_eval(other, make_generator=make, identify=model_identity)
    assert len(built) == 4 and not payload["summary"]["cached"] and not payload["compare_summary"]["cached"]
    assert run_eval(other, make_generator=make, identify=model_identity)["summary"]["cached"] and len(built) == 4


def _callback_problems():
    return [
        {"prompt": [{"role": "user", "content": q}], "answer": a, "task": t}
        for q, a, t in [("1 + 2 =", "#### 3", "easy"), ("2 * 5 =", "#### 10", "easy"), ("7 - 3 =", "#### 4", "hard")]
    ]


@pytest.mark.slow
def test_before_after_callback_cache_resume_and_paired_gain(tiny_model_path, tmp_path, monkeypatch):
    import shutil
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_grpo_ext.evaluation import read_results
    from trl_grpo_ext.trl.callbacks import BeforeAfterEvalCallback

    monkeypatch.setenv("TRL_GRPO_EXT_CACHE", str(tmp_path / "cache"))
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_path, model_dir)
    model, tok = AutoModelForCausalLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    side = tok.padding_side

    def train(out, step=0, end=True):
        cb = BeforeAfterEvalCallback(_callback_problems(), max_new_tokens=3, batch_size=2)
        args, state = (
            SimpleNamespace(output_dir=str(out)),
            SimpleNamespace(global_step=step, is_world_process_zero=True),
        )
        (tmp_path / out).mkdir(parents=True, exist_ok=True)
        cb.on_train_begin(args, state, None, model=model, processing_class=tok)
        if end:
            state.global_step = step + 2
            cb.on_train_end(args, state, None, model=model, processing_class=tok)
        return json.loads((tmp_path / out / "eval_before_after.json").read_text())

    first = train(tmp_path / "run1")
    assert first["before"]["source"] == "generated" and first["after"]["step"] == 2
    assert set(first["before"]["per_task"]) == {"easy", "hard"}
    assert first["paired"]["metrics"]["accuracy"]["gain"] == 0.0  # the same weights before and after
    assert len(read_results(tmp_path / "run1" / "eval_before.jsonl")) == 3
    assert tok.padding_side == side and model.training is False

    from trl_grpo_ext.evaluation import HFGenerator

    real_generate = HFGenerator.generate

    def refuse(self, *a, **k):
        raise AssertionError("the cached 'before' eval must not generate")

    monkeypatch.setattr(HFGenerator, "generate", refuse)
    assert train(tmp_path / "run2", end=False)["before"]["source"] == "cache"
    # a resumed run keeps its own step-0 eval, read from its folder (the cache is gone)
    shutil.rmtree(tmp_path / "cache")
    resumed = train(tmp_path / "run1", step=5, end=False)
    assert resumed["before"]["source"] == "run folder" and resumed["before"]["step"] == 0
    # new weights: the cache key changes, so the model is evaluated again
    monkeypatch.setattr(HFGenerator, "generate", real_generate)
    model.save_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert train(tmp_path / "run3", end=False)["before"]["source"] == "generated"


# ------------------------------------------------------------------------------------------ the eval options


def _eval_parser():
    import argparse

    from trl_grpo_ext.evaluation import add_eval_arguments

    parser = argparse.ArgumentParser()
    add_eval_arguments(parser)
    return parser


def test_eval_flags_come_from_the_options_dataclass():
    import dataclasses

    from trl_grpo_ext.evaluation import eval_run_from_args

    parser = _eval_parser()
    flags = {flag for action in parser._actions for flag in action.option_strings}
    old = ("--model --adapter --data --tasks --limit --k --batch_size --batch-size --max_new_tokens --max-new-tokens "
           "--temperature --top_p --top-p --seed --no_one_shot --no-one-shot --out --compare_model --compare-model "
           "--no_cache --no-cache --no-progress --no_progress").split()  # fmt: skip
    assert set(old) <= flags
    assert {a.dest for a in parser._actions} - {"help"} == {f.name for f in dataclasses.fields(EvalRun)}
    cfg = eval_run_from_args(parser.parse_args(["--model", "m", "--batch-size", "4", "--no-cache", "--limit", "3"]))
    assert cfg == EvalRun(model="m", batch_size=4, cache=False, limit=3)
    assert eval_run_from_args(parser.parse_args(["--model", "m"])) == EvalRun(model="m")
    with pytest.raises(ValueError, match="--limit must be >= 1"):
        eval_run_from_args(parser.parse_args(["--model", "m", "--limit", "0"]))


def test_sweep_eval_options_are_checked_and_become_the_same_flags():
    from trl_grpo_ext.evaluation import eval_cli_args, sweep_eval_options

    options = sweep_eval_options({"data": "gsm8k-test", "limit": 500, "k": 4, "no_one_shot": True, "cache": False})
    assert options == {"data": "gsm8k-test", "limit": 500, "k": 4, "one_shot": False, "cache": False}
    args = eval_cli_args(options)
    assert args == ["--data", "gsm8k-test", "--limit", "500", "--k", "4", "--no_one_shot", "--no_cache"]
    parsed = _eval_parser().parse_args(["--model", "m", *args])
    assert (parsed.limit, parsed.k, parsed.one_shot, parsed.cache) == (500, 4, False, False)
    with pytest.raises(ValueError, match="unknown option 'limt' \\(did you mean 'limit'\\?\\)"):
        sweep_eval_options({"limt": 5})
    with pytest.raises(ValueError, match="'out' is set by the sweep"):
        sweep_eval_options({"out": "x.jsonl"})
    with pytest.raises(ValueError, match="--batch_size and --k must be >= 1"):
        sweep_eval_options({"k": 0})


def test_recipe_eval_options_follow_the_recipe_and_disable_tqdm():
    from types import SimpleNamespace

    from trl_grpo_ext.evaluation import RECIPE_EVAL_BATCH_SIZE, recipe_eval_options

    script = SimpleNamespace(eval_max_new_tokens=None)
    options = recipe_eval_options(script, SimpleNamespace(max_completion_length=96, disable_tqdm=False))
    assert (options.max_new_tokens, options.batch_size, options.progress, options.cache) == (
        96, RECIPE_EVAL_BATCH_SIZE, True, True
    )  # fmt: skip
    script.eval_max_new_tokens = 40
    options = recipe_eval_options(script, SimpleNamespace(max_completion_length=96, disable_tqdm=True))
    assert options.max_new_tokens == 40 and options.progress is False


def test_a_sweep_with_a_bad_evaluate_option_is_refused_when_loaded():
    from trl_grpo_ext.experiments.sweep import parse_sweep

    with pytest.raises(ValueError, match="evaluate: unknown option 'kk'"):
        parse_sweep({"name": "s", "evaluate": {"kk": 2}})
    assert parse_sweep({"name": "s", "evaluate": {"no_cache": True, "k": 2}}).evaluate == {"cache": False, "k": 2}
