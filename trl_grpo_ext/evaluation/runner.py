"""Running an eval: `evaluate` generates for every problem in batches through a `Generator` and scores the
completions. Its one implementation for `transformers` models is `evaluation.generator.HFGenerator`."""

from __future__ import annotations

from typing import Protocol, Sequence

from trl_grpo_ext.evaluation.problems import Problem, Prompt
from trl_grpo_ext.evaluation.scoring import ProblemResult, score_problem, summarize
from trl_grpo_ext.progress import progress_bar


class Generator(Protocol):
    """Anything with `generate`; an optional `chat` attribute (default True) says whether it takes chat messages
    (else prompts are plain text, as the recipes do for models without a chat template). An optional
    `last_completion_tokens` (list of ints) gives the token count of each completion of the last call."""

    def generate(self, prompts: Sequence[Prompt], num_samples: int, greedy: bool) -> list[list[str]]:
        """`num_samples` completions (text only, prompt excluded) for each prompt, in prompt order."""
        ...


def evaluate(
    problems: Sequence[Problem],
    generator: Generator,
    k: int = 1,
    batch_size: int = 8,
    greedy: bool = True,
    progress: bool = True,
    desc: str = "eval",
) -> tuple[list[ProblemResult], dict]:
    """Generate for every problem in batches, score, and summarize. k > 1 adds k sampled completions each.

    Batches hold prompts of similar length (less padding to run through the model); results come back in
    problem order. The batching depends on the problems only, so the same problems give the same batches.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not greedy and k < 2:
        raise ValueError("with greedy off, k must be >= 2 (nothing would be generated)")
    order = sorted(range(len(problems)), key=lambda i: len(str(problems[i].prompt)))
    by_index: dict[int, ProblemResult] = {}
    with progress_bar(len(problems), desc, "problem", progress) as bar:
        for start in range(0, len(order), batch_size):
            indices = order[start : start + batch_size]
            prompts = [problems[i].prompt for i in indices]
            greedy_out, tokens = None, None
            if greedy:
                greedy_out = _checked(generator.generate(prompts, 1, True), len(indices), 1)
                tokens = getattr(generator, "last_completion_tokens", None)
                if tokens is not None and len(tokens) != len(indices):
                    tokens = None
            sampled = _checked(generator.generate(prompts, k, False), len(indices), k) if k > 1 else None
            for j, i in enumerate(indices):
                by_index[i] = score_problem(
                    i,
                    problems[i],
                    greedy_out[j][0] if greedy_out else None,
                    sampled[j] if sampled else [],
                    tokens[j] if tokens is not None else None,
                )
            bar.update(len(indices))
            if greedy:
                done = list(by_index.values())
                bar.set_postfix({"pass@1": f"{sum(bool(r.greedy_correct) for r in done) / len(done):.3f}"})
    results = [by_index[i] for i in range(len(problems))]
    return results, summarize(results, k)


def _checked(out: list[list[str]], n_prompts: int, n: int) -> list[list[str]]:
    if len(out) != n_prompts or any(len(x) != n for x in out):
        raise RuntimeError(f"generator returned {[len(x) for x in out]} completions for {n_prompts} prompts x {n}")
    return out
