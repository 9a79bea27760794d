"""Answer parsing: completion text, box extraction, ground truth, normalisation and equality."""

import asyncio
import subprocess
import sys
import textwrap
import threading
import time
from fractions import Fraction

import pytest

from trl_grpo_ext.task import answers
from trl_grpo_ext.task.answers import (
    Refused,
    Surd,
    answers_match,
    box_spans,
    boxes_disagree,
    completion_text,
    decide,
    exact_value,
    extract_all_boxed,
    extract_boxed,
    extract_last_number,
    normalize_answer,
    parse_ground_truth,
    same_answer,
)
from trl_grpo_ext.task.answers.verifier import VERIFIER, MathVerifyWorker


class Weird:
    def __str__(self):
        raise RuntimeError("no str for you")


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("plain \\boxed{1}", "plain \\boxed{1}"),
        (None, ""),
        ("", ""),
        ([{"role": "assistant", "content": "hi"}], "hi"),
        (
            [
                {"role": "assistant", "content": "a"},
                {"role": "tool", "content": "t"},
                {"role": "assistant", "content": "b"},
            ],
            "a\nb",
        ),
        ([{"role": "user", "content": "only user"}], "only user"),
        ({"role": "assistant", "content": "dict"}, "dict"),
        (
            [
                {
                    "role": "assistant",
                    "content": [{"type": "text", "text": "x"}, {"type": "image"}, {"type": "text", "text": "y"}],
                }
            ],
            "xy",
        ),
        ([{"role": "assistant", "content": None}], ""),
        ([{"role": "assistant", "content": 18}], "18"),
        ([{"role": "assistant"}], ""),
        (18, "18"),
        (True, ""),
        (Weird(), ""),
        ([Weird(), 3], ""),
        (b"bytes \xff", "bytes \ufffd"),
        ({"text": "t"}, "t"),
    ],
)
def test_completion_text(completion, expected):
    assert completion_text(completion) == expected


@pytest.mark.parametrize(
    "text, last, all_boxes",
    [
        ("The answer is \\boxed{18}.", "18", ["18"]),
        ("\\boxed{1} then \\boxed{2}", "2", ["1", "2"]),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", ["\\frac{1}{2}"]),
        ("\\boxed{\\boxed{18}}", "\\boxed{18}", ["\\boxed{18}"]),
        ("\\fbox{7}", "7", ["7"]),
        ("\\boxed {4}.", "4", ["4"]),
        ("\\boxed{18", None, []),
        ("\\boxed{1} and \\boxed{2", "1", ["1"]),
        ("\\boxed{ 5 \\boxed{7}", "7", ["7"]),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}", ["\\{1, 2\\}"]),
        ("\\boxed{a{b}c}", "a{b}c", ["a{b}c"]),
        ("no box at all", None, []),
        ("\\boxed", None, []),
        ("", None, []),
        (None, None, []),
        ([{"role": "assistant", "content": "$\\boxed{1,080}$"}], "1,080", ["1,080"]),
        ("\\boxed{" + "x" * (answers.MAX_BOX_CHARS + 1) + "}", None, []),
    ],
)
def test_extract_boxed(text, last, all_boxes):
    assert extract_boxed(text) == last
    assert extract_all_boxed(text) == all_boxes


def test_box_search_looks_at_the_tail_of_brace_heavy_text():
    text = "{" * 50_000 + " the answer is \\boxed{42}"
    assert extract_boxed(text) == "42"
    assert extract_boxed("\\boxed{9}" + "x" * (answers.MAX_SCAN_CHARS + 10)) is None


