"""A sample request's parameters checked in full at admission, before it can join a decode batch.

Every value a decode step uses is checked here (types, ranges, finiteness, token ids, stop strings, seeds), so a
request that would fail while drawing tokens is refused alone with a 400 instead of failing the batch it joined.
`sample_spec` is the one place: the HTTP handler calls it before queueing, and `Sampling.sample` (in-process use)
through `check_spec`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trl_grpo_ext.pytrio_server.decoding import SampleSpec
from trl_grpo_ext.pytrio_server.errors import EngineError

SAMPLING_PARAM_KEYS = {"max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "stop_token_ids"}
# torch.Generator.manual_seed takes seeds in [-2**63, 2**64): outside it raises while the batch draws
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
# Below this a positive temperature turns the scaled logits into infinities (NaN probabilities): 0 means greedy
MIN_TEMPERATURE = 1e-6
# Stop strings are matched on the decoded tail of every row after every token: their number and length bound it
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 512
MAX_STOP_TOKEN_IDS = 256


@dataclass(frozen=True)
class SampleLimits:
    """What the engine and the server's options allow a request."""

    vocab_size: int
    max_seq_len: int | None
    max_num_samples: int


def _invalid(message: str) -> EngineError:
    return EngineError("invalid_sampling_params", message)


def _integer(params: dict, key: str, default: int | None) -> int | None:
    value = params.get(key, default)
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise _invalid(f"{key} must be an integer, got {value!r}")


def _number(params: dict, key: str, default: float) -> float:
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _invalid(f"{key} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise _invalid(f"{key} must be a finite number, got {value!r}")
    return float(value)


def _token_ids(values: object, what: str, vocab_size: int, limit: int | None = None) -> list[int]:
    if not isinstance(values, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in values):
        raise EngineError("invalid_sampling_params", f"{what} must be a list of integer token ids")
    if limit is not None and len(values) > limit:
        raise _invalid(f"{what} has {len(values)} entries; at most {limit}")
    if any(not 0 <= t < vocab_size for t in values):
        raise EngineError("token_out_of_range", f"{what} must lie in [0, {vocab_size}) (this model's vocabulary)")
    return list(values)


def sample_spec(
    prompt: object, num_samples: object, params: dict, limits: SampleLimits, return_text: bool = True
) -> SampleSpec:
    """The `SampleSpec` of a request, or `EngineError` (``invalid_sampling_params``, ``token_out_of_range``,
    ``sequence_too_long``, ``too_many_samples``) naming the first bad value."""
    if not isinstance(params, dict):
        raise _invalid(f"sampling_params must be a map, got {type(params).__name__}")
    unknown = sorted(set(params) - SAMPLING_PARAM_KEYS)
    if unknown:
        raise _invalid(f"unsupported sampling params {unknown}; this server takes {sorted(SAMPLING_PARAM_KEYS)}")
    prompt = _token_ids(prompt, "prompt token ids", limits.vocab_size)
    if not prompt:
        raise _invalid("the prompt has no tokens")
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise _invalid(f"num_samples must be an integer >= 1, got {num_samples!r}")
    if num_samples > limits.max_num_samples:
        raise EngineError(
            "too_many_samples",
            f"num_samples {num_samples} exceeds this server's limit of {limits.max_num_samples} "
            "(ServerConfig.max_num_samples, pytrio-serve --max-num-samples); split the request",
        )
    max_tokens = _integer(params, "max_tokens", None)
    if max_tokens is None or max_tokens < 0:  # the wire's model refuses 0 already; in-process callers may ask 0
        raise _invalid(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    if limits.max_seq_len and len(prompt) + max_tokens > limits.max_seq_len:
        raise EngineError(
            "sequence_too_long",
            f"prompt {len(prompt)} + max_tokens {max_tokens} tokens exceeds the model's context of "
            f"{limits.max_seq_len} tokens",
        )
    temperature = _number(params, "temperature", 1.0)
    if temperature < 0 or 0 < temperature < MIN_TEMPERATURE:
        raise _invalid(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE:g}, got {temperature!r}")
    top_p = _number(params, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise _invalid(f"top_p must be in (0, 1], got {top_p!r}")
    top_k = _integer(params, "top_k", -1)
    if top_k is None or top_k < -1:
        raise _invalid(f"top_k must be -1 or 0 (no limit) or a positive integer, got {top_k!r}")
    seed = _integer(params, "seed", None)
    if seed is not None and not SEED_MIN <= seed <= SEED_MAX:
        raise _invalid(f"seed must be an integer in [-2**63, 2**64 - 1], got {seed!r}")
    stop = params.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or any(not isinstance(s, str) for s in stop):
        raise _invalid(f"stop must be a string or a list of strings (token ids go in stop_token_ids), got {stop!r}")
    if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stop):
        raise _invalid(f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters")
    stop_ids = _token_ids(params.get("stop_token_ids") or [], "stop_token_ids", limits.vocab_size, MAX_STOP_TOKEN_IDS)
    if not isinstance(return_text, bool):
        raise _invalid(f"return_text must be true or false, got {return_text!r}")
    return SampleSpec(
        prompt, num_samples, max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
        stop=stop, stop_token_ids=stop_ids, return_text=return_text,
    )  # fmt: skip


def check_topk(topk: int, limit: int) -> None:
    """Top-k prompt log-probs: each position's answer grows with k (k pairs per prompt token), so k is capped."""
    if topk > limit:
        raise EngineError(
            "topk_too_large",
            f"topk_prompt_logprobs {topk} exceeds this server's limit of {limit} "
            "(ServerConfig.max_topk_logprobs, pytrio-serve --max-topk-logprobs)",
        )


def check_spec(spec: SampleSpec, limits: SampleLimits) -> SampleSpec:
    """`spec` checked as a request with its values would be (in-process callers build specs themselves)."""
    params = {"max_tokens": spec.max_tokens, "temperature": spec.temperature, "top_k": spec.top_k,
              "top_p": spec.top_p, "seed": spec.seed, "stop": list(spec.stop),
              "stop_token_ids": list(spec.stop_token_ids)}  # fmt: skip
    checked = sample_spec(list(spec.prompt), spec.num_samples, params, limits, spec.return_text)
    if spec.vision is not None:  # the images stay with their placeholders
        if list(spec.vision.tokens) != checked.prompt:
            raise _invalid("the prompt must be the token sequence of its images' input (vision.tokens)")
        checked.vision = spec.vision
    return checked
