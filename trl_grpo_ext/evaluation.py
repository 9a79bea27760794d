"""Accuracy of a model on GSM8K-style problems: greedy pass@1, sampled maj@k and pass@k.

Answers are parsed exactly as the `boxed` reward parses them (`trl_grpo_ext.answers`), so an eval number
and a training reward mean the same thing. Generation sits behind `Generator`, a single method, so tests
(and other engines) can supply completions without a model.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, Sequence

Prompt = Any  # a list of chat messages, or a plain string for models without a chat template


class Generator(Protocol):
    """Anything with `generate`; an optional `chat` attribute (default True) says whether it takes chat messages
    (else prompts are plain text, as the recipes do for models without a chat template)."""

    def generate(self, prompts: Sequence[Prompt], num_samples: int, greedy: bool) -> list[list[str]]:
        """`num_samples` completions (text only, prompt excluded) for each prompt, in prompt order."""
        ...


@dataclass
class Problem:
    question: str
    answer: str  # the ground truth, already parsed (e.g. "72" from GSM8K's "... #### 72")
    prompt: Prompt
    id: str | int | None = None


# ------------------------------------------------------------------------------------------ scoring


def extract_prediction(completion: Any) -> str | None:
    """The answer a completion gives, as the boxed reward reads it (last `\\boxed{}`), or None."""
    from trl_grpo_ext.answers import completion_text, extract_boxed

    return extract_boxed(completion_text(completion))


def is_correct(pred: str | None, truth: str) -> bool:
    from trl_grpo_ext.answers import answers_match

    return pred is not None and bool(answers_match(pred, truth))


def majority_vote(preds: Sequence[str | None]) -> tuple[str | None, int]:
    """Most frequent answer among `preds` (equivalent answers such as "18" and "18.0" vote together).

    Unanswered samples (None) do not vote; a tie goes to the answer seen first. Returns (answer, votes).
    """
    from trl_grpo_ext.answers import same_answer

    clusters: list[list[str]] = []
    for p in preds:
        if p is None:
            continue
        for cluster in clusters:
            if p == cluster[0] or same_answer(p, cluster[0]):
                cluster.append(p)
                break
        else:
            clusters.append([p])
    if not clusters:
        return None, 0
    best = max(clusters, key=len)  # max keeps the first of equal lengths
    return best[0], len(best)


@dataclass
class ProblemResult:
    index: int
    id: str | int | None
    question: str
    answer: str
    greedy_completion: str | None = None
    greedy_pred: str | None = None
    greedy_correct: bool | None = None
    samples: list[str] = field(default_factory=list)
    sample_preds: list[str | None] = field(default_factory=list)
    sample_correct: list[bool] = field(default_factory=list)
    maj_pred: str | None = None
    maj_correct: bool | None = None
    pass_at_k: bool | None = None


def score_problem(index: int, problem: Problem, greedy: str | None, samples: Sequence[str]) -> ProblemResult:
    r = ProblemResult(index, problem.id, problem.question, problem.answer)
    if greedy is not None:
        r.greedy_completion = greedy
        r.greedy_pred = extract_prediction(greedy)
        r.greedy_correct = is_correct(r.greedy_pred, problem.answer)
    if samples:
        r.samples = list(samples)
        r.sample_preds = [extract_prediction(s) for s in samples]
        r.sample_correct = [is_correct(p, problem.answer) for p in r.sample_preds]
        r.maj_pred, _ = majority_vote(r.sample_preds)
        r.maj_correct = is_correct(r.maj_pred, problem.answer)
        r.pass_at_k = any(r.sample_correct)
    return r


def summarize(results: Sequence[ProblemResult], k: int) -> dict:
    """Accuracies over problems. pass@1: greedy; maj@k / pass@k: over k samples; mean@k: mean sample accuracy."""
    n = len(results)
    out: dict[str, Any] = {"n": n, "k": k}
    if not n:
        return out
    greedy = [r for r in results if r.greedy_correct is not None]
    if greedy:
        out["pass@1"] = sum(r.greedy_correct for r in greedy) / len(greedy)
        out["boxed_rate"] = sum(r.greedy_pred is not None for r in greedy) / len(greedy)
    sampled = [r for r in results if r.sample_correct]
    if sampled:
        out["maj@k"] = sum(bool(r.maj_correct) for r in sampled) / len(sampled)
        out["pass@k"] = sum(bool(r.pass_at_k) for r in sampled) / len(sampled)
        out["mean@k"] = sum(sum(r.sample_correct) / len(r.sample_correct) for r in sampled) / len(sampled)
    return out


# ----------------------------------------------------------------------------------------- running


def evaluate(
    problems: Sequence[Problem],
    generator: Generator,
    k: int = 1,
    batch_size: int = 8,
    greedy: bool = True,
    progress: bool = True,
    desc: str = "eval",
) -> tuple[list[ProblemResult], dict]:
    """Generate for every problem in batches, score, and summarize. k > 1 adds k sampled completions each."""
    from tqdm.auto import tqdm

    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not greedy and k < 2:
        raise ValueError("with greedy off, k must be >= 2 (nothing would be generated)")
    results: list[ProblemResult] = []
    with tqdm(total=len(problems), desc=desc, unit="problem", disable=not progress, dynamic_ncols=True) as bar:
        for start in range(0, len(problems), batch_size):
            batch = problems[start : start + batch_size]
            prompts = [p.prompt for p in batch]
            greedy_out = _checked(generator.generate(prompts, 1, True), len(batch), 1) if greedy else None
            sampled = _checked(generator.generate(prompts, k, False), len(batch), k) if k > 1 else None
            for i, problem in enumerate(batch):
                results.append(
                    score_problem(
                        start + i,
                        problem,
                        greedy_out[i][0] if greedy_out else None,
                        sampled[i] if sampled else [],
                    )
                )
            bar.update(len(batch))
            summary = summarize(results, k)
            if "pass@1" in summary:
                bar.set_postfix({"pass@1": f"{summary['pass@1']:.3f}"})
    return results, summarize(results, k)


def _checked(out: list[list[str]], n_prompts: int, n: int) -> list[list[str]]:
    if len(out) != n_prompts or any(len(x) != n for x in out):
        raise RuntimeError(f"generator returned {[len(x) for x in out]} completions for {n_prompts} prompts x {n}")
    return out


def compare_results(before: Sequence[ProblemResult], after: Sequence[ProblemResult]) -> dict:
    """Per-problem flips of greedy correctness between two evaluations of the same problems."""
    if len(before) != len(after):
        raise ValueError("the two evaluations cover different numbers of problems")
    fixed = sum(1 for b, a in zip(before, after, strict=False) if not b.greedy_correct and a.greedy_correct)
    broken = sum(1 for b, a in zip(before, after, strict=False) if b.greedy_correct and not a.greedy_correct)
    return {"fixed": fixed, "broken": broken, "net": fixed - broken}


# -------------------------------------------------------------------------------------------- data


EMBEDDED_DATA = "embedded"
GSM8K_TEST = "gsm8k-test"


def _ground_truth(row: dict) -> str:
    from trl_grpo_ext.answers import parse_ground_truth

    for key in ("answer", "solution", "ground_truth", "target"):
        if row.get(key) is not None:
            truth = parse_ground_truth(row[key])
            if truth is None or not str(truth).strip():
                raise ValueError(f"cannot parse a ground-truth answer from {row[key]!r}")
            return str(truth)
    raise ValueError(f"row has no answer field (answer/solution/ground_truth): keys {sorted(row)}")


def problems_from_rows(rows: Sequence[dict], one_shot: bool = True, chat: bool = True) -> list[Problem]:
    """GSM8K-schema rows (`question`, `answer`) -> problems with the training prompt (`data.prompts`)."""
    from trl_grpo_ext.data.prompts import build_prompt

    problems = []
    for i, row in enumerate(rows):
        question = row.get("question") or row.get("problem")
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"row {i} has no question (keys {sorted(row)})")
        problems.append(Problem(question, _ground_truth(row), build_prompt(question, one_shot=one_shot, chat=chat),
                                row.get("id", i)))
    return problems


def load_rows(data: str, limit: int | None = None, seed: int = 0, tasks: str | None = None) -> list[dict]:
    """GSM8K-schema rows through the recipes' own loader (`trl_grpo_ext.data.load_problems`).

    `embedded` / `synthetic`: the offline reasoning-gym test split (never shares a problem with training;
    `tasks` as the recipe's `synthetic_tasks`); `gsm8k-test`: GSM8K test from the hub; otherwise a JSONL
    file, or a folder holding `test.jsonl`, of question/answer rows.
    """
    from trl_grpo_ext.data import SYNTHETIC_SOURCE, load_problems
    from trl_grpo_ext.data.loading import DEFAULT_TASKS

    if limit is not None and limit < 1:
        raise ValueError("--limit must be >= 1")
    if data in (EMBEDDED_DATA, SYNTHETIC_SOURCE):
        return load_problems(SYNTHETIC_SOURCE, "test", limit or 200, tasks=tasks or DEFAULT_TASKS, seed=seed)
    if data in (GSM8K_TEST, "gsm8k", "openai/gsm8k"):
        return load_problems("openai/gsm8k", "test", limit)
    if not Path(data).exists():
        raise FileNotFoundError(f"eval data '{data}' is neither '{EMBEDDED_DATA}', '{GSM8K_TEST}' nor a JSONL file/folder")
    return load_problems(data, "test", limit)


# --------------------------------------------------------------------------------------- generation


class HFGenerator:
    """Batched `transformers` generation with left padding; the chat template when the tokenizer has one."""

    def __init__(
        self,
        model: str,
        adapter: str | None = None,
        max_new_tokens: int = 256,
        temperature: float = 0.7,
        top_p: float = 1.0,
        seed: int = 0,
        device: str | None = None,
    ):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from trl_grpo_ext.models import resolve_model

        path = resolve_model(model)
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        tok_source = adapter if adapter and Path(adapter, "tokenizer_config.json").is_file() else path
        self.tokenizer = AutoTokenizer.from_pretrained(tok_source, padding_side="left")
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        if adapter:
            from peft import PeftModel

            self.model = PeftModel.from_pretrained(self.model, adapter).merge_and_unload()
        self.model.to(self.device).eval()
        self.chat = bool(self.tokenizer.chat_template)
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.seed = seed
        self._calls = 0

    def _text(self, prompt: Prompt) -> str:
        if isinstance(prompt, str):
            return prompt
        if not self.chat:
            raise ValueError("chat messages given to a model without a chat template; build text prompts")
        return self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)

    def generate(self, prompts: Sequence[Prompt], num_samples: int, greedy: bool) -> list[list[str]]:
        import torch

        texts = [self._text(p) for p in prompts]
        # Templated text already holds its special tokens; adding BOS again would shift the prompt.
        templated = not isinstance(prompts[0], str)
        enc = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=not templated)
        enc = {k: v.to(self.device) for k, v in enc.items()}
        kwargs: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "num_return_sequences": num_samples,
            "pad_token_id": self.tokenizer.pad_token_id,
        }
        if greedy:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            kwargs.update(do_sample=True, temperature=self.temperature, top_p=self.top_p, top_k=0)
            # One seed per call: sampled results reproduce for the same data, batch size and k.
            torch.manual_seed(self.seed + self._calls)
        self._calls += 1
        with torch.no_grad():
            out = self.model.generate(**enc, **kwargs)
        new = out[:, enc["input_ids"].shape[1] :]
        decoded = self.tokenizer.batch_decode(new, skip_special_tokens=True)
        return [decoded[i * num_samples : (i + 1) * num_samples] for i in range(len(prompts))]


# ------------------------------------------------------------------------------------------- output


def summary_path_for(out: str | os.PathLike) -> Path:
    """`eval.jsonl` -> `eval_summary.json` (the name the sweep looks for in a run folder)."""
    out = Path(out)
    return out.with_name(f"{out.stem}_summary.json")


def write_results(path: str | os.PathLike, results: Sequence[ProblemResult]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in results:
            f.write(json.dumps(asdict(r)) + "\n")
    return path


@dataclass
class EvalRun:
    """One `trl-grpo-ext eval` invocation's settings; `run_eval` does the work."""

    model: str
    data: str = EMBEDDED_DATA
    adapter: str | None = None
    compare_model: str | None = None
    limit: int | None = None
    k: int = 1
    batch_size: int = 8
    max_new_tokens: int = 256
    temperature: float = 0.7
    top_p: float = 1.0
    seed: int = 0
    one_shot: bool = True
    tasks: str | None = None
    out: str = "eval_results.jsonl"
    progress: bool = True


def run_eval(cfg: EvalRun, make_generator=None) -> dict:
    """Evaluate `cfg.model` (and `cfg.compare_model` as the "before" model); write results and summary.

    `make_generator(model, adapter)` builds a `Generator`; by default an `HFGenerator`.
    """
    if cfg.limit is not None and cfg.limit < 1:
        raise ValueError("--limit must be >= 1")
    if make_generator is None:

        def make_generator(model, adapter):
            return HFGenerator(model, adapter, cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.seed)

    rows = load_rows(cfg.data, cfg.limit, cfg.seed, cfg.tasks)
    if not rows:
        raise ValueError(f"eval data '{cfg.data}' holds no problems")
    settings = {k: v for k, v in asdict(cfg).items() if k != "progress"}

    def problems_for(gen):
        # As the recipes' prompt_format 'auto': chat messages when the model has a chat template, else text.
        return problems_from_rows(rows, one_shot=cfg.one_shot, chat=getattr(gen, "chat", True))

    start = time.monotonic()
    gen = make_generator(cfg.model, cfg.adapter)
    results, summary = evaluate(problems_for(gen), gen, cfg.k, cfg.batch_size, progress=cfg.progress, desc="eval model")
    del gen
    summary["wall_time"] = round(time.monotonic() - start, 2)
    write_results(cfg.out, results)
    payload: dict[str, Any] = {"settings": settings, "summary": summary}

    if cfg.compare_model:
        start = time.monotonic()
        gen = make_generator(cfg.compare_model, None)
        before, before_summary = evaluate(
            problems_for(gen), gen, cfg.k, cfg.batch_size, progress=cfg.progress, desc="eval compare_model"
        )
        del gen
        before_summary["wall_time"] = round(time.monotonic() - start, 2)
        out = Path(cfg.out)
        write_results(out.with_name(f"{out.stem}_compare{out.suffix or '.jsonl'}"), before)
        payload["compare_summary"] = before_summary
        payload["delta"] = {
            key: summary[key] - before_summary[key]
            for key in ("pass@1", "maj@k", "pass@k", "mean@k", "boxed_rate")
            if key in summary and key in before_summary
        }
        payload["flips"] = compare_results(before, results)

    summary_path_for(cfg.out).write_text(json.dumps(payload, indent=2, default=str))
    return payload


def format_summary(payload: dict) -> str:
    """A short markdown table of the summary (and of the comparison when there is one)."""
    keys = [k for k in ("pass@1", "maj@k", "pass@k", "mean@k", "boxed_rate") if k in payload["summary"]]
    k = payload["summary"].get("k", 1)
    names = [n.replace("@k", f"@{k}") for n in keys]
    settings = payload.get("settings", {})
    lines = [f"{payload['summary']['n']} problems from '{settings.get('data')}'", ""]
    lines.append("| model | " + " | ".join(names) + " |")
    lines.append("|---|" + "---|" * len(names))
    if "compare_summary" in payload:
        cs = payload["compare_summary"]
        lines.append(f"| {settings.get('compare_model')} (before) | " + " | ".join(f"{cs.get(x, 0):.3f}" for x in keys) + " |")
    model = settings.get("model") + (f" + {settings['adapter']}" if settings.get("adapter") else "")
    lines.append(f"| {model} | " + " | ".join(f"{payload['summary'][x]:.3f}" for x in keys) + " |")
    if "delta" in payload:
        lines.append("| delta | " + " | ".join(f"{payload['delta'].get(x, 0):+.3f}" for x in keys) + " |")
        f = payload["flips"]
        lines += ["", f"greedy answers fixed: {f['fixed']}, broken: {f['broken']} (net {f['net']:+d})"]
    return "\n".join(lines)