@pytest.mark.parametrize(
    "value, expected",
    [
        ("Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72", "72"),
        ("so 1,080 in all\n#### 1,080", "1080"),
        ("#### -5", "-5"),
        ("#### 18\n", "18"),
        ("#### 0.50", "0.5"),
        ("18", "18"),
        ("  1,080 ", "1080"),
        ("\\frac{1}{2}", "\\frac{1}{2}"),
        ("The area is \\boxed{\\frac{\\pi}{2}}.", "\\frac{\\pi}{2}"),
        (18, "18"),
        (18.0, "18"),
        (0.25, "0.25"),
        (-3, "-3"),
        (Fraction(1, 2), "1/2"),
        (None, None),
        ("", None),
        ("   ", None),
        ("####", None),
        ("#### \n", None),
        ("a long solution\nwith no marked answer\nat all", None),
        # prose is no answer: matching it as text would reward copying the sentence
        ("The answer is twelve", None),
        ("Natalia sold 24 clips", None),
        ("twelve", None),
        ("#### Natalia sold 24 clips", None),
        ("24 clips", "24"),
        ("#### 1,080", "1080"),
        ("x^2+1", "x^2+1"),
        ("\\sin(x)", "\\sin(x)"),
        ("The winner is \\boxed{\\text{Devon}}.", "Devon"),
        (float("nan"), None),
        (float("inf"), None),
        (True, None),
        ([18], None),
        ({"answer": 18}, None),
    ],
)
def test_parse_ground_truth(value, expected):
    assert parse_ground_truth(value) == expected


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("1,080", "1080"),
        ("1,000,000", "1000000"),
        ("18\\,000", "18000"),
        ("18{,}000", "18000"),
        ("18 000", "18000"),
        ("\\$18", "18"),
        ("$18$", "18"),
        ("\\$18.00", "18"),
        ("18 \\text{ dollars}", "18"),
        ("\\text{18}", "18"),
        ("18 dollars", "18"),
        ("18 \\mathrm{cm}^2", "18"),
        ("50\\%", "50"),
        ("50%", "50"),
        ("\u221218", "-18"),
        ("18.", "18"),
        ("018", "18"),
        ("18.00", "18"),
        ("+18", "18"),
        ("-0", "0"),
        (".5", "0.5"),
        ("x = 18", "18"),
        ("\\approx 18", "18"),
        ("\\boxed{18}", "18"),
        ("\\left( 3 \\right)", "( 3 )"),
        ("\\dfrac{1}{2}", "\\frac{1}{2}"),
        ("17 or 18", "17 or 18"),
        ("", ""),
        (None, ""),
    ],
)
def test_normalize_answer(raw, expected):
    assert normalize_answer(raw) == expected


# (prediction, truth, equal) decided by normalisation / exact values alone
FAST_CASES = [
    ("1,080", "1080", True),
    ("18\\,000", "18000", True),
    ("\\$18", "18", True),
    ("$18$", "18", True),
    ("\\$18.00", "18", True),
    ("18 \\text{ dollars}", "18", True),
    ("\\text{18}", "18", True),
    ("50\\%", "50", True),
    ("\u221218", "-18", True),
    ("18.", "18", True),
    ("018", "18", True),
    ("18.00", "18", True),
    ("\\frac{1}{2}", "0.5", True),
    ("\\dfrac{36}{2}", "18", True),
    ("-\\frac{1}{2}", "-0.5", True),
    ("\\frac{-1}{2}", "-0.5", True),
    ("\\frac12", "0.5", True),
    ("1/2", "\\frac{1}{2}", True),
    ("1.5e3", "1500", True),
    ("1.5 \\times 10^{3}", "1500", True),
    ("10^{3}", "1000", True),
    ("\\sqrt{324}", "18", True),
    ("x = 18", "18", True),
    ("0.333", "\\frac{1}{3}", True),
    ("1,08", "108", False),
    ("17 or 18", "18", False),
    ("17, 18", "18", False),
    ("17 \\text{ or } 18", "18", False),
    ("18 and 19", "18", False),
    ("\\pm 18", "18", False),
    ("19", "18", False),
    ("0.33", "\\frac{1}{3}", False),
    ("0.5", "0.25", False),
    ("eighteen", "18", False),
    ("x + 18", "18", False),
    ("5x", "5", False),
    ("18 m", "18", True),
    ("18 km/h", "18", True),
    ("Yes", "yes", True),
    ("", "18", False),
    ("18", "", False),
    ("9" * 100_000, "18", False),
    ("9" * 100_000, "9" * 100_000, True),
    ("9^{9^{9^{9}}}", "18", False),
    ("1e999999999", "18", False),
    ("10^{10^{10}}", "18", False),
    ("100000!", "18", False),
    ("2^{3}", "8", True),
    ("2^3", "8", True),
    ("3!", "6", True),
    ("0!", "1", True),
    ("\\sqrt[3]{27}", "3", True),
    ("\\sqrt{8}", "2\\sqrt{2}", True),
    ("\\sqrt{8}", "3\\sqrt{2}", False),
    ("2^{1/2}", "\\sqrt{2}", True),
    ("3\\times 6", "18", False),  # arithmetic left to do is not the value (values.is_unevaluated_arithmetic)
    ("1 - 8", "-7", False),
    ("32 + 28", "60", False),
    ("\\frac{1+2}{3}", "1", False),
    ("(-7)", "-7", True),
    ("-3/4", "-0.75", True),
    ("2\\frac{1}{2}", "2.5", True),
    ("\\sqrt{2}", "1.414", True),
    ("\\sqrt{2}", "1.41", False),
    ("1000!", "18", False),
    ("(x+1)^{99}-(x+2)^{98}", "x^2+1", False),
    ("\\sum_{k=1}^{n} k", "18", False),
    ("(10^{9})!", "\\pi", False),
]


