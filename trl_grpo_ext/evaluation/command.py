"""`trl-grpo-ext eval`'s work: evaluate a model (and a second one as the "before" model on the same problems),
write the per-problem results and the summary beside them."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from trl_grpo_ext.evaluation.cache import (
    cached_greedy_eval,
    engine_settings,
    greedy_settings,
    local_model_folder,
    model_identity,
)
from trl_grpo_ext.evaluation.generator import HFGenerator
from trl_grpo_ext.evaluation.options import EvalRun
from trl_grpo_ext.evaluation.paired import compare_results, paired_comparison
from trl_grpo_ext.evaluation.problems import EMBEDDED_DATA, HELDOUT_SEED, load_rows, problems_from_rows
from trl_grpo_ext.evaluation.results import write_results
from trl_grpo_ext.evaluation.runner import evaluate
from trl_grpo_ext.evaluation.scoring import summarize
from trl_grpo_ext.models import resolve_model
from trl_grpo_ext.runs import atomic_write_json, eval_compare_path, eval_summary_path
from trl_grpo_ext.task.data import SYNTHETIC_SOURCE


def _has_chat_template(model: str, adapter: str | None) -> bool:
    """Whether HFGenerator will see a chat template, from the tokenizer files alone (no model load)."""
    folder = Path(adapter) if adapter and Path(adapter, "tokenizer_config.json").is_file() else None
    folder = folder or local_model_folder(resolve_model(model))
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
    if make_generator is None:

        def make_generator(model, adapter):
            return HFGenerator(
                model,
                adapter,
                cfg.max_new_tokens,
                cfg.temperature,
                cfg.top_p,
                cfg.seed,
                decode_engine=cfg.decode_engine,
            )

        identify = identify or model_identity
    rows = load_rows(
        cfg.data, cfg.limit, cfg.seed if cfg.data not in (EMBEDDED_DATA, SYNTHETIC_SOURCE) else HELDOUT_SEED, cfg.tasks
    )
    if not rows:
        raise ValueError(f"eval data '{cfg.data}' holds no problems")
    # the settings that change the results (the cache key's)
    settings = {k: v for k, v in asdict(cfg).items() if k not in ("progress", "decode_engine")}
    settings.update(engine_settings(cfg.decode_engine))

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
                greedy_settings(cfg.max_new_tokens, _default_device(), _default_dtype(), cfg.decode_engine),
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

    atomic_write_json(eval_summary_path(cfg.out), payload, indent=2, default=str)
    return payload


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _default_dtype() -> str:
    # HFGenerator's choice: bf16 on GPU, fp32 on CPU.
    return "torch.bfloat16" if _default_device() == "cuda" else "torch.float32"
