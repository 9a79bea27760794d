"""Accuracy of a model on GSM8K-style problems: greedy pass@1, sampled maj@k and pass@k, before vs after.

Answers are parsed exactly as the `boxed` reward parses them (`trl_grpo_ext.answers`), so an eval number
and a training reward mean the same thing. Each greedy answer is scored twice: as the reward reads it (the
last `\\boxed{}`), and format-independently (that box if there is one, else the last number in the text), so a
gain can be split into "learned the format" and "solves more problems".

One greedy eval serves both `trl-grpo-ext eval` and the recipes' before/after eval (`BeforeAfterEvalCallback`):
`evaluate` over a `Generator`, whose one implementation for `transformers` models is `HFGenerator` (a model
loaded from a path, or one in memory via `HFGenerator.borrowing`). The "before" eval of a model on an eval set
is cached on disk (`cached_greedy_eval`), keyed by the model's files, the eval set and the generation settings.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

from trl_grpo_ext.runs import (
    TRAINER_STATE_FILENAME,
    atomic_write_json,
    eval_compare_path,
    eval_summary_path,
    read_jsonl,
    write_jsonl,
)

Prompt = Any  # a list of chat messages, or a plain string for models without a chat template


class Generator(Protocol):
    """Anything with `generate`; an optional `chat` attribute (default True) says whether it takes chat messages
    (else prompts are plain text, as the recipes do for models without a chat template). An optional
    `last_completion_tokens` (list of ints) gives the token count of each completion of the last call."""

    def generate(self, prompts: Sequence[Prompt], num_samples: int, greedy: bool) -> list[list[str]]:
        """`num_samples` completions (text only, prompt excluded) for each prompt, in prompt order."""
        ...


@dataclass
class Problem:
    question: str
    answer: str  # the ground truth, already parsed (e.g. "72" from GSM8K's "... #### 72")
    prompt: Prompt
    id: str | int | None = None
    task: str | None = None  # reasoning-gym task name or data source, for per-task figures


# ------------------------------------------------------------------------------------------ scoring


def extract_prediction(completion: Any) -> str | None:
    """The answer a completion gives, as the boxed reward reads it (last `\\boxed{}`), or None."""
    from trl_grpo_ext.answers import completion_text, extract_boxed

    return extract_boxed(completion_text(completion))


def extract_any_prediction(completion: Any) -> str | None:
    """The answer regardless of format: the last `\\boxed{}` if there is one, else the last number, or None."""
    from trl_grpo_ext.answers import completion_text, extract_last_number

    text = completion_text(completion)
    boxed = extract_prediction(text)
    return boxed if boxed is not None else extract_last_number(text)


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
    task: str | None = None
    greedy_completion: str | None = None
    greedy_pred: str | None = None  # the last boxed answer (what the reward reads)
    greedy_correct: bool | None = None
    greedy_boxed: bool | None = None
    greedy_any_pred: str | None = None  # format-independent: the boxed answer, else the last number
    greedy_any_correct: bool | None = None
    greedy_tokens: int | None = None
    samples: list[str] = field(default_factory=list)
    sample_preds: list[str | None] = field(default_factory=list)
    sample_correct: list[bool] = field(default_factory=list)
    maj_pred: str | None = None
    maj_correct: bool | None = None
    pass_at_k: bool | None = None

    @classmethod
    def from_dict(cls, row: dict) -> ProblemResult:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in row.items() if k in names})


def score_problem(
    index: int, problem: Problem, greedy: str | None, samples: Sequence[str], greedy_tokens: int | None = None
) -> ProblemResult:
    r = ProblemResult(index, problem.id, problem.question, problem.answer, problem.task)
    if greedy is not None:
        r.greedy_completion = greedy
        r.greedy_pred = extract_prediction(greedy)
        r.greedy_correct = is_correct(r.greedy_pred, problem.answer)
        r.greedy_boxed = r.greedy_pred is not None
        r.greedy_any_pred = extract_any_prediction(greedy)
        r.greedy_any_correct = is_correct(r.greedy_any_pred, problem.answer)
        r.greedy_tokens = greedy_tokens
    if samples:
        r.samples = list(samples)
        r.sample_preds = [extract_prediction(s) for s in samples]
        r.sample_correct = [is_correct(p, problem.answer) for p in r.sample_preds]
        r.maj_pred, _ = majority_vote(r.sample_preds)
        r.maj_correct = is_correct(r.maj_pred, problem.answer)
        r.pass_at_k = any(r.sample_correct)
    return r


# Greedy held-out figures: name -> (ProblemResult field, how the summary says it). Format-independent first:
# it is the one that says whether the model solves more problems.
HELDOUT_METRICS: dict[str, tuple[str, str]] = {
    "accuracy_any_format": ("greedy_any_correct", "format-independent accuracy"),
    "accuracy": ("greedy_correct", "boxed accuracy"),
    "boxed_rate": ("greedy_boxed", "boxed rate"),
}


def _rates(results: Sequence[ProblemResult]) -> dict:
    n = len(results)
    out: dict[str, Any] = {"n": n}
    for name, (attr, _) in HELDOUT_METRICS.items():
        out[name] = sum(bool(getattr(r, attr)) for r in results) / n if n else None
    return out


def greedy_summary(results: Sequence[ProblemResult]) -> dict:
    """Boxed accuracy, format-independent accuracy, boxed rate and mean length of greedy results, overall and per task."""
    greedy = [r for r in results if r.greedy_correct is not None]
    out = _rates(greedy)
    tokens = [r.greedy_tokens for r in greedy if r.greedy_tokens is not None]
    out["mean_length"] = sum(tokens) / len(tokens) if tokens and len(tokens) == len(greedy) else None
    tasks = sorted({r.task for r in greedy if r.task is not None})
    if tasks:
        out["per_task"] = {task: _rates([r for r in greedy if r.task == task]) for task in tasks}
    return out


def summarize(results: Sequence[ProblemResult], k: int) -> dict:
    """Accuracies over problems. pass@1: greedy (boxed, as `accuracy`); maj@k / pass@k: over k samples; mean@k:
    mean sample accuracy. Greedy results add `accuracy_any_format`, `boxed_rate` and `per_task`."""
    n = len(results)
    out: dict[str, Any] = {"n": n, "k": k}
    if not n:
        return out
    if any(r.greedy_correct is not None for r in results):
        greedy = greedy_summary(results)
        out["pass@1"] = greedy["accuracy"]
        out.update({key: value for key, value in greedy.items() if key != "n"})
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
    """Generate for every problem in batches, score, and summarize. k > 1 adds k sampled completions each.

    Batches hold prompts of similar length (less padding to run through the model); results come back in
    problem order. The batching depends on the problems only, so the same problems give the same batches.
    """
    from tqdm.auto import tqdm

    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not greedy and k < 2:
        raise ValueError("with greedy off, k must be >= 2 (nothing would be generated)")
    order = sorted(range(len(problems)), key=lambda i: len(str(problems[i].prompt)))
    by_index: dict[int, ProblemResult] = {}
    with tqdm(total=len(problems), desc=desc, unit="problem", disable=not progress, dynamic_ncols=True) as bar:
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


# ------------------------------------------------------------------------------------- before vs after


def _check_same_problems(before: Sequence[ProblemResult], after: Sequence[ProblemResult]) -> None:
    if len(before) != len(after):
        raise ValueError(f"the two evaluations cover different numbers of problems ({len(before)} vs {len(after)})")
    for b, a in zip(before, after, strict=True):
        if (b.question, b.answer) != (a.question, a.answer):
            raise ValueError(
                f"the two evaluations differ at problem {b.index}: {b.question[:60]!r} vs {a.question[:60]!r}"
            )


def compare_results(before: Sequence[ProblemResult], after: Sequence[ProblemResult]) -> dict:
    """Per-problem flips of greedy (boxed) correctness between two evaluations of the same problems."""
    _check_same_problems(before, after)
    fixed = sum(1 for b, a in zip(before, after, strict=True) if not b.greedy_correct and a.greedy_correct)
    broken = sum(1 for b, a in zip(before, after, strict=True) if b.greedy_correct and not a.greedy_correct)
    return {"fixed": fixed, "broken": broken, "net": fixed - broken}


def paired_gain(before: Sequence[bool], after: Sequence[bool], seed: int = 0) -> dict:
    """Rates before/after on the same items, the paired gain with its 95% paired-bootstrap interval, and the exact
    McNemar p-value of the discordant pairs (`fixed`: wrong -> right, `broken`: right -> wrong)."""
    from trl_grpo_ext.stats import mcnemar_exact, paired_bootstrap_ci

    b = [float(bool(x)) for x in before]
    a = [float(bool(x)) for x in after]
    iv = paired_bootstrap_ci(b, a, seed=seed)
    fixed = sum(1 for x, y in zip(b, a, strict=True) if y > x)
    broken = sum(1 for x, y in zip(b, a, strict=True) if y < x)
    n = len(b)
    return {
        "n": n,
        "before": sum(b) / n,
        "after": sum(a) / n,
        "gain": iv.estimate,
        "ci_low": iv.low,
        "ci_high": iv.high,
        "mcnemar_p": mcnemar_exact(fixed, broken),
        "fixed": fixed,
        "broken": broken,
    }


def paired_comparison(before: Sequence[ProblemResult], after: Sequence[ProblemResult]) -> dict:
    """The paired before/after figures of every `HELDOUT_METRICS` entry, overall and per task (same problems)."""
    _check_same_problems(before, after)
    if not before:
        raise ValueError("no problems to compare")

    def block(pairs):
        return {
            name: paired_gain([getattr(b, attr) for b, _ in pairs], [getattr(a, attr) for _, a in pairs])
            for name, (attr, _) in HELDOUT_METRICS.items()
        }

    pairs = list(zip(before, after, strict=True))
    out: dict[str, Any] = {"n": len(pairs), "metrics": block(pairs)}
    tasks = sorted({b.task for b in before if b.task is not None})
    if tasks:
        out["per_task"] = {}
        for task in tasks:
            sub = [(b, a) for b, a in pairs if b.task == task]
            out["per_task"][task] = {"n": len(sub), "metrics": block(sub)}
    return out


def format_gain(label: str, g: dict) -> str:
    """`format-independent accuracy 0.220 -> 0.330, paired gain +0.110 [+0.070, +0.150] (n=400, McNemar p=1e-5)`."""
    from trl_grpo_ext.stats import format_p, signed

    ci = _interval(g, missing=" (no interval)")
    return (
        f"{label} {g['before']:.3f} -> {g['after']:.3f}, paired gain {signed(g['gain'], 3)}{ci} "
        f"(n={g['n']}, McNemar p={format_p(g['mcnemar_p'])})"
    )


def format_paired(paired: dict, indent: str = "") -> list[str]:
    """Printed lines of a `paired_comparison`: each metric overall, then each task's format-independent and boxed gains."""
    lines = [indent + format_gain(HELDOUT_METRICS[name][1], g) for name, g in paired["metrics"].items()]
    for task, entry in paired.get("per_task", {}).items():
        parts = [
            _short_gain(short, entry["metrics"][name])
            for name, short in (("accuracy_any_format", "format-independent"), ("accuracy", "boxed"))
        ]
        lines.append(f"{indent}  {task} (n={entry['n']}): " + "; ".join(parts))
    return lines


