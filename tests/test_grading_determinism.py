"""Grading does not depend on timing: the same (completion, ground truth) gets the same score idle, under
CPU load, repeatedly, in a fresh process and in a worker thread; adversarial answers finish in bounded
time with a fixed score."""

import asyncio
import json
import multiprocessing
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from trl_grpo_ext.task.answers import clear_caches, warm_up_verifier
from trl_grpo_ext.task.rewards import boxed_reward

GSM = "Natalia sold 48/2 = 24 clips.\n#### 1,080"

# (completion, ground truth, score): the kinds of answer that flipped from 1.0 to 0.0 under load while
# a 25 ms math-verify deadline decided them, plus the other spellings GSM8K-style answers take.
CASES = [
    # powers, roots, factorials (the ones that used to flip under load)
    ("\\boxed{2^{3}}", "8", 1.0),
    ("\\boxed{2^3}", "8", 1.0),
    ("\\boxed{2^{10}}", "#### 1,024", 1.0),
    ("\\boxed{3!}", "6", 1.0),
    ("\\boxed{4!}", "24", 1.0),
    ("\\boxed{0!}", "1", 1.0),
    ("\\boxed{5!/3!}", "20", 0.0),  # a quotient left to do
    ("\\boxed{\\sqrt{2}}", "\\sqrt{2}", 1.0),
    ("\\boxed{\\sqrt{2}}", "2^{1/2}", 1.0),
    ("\\boxed{\\sqrt{2}}", "1.414", 1.0),
    ("\\boxed{\\sqrt{2}}", "1.41", 0.0),
    ("\\boxed{\\sqrt{2}}", "2", 0.0),
    ("\\boxed{\\sqrt[3]{27}}", "3", 1.0),
    ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}", 1.0),
    ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", 1.0),
    ("\\boxed{\\sqrt{324}}", "18", 1.0),
    ("\\boxed{\\sqrt{\\frac{1}{4}}}", "0.5", 1.0),
    ("\\boxed{8^{2/3}}", "4", 1.0),
    ("\\boxed{10^{3}}", "1000", 1.0),
    ("\\boxed{2^{-1}}", "0.5", 1.0),
    # percentages, mixed numbers, fractions
    ("\\boxed{50\\%}", "50", 1.0),
    ("\\boxed{50\\%}", "#### 50", 1.0),
    ("\\boxed{12.5\\%}", "12.5", 1.0),
    ("\\boxed{25 percent}", "25", 1.0),
    ("\\boxed{2\\frac{1}{2}}", "2.5", 1.0),
    ("\\boxed{2 1/2}", "5/2", 1.0),
    ("\\boxed{-1\\frac{3}{4}}", "-1.75", 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{\\dfrac{36}{2}}", "18", 1.0),
    ("\\boxed{\\frac12}", "0.5", 1.0),
    ("\\boxed{3/4}", "0.75", 1.0),
    ("\\boxed{0.333}", "\\frac{1}{3}", 1.0),
    ("\\boxed{0.33}", "\\frac{1}{3}", 0.0),
    ("\\boxed{\\frac{2}{3}}", "0.667", 1.0),
    # units, currency, separators, signs
    ("\\boxed{18 \\text{ dollars}}", "18", 1.0),
    ("\\boxed{\\$1,080.00}", GSM, 1.0),
    ("\\boxed{1,080}", GSM, 1.0),
    ("\\boxed{1080 \\text{ clips}}", GSM, 1.0),
    ("\\boxed{18\\,000}", "18000", 1.0),
    ("\\boxed{18{,}000}", "18,000", 1.0),
    ("\\boxed{18 km/h}", "18", 1.0),
    ("\\boxed{90^\\circ}", "90", 1.0),
    ("\\boxed{-5}", "#### -5", 1.0),
    ("\\boxed{\u22125}", "-5", 1.0),
    ("\\boxed{(-5)}", "-5", 1.0),
    ("\\boxed{1.5e3}", "1500", 1.0),
    ("\\boxed{1.5 \\times 10^{3}}", "1500", 1.0),
    # arithmetic left to do restates the question: not its value (RL learns to box the question otherwise)
    ("\\boxed{3 \\times 6}", "18", 0.0),
    ("\\boxed{(3+3) \\cdot 3}", "18", 0.0),
    ("\\boxed{36 \\div 2}", "18", 0.0),
    ("\\boxed{2(4+5)}", "18", 0.0),
    ("\\boxed{20 - 2}", "18", 0.0),
    ("1 - 8 = ?\n\\boxed{1 - 8}", "-7", 0.0),
    ("\\boxed{-(3-8)}", "5", 0.0),
    ("\\boxed{3/4}", "0.75", 1.0),
    ("\\boxed{2^{-1}}", "0.5", 1.0),
    ("\\boxed{x = 18}", "18", 1.0),
    # wrong, hedged, no answer
    ("\\boxed{19}", "18", 0.0),
    ("\\boxed{17 or 18}", "18", 0.0),
    ("\\boxed{17, 18}", "18", 0.0),
    ("\\boxed{\\pm 18}", "18", 0.0),
    ("The answer is 18.", "18", 0.0),
    ("\\boxed{18", "18", 0.0),
    ("\\boxed{eighteen}", "18", 0.0),
    ("\\boxed{5x}", "5", 0.0),
    # symbolic: decided by math-verify
    ("\\boxed{\\pi/2}", "\\frac{\\pi}{2}", 1.0),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    ("\\boxed{\\sqrt{2}+\\sqrt{3}}", "\\sqrt{3}+\\sqrt{2}", 1.0),
    ("\\boxed{\\frac{\\pi}{3}}", "\\frac{\\pi}{2}", 0.0),
    ("\\boxed{1+\\sqrt{2}}", "\\sqrt{2}+1", 1.0),
]