@pytest.mark.parametrize("pred, truth, equal", FAST_CASES)
def test_answers_match_without_math_verify(pred, truth, equal):
    calls = VERIFIER.stats["calls"]
    assert answers_match(pred, truth) is equal
    assert VERIFIER.stats["calls"] == calls  # decided without the math-verify worker


@pytest.mark.parametrize(
    "pred, truth, equal",
    [
        ("\\pi/2", "\\frac{\\pi}{2}", True),
        ("x^2+2x+1", "(x+1)^2", True),
        ("\\sqrt{2}+\\sqrt{3}", "\\sqrt{3}+\\sqrt{2}", True),
        ("(x+1)^{32}", "(1+x)^{32}", True),
        ("\\frac{\\pi}{3}", "\\frac{\\pi}{2}", False),
        ("5y", "5x", False),
    ],
)
def test_answers_match_falls_back_to_math_verify(pred, truth, equal):
    assert decide(normalize_answer(pred), normalize_answer(truth)) is None  # text and values can't decide
    assert answers_match(pred, truth) is equal


@pytest.mark.parametrize(
    "answer, value",
    [
        ("18", Fraction(18)),
        ("-0.50", Fraction(-1, 2)),
        ("2^{3}", Fraction(8)),
        ("2^-1", Fraction(1, 2)),
        ("2**3", Fraction(8)),
        ("2^{3^2}", Fraction(512)),
        ("-2^2", Fraction(-4)),
        ("3!", Fraction(6)),
        ("0!", Fraction(1)),
        ("5!/3!", Fraction(20)),
        ("\\sqrt{324}", Fraction(18)),
        ("\\sqrt[3]{27}", Fraction(3)),
        ("\\sqrt[3]{-8}", Fraction(-2)),
        ("\\sqrt{\\frac{1}{4}}", Fraction(1, 2)),
        ("8^{2/3}", Fraction(4)),
        ("\\sqrt{2}", Surd(Fraction(1), 2, 2)),
        ("\\sqrt{8}", Surd(Fraction(2), 2, 2)),
        ("\\frac{4}{\\sqrt{2}}", Surd(Fraction(2), 2, 2)),
        ("\\sqrt[4]{4}", Surd(Fraction(1), 2, 2)),
        ("\\sqrt{2}\\sqrt{3}", Surd(Fraction(1), 2, 6)),
        ("\\sqrt{2}\\sqrt{2}", Fraction(2)),
        ("2^{1/2}", Surd(Fraction(1), 2, 2)),
        ("(\\sqrt{6})^{3}", Surd(Fraction(6), 2, 6)),
        ("(\\sqrt[3]{12})^{2}", Surd(Fraction(2), 3, 18)),
        ("(\\sqrt{2})^{-3}", Surd(Fraction(1, 4), 2, 2)),
        ("-\\sqrt[3]{16}", Surd(Fraction(-2), 3, 2)),
        ("2\\frac{1}{2}", Fraction(5, 2)),
        ("-1\\frac{3}{4}", Fraction(-7, 4)),
        ("2\\frac{3}{2}", Fraction(3)),  # not a proper fraction: a product
        ("2 1/2", Fraction(5, 2)),
        ("\\frac12", Fraction(1, 2)),
        ("1.5e3", Fraction(1500)),
        ("1.5 \\times 10^{3}", Fraction(1500)),
        ("(3+3) \\cdot 3", Fraction(18)),
        ("36 \\div 2", Fraction(18)),
        ("2(4+5)", Fraction(18)),
        ("x+1", None),
        ("2 3", None),
        ("\\pi", None),
        ("\\sqrt{2}+\\sqrt{3}", None),
        ("\\sqrt{-4}", None),
        ("", None),
    ],
)
def test_exact_value(answer, value):
    assert exact_value(answer) == value