def _short_gain(label: str, g: dict) -> str:
    """`boxed 0.02 -> 0.30, gain +0.280 [+0.200, +0.360] (p=1e-9)`: a per-task part of `format_paired`."""
    from trl_grpo_ext.stats import format_p, signed

    return (
        f"{label} {g['before']:.2f} -> {g['after']:.2f}, gain {signed(g['gain'], 3)}{_interval(g)} "
        f"(p={format_p(g['mcnemar_p'])})"
    )


def _interval(g: dict, missing: str = "") -> str:
    """` [+0.070, +0.150]`: a paired gain's 95% interval as printed, or `missing` when it has none."""
    from trl_grpo_ext.stats import signed

    return f" [{signed(g['ci_low'], 3)}, {signed(g['ci_high'], 3)}]" if g.get("ci_low") is not None else missing


# -------------------------------------------------------------------------------------------- data


EMBEDDED_DATA = "embedded"
GSM8K_TEST = "gsm8k-test"
# The held-out split does not depend on the training seed: every run of a sweep, whatever its seed, is
# evaluated on the same problems, so runs can be compared problem by problem.
HELDOUT_SEED = 0


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
    """GSM8K-schema rows (`question`, `answer`, optional `task`) -> problems with the training prompt (`data.prompts`)."""
    from trl_grpo_ext.data.prompts import build_prompt

    problems = []
    for i, row in enumerate(rows):
        question = row.get("question") or row.get("problem")
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"row {i} has no question (keys {sorted(row)})")
        problems.append(
            Problem(
                question,
                _ground_truth(row),
                build_prompt(question, one_shot=one_shot, chat=chat, task=row.get("task")),
                row.get("id", i),
                row.get("task") or row.get("source"),
            )
        )
    return problems


