"""Score the same GSM8K-style completions three ways and print throughput, ratios and accuracy.

1. `boxed_reward` (this package),
2. math-verify alone: `math_verify.parse` + `verify` on each completion, as a plain math-verify reward does,
3. the seed's regex `\\boxed\\{([^}]+)\\}` (first match) with commas stripped, compared as text.

Completions are built from `../shared/data/gsm8k/train.jsonl` when present (synthetic questions
otherwise): the reference reasoning followed by a final answer in one of many formats, correct or
not, so each completion carries a known label. Run: `python bench/rewards.py [--n 3000]`; with `--adversarial`,
each reward's time on the test suite's adversarial completions (huge, deeply nested, symbolic) instead.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trl_grpo_ext.task import answers  # noqa: E402
from trl_grpo_ext.task.answers.verifier import VERIFIER  # noqa: E402
from trl_grpo_ext.task.rewards import boxed_reward  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
SEED_REGEX = re.compile(r"\\boxed\{([^}]+)\}")


def thousands(v: int) -> str:
    return f"{v:,}"


# (name, template producing the final-answer text for value v, whether it states v as the final answer)
FORMATS = [
    ("plain", lambda v: f"\\boxed{{{v}}}", True),
    ("thousands", lambda v: f"\\boxed{{{thousands(v)}}}", True),
    ("dollar math", lambda v: f"$\\boxed{{{v}}}$", True),
    ("currency", lambda v: f"\\boxed{{\\${v}.00}}", True),
    ("text unit", lambda v: f"\\boxed{{{v} \\text{{ dollars}}}}", True),
    ("fraction", lambda v: f"\\boxed{{\\frac{{{2 * v}}}{{2}}}}", True),
    ("nested", lambda v: f"\\boxed{{\\boxed{{{v}}}}}", True),
    ("assignment", lambda v: f"\\boxed{{x = {v}}}", True),
    ("fbox", lambda v: f"\\fbox{{{v}}}", True),
    ("thin space", lambda v: f"\\boxed{{{thousands(v).replace(',', chr(92) + ',')}}}", True),
    ("trailing zeros", lambda v: f"\\boxed{{{v}.0}}", True),
    ("leading zero", lambda v: f"\\boxed{{0{v}}}" if v >= 0 else f"\\boxed{{-0{-v}}}", True),
    ("scientific", lambda v: f"\\boxed{{{v / 10:g} \\times 10^{{1}}}}", True),
    ("product", lambda v: f"\\boxed{{{v} \\times 1}}", True),
    ("two boxes, last right", lambda v: f"first \\boxed{{{v + 1}}}, no wait: \\boxed{{{v}}}", True),
    ("no box", lambda v: f"The answer is {v}.", False),
    ("unclosed box", lambda v: f"\\boxed{{{v}", False),
    ("hedged or", lambda v: f"\\boxed{{{v - 1} \\text{{ or }} {v}}}", False),
    ("hedged comma", lambda v: f"\\boxed{{{v - 1}, {v}}}", False),
]


def wrong_value(v: int, rng: random.Random) -> int:
    return v + rng.choice([-10, -2, -1, 1, 2, 3, 10, v or 1])


def load_problems(n: int, rng: random.Random) -> tuple[list[tuple[str, int]], str]:
    if DATA.exists():
        rows = [json.loads(line) for line in DATA.open()]
        problems = []
        for row in rows:
            reasoning, _, final = row["answer"].rpartition("####")
            try:
                value = int(final.strip().replace(",", ""))
            except ValueError:
                continue
            problems.append((re.sub(r"<<[^>]*>>", "", reasoning).strip(), value, row["answer"]))
        rng.shuffle(problems)
        return problems[:n], f"GSM8K train ({DATA})"
    problems = []
    for _ in range(n):
        a, b = rng.randint(2, 900), rng.randint(2, 40)
        problems.append(
            (f"She buys {b} boxes of {a} pens, so {a} * {b} = {a * b} pens.", a * b, f"... #### {a * b:,}")
        )
    return problems, "synthetic"


def build(n: int, seed: int):
    rng = random.Random(seed)
    problems, source = load_problems(n, rng)
    completions, truths, labels, kinds = [], [], [], []
    for i, (reasoning, value, solution) in enumerate(problems):
        name, template, states_value = FORMATS[i % len(FORMATS)]
        correct = rng.random() < 0.5
        stated = value if correct else wrong_value(value, rng)
        completions.append(f"{reasoning}\nSo the final answer is {template(stated)}.")
        truths.append(solution)
        labels.append(1.0 if (states_value and stated == value) else 0.0)
        kinds.append(name)
    return completions, truths, labels, kinds, source


def seed_regex_reward(completions, answer, **kwargs):
    out = []
    for text, truth in zip(completions, answer, strict=True):
        gold = truth.rsplit("####", 1)[-1].strip().replace(",", "")
        m = SEED_REGEX.search(text)
        out.append(1.0 if m and m.group(1).replace(",", "").strip() == gold else 0.0)
    return out


def math_verify_reward(completions, answer, **kwargs):
    from math_verify import parse, verify

    out = []
    for text, truth in zip(completions, answer, strict=True):
        gold = parse(truth.rsplit("####", 1)[-1].strip())
        out.append(1.0 if verify(gold, parse(text)) else 0.0)
    return out


def clear_caches():
    answers.clear_caches()


def timed(func, completions, truths):
    start = time.perf_counter()
    scores = func(completions, answer=truths)
    return scores, time.perf_counter() - start


def accuracy(scores, labels) -> float:
    return sum(float(s == lab) for s, lab in zip(scores, labels, strict=True)) / len(labels)


def table_accuracy(scorers):
    """Accuracy of each scorer on the boxed-reward table of tests/test_rewards.py (cases under 10 kB)."""
    try:
        sys.path.insert(0, str(ROOT / "tests"))
        from test_rewards import BOXED_CASES
    except Exception as err:  # pytest missing, tests not shipped
        print(f"(table tests not available: {err})")
        return
    cases = [(c, t, e) for c, t, e in BOXED_CASES if isinstance(c, str) and len(c) < 10_000]
    truths = [f"#### {answers.parse_ground_truth(t)}" for _, t, _ in cases]
    completions = [c for c, _, _ in cases]
    expected = [e for _, _, e in cases]
    print(f"\nTable tests ({len(cases)} plain-string cases of tests/test_rewards.py::BOXED_CASES):")
    for name, func in scorers:
        scores = func(completions, answer=truths)
        wrong = [c for c, s, e in zip(completions, scores, expected, strict=True) if s != e]
        print(f"  {name:<22} accuracy {accuracy(scores, expected):6.1%}  wrong on {len(wrong)}")


def adversarial_times(limit_ms: float = 50.0) -> None:
    """Each built-in reward's time (fastest of 3, after a warm-up) on the adversarial completions of
    tests/test_rewards.py and tests/test_grading_determinism.py, the cases over `limit_ms` flagged: a missing
    bound costs seconds on every run, a busy machine only delays some."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_grading_determinism import ADVERSARIAL as ANSWERS
    from test_rewards import ADVERSARIAL, BUILTIN_REWARDS

    cases = {**ADVERSARIAL, **{f"boxed {name}": "\\boxed{" + text + "}" for name, text in ANSWERS.items()}}
    answers.warm_up_verifier()
    slow = 0
    print(f"{'case':<40} {'reward':<22} {'ms':>8}")
    for case, text in cases.items():
        for name, func in BUILTIN_REWARDS.items():
            func([text], answer=["#### 18"])
            best = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                func([text], answer=["#### 18"])
                best = min(best, time.perf_counter() - start)
            flag = "  SLOW" if best * 1000 > limit_ms else ""
            slow += bool(flag)
            print(f"{case[:40]:<40} {name:<22} {best * 1000:>8.1f}{flag}")
    print(f"\n{slow} of {len(cases) * len(BUILTIN_REWARDS)} over {limit_ms:.0f} ms")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=3000, help="number of completions")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--adversarial", action="store_true", help="time each reward on the adversarial completions instead"
    )
    args = parser.parse_args()
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    if args.adversarial:
        adversarial_times()
        return

    completions, truths, labels, kinds, source = build(args.n, args.seed)
    start = time.perf_counter()
    answers.warm_up_verifier()
    print(f"math-verify worker start (once per process, not timed below): {time.perf_counter() - start:.2f} s")
    print(
        f"{len(completions)} completions from {source}, {sum(labels):.0f} labelled correct, "
        f"{len(FORMATS)} answer formats, mean length {sum(map(len, completions)) / len(completions):.0f} chars\n"
    )

    clear_caches()
    scorers = [
        ("boxed_reward", boxed_reward),
        ("math-verify alone", math_verify_reward),
        ("seed regex", seed_regex_reward),
    ]
    results = {}
    for name, func in scorers:
        if name == "boxed_reward":
            clear_caches()
        scores, seconds = timed(func, completions, truths)
        results[name] = (scores, seconds)
    ours = results["boxed_reward"][1]
    print(f"{'scorer':<22} {'completions/s':>14} {'time':>9} {'vs boxed_reward':>16} {'accuracy':>9}")
    for name, (scores, seconds) in results.items():
        print(
            f"{name:<22} {len(completions) / seconds:>14,.0f} {seconds:>8.2f}s {seconds / ours:>15.1f}x "
            f"{accuracy(scores, labels):>9.1%}"
        )
    print(f"\nboxed_reward speed-up over math-verify alone: {results['math-verify alone'][1] / ours:.1f}x")
    print(f"math-verify worker calls during the run: {VERIFIER.stats}")

    print("\nAccuracy by answer format (boxed_reward / math-verify alone / seed regex):")
    for fmt, _, _ in FORMATS:
        idx = [i for i, k in enumerate(kinds) if k == fmt]
        accs = [accuracy([results[n][0][i] for i in idx], [labels[i] for i in idx]) for n, _ in scorers]
        print(f"  {fmt:<22} " + " / ".join(f"{a:6.1%}" for a in accs))

    agree = accuracy(results["boxed_reward"][0], results["math-verify alone"][0])
    print(f"\nAgreement boxed_reward vs math-verify alone: {agree:.1%}")
    table_accuracy(scorers)


if __name__ == "__main__":
    main()
