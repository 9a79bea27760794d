"""Compare two pytest JUnit reports of TRL's GRPO tests: TRL's classes against this package's.

    python bench/trl_conformance/compare.py TRL.xml OURS.xml

Prints each variant's counts (passed, failed, errors, skipped, xfailed), the tests that fail for both (environment
limits: no GPU, no vLLM, no stand-in for a hub id), the tests that pass with TRL and not with ours, and those that
pass only with ours. Exits 1 if any test passes with TRL and not with ours, 2 if a report is missing or empty.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed")


def outcomes(report: Path) -> dict[str, tuple[str, str]]:
    """{test id: (outcome, first line of the failure message)} of a JUnit XML report."""
    results = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, message = ("failed" if child.tag == "failure" else "error"), child.get("message", "")
            elif child.tag == "skipped":
                xfail = child.get("type") == "pytest.xfail"
                outcome, message = ("xfailed" if xfail else "skipped"), child.get("message", "")
        results[test_id] = (outcome, message.strip().splitlines()[0] if message.strip() else "")
    return results


def summary(name: str, results: dict[str, tuple[str, str]]) -> str:
    counts = Counter(outcome for outcome, _ in results.values())
    return f"{name}: " + ", ".join(f"{counts[o]} {o}" for o in OUTCOMES) + f" ({len(results)} tests)"


def main(trl_report: str, ours_report: str) -> int:
    reports = {"TRL": Path(trl_report), "ours": Path(ours_report)}
    for name, path in reports.items():
        if not path.is_file():
            print(f"{name}: no report at {path} (pytest did not run to the end; see its log beside it)")
            return 2
    theirs, ours = outcomes(reports["TRL"]), outcomes(reports["ours"])
    if not theirs:
        print("TRL: the report holds no test (collection failed; see the log beside it)")
        return 2
    print(summary("TRL (trl.GRPOTrainer, trl.GRPOConfig)", theirs))
    print(summary("ours (trl_grpo_ext.GRPOTrainer, trl_grpo_ext.GRPOConfig)", ours))
    failing = ("failed", "error")
    both = sorted(t for t in theirs if theirs[t][0] in failing and ours.get(t, ("missing",))[0] in failing)
    regressions = sorted(t for t in theirs if theirs[t][0] == "passed" and ours.get(t, ("missing", ""))[0] != "passed")
    only_ours = sorted(t for t in ours if ours[t][0] == "passed" and theirs.get(t, ("missing",))[0] != "passed")
    print(f"\nfail with both ({len(both)}):")
    for test in both:
        print(f"  {test}: {theirs[test][1][:160]}")
    print(f"\npass with TRL, not with ours ({len(regressions)}):")
    for test in regressions:
        outcome, message = ours.get(test, ("missing", ""))
        print(f"  {test}: {outcome}: {message[:200]}")
    if only_ours:
        print(f"\npass with ours, not with TRL ({len(only_ours)}):")
        for test in only_ours:
            print(f"  {test}: TRL {theirs.get(test, ('missing', ''))[0]}: {theirs.get(test, ('', ''))[1][:160]}")
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