def _prompt_question(prompt: Prompt) -> str:
    if isinstance(prompt, str):
        return prompt
    users = [m.get("content") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
    return str(users[-1]) if users else json.dumps(prompt, sort_keys=True)


def as_problems(items: Sequence[Problem | dict]) -> list[Problem]:
    """`Problem`s from problems or recipe dicts {'prompt', 'answer' (GSM8K style), optional 'question', 'task'}."""
    out = []
    for i, item in enumerate(items):
        if isinstance(item, Problem):
            out.append(item)
            continue
        if not isinstance(item, dict) or "prompt" not in item or "answer" not in item:
            raise ValueError(f"eval problem {i} needs 'prompt' and 'answer', got {item!r:.100}")
        question = item.get("question") or _prompt_question(item["prompt"])
        out.append(Problem(question, _ground_truth(item), item["prompt"], item.get("id", i), item.get("task")))
    return out


def load_rows(data: str, limit: int | None = None, seed: int = HELDOUT_SEED, tasks: str | None = None) -> list[dict]:
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
        return load_problems(SYNTHETIC_SOURCE, "test", limit or 320, tasks=tasks or DEFAULT_TASKS, seed=seed)
    if data in (GSM8K_TEST, "gsm8k", "openai/gsm8k"):
        return load_problems("openai/gsm8k", "test", limit)
    if not Path(data).exists():
        raise FileNotFoundError(
            f"eval data '{data}' is neither '{EMBEDDED_DATA}', '{GSM8K_TEST}' nor a JSONL file/folder"
        )
    return load_problems(data, "test", limit)


# -------------------------------------------------------------------------------------- "before" cache

EVAL_CACHE_VERSION = 1
# Files of a model folder that decide its outputs: weights, config, tokenizer and chat template.
_IDENTITY_SKIP = {"README.md", ".gitattributes", "training_args.bin", TRAINER_STATE_FILENAME}


def eval_cache_dir() -> Path:
    """`<cache>/eval` (`$TRL_GRPO_EXT_CACHE`, else `~/.cache/trl_grpo_ext`): one JSON file per cached eval."""
    from trl_grpo_ext.models import cache_dir

    return cache_dir() / "eval"


def folder_identity(folder: str | os.PathLike) -> dict:
    """What a model folder's outputs depend on, cheaply: config.json's hash and each top-level file's name, size
    and modification time (hashing gigabytes of weights on every run would cost more than the eval it saves)."""
    folder = Path(folder)
    config = folder / "config.json"
    files = []
    for p in sorted(folder.iterdir()):
        if p.name in _IDENTITY_SKIP or p.name.startswith(".") or not p.is_file():
            continue
        st = p.stat()  # follows the hub cache's symlinks to the blobs
        files.append([p.name, st.st_size, st.st_mtime_ns])
    return {
        "config_sha256": hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else None,
        "files": files,
    }


def _local_folder(name_or_path: str, revision: str | None = None) -> Path | None:
    path = Path(str(name_or_path)).expanduser()
    if path.is_dir():
        return path
    try:  # a hub id already downloaded: its snapshot folder (no network)
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(str(name_or_path), "config.json", revision=revision)
    except Exception:
        return None
    return Path(found).parent if isinstance(found, str) else None


def model_identity(name_or_path: str, adapter: str | None = None, revision: str | None = None) -> dict | None:
    """Identity of a model (and LoRA adapter) for the eval cache, or None when it cannot be known offline."""
    from trl_grpo_ext.models import resolve_model

    folder = _local_folder(resolve_model(name_or_path), revision)
    if folder is None:
        return None
    out = {"model": folder_identity(folder)}
    if adapter:
        if not Path(adapter).is_dir():
            return None
        out["adapter"] = folder_identity(adapter)
    return out


def live_model_identity(model) -> dict | None:
    """Identity of a model in memory (as a trainer holds it) from the folder it was loaded from, or None.

    A PEFT model counts as its base model only when its adapters start as a no-op (LoRA's default zero init):
    then its outputs are the base model's. (dtype and device go into the settings: `live_model_settings`.)
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for cfg in (getattr(model, "peft_config", None) or {}).values():
        if getattr(cfg, "init_lora_weights", True) is not True:
            return None
    config = getattr(base, "config", None)
    name = getattr(config, "_name_or_path", None)
    if not name:
        return None
    folder = _local_folder(name, getattr(config, "_commit_hash", None))
    return None if folder is None else {"model": folder_identity(folder)}


def live_model_settings(model, max_new_tokens: int) -> dict:
    """Generation settings of a greedy eval that change its outputs: the token limit, dtype and device."""
    param = next(model.parameters())
    return {"max_new_tokens": max_new_tokens, "device": param.device.type, "dtype": str(param.dtype)}


def eval_set_hash(problems: Sequence[Problem]) -> str:
    """sha256 of the eval set as generated: each problem's prompt (system prompt, one-shot example, question),
    ground truth and task, in order."""
    h = hashlib.sha256()
    for p in problems:
        h.update(json.dumps([p.prompt, p.answer, p.task], sort_keys=True, default=str).encode("utf-8"))
        h.update(b"\n")
    return h.hexdigest()


def eval_cache_key(identity: dict, problems: Sequence[Problem], settings: dict) -> tuple[str, dict]:
    """(key, what it hashes): model identity, eval-set hash, generation settings and library versions."""
    import torch
    import transformers

    material = {
        "version": EVAL_CACHE_VERSION,
        "identity": identity,
        "eval_set": eval_set_hash(problems),
        "n": len(problems),
        "settings": settings,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    key = hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode("utf-8")).hexdigest()[:32]
    return key, material


def load_cached_eval(key: str, n: int) -> list[ProblemResult] | None:
    """The cached results under `key`, or None when absent, unreadable or not `n` problems."""
    path = eval_cache_dir() / f"{key}.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        results = [ProblemResult.from_dict(row) for row in data["results"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return results if data.get("key") == key and len(results) == n else None


def store_cached_eval(key: str, material: dict, results: Sequence[ProblemResult]) -> Path:
    path = eval_cache_dir() / f"{key}.json"
    atomic_write_json(path, {"key": key, "material": material, "results": [asdict(r) for r in results]})
    return path


def cached_greedy_eval(
    problems: Sequence[Problem],
    make_generator: Callable[[], Generator],
    identity: dict | None,
    settings: dict,
    batch_size: int,
    progress: bool = True,
    desc: str = "eval",
    use_cache: bool = True,
    write: bool = True,
) -> tuple[list[ProblemResult], dict]:
    """Greedy results of a model on `problems`, from the cache when it holds them, else generated (and stored).

    `make_generator` is called only on a cache miss. `identity` None (a model whose files are unknown) or
    `use_cache` False: always generated, never stored. `write` False: read the cache but leave it as it is
    (processes other than the main one). Returns (results, {'cached': bool, 'key': str | None, 'seconds'}).
    """
    start = time.monotonic()
    key = material = None
    if use_cache and identity is not None:
        key, material = eval_cache_key(identity, problems, {**settings, "batch_size": batch_size})
        results = load_cached_eval(key, len(problems))
        if results is not None:
            # The cache holds what is expensive, the completions; verdicts are graded again here, so a change of
            # the grading rules (trl_grpo_ext.answers) never leaves a stale "before" figure.
            results = [
                score_problem(r.index, problem, r.greedy_completion, r.samples, r.greedy_tokens)
                for r, problem in zip(results, problems, strict=True)
            ]
            return results, {"cached": True, "key": key, "seconds": round(time.monotonic() - start, 2)}
    results, _ = evaluate(problems, make_generator(), 1, batch_size, progress=progress, desc=desc)
    if key is not None and write:
        store_cached_eval(key, material, results)
    return results, {"cached": False, "key": key, "seconds": round(time.monotonic() - start, 2)}


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

            from trl_grpo_ext.compat import merge_and_unload

            self.model = merge_and_unload(PeftModel.from_pretrained(self.model, adapter))
        self.model.to(self.device).eval()
        self._settings(max_new_tokens, temperature, top_p, seed)

    def _settings(self, max_new_tokens: int, temperature: float, top_p: float, seed: int) -> None:
        self.chat = bool(self.tokenizer.chat_template)
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.seed = seed
        self._calls = 0
        self.last_completion_tokens: list[int] | None = None

    @classmethod
    @contextlib.contextmanager
    def borrowing(
        cls, model, tokenizer, max_new_tokens: int, temperature: float = 0.7, top_p: float = 1.0, seed: int = 0
    ):
        """A generator over a model already in memory (a trainer's), for the duration of a `with` block: eval mode
        and left padding inside, the model's train/eval mode and the tokenizer's padding side restored after."""
        gen = cls.__new__(cls)
        gen.model, gen.tokenizer = model, tokenizer
        gen.device = str(next(model.parameters()).device)
        gen._settings(max_new_tokens, temperature, top_p, seed)
        was_training, side, pad = model.training, tokenizer.padding_side, tokenizer.pad_token
        model.eval()
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        try:
            yield gen
        finally:
            tokenizer.padding_side = side
            if pad is None:
                tokenizer.pad_token = None
            model.train(was_training)

    def _text(self, prompt: Prompt) -> str:
        if isinstance(prompt, str):
            return prompt
        if not self.chat:
            raise ValueError("chat messages given to a model without a chat template; build text prompts")
        return self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)

    def generate(self, prompts: Sequence[Prompt], num_samples: int, greedy: bool) -> list[list[str]]:
        import torch

        from trl_grpo_ext.prefix import shared_prefix_generate

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
        # `generate` with each shared prompt token (the one-shot prefix all prompts share) encoded once per batch;
        # each prompt repeated as num_return_sequences would repeat it (trl_grpo_ext.prefix, docs/prefix_sharing.md)
        rows = [ids[mask.bool()].tolist() for ids, mask in zip(enc["input_ids"], enc["attention_mask"], strict=True)]
        del kwargs["num_return_sequences"]
        rows = [row for row in rows for _ in range(num_samples)]
        with torch.no_grad():
            out = shared_prefix_generate(self.model, rows, **kwargs)
        new = out[:, enc["input_ids"].shape[1] :]
        # Tokens up to the end of each completion (padding after EOS excluded), for the mean length.
        self.last_completion_tokens = (
            (new != self.tokenizer.pad_token_id).sum(dim=1).tolist() if num_samples == 1 else None
        )
        decoded = self.tokenizer.batch_decode(new, skip_special_tokens=True)
        return [decoded[i * num_samples : (i + 1) * num_samples] for i in range(len(prompts))]


# ------------------------------------------------------------------------------------------- output

# Per-problem greedy results of the recipes' before/after eval sit next to eval_before_after.json in a run folder
# (`runs.EVAL_BEFORE_PROBLEMS_FILENAME`, `runs.EVAL_AFTER_PROBLEMS_FILENAME`); `trl-grpo-ext eval` writes its summary
# beside its per-problem results.
summary_path_for = eval_summary_path


def write_results(path: str | os.PathLike, results: Sequence[ProblemResult]) -> Path:
    return write_jsonl(path, (asdict(r) for r in results))


def read_results(path: str | os.PathLike) -> list[ProblemResult]:
    """Per-problem results written by `write_results`; ValueError naming the file when one is unreadable."""
    out = []
    for number, row in enumerate(read_jsonl(path), 1):
        try:
            out.append(ProblemResult.from_dict(row))
        except TypeError as err:
            raise ValueError(f"{path}: row {number}: not a per-problem result ({err})") from None
    return out


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
    cache: bool = True  # greedy-only evals (k=1) of a model with known files are cached


def _has_chat_template(model: str, adapter: str | None) -> bool:
    """Whether HFGenerator will see a chat template, from the tokenizer files alone (no model load)."""
    from trl_grpo_ext.models import resolve_model

    folder = Path(adapter) if adapter and Path(adapter, "tokenizer_config.json").is_file() else None
    folder = folder or _local_folder(resolve_model(model))
    if folder is None:
        return True
    if any((folder / name).is_file() for name in ("chat_template.jinja", "chat_template.json")):
        return True
    try:
        return bool(json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError):
        return False


def run_eval(cfg: EvalRun, make_generator=None, identify=None) -> dict:
    """Evaluate `cfg.model` (and `cfg.compare_model` as the "before" model); write results and summary.

    `make_generator(model, adapter)` builds a `Generator` (default an `HFGenerator`); `identify(model, adapter)`
    gives a model's cache identity (default `model_identity`, None for generators given by the caller).
    """
    if cfg.limit is not None and cfg.limit < 1:
        raise ValueError("--limit must be >= 1")
    if cfg.batch_size < 1 or cfg.k < 1:
        raise ValueError("--batch_size and --k must be >= 1")
    if make_generator is None:

        def make_generator(model, adapter):
            return HFGenerator(model, adapter, cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.seed)

        identify = identify or model_identity
    rows = load_rows(
        cfg.data, cfg.limit, cfg.seed if cfg.data not in (EMBEDDED_DATA, "synthetic") else HELDOUT_SEED, cfg.tasks
    )
    if not rows:
        raise ValueError(f"eval data '{cfg.data}' holds no problems")
    settings = {k: v for k, v in asdict(cfg).items() if k != "progress"}

    def one(model, adapter, desc):
        start = time.monotonic()
        identity = identify(model, adapter) if identify and cfg.cache and cfg.k == 1 else None
        if identity is not None:
            # As the recipes' prompt_format 'auto': chat messages when the model has a chat template, else text.
            problems = problems_from_rows(rows, one_shot=cfg.one_shot, chat=_has_chat_template(model, adapter))
            results, info = cached_greedy_eval(
                problems,
                lambda: make_generator(model, adapter),
                identity,
                {"max_new_tokens": cfg.max_new_tokens, "device": _default_device(), "dtype": _default_dtype()},
                cfg.batch_size,
                cfg.progress,
                desc,
            )
            summary = summarize(results, 1)
            summary["cached"] = info["cached"]
        else:
            gen = make_generator(model, adapter)
            problems = problems_from_rows(rows, one_shot=cfg.one_shot, chat=getattr(gen, "chat", True))
            results, summary = evaluate(problems, gen, cfg.k, cfg.batch_size, progress=cfg.progress, desc=desc)
            del gen
        summary["wall_time"] = round(time.monotonic() - start, 2)
        return results, summary

    results, summary = one(cfg.model, cfg.adapter, "eval model")
    write_results(cfg.out, results)
    payload: dict[str, Any] = {"settings": settings, "summary": summary}

    if cfg.compare_model:
        before, before_summary = one(cfg.compare_model, None, "eval compare_model")
        write_results(eval_compare_path(cfg.out), before)
        payload["compare_summary"] = before_summary
        payload["delta"] = {
            key: summary[key] - before_summary[key]
            for key in ("pass@1", "accuracy_any_format", "maj@k", "pass@k", "mean@k", "boxed_rate")
            if key in summary and key in before_summary
        }
        payload["flips"] = compare_results(before, results)
        if cfg.k == 1 or all(r.greedy_correct is not None for r in results):
            payload["paired"] = paired_comparison(before, results)

    atomic_write_json(summary_path_for(cfg.out), payload, indent=2, default=str)
    return payload


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _default_dtype() -> str:
    # HFGenerator's choice: bf16 on GPU, fp32 on CPU.
    return "torch.bfloat16" if _default_device() == "cuda" else "torch.float32"


def format_summary(payload: dict) -> str:
    """A short markdown table of the summary (and of the comparison when there is one)."""
    keys = [
        k
        for k in ("pass@1", "accuracy_any_format", "maj@k", "pass@k", "mean@k", "boxed_rate")
        if k in payload["summary"]
    ]
    k = payload["summary"].get("k", 1)
    names = [{"accuracy_any_format": "pass@1 any format"}.get(n, n.replace("@k", f"@{k}")) for n in keys]
    settings = payload.get("settings", {})
    lines = [f"{payload['summary']['n']} problems from '{settings.get('data')}'", ""]
    lines.append("| model | " + " | ".join(names) + " |")
    lines.append("|---|" + "---|" * len(names))
    if "compare_summary" in payload:
        cs = payload["compare_summary"]
        lines.append(
            f"| {settings.get('compare_model')} (before) | " + " | ".join(f"{cs.get(x, 0):.3f}" for x in keys) + " |"
        )
    model = settings.get("model") + (f" + {settings['adapter']}" if settings.get("adapter") else "")
    lines.append(f"| {model} | " + " | ".join(f"{payload['summary'][x]:.3f}" for x in keys) + " |")
    if "delta" in payload:
        lines.append("| delta | " + " | ".join(f"{payload['delta'].get(x, 0):+.3f}" for x in keys) + " |")
        f = payload["flips"]
        lines += ["", f"greedy answers fixed: {f['fixed']}, broken: {f['broken']} (net {f['net']:+d})"]
    if "paired" in payload:
        lines += ["", "paired (same problems, 95% paired-bootstrap interval, exact McNemar test):"]
        lines += format_paired(payload["paired"], indent="  ")
    return "\n".join(lines)