@pytest.mark.parametrize(
    "answer",
    [
        "9^{9^{9^{9}}}",
        "10^{1001}",
        "2^{16385}",
        "1e999999999",
        "1000!",
        "(-1)!",
        "1/0",
        "\\sqrt{1000000000001}",
        "\\sqrt[11]{2}",
        "9" * 1001,
        "(" * 21 + "1" + ")" * 21,
        "1+" * 100 + "1",
    ],
)
def test_exact_value_refuses_past_its_limits(answer):
    with pytest.raises(Refused):
        exact_value(answer)
    assert answers_match(answer, "18") is False


def test_box_spans_are_offsets_into_the_text_and_disagreement_is_one_rule():
    text = "x" * 10 + "\\boxed{17} then \\boxed{\\$17.00}."
    spans = box_spans(text)
    assert [text[s.start : s.end] for s in spans] == ["\\boxed{17}", "\\boxed{\\$17.00}"]
    assert [text[s.content_start : s.content_end] for s in spans] == ["17", "\\$17.00"]
    assert text[spans[-1].end :] == "."
    far = "{" * 50_000 + " \\boxed{42}"
    (span,) = box_spans(far)
    assert far[span.content_start : span.content_end] == "42"
    assert not boxes_disagree(["18", "2 \\times 9", "\\$18.00"])
    assert boxes_disagree(["17", "18"])
    assert not boxes_disagree(["18"])


def test_same_answer_is_quick_equivalence():
    assert same_answer("1,080", "\\$1080.00")
    assert same_answer("\\frac{1}{2}", "0.5")
    assert not same_answer("17", "18")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The answer is 1,080.", "1080"),
        ("x = -3.50 then", "-3.5"),
        ("#### 72", "72"),
        ("no number", None),
        (None, None),
        ("1" * 100_000, "1" * 100_000),
        ("12 " + "a" * 100_000, "12"),
        ("a" * 300 + "1,234", "1234"),
    ],
)
def test_extract_last_number(text, expected):
    assert extract_last_number(text) == expected


def stand_in(pred, gold):
    """A stand-in for math-verify in the worker: answers `pred == gold`, computes for 300 s on "slow", waits 2 s
    without computing on "starved" (what a worker on a loaded machine sees: wall time passing, little CPU), dies on
    "die" (as a worker killed from outside)."""
    import os

    if pred == "slow":
        end = time.monotonic() + 300
        while time.monotonic() < end:
            pass
    if pred == "starved":
        time.sleep(2)
    if pred == "die":
        os._exit(1)
    return pred == gold


def test_verifier_timeout_ends_the_worker_so_no_late_answer_reaches_another_call():
    worker = MathVerifyWorker(compare=stand_in, warm_up=())
    try:
        assert worker.check("a", "a", timeout=30) is True
        assert worker.check("slow", "slow", timeout=0.5) is None
        assert worker.stats["timeouts"] == 1
        # A fresh worker answers the next calls; the slow call's answer (True) never shows up.
        assert worker.check("b", "c", timeout=30) is False
        assert worker.check("c", "c", timeout=30) is True
        assert worker.check("slow", "slow", timeout=0.5) is None  # a timeout is not remembered as an answer
        assert worker.check("die", "die", timeout=30) is None  # died twice (one retry)
        assert worker.stats["restarts"] == 2
        assert worker.check("d", "d", timeout=30) is True
    finally:
        worker.close()


