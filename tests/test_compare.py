"""`trl-grpo-ext compare` on synthetic metrics files: table values, config differences, plots, robustness."""

import json

import pytest
import yaml

from trl_grpo_ext.experiments.compare import (
    build_report,
    config_differences,
    identical_curves,
    load_run,
    load_runs,
    metrics_by_step,
    summarize,
)
from trl_grpo_ext.report.curves import normalized_auc, smooth


def write_run(root, name, rows, config=None, marker=None, raw_lines=()):
    d = root / name
    d.mkdir(parents=True)
    with open(d / "metrics.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
        for line in raw_lines:
            f.write(line + "\n")
    if config is not None:
        (d / "sweep_config.yaml").write_text(yaml.safe_dump(config))
    if marker is not None:
        (d / "sweep_done.json").write_text(json.dumps(marker))
    return d


BASE = {"learning_rate": 1e-5, "num_generations": 4, "max_steps": 4, "seed": 0}


@pytest.fixture
def runs(tmp_path):
    a = write_run(
        tmp_path,
        "loss_type=ppo",
        [
            {
                "step": 1,
                "reward": 0.0,
                "frac_degenerate": 1.0,
                "entropy": 2.0,
                "kl": 0.0,
                "completions/mean_length": 100,
                "clip_low_frac": 0.1,
                "clip_high_frac": 0.3,
                "train_tokens": 100,
                "step_time": 2.0,
            },
            {
                "step": 2,
                "reward": 0.5,
                "frac_degenerate": 0.5,
                "entropy": 1.5,
                "kl": 0.01,
                "completions/mean_length": 80,
                "clip_low_frac": 0.1,
                "clip_high_frac": 0.1,
                "train_tokens": 300,
                "step_time": 2.0,
            },
            {
                "step": 3,
                "reward": 0.25,
                "frac_degenerate": 0.5,
                "entropy": 1.0,
                "kl": 0.02,
                "completions/mean_length": 60,
                "clip_low_frac": 0.4,
                "clip_high_frac": 0.2,
                "train_tokens": 200,
                "step_time": 1.0,
            },
        ],
        config={**BASE, "loss_type": "ppo", "output_dir": "/x/a"},
        marker={"backend": "trl", "wall_time": 12.5, "config": {**BASE, "loss_type": "ppo", "output_dir": "/x/a"}},
        raw_lines=['{"step": 4, "reward": 0.9'],  # torn last line of a killed run
    )
    # PyTRIO-style run: no entropy/kl/clip metrics, a resumed step logged twice, different learning rate
    b = write_run(
        tmp_path,
        "loss_type=cispo",
        [
            {"step": 2, "reward": 0.2, "frac_degenerate": 0.25},
            {"step": 4, "reward": 0.1, "frac_degenerate": 0.0},
            {"step": 4, "reward": 0.6, "frac_degenerate": 0.0, "completions/mean_length": 50},
        ],
        config={**BASE, "loss_type": "cispo", "learning_rate": 4e-5, "backend": "pytrio", "output_dir": "/x/b"},
    )
    return a, b


def test_metrics_by_step_dedupes_steps_and_skips_torn_lines(runs):
    rows, notes = metrics_by_step(runs[0] / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert any("unreadable" in n for n in notes)
    rows, _ = metrics_by_step(runs[1] / "metrics.jsonl")
    assert [(r["step"], r["reward"]) for r in rows] == [(2, 0.2), (4, 0.6)]  # the later row of step 4 wins
    assert rows[1]["completions/mean_length"] == 50


def test_curve_numbers():
    assert smooth([0, 1, 2, 3], 2) == [0, 0.5, 1.5, 2.5]
    assert smooth([1, 2], 1) == [1, 2]
    # trapezoid over steps 1..3: (0+0.5)/2 + (0.5+0.25)/2 = 0.625, over a span of 2
    assert normalized_auc([1, 2, 3], [0.0, 0.5, 0.25]) == pytest.approx(0.3125)
    assert normalized_auc([5], [0.7]) == 0.7
    assert normalized_auc([], []) is None


def test_summary_values(runs):
    a = summarize(load_run(runs[0]))
    assert a["steps"] == 3
    assert a["final_reward"] == 0.25 and a["best_reward"] == 0.5
    assert a["reward_auc"] == pytest.approx(0.3125)
    assert a["frac_degenerate"] == pytest.approx(2 / 3)
    assert a["clip_low_frac"] == pytest.approx(0.2) and a["clip_high_frac"] == pytest.approx(0.2)
    assert a["completion_length"] == pytest.approx(80)
    assert a["tokens_per_s"] == pytest.approx(600 / 5)
    assert a["wall_time"] == 12.5  # from the sweep marker
    b = summarize(load_run(runs[1]))
    assert b["final_reward"] == 0.6 and b["best_reward"] == 0.6
    assert b["reward_auc"] == pytest.approx(0.4)
    assert b["clip_low_frac"] is None and b["tokens_per_s"] is None and b["wall_time"] is None
    smoothed = summarize(load_run(runs[0]), smooth_window=2)
    assert smoothed["final_reward"] == pytest.approx(0.375) and smoothed["best_reward"] == pytest.approx(0.375)


def test_config_differences_ignore_output_paths(runs):
    loaded = load_runs(list(runs))
    assert config_differences(loaded) == ["learning_rate", "loss_type"]  # backend: only one run's config has it
    assert loaded[0].backend == "trl" and loaded[1].backend == "pytrio"


def test_report_files_and_table(runs, tmp_path):
    out = tmp_path / "report"
    report = build_report(list(runs), out)
    md = (out / "report.md").read_text()
    assert report.table in md
    lines = report.table.splitlines()
    assert lines[0].startswith("| run | backend | steps | final reward | best reward | reward AUC/step |")
    ppo = next(line for line in lines if line.startswith("| loss_type=ppo"))
    cells = [c.strip() for c in ppo.strip("|").split("|")]
    assert cells[:6] == ["loss_type=ppo", "trl", "3", "0.250", "0.500", "0.312"]
    assert "12s" in cells
    cispo = next(line for line in lines if line.startswith("| loss_type=cispo"))
    assert "| pytrio | 4 | 0.600 | 0.600 | 0.400 |" in cispo and "–" in cispo
    assert "## Config differences" in md and "| run | learning_rate | loss_type |" in md
    for name in ("reward", "frac_degenerate", "entropy", "kl", "completion_length", "overview"):
        png = out / f"{name}.png"
        assert png.is_file() and png.stat().st_size > 1000
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({name}.png)" in md
    summary = json.loads((out / "summary.json").read_text())
    assert summary[0]["run"] == "loss_type=ppo" and summary[0]["config"]["loss_type"] == "ppo"


def test_heldout_accuracy_before_after_columns(runs, tmp_path):
    (runs[0] / "eval_before_after.json").write_text(
        json.dumps(
            {
                "before": {"n": 16, "accuracy": 0.125, "step": 0},
                "after": {"n": 16, "accuracy": 0.25, "step": 3},
            }
        )
    )
    (runs[1] / "eval_before_after.json").write_text("{not json")
    a, b = load_run(runs[0]), load_run(runs[1])
    assert a.heldout == {"before": 0.125, "after": 0.25, "n": 16}
    assert b.heldout == {} and "unreadable eval_before_after.json" in b.notes
    assert summarize(a)["heldout_after"] == 0.25 and "heldout_after" not in summarize(b)
    report = build_report(list(runs), tmp_path / "report")
    header, _, ppo, cispo = report.table.splitlines()
    assert header.endswith("| held-out acc before | held-out acc after |")
    assert ppo.endswith("| 0.125 | 0.250 |") and cispo.endswith("| – | – |")
    assert "greedy accuracy on 16 held-out problems" in (tmp_path / "report" / "report.md").read_text()


def test_runs_with_identical_curves_are_noted(tmp_path):
    rows = [{"step": s, "reward": s / 10, "loss": -s / 7, "grad_norm": 1.0 + s} for s in (1, 2, 3)]
    a = write_run(tmp_path, "loss_type=importance_sampling", rows)
    # same gradient up to float rounding, other loss values
    b = write_run(
        tmp_path,
        "loss_type=cispo",
        [{**r, "loss": r["loss"] * 2, "grad_norm": r["grad_norm"] * (1 + 2e-5)} for r in rows],
    )
    c = write_run(tmp_path, "loss_type=ppo", [{**r, "reward": r["reward"] + 0.01} for r in rows])
    runs = load_runs([a, b, c])
    notes = identical_curves(runs)
    assert len(notes) == 1  # ppo's reward differs; the loss values of the other two may differ
    assert notes[0].startswith(
        "loss_type=importance_sampling and loss_type=cispo logged the same reward and grad_norm"
    )
    assert identical_curves(load_runs([a, write_run(tmp_path, "short", rows[:2])])) == []  # different steps
    off = write_run(tmp_path, "off", [{**r, "grad_norm": r["grad_norm"] * (1 + 1e-3)} for r in rows])
    assert identical_curves(load_runs([a, off])) == []
    report = build_report([a, b, c], tmp_path / "report")
    assert any("logged the same reward" in n for n in report.notes)


def test_metric_no_run_logged_is_skipped(tmp_path):
    d = write_run(tmp_path, "r1", [{"step": 1, "reward": 0.1}, {"step": 2, "reward": 0.3}])
    report = build_report([d], tmp_path / "out", smooth_window=3)
    assert set(report.plots) == {"reward", "overview"}
    assert any("'entropy'" in n for n in report.notes)
    assert any("no saved config" in n for n in report.notes)
    assert not (tmp_path / "out" / "entropy.png").exists()
    assert "(one run: nothing to compare)" in report.markdown


def test_same_named_runs_get_distinct_labels(tmp_path):
    for root in ("a/runs", "b/runs"):
        write_run(tmp_path / root, "loss_type=ppo", [{"step": 1, "reward": 0.0}])
    write_run(tmp_path / "a" / "runs", "other", [{"step": 1, "reward": 0.0}])
    loaded = load_runs(
        [tmp_path / "a/runs/loss_type=ppo", tmp_path / "b/runs/loss_type=ppo", tmp_path / "a/runs/other"]
    )
    assert [r.label for r in loaded] == ["a/runs/loss_type=ppo", "b/runs/loss_type=ppo", "other"]


def test_sweep_root_expands_to_its_runs_in_summary_order(runs, tmp_path):
    (tmp_path / "sweep_summary.json").write_text(
        json.dumps({"runs": [{"name": "loss_type=ppo"}, {"name": "loss_type=cispo"}]})
    )
    (tmp_path / "not-a-run").mkdir()
    loaded = load_runs([tmp_path])
    assert [r.label for r in loaded] == ["loss_type=ppo", "loss_type=cispo"]


def test_missing_files_give_clear_errors(tmp_path, capsys):
    from trl_grpo_ext.cli import main

    assert main(["compare", str(tmp_path / "nope")]) == 2
    assert "run folder not found" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["compare", str(empty)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    # a run with a config but no metrics is listed, with a note, not a crash
    cfg_only = tmp_path / "cfg-only"
    cfg_only.mkdir()
    (cfg_only / "sweep_config.yaml").write_text("loss_type: ppo\n")
    assert main(["compare", str(cfg_only), "--out", str(tmp_path / "o")]) == 0
    captured = capsys.readouterr()
    assert "| cfg-only |" in captured.out and "no metrics.jsonl" in captured.err


def test_cli_prints_table(runs, tmp_path, capsys):
    from trl_grpo_ext.cli import main

    assert main(["compare", *map(str, runs), "--out", str(tmp_path / "o"), "--smooth", "2"]) == 0
    out = capsys.readouterr().out
    assert "| loss_type=ppo | trl | 3 | 0.375 | 0.375 |" in out
    assert (tmp_path / "o" / "reward.png").stat().st_size > 1000


def _seeded_run(root, loss, seed, rewards, correct):
    """A sweep-style run folder: config with loss and seed, reward curve, and per-problem held-out results."""
    from trl_grpo_ext.evaluation import Problem, score_problem, write_results
    from trl_grpo_ext.runs import EVAL_AFTER_PROBLEMS_FILENAME

    config = {**BASE, "loss_type": loss, "seed": seed, "output_dir": f"/x/{loss}-{seed}"}
    d = write_run(
        root,
        f"loss_type={loss},seed={seed}",
        [{"step": i + 1, "reward": r} for i, r in enumerate(rewards)],
        config=config,
    )
    problems = [Problem(f"q{i}", str(i), f"q{i}") for i in range(len(correct))]
    results = [
        score_problem(i, p, f"\\boxed{{{i if ok else -1}}}", [])
        for i, (p, ok) in enumerate(zip(problems, correct, strict=True))
    ]
    write_results(d / EVAL_AFTER_PROBLEMS_FILENAME, results)
    acc = sum(correct) / len(correct)
    (d / "eval_before_after.json").write_text(
        json.dumps(
            {
                "before": {"n": len(correct), "accuracy": 0.0, "accuracy_any_format": 0.1},
                "after": {"n": len(correct), "accuracy": acc, "accuracy_any_format": acc},
            }
        )
    )
    return d


def test_seed_groups_intervals_and_verdicts(tmp_path):
    import random

    from trl_grpo_ext.experiments.seed_comparison import group_by_seed

    rng = random.Random(0)
    n = 200
    # ppo: three seeds of noisy curves and held-out results; importance_sampling: the same three outcomes, drawn
    # for other seeds (identical distributions); cispo: clearly lower reward and accuracy.
    ppo = [
        ([0.8 * (i + 1) / 4 + rng.uniform(-0.02, 0.02) for i in range(4)], [rng.random() < 0.6 for _ in range(n)])
        for _ in range(3)
    ]
    cispo = [
        ([0.4 * (i + 1) / 4 + rng.uniform(-0.02, 0.02) for i in range(4)], [rng.random() < 0.2 for _ in range(n)])
        for _ in range(3)
    ]
    dirs = []
    for seed in (0, 1, 2):
        for loss, (rewards, correct) in (
            ("ppo", ppo[seed]),
            ("cispo", cispo[seed]),
            ("importance_sampling", ppo[(seed + 1) % 3]),
        ):
            dirs.append(_seeded_run(tmp_path / "runs", loss, seed, rewards, correct))
    runs = load_runs(dirs)
    groups = group_by_seed(runs, [summarize(r) for r in runs], {"output_dir", "run_name"})
    assert [g.label for g in groups] == ["loss_type=ppo", "loss_type=cispo", "loss_type=importance_sampling"]
    assert [len(g.runs) for g in groups] == [3, 3, 3] and groups[0].seeds == [0, 1, 2]

    report = build_report(dirs, tmp_path / "report")
    md = (tmp_path / "report" / "report.md").read_text()
    assert "## Configurations across seeds" in md and "not a ranking" in md
    row = next(line for line in md.splitlines() if line.startswith("| loss_type=ppo | 3 (0,1,2) |"))
    assert row.count("[") >= 3  # every figure with its interval
    by_pair = {}
    for v in report.verdicts:
        metric, rest = v.split(": ", 1)
        by_pair[(metric, rest.split(" = ")[0])] = v
    sig = "significant at 95%"
    for metric in ("final reward", "reward AUC/step", "held-out format-independent acc after"):
        assert by_pair[(metric, "loss_type=ppo − loss_type=cispo")].split(": ")[-1].startswith(sig)
        assert "not significant" in by_pair[(metric, "loss_type=ppo − loss_type=importance_sampling")]
    held = by_pair[("held-out boxed acc after", "loss_type=ppo − loss_type=cispo")]
    assert "paired over 200 problems" in held
    assert (tmp_path / "report" / "reward_mean_ci.png").stat().st_size > 1000
    payload = json.loads((tmp_path / "report" / "groups.json").read_text())
    assert payload["groups"][0]["final_reward"]["n"] == 3 and len(payload["differences"]) == 3 * 4
    first = payload["differences"][0]
    assert (first["a"], first["b"], first["metric"]) == ("loss_type=ppo", "loss_type=cispo", "final_reward")
    assert first["estimate"] == pytest.approx(0.4, abs=0.03) and first["low"] > 0.3


def test_one_seed_per_configuration_gives_no_verdict_on_seed_metrics(tmp_path):
    a = _seeded_run(tmp_path, "ppo", 0, [0.1, 0.9], [True] * 30)
    b = _seeded_run(tmp_path, "cispo", 0, [0.1, 0.2], [False] * 30)
    report = build_report([a, b], tmp_path / "report")
    final = next(v for v in report.verdicts if v.startswith("final reward"))
    assert "no verdict" in final and "(no interval)" in final
    held = next(v for v in report.verdicts if v.startswith("held-out boxed acc after"))
    assert "significant at 95%" in held and "paired over 30 problems" in held  # problem-level interval exists
    assert "no seed variation" in held and "seeds resampled" not in held  # says what the interval cannot carry


def test_heldout_differences_pair_only_on_one_common_eval_set(tmp_path):
    a = [_seeded_run(tmp_path / "a", "ppo", s, [0.1, 0.5], [True] * 20 + [False] * 20) for s in (0, 1)]
    b = [_seeded_run(tmp_path / "b", "cispo", s, [0.1, 0.2], [False] * 40) for s in (0, 1)]
    report = build_report([*a, *b], tmp_path / "report")
    held = next(v for v in report.verdicts if v.startswith("held-out boxed acc after"))
    assert "paired over 40 problems" in held and "significant at 95%" in held
    # one run evaluated on other problems: no pairing on a partial overlap, the seeds' accuracies instead
    from trl_grpo_ext.evaluation import Problem, score_problem, write_results
    from trl_grpo_ext.runs import EVAL_AFTER_PROBLEMS_FILENAME

    other = [score_problem(i, Problem(f"other{i}", "1", "p"), "\\boxed{1}", []) for i in range(40)]
    write_results(b[1] / EVAL_AFTER_PROBLEMS_FILENAME, other)
    report = build_report([*a, *b], tmp_path / "report2")
    held = next(v for v in report.verdicts if v.startswith("held-out boxed acc after"))
    assert "no per-problem results on one common eval set" in held


def test_a_saved_models_config_json_is_not_taken_for_the_runs_config(tmp_path):
    """A TRL run folder holds the model's config.json (`save_model`): two such runs without a run config are two
    unknown configurations, not one configuration whose 'config' is the architecture."""
    from trl_grpo_ext.experiments.seed_comparison import group_by_seed

    dirs = []
    for name in ("lr1e-5", "lr2e-5"):
        d = write_run(tmp_path, name, [{"step": 1, "reward": 0.5}])
        (d / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
        dirs.append(d)
    runs = load_runs(dirs)
    assert all(r.config == {} and any("no saved config" in n for n in r.notes) for r in runs)
    assert len(group_by_seed(runs, [summarize(r) for r in runs], set())) == 2
    (dirs[0] / "config.yaml").write_text(yaml.safe_dump({"learning_rate": 1e-5, "seed": 0}))
    assert load_run(dirs[0]).config == {"learning_rate": 1e-5, "seed": 0}
