"""Reward functions: TRL's contract, boxed/format/hybrid rules, registry, threads and the size bounds."""

import asyncio
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest

from trl_grpo_ext import REWARD_REGISTRY, boxed_reward, format_reward, get_reward_funcs, make_hybrid_reward
from trl_grpo_ext.task.answers import answers_match, warm_up_verifier
from trl_grpo_ext.task.answers.verifier import VERIFIER
from trl_grpo_ext.task.rewards import has_repetition_loop, hybrid_reward, make_format_reward, register_reward

GSM8K = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nAltogether 1,080 clips.\n#### 1,080"
TRL_KWARGS = dict(prompts=None, trainer_state=object(), log_extra=lambda *a: None, environments=None)


def conv(text):
    return [{"role": "assistant", "content": text}]


# (completion, ground truth, expected boxed_reward)
BOXED_CASES = [
    ("So she sold \\boxed{1,080} clips.", GSM8K, 1.0),
    ("$\\boxed{1080}$", GSM8K, 1.0),
    ("\\boxed{\\$1,080.00}", GSM8K, 1.0),
    ("\\boxed{1080 \\text{ clips}}", GSM8K, 1.0),
    ("\\fbox{1080}", GSM8K, 1.0),
    ("\\boxed{\\boxed{1080}}", GSM8K, 1.0),
    ("first \\boxed{7} then final \\boxed{1080}", GSM8K, 1.0),
    ("first \\boxed{1080} then final \\boxed{7}", GSM8K, 0.0),
    ("\\boxed{1081}", GSM8K, 0.0),
    ("The answer is 1080.", GSM8K, 0.0),
    ("\\boxed{1080", GSM8K, 0.0),
    ("\\boxed{1079 or 1080}", GSM8K, 0.0),
    ("\\boxed{1079, 1080}", GSM8K, 0.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{x = 18}", 18, 1.0),
    ("\\boxed{18.00}", 18.0, 1.0),
    ("\\boxed{\u221218}", "#### -18", 1.0),
    ("\\boxed{1.8 \\times 10^{1}}", "18", 1.0),
    ("\\boxed{\\sqrt{324}}", "18", 1.0),
    ("\\boxed{50\\%}", "#### 50", 1.0),
    ("\\boxed{018.}", "18", 1.0),
    (conv("\\boxed{18}"), "18", 1.0),
    (conv("\\boxed{17}"), "18", 0.0),
    ("The area is \\boxed{\\frac{\\pi}{2}}", "The solution... so $\\boxed{\\pi/2}$.", 1.0),
    # bad completions are scored, never raised on
    (None, "18", 0.0),
    ("", "18", 0.0),
    (18, "18", 0.0),
    (conv(None), "18", 0.0),
    ([{"role": "assistant", "content": ["\\boxed{18}"]}], "18", 1.0),
    ([{"role": "assistant", "content": object()}], "18", 0.0),
    ("x" * 1_000_000, "18", 0.0),
    ("x" * 1_000_000 + " \\boxed{18}", "18", 1.0),
]


@pytest.mark.parametrize("completion, truth, expected", BOXED_CASES)
def test_boxed_reward(completion, truth, expected):
    warm_up_verifier()
    assert boxed_reward([completion], answer=[truth], completion_ids=[[1, 2]], log_metric=None, **TRL_KWARGS) == [
        expected
    ]


def test_boxed_reward_batch_solution_alias_and_broadcast():
    completions = ["\\boxed{18}", conv("\\boxed{17}"), None]
    assert boxed_reward(completions, solution=["18", "18", "18"]) == [1.0, 0.0, 0.0]
    assert boxed_reward(completions, answer="#### 18") == [1.0, 0.0, 0.0]
    assert boxed_reward([], answer=[]) == []


def test_boxed_reward_needs_a_ground_truth_column():
    with pytest.raises(ValueError, match="answer.*solution"):
        boxed_reward(["\\boxed{1}"], question=["q"])
    with pytest.raises(ValueError, match="2 values for 1 completions"):
        boxed_reward(["\\boxed{1}"], answer=["1", "2"])


def test_unparseable_ground_truth_scores_none_with_one_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scores = boxed_reward(["\\boxed{1}", "\\boxed{2}", "\\boxed{3}"], answer=["", None, "#### 3"])
    assert scores == [None, None, 1.0]
    ours = [w for w in caught if "ground truths could not be parsed" in str(w.message)]
    assert len(ours) == 1 and "2 of 3" in str(ours[0].message)


def test_prose_ground_truth_scores_none_with_one_warning():
    completions = ["\\boxed{12}", "\\boxed{Natalia sold 24 clips}", "\\boxed{1080}", "\\boxed{7}"]
    truths = ["The answer is twelve", "Natalia sold 24 clips", "#### 1,080", "7"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scores = boxed_reward(completions, answer=truths)
    assert scores == [None, None, 1.0, 1.0]
    ours = [w for w in caught if "ground truths could not be parsed" in str(w.message)]
    assert len(ours) == 1 and "2 of 4" in str(ours[0].message) and "The answer is twelve" in str(ours[0].message)


# (completion, format_reward, require_think variant, partial-credit variant)
FORMAT_CASES = [
    ("Step... so the answer is \\boxed{18}.", 1.0, 0.0, 1.0),
    ("\\boxed{18}", 1.0, 0.0, 1.0),
    ("$\\boxed{18}$.", 1.0, 0.0, 1.0),
    ("\\[\\boxed{18}\\]", 1.0, 0.0, 1.0),
    ("**\\boxed{18}**", 1.0, 0.0, 1.0),
    ("\\boxed{18} ... so again \\boxed{18}", 1.0, 0.0, 1.0),
    ("\\boxed{18} ... so again \\boxed{\\$18.00}", 1.0, 0.0, 1.0),
    ("\\boxed{17} ... no wait \\boxed{18}", 0.0, 0.0, 2 / 3),
    ("\\boxed{18} and some words after", 0.0, 0.0, 2 / 3),
    ("\\boxed{18} 19", 0.0, 0.0, 2 / 3),
    ("no box here: 18", 0.0, 0.0, 0.0),
    ("\\boxed{18", 0.0, 0.0, 0.0),
    ("<think>reasoning</think> so \\boxed{18}", 1.0, 1.0, 1.0),
    ("<think>reasoning</think> so \\boxed{18}.", 1.0, 1.0, 1.0),
    ("reasoning started in the prompt</think>\\boxed{18}", 1.0, 1.0, 1.0),
    ("<think></think>\\boxed{18}", 1.0, 0.0, 1.0),
    ("<think>a</think><think>b</think>\\boxed{18}", 1.0, 0.0, 1.0),
    ("<think>no closing tag \\boxed{18}", 1.0, 0.0, 1.0),
    ("preamble <think>a</think>\\boxed{18}", 1.0, 0.0, 1.0),
    ("<think>maybe \\boxed{17}</think> final \\boxed{18}", 0.0, 1.0, 2 / 3),
    (None, 0.0, 0.0, 0.0),
    (conv("\\boxed{18}"), 1.0, 0.0, 1.0),
    ("x" * 1_000_000, 0.0, 0.0, 0.0),
]


@pytest.mark.parametrize("completion, plain, think, partial", FORMAT_CASES)
def test_format_reward(completion, plain, think, partial):
    assert format_reward([completion], **TRL_KWARGS) == [plain]
    assert REWARD_REGISTRY["format_think"]([completion]) == [think]
    assert REWARD_REGISTRY["format_partial"]([completion]) == [pytest.approx(partial)]


def test_format_reward_partial_credit_with_think():
    reward = make_format_reward(require_think=True, partial_credit=True)
    assert reward.__name__ == "format_reward_think_partial"
    assert reward(["no think but \\boxed{18}", "<think>x</think> \\boxed{18}", "<think>x</think> 18"]) == [
        0.75,
        1.0,
        0.25,
    ]


@pytest.mark.parametrize(
    "text, loop",
    [
        ("Let me check. " * 20, True),
        ("!" * 100, True),
        ("1111111111" * 10, True),
        ("the cat sat on the mat and then it sat on the mat again " * 6 + "\\boxed{3}", True),
        ("Natalia sold 48 clips in April and 24 in May, 72 in all. \\boxed{72}", False),
        ("Step 1: 3 + 4 = 7. Step 2: 7 * 2 = 14. Step 3: 14 - 1 = 13. \\boxed{13}", False),
        ("", False),
        ("---\n" + "\\boxed{3}", False),
    ],
)
def test_repetition_loop(text, loop):
    assert has_repetition_loop(text) is loop


def test_hybrid_vetoes_come_before_the_weighted_sum():
    completions = [
        "Work. \\boxed{1080}.",  # correct and well formatted
        "Work. \\boxed{1081}.",  # wrong, well formatted: format credit only
        "Work. 1080.",  # no box: vetoed
        "\\boxed{1080} hmm \\boxed{1081}",  # conflicting boxes: vetoed even though...
        "Let me check. " * 30 + "\\boxed{1080}",  # repetition loop: vetoed
        "Work. \\boxed{1080} trailing words",  # correct, bad format: no format credit
    ]
    scores = hybrid_reward(completions, answer=[GSM8K] * 6)
    assert scores == [pytest.approx(1.3), pytest.approx(0.3), 0.0, 0.0, 0.0, 1.0]


def test_an_empty_box_is_no_answer_anywhere():
    # Found by RL on the embedded default (loss_type=cispo, seed 2): the policy learned to end with `\\boxed{}`,
    # which earned a wrong answer's format credit while committing to nothing, and the eval counted it as boxed.
    from trl_grpo_ext.evaluation import extract_any_prediction, extract_prediction

    for text in ("1 - 8 = 9.\n\\boxed{}", "1 - 8 = 9. \\boxed{  }.", "\\fbox{} 9"):
        assert format_reward([text]) == [0.0], text
        assert hybrid_reward([text], answer=["#### 9"]) == [0.0], text  # the no_box veto fires
        assert extract_prediction(text) is None, text  # not boxed in the eval's boxed rate
        assert extract_any_prediction(text) == "9", text  # the format-independent reading falls back to the number
    # an empty box next to a real one: the real one is the answer, nothing conflicts
    assert hybrid_reward(["\\boxed{} so \\boxed{9}"], answer=["#### 9"]) == [pytest.approx(1.3)]


def test_hybrid_truncation_veto():
    reward = make_hybrid_reward({"boxed": 1.0}, vetoes=["truncated"], veto_value=-1.0, name="h")
    ok = "\\boxed{18}"
    ids = [[5, 6, 7, 8], [5, 6, 7, 2], [5, 6]]  # 2 is EOS
    # No limit and no EOS known: truncation cannot be told.
    assert reward([ok] * 3, answer="18", completion_ids=ids) == [1.0, 1.0, 1.0]
    # Limit given at call time: full-length completions without EOS are truncated.
    assert reward([ok] * 3, answer="18", completion_ids=ids, max_completion_length=4) == [-1.0, -1.0, 1.0]
    assert reward.with_context(max_completion_length=4, eos_token_ids=[2])(
        [ok] * 3, answer="18", completion_ids=ids
    ) == [-1.0, 1.0, 1.0]
    # EOS only: TRL's own `mask_truncated_completions` test.
    assert reward.with_context(eos_token_ids=[2])([ok] * 3, answer="18", completion_ids=ids) == [-1.0, 1.0, -1.0]
    # Through the registry with the trainer's settings.
    (hybrid,) = get_reward_funcs(["hybrid"], max_completion_length=4, eos_token_ids=[2])
    assert hybrid([ok + "."] * 3, answer="18", completion_ids=ids) == [0.0, pytest.approx(1.3), pytest.approx(1.3)]


def test_hybrid_reports_components_and_vetoes_through_log_metric():
    logged = {}
    scores = hybrid_reward(
        ["\\boxed{18}.", "\\boxed{17}.", "18"], answer=["18"] * 3, log_metric=lambda k, v: logged.update({k: v})
    )
    assert scores == [pytest.approx(1.3), pytest.approx(0.3), 0.0]
    assert logged == {
        "rewards/hybrid_reward/boxed": pytest.approx(1 / 3),
        "rewards/hybrid_reward/format": pytest.approx(2 / 3),
        "rewards/hybrid_reward/veto_no_box": pytest.approx(1 / 3),
        "rewards/hybrid_reward/veto_conflicting_boxes": 0.0,
        "rewards/hybrid_reward/veto_repetition": 0.0,
        "rewards/hybrid_reward/veto_truncated": 0.0,
        "rewards/hybrid_reward/vetoed": pytest.approx(1 / 3),
    }


def test_a_costly_component_is_asked_about_the_completions_no_veto_fired_on_only():
    calls = []

    def costly(completions, answer, prompts, trainer_state, **kwargs):
        calls.append((list(completions), list(answer), list(prompts), trainer_state))
        return [float(len(c)) for c in completions]

    costly.scored_after_vetoes = True
    reward = make_hybrid_reward({"boxed": 1.0, costly: 0.01}, vetoes=["no_box"], name="gated")
    completions = ["\\boxed{18}", "no box", "\\boxed{7} x", "nothing"]
    logged = {}
    scores = reward(
        completions,
        answer=["18", "1", "7", "2"],
        prompts=["p0", "p1", "p2", "p3"],
        trainer_state="state",
        log_metric=logged.__setitem__,
    )
    assert scores == [pytest.approx(1.1), 0.0, pytest.approx(1.11), 0.0]  # boxed + 0.01 * length
    # the kept completions with their own columns; non-column arguments as they were
    assert calls == [(["\\boxed{18}", "\\boxed{7} x"], ["18", "7"], ["p0", "p2"], "state")]
    assert logged["rewards/gated/costly"] == pytest.approx(10.5)  # over the two it was asked about
    assert logged["rewards/gated/boxed"] == pytest.approx(0.5)  # a rule scores all four
    assert reward(["none", "at all"], answer=["1", "2"]) == [0.0, 0.0] and len(calls) == 1  # all vetoed: not called


def test_hybrid_with_callables_and_none():
    def length_bonus(completions, **kwargs):
        return [0.5 for _ in completions]

    def never_says_seven(text, **_):
        return "7" in text

    reward = make_hybrid_reward({"boxed": 2.0, length_bonus: 1.0}, vetoes=[never_says_seven], name="custom")
    assert reward.__name__ == "custom"
    with pytest.warns(RuntimeWarning, match="1 of 3 ground truths"):
        scores = reward(["\\boxed{18}", "\\boxed{7}", "\\boxed{18}"], answer=["18", "7", ""])
    assert scores == [2.5, 0.0, None]
    with pytest.raises(ValueError, match="unknown veto 'nope'"):
        make_hybrid_reward({"boxed": 1.0}, vetoes=["nope"])
    with pytest.raises(ValueError, match="unknown reward 'boxd'"):
        make_hybrid_reward({"boxd": 1.0})


def test_registry_names_and_typos():
    assert {"boxed", "format", "hybrid"} <= set(REWARD_REGISTRY)
    assert get_reward_funcs(["boxed", "format"]) == [boxed_reward, format_reward]
    assert get_reward_funcs("boxed, hybrid") == [boxed_reward, hybrid_reward]
    assert all(isinstance(f.__name__, str) for f in REWARD_REGISTRY.values())
    with pytest.raises(ValueError) as err:
        get_reward_funcs(["boxd"])
    message = str(err.value)
    assert "unknown reward 'boxd'" in message and "did you mean 'boxed'" in message
    assert "valid: boxed, format" in message and "hybrid" in message
    with pytest.raises(ValueError, match="no reward functions"):
        get_reward_funcs([])


def test_register_reward_decorator():
    @register_reward("test_constant")
    def constant(completions, **kwargs):
        return [0.25] * len(completions)

    try:
        assert get_reward_funcs(["test_constant"])[0](["a", "b"]) == [0.25, 0.25]
        with pytest.raises(ValueError, match="already registered"):
            register_reward("test_constant")(lambda completions, **kw: [])
    finally:
        del REWARD_REGISTRY["test_constant"]


MIXED = [
    ("\\boxed{18}.", "18"),
    (conv("\\boxed{\\sqrt{8}}."), "2\\sqrt{2}"),
    ("\\boxed{1,080}", GSM8K),
    ("\\boxed{17 or 18}", "18"),
    (None, "18"),
]


@pytest.mark.parametrize("name", ["boxed", "format", "hybrid"])
def test_rewards_from_worker_threads_and_asyncio(name):
    warm_up_verifier()
    func = REWARD_REGISTRY[name]
    completions, truths = [c for c, _ in MIXED], [t for _, t in MIXED]
    # Settle the symbolic comparison once without a tight deadline, so every call below agrees.
    assert answers_match("\\sqrt{8}", "2\\sqrt{2}", timeout=30)
    expected = func(completions, answer=truths)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: func(completions, answer=truths), range(8)))
    assert results == [expected] * 8
    assert asyncio.run(asyncio.to_thread(func, completions, answer=truths)) == expected