def test_verifier_limit_is_the_workers_cpu_time_not_the_wall_clock():
    # 2 s of wall time with almost no CPU used is not over a 0.5 s limit: machine load can't change a score.
    worker = MathVerifyWorker(compare=stand_in, warm_up=())
    try:
        assert worker.check("starved", "starved", timeout=0.5) is True
        assert worker.stats["timeouts"] == 0
        t0 = time.monotonic()
        assert worker.check("slow", "slow", timeout=0.5) is None  # 0.5 s of CPU: cut off well before 300 s
        # Generous: on a loaded machine the worker's 0.5 s of CPU has taken 37 s of wall time.
        assert time.monotonic() - t0 < 150 and worker.stats["timeouts"] == 1
    finally:
        worker.close()


def test_verifier_warm_up_runs_in_the_worker_and_a_failed_start_scores_none():
    worker = MathVerifyWorker(compare=stand_in, warm_up=[("x", "x")])
    try:
        assert worker.warm_up() is True and worker.check("e", "e", timeout=30) is True
    finally:
        worker.close()
    broken = MathVerifyWorker(compare=stand_in, warm_up=[("die", "die")], startup_timeout=120)
    try:
        assert broken.warm_up() is False  # the worker died while starting: no retry loop, symbolic answers score 0
        assert broken.check("f", "f", timeout=30) is None
    finally:
        broken.close()


def test_math_verify_fallback_works_off_the_main_thread():
    results = {}

    def work():
        results["thread"] = answers_match("\\frac{\\pi}{4}", "\\pi/4")

    t = threading.Thread(target=work)
    t.start()
    t.join()
    results["async"] = asyncio.run(asyncio.to_thread(answers_match, "x^2-1", "(x-1)(x+1)"))
    assert results == {"thread": True, "async": True}


def test_gsm8k_scoring_needs_no_sympy():
    code = textwrap.dedent(
        """
        import sys
        from trl_grpo_ext import boxed_reward
        forms = ["\\\\boxed{1,080}", "$\\\\boxed{1080}$", "\\\\boxed{\\\\$1,080.00}", "\\\\boxed{1080 \\\\text{ dollars}}",
                 "\\\\boxed{1079}", "no box", "\\\\boxed{17 or 18}", "\\\\boxed{\\\\frac{2160}{2}}", "\\\\boxed{x = 1080}"]
        scores = boxed_reward([f"Work... {f}." for f in forms] * 50, answer=["#### 1,080"] * len(forms) * 50)
        assert scores[:9] == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0], scores[:9]
        assert "sympy" not in sys.modules and "math_verify" not in sys.modules
        assert "trl_grpo_ext.task.answers.verifier" not in sys.modules
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize(
    "answer, expected",
    [
        ("1 - 8", True),
        ("32 + 28", True),
        ("3 \\times 4", True),
        ("36 \\div 2", True),
        ("2(4+5)", True),
        ("-(3-8)", True),
        ("\\frac{1+2}{3}", True),
        ("2^{3}+1", True),
        ("-7", False),
        ("(-7)", False),
        ("-3/4", False),
        ("2 1/2", False),
        ("2\\frac{1}{2}", False),
        ("1.5 \\times 10^{3}", False),
        ("10^{-2}", False),
        ("1.5e-3", False),
        ("2^{3}", False),
        ("4!", False),
        ("\\sqrt[3]{27}", False),
        ("2\\sqrt{2}", False),
    ],
)
def test_unevaluated_arithmetic_is_told_from_value_notations(answer, expected):
    from trl_grpo_ext.task.answers.values import is_unevaluated_arithmetic

    assert is_unevaluated_arithmetic(answer) is expected
