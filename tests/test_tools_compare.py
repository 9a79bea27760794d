"""`trl-grpo-ext compare` reads the tool metrics of multi-turn runs and the teacher metrics of distillation runs;
runs without them keep their table."""

import json

from trl_grpo_ext.experiments.compare import build_report


def write_run(root, name, rows, config):
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "config.yaml").write_text("".join(f"{k}: {v}\n" for k, v in config.items()))
    return folder


def test_compare_reads_the_tool_metrics(tmp_path):
    tool_rows = [
        {
            "step": 1,
            "reward": 0.1,
            "tools/calls_per_completion": 0.5,
            "tools/errors": 1.0,
            "tools/token_fraction": 0.2,
        },
        {
            "step": 2,
            "reward": 0.3,
            "tools/calls_per_completion": 1.5,
            "tools/errors": 0.0,
            "tools/token_fraction": 0.4,
        },
    ]
    plain_rows = [{"step": 1, "reward": 0.2}, {"step": 2, "reward": 0.2}]
    tools = write_run(tmp_path, "tools", tool_rows, {"environments": "[calculator]", "seed": 0})
    plain = write_run(tmp_path, "plain", plain_rows, {"environments": "[]", "seed": 0})
    report = build_report([tools, plain], tmp_path / "report")
    header = report.table.splitlines()[0]
    assert "| tool calls/completion | tool errors/step | tool token frac |" in header
    row = next(line for line in report.table.splitlines() if line.startswith("| tools"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    columns = [c.strip() for c in header.strip("|").split("|")]
    assert cells[columns.index("tool calls/completion")] == "1.000"
    assert cells[columns.index("tool errors/step")] == "0.500"
    assert cells[columns.index("tool token frac")] == "0.300"
    plain_row = next(line for line in report.table.splitlines() if line.startswith("| plain"))
    assert [c.strip() for c in plain_row.strip("|").split("|")][columns.index("tool calls/completion")] == "–"
    assert "`tools/calls_per_completion`" in (tmp_path / "report" / "report.md").read_text()
    alone = build_report([plain], tmp_path / "report-plain")
    assert "tool" not in alone.table  # runs without tools: the columns drop out


def test_compare_reads_the_distillation_metrics(tmp_path):
    opd_rows = [
        {"step": 1, "reward": 0.1, "distill/reverse_kl": 0.30},
        {"step": 2, "reward": 0.3, "distill/reverse_kl": 0.10},
    ]
    plain_rows = [{"step": 1, "reward": 0.2}, {"step": 2, "reward": 0.2}]
    opd = write_run(tmp_path, "opd", opd_rows, {"distillation": "{teacher: t}", "seed": 0})
    plain = write_run(tmp_path, "plain", plain_rows, {"distillation": "null", "seed": 0})
    report = build_report([opd, plain], tmp_path / "report")
    header = report.table.splitlines()[0]
    columns = [c.strip() for c in header.strip("|").split("|")]
    row = next(line for line in report.table.splitlines() if line.startswith("| opd"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[columns.index("reverse KL to teacher")] == "0.200"
    assert cells[columns.index("reverse KL to teacher, last step")] == "0.100"
    plain_row = next(line for line in report.table.splitlines() if line.startswith("| plain"))
    assert [c.strip() for c in plain_row.strip("|").split("|")][columns.index("reverse KL to teacher")] == "–"
    assert "`distill/reverse_kl`" in (tmp_path / "report" / "report.md").read_text()
    assert "reverse KL" not in build_report([plain], tmp_path / "report-plain").table