COMPLETIONS = [c for c, _, _ in CASES]
TRUTHS = [t for _, t, _ in CASES]
EXPECTED = [e for _, _, e in CASES]


def score_all(cold: bool = True) -> list:
    if cold:
        clear_caches()  # recompute everything (the math-verify answers too), as a fresh process would
    return boxed_reward(COMPLETIONS, answer=TRUTHS)


def _burn():
    while True:
        pass


@pytest.fixture(scope="module", autouse=True)
def ready_verifier():
    assert warm_up_verifier()


def test_the_case_list_is_varied_and_scored_right_when_idle():
    assert len(CASES) >= 60
    assert score_all() == EXPECTED


def test_same_scores_while_two_processes_burn_the_cpu():
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    burners = [context.Process(target=_burn, daemon=True) for _ in range(2)]
    for proc in burners:
        proc.start()
    try:
        time.sleep(0.2)  # let them take the cores
        loaded = [score_all() for _ in range(2)]
    finally:
        for proc in burners:
            proc.terminate()
        for proc in burners:
            proc.join(5)
    assert loaded == [EXPECTED, EXPECTED]


def test_same_scores_three_times_in_one_process():
    assert [score_all(cold=False) for _ in range(3)] == [EXPECTED] * 3
    assert [score_all(cold=True) for _ in range(3)] == [EXPECTED] * 3


def test_same_scores_in_a_fresh_process():
    code = (
        "import json, sys\n"
        "from trl_grpo_ext.task.rewards import boxed_reward\n"
        "completions, truths = json.load(sys.stdin)\n"
        "print(json.dumps(boxed_reward(completions, answer=truths)))\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    out = subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps([COMPLETIONS, TRUTHS]),
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == EXPECTED


def test_same_scores_from_worker_threads():
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda i: boxed_reward(COMPLETIONS, answer=TRUTHS), range(3)))
    assert results == [EXPECTED] * 3
    clear_caches()
    assert asyncio.run(asyncio.to_thread(boxed_reward, COMPLETIONS, answer=TRUTHS)) == EXPECTED


# Adversarial answers against a plain truth: each is refused by a stated size limit (or never gets past
# the box search) and scores 0.0 in well under the bound, under any load.
ADVERSARIAL = {
    "exponent tower": "9^{9^{9^{9}}}",
    "100,000-digit number": "9" * 100_000,
    "1,000-digit number": "9" * 1_000,
    "deep parentheses": "(" * 5_000 + "18" + ")" * 5_000,
    "nested beyond the depth limit": "(" * 25 + "18" + ")" * 25,
    "1000!": "1000!",
    "factorial of a power": "(10^{9})!",
    "huge sqrt": "\\sqrt{" + "9" * 900 + "}",
    "sqrt of a large non-square": "\\sqrt{99999999999999999999}",
    "sqrt of a huge power": "\\sqrt{10^{999}}",
    "root of high index": "\\sqrt[1000]{2}",
    "huge power": "2^{100000}",
    "huge scientific": "1e999999999",
    "long sum": "+".join(["1"] * 90),
    "symbolic slow in sympy": "(x+1)^{99}-(x+2)^{98}",
    "nested fractions": "\\frac{1}{" * 30 + "2" + "}" * 30,
}


@pytest.mark.parametrize("case", list(ADVERSARIAL))
def test_adversarial_answers_are_refused_by_the_limits_with_a_fixed_score(case, monkeypatch):
    """Each is decided by the size and shape limits, in this process: never handed to math-verify (whose time is
    the only unbounded part of grading), and the same score every time."""
    from trl_grpo_ext.task.answers.verifier import VERIFIER

    asked = []
    monkeypatch.setattr(VERIFIER, "check", lambda pred, gold, timeout: asked.append(pred))
    completion = "\\boxed{" + ADVERSARIAL[case] + "}"
    scores = []
    for _ in range(2):
        clear_caches()
        scores.append(boxed_reward([completion], answer=["18"])[0])
    assert scores == [0.0, 0.0] and asked == []