ADVERSARIAL = {
    "exponent tower": "\\boxed{9^{9^{9^{9}}}}",
    "100k-digit number": "\\boxed{" + "9" * 100_000 + "}",
    "huge scientific": "\\boxed{1e999999999}",
    "1 MB of text": "word " * 200_000,
    "1 MB of braces": "{" * 1_000_000,
    "1 MB of open boxes": "\\boxed{" * 150_000,
    "1 MB of closed boxes": "\\boxed{1}" * 110_000,
    "5000 nested boxes": "\\boxed{" * 5_000 + "18" + "}" * 5_000,
    "nested fractions": "\\boxed{" + "\\frac{1}{" * 3_000 + "2" + "}" * 3_001,
    "repetition loop": "Let me check again. " * 50_000,
    "unicode minus": "\u2212" * 1_000_000 + "\\boxed{\u221218}",
    "huge fraction": "\\boxed{\\frac{" + "7" * 3_000 + "}{" + "3" * 3_000 + "}}",
}


# The package's own rewards, snapshotted at collection: other test modules register test-only rewards.
BUILTIN_REWARDS = dict(REWARD_REGISTRY)


def _check_scored_without_math_verify(text, truth):
    """Every built-in reward gives one float, the same on a repeat, without asking math-verify: a huge or deeply
    nested input is bounded by the scan and size limits (their timings: `python bench/rewards.py --adversarial`)."""
    calls = VERIFIER.stats["calls"]
    for name, func in BUILTIN_REWARDS.items():
        scores = func([text], answer=[truth])
        assert len(scores) == 1 and isinstance(scores[0], float), name
        assert func([text], answer=[truth]) == scores, name
    assert VERIFIER.stats["calls"] == calls


@pytest.mark.parametrize("case", list(ADVERSARIAL))
def test_every_adversarial_completion_is_scored_by_the_limits(case):
    warm_up_verifier()
    _check_scored_without_math_verify(ADVERSARIAL[case], "#### 18")


def test_symbolic_answer_past_the_limits_is_refused_without_math_verify():
    # sympy would need seconds to expand this; the exponent limit refuses it before any worker call.
    _check_scored_without_math_verify("\\boxed{(x+1)^{99}-(x+2)^{98}}", "x^2+1")
