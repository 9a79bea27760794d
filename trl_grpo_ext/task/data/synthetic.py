"""Offline GSM8K-style problems generated with reasoning-gym, in the GSM8K schema (`question`, `answer`).

Tasks are reasoning-gym generators with fixed difficulty settings (`TASKS`); a mix draws each problem's task
by weight, which gives an easy-to-hard curriculum inside every batch. Every problem carries its `task`, which the
adaptive curriculum (`trl_grpo_ext.grpo.curriculum`) reweights during training by each task's pass rate. Train and eval are disjoint by
construction: a problem belongs to the eval split iff a hash of its text says so, so even tiny problem
spaces ("4 + 5") never leak from train into eval whatever the seeds.
"""

from __future__ import annotations

import ast
import hashlib
import operator
import random
from functools import lru_cache

from trl_grpo_ext.task.data.prompts import ARITHMETIC_ONE_SHOT_QUESTION, ONE_SHOT_QUESTION

# A problem the prompt's worked example answers is never drawn (its answer would be in the prompt).
_EXAMPLE_QUESTIONS = frozenset({ONE_SHOT_QUESTION, ARITHMETIC_ONE_SHOT_QUESTION})

# name -> (reasoning-gym generator, its config). Easiest first.
TASKS: dict[str, tuple[str, dict]] = {
    "chain_sum_easy": ("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}),
    "chain_sum": ("chain_sum", {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}),
    "basic_arithmetic": (
        "basic_arithmetic",
        {
            "min_terms": 2,
            "max_terms": 3,
            "min_digits": 1,
            "max_digits": 2,
            "operators": ("+", "-", "*"),
            "allow_parentheses": False,
            "allow_negation": False,
        },
    ),
    "gsm_symbolic": ("gsm_symbolic", {}),
}
# gsm_symbolic appends this to every question; our prompt carries its own answer-format instruction.
_GSM_SYMBOLIC_SUFFIX = " Give the result as your final answer. Do not include units."
EVAL_FRACTION_BUCKETS = 8  # 1 problem in 8 (by hash) is reserved for eval
_POOL = 4096  # problems per generator instance; indices beyond wrap onto a new seed


def parse_task_mix(spec) -> dict[str, float]:
    """'chain_sum:2,gsm_symbolic:1' (or a dict / list of names) -> normalised {task: weight}."""
    if isinstance(spec, dict):
        items = list(spec.items())
    else:
        names = spec.split(",") if isinstance(spec, str) else list(spec)
        items = []
        for raw in names:
            name, _, weight = str(raw).strip().partition(":")
            items.append((name.strip(), float(weight) if weight else 1.0))
    mix = {}
    for name, weight in items:
        if name not in TASKS:
            raise ValueError(f"unknown synthetic task {name!r}; known tasks: {', '.join(TASKS)}")
        if not float(weight) > 0:
            raise ValueError(f"task weight for {name!r} must be > 0, got {weight}")
        mix[name] = mix.get(name, 0.0) + float(weight)
    if not mix:
        raise ValueError("empty task mix")
    total = sum(mix.values())
    return {name: weight / total for name, weight in mix.items()}


def is_eval_question(question: str) -> bool:
    digest = hashlib.sha1(question.encode("utf-8")).digest()
    return digest[0] % EVAL_FRACTION_BUCKETS == 0


@lru_cache(maxsize=32)
def _generator(task: str, seed: int):
    import reasoning_gym

    name, config = TASKS[task]
    config = {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()}
    return reasoning_gym.create_dataset(name, seed=seed, size=_POOL, **config)


_BINARY_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def evaluate_expression(expression: str) -> int:
    """Integer value of `expression` ('3 + 10 * 7') with the usual precedence (* before + and -).

    reasoning-gym 0.1's basic_arithmetic without parentheses folds its terms left to right, so its answer
    to 'Calculate 3 + 10 * 7.' is 91, not 73: 210 of 2,000 of the task's problems had a wrong label, which
    trained the wrong arithmetic and graded the right one as wrong. We recompute the answer from the
    expression it prints. Only integers and + - * are accepted (no eval() of arbitrary text).
    """

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
            return _BINARY_OPS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"not an integer + - * expression: {expression!r}")

    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as err:
        raise ValueError(f"not an integer + - * expression: {expression!r}") from err
    return value(tree.body)


def _problem(task: str, seed: int, index: int) -> dict:
    item = _generator(task, seed + (index // _POOL) * 7919)[index % _POOL]
    question = item["question"].removesuffix(_GSM_SYMBOLIC_SUFFIX).strip()
    answer = str(item["answer"]).strip()
    if TASKS[task][0] == "basic_arithmetic":
        answer = str(evaluate_expression(item["metadata"]["expression"]))
    return {"question": question, "answer": f"#### {answer}", "task": task}


def generate_problems(num_samples: int, split: str = "train", tasks="chain_sum,basic_arithmetic", seed: int = 0):
    """`num_samples` distinct problems of `split` ('train' or 'test'/'eval'), each {'question','answer','task'}."""
    if split not in ("train", "test", "eval", "validation"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if num_samples <= 0:
        raise ValueError(f"num_samples must be > 0, got {num_samples}")
    want_eval = split != "train"
    mix = parse_task_mix(tasks)
    names, weights = list(mix), list(mix.values())
    # Separate seed streams per split: different problems, same generator settings.
    rng = random.Random(f"{seed}-{split}")
    counters = dict.fromkeys(names, 0)
    base_seed = seed * 1_000_003 + (500_009 if want_eval else 0)
    rows, seen, tries = [], set(), 0
    while len(rows) < num_samples:
        tries += 1
        if tries > 20 * num_samples + 500:
            raise ValueError(
                f"could only generate {len(rows)} distinct {split} problems for tasks {list(mix)}; "
                "ask for fewer or add harder tasks"
            )
        task = rng.choices(names, weights)[0]
        problem = _problem(task, base_seed, counters[task])
        counters[task] += 1
        key = problem["question"]
        if key in seen or key in _EXAMPLE_QUESTIONS or is_eval_question(key) != want_eval:
            continue
        seen.add(key)
        rows.append(problem)
    return rows
