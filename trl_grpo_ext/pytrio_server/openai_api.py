"""OpenAI-compatible chat completions on the local server (``/api/openai/v1/...``), as the hosted service serves them.

A mixin of `LocalPyTrioServer`. ``model`` is a name of a served model (the training model without an adapter, or a
sampling-only model such as a distillation teacher) or a ``trio://`` checkpoint URI the caller's key owns (its LoRA
weights on the training model); anything else, another key's checkpoint included, is the same ``404``. The
request's messages go through the model's chat template, and the prompt joins the server's decode batches
(`SamplingBatcher`) with the same checks as a PyTRIO ``sample`` request (`sample_params.sample_spec`), so its
completion is what ``sample`` with the same parameters returns (``text`` as there: special tokens, the stop token
and a matched stop string left out). Streaming answers the same completion as server-sent events once it is
sampled (the decode batch does not hand out tokens as they are drawn).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time

from trl_grpo_ext.pytrio_server.errors import ApiError, EngineError
from trl_grpo_ext.pytrio_server.sample_params import sample_spec

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
MAX_MESSAGES = 1024
DEFAULT_MAX_TOKENS = 512  # when the request names none (within the model's context)
# Accepted and without effect here (they change nothing a local sampler does, or say what it does anyway).
IGNORED_KEYS = {"user", "stream_options", "metadata", "store", "service_tier", "parallel_tool_calls"}
# Accepted at their neutral value only: anything else would be silently wrong.
NEUTRAL = {"frequency_penalty": 0, "presence_penalty": 0, "logprobs": False, "top_logprobs": 0, "logit_bias": None}
SAMPLING_KEYS = {"n", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop"}
KNOWN_KEYS = {"model", "messages", "stream", *SAMPLING_KEYS, *IGNORED_KEYS, *NEUTRAL}


def _bad(message: str, code: str = "invalid_request") -> ApiError:
    return ApiError(400, code, message)


def _message_text(index: int, message: object) -> dict:
    """A chat message as the chat template takes it: ``role`` and ``content`` text (text parts joined)."""
    if not isinstance(message, dict):
        raise _bad(f"messages[{index}] must be an object with role and content")
    role, content = message.get("role"), message.get("content")
    if role not in CHAT_ROLES:
        raise _bad(f"messages[{index}].role must be one of {list(CHAT_ROLES)}, got {role!r}")
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"messages[{index}].content[{j}] must be a text part ({{'type': 'text', 'text': ...}})")
            parts.append(part["text"])
        content = "".join(parts)
    if content is None and role == "assistant":
        content = ""
    if not isinstance(content, str):
        raise _bad(f"messages[{index}].content must be a string or a list of text parts")
    return {"role": role, "content": content}


class OpenAIHandlers:
    def openai_models(self, caller) -> dict:
        """The training model's served names, the sampling-only models (each under the name it was served as), then
        the caller's own sampler checkpoints on this server's base (``trio://`` URIs, oldest first): every ``model``
        this key may ask for, so a client that checks the listing (an LLM judge) finds each."""
        created = int(self.started)
        names = [self.model_alias, *self.served_names, *(m.alias for m in self.sampling_models.values())]
        data = [
            {"id": name, "object": "model", "created": created, "owned_by": "trl-grpo-ext"}
            for name in dict.fromkeys(names)
        ]
        records = sorted(
            (
                c
                for c in self.registry.visible_checkpoints(caller)
                if c.kind == "sampler" and not self._base_differs(c)
            ),
            key=lambda c: c.created,
        )
        data += [{"id": c.uri, "object": "model", "created": int(c.created), "owned_by": c.run} for c in records]
        return {"object": "list", "data": data}

    async def chat_completion(self, caller, body: object) -> tuple[dict, list[dict] | None]:
        """The completion of a chat-completions request, and, with ``stream``, its chunks (else None)."""
        job = await self._in_thread(self._queue_chat, caller, body)
        try:
            results = await asyncio.wrap_future(job["future"])
        except EngineError as error:
            raise ApiError(400, error.code, error.message) from None
        return self._chat_answer(job, results)

    def _queue_chat(self, caller, body: object) -> dict:
        """Check the request, resolve its model and queue its prompt for decoding (in a request thread)."""
        if not isinstance(body, dict):
            raise _bad("the request body must be a JSON object")
        unknown = sorted(set(body) - KNOWN_KEYS)
        if unknown:
            raise _bad(f"unsupported parameters {unknown}; this server takes {sorted(KNOWN_KEYS)}")
        for key, neutral in NEUTRAL.items():
            if body.get(key) not in (None, neutral) and not (neutral is None and body.get(key) == {}):
                raise _bad(f"{key} is not supported by this server (only {neutral!r})")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise _bad("model must be a served model name or a trio:// checkpoint path")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise _bad(f"stream must be true or false, got {stream!r}")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or len(messages) > MAX_MESSAGES:
            raise _bad(f"messages must be a list of 1 to {MAX_MESSAGES} messages")
        chat = [_message_text(i, m) for i, m in enumerate(messages)]
        engine, sampler, snapshot = self._chat_weights(model, caller)
        prompt = self._chat_prompt(engine.tokenizer, chat)
        limits = engine.sample_limits(self.config.max_num_samples)
        n = body.get("n", 1)
        if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
            raise _bad("give max_tokens or max_completion_tokens, not both")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is None:
            room = (limits.max_seq_len - len(prompt)) if limits.max_seq_len else DEFAULT_MAX_TOKENS
            max_tokens = max(1, min(DEFAULT_MAX_TOKENS, room))
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise _bad(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        params = {"max_tokens": max_tokens}
        for key in ("temperature", "top_p", "top_k", "seed", "stop"):
            if body.get(key) is not None:
                params[key] = body[key]
        try:
            spec = sample_spec(prompt, n, params, limits)
        except EngineError as error:
            raise ApiError(400, error.code, error.message) from None
        cost = engine.memory_model.sample_bytes(len(prompt), spec.num_samples, spec.max_tokens)
        self.memory.refuse_beyond(cost, f"this chat completion ({spec.num_samples} x {spec.max_tokens} tokens)")
        try:
            future = sampler.submit(snapshot, spec, cost)
        except EngineError as error:
            raise ApiError(400, error.code, error.message) from None
        options = body.get("stream_options")
        usage = stream and isinstance(options, dict) and options.get("include_usage") is True
        return {"model": model, "prompt": prompt, "stream": stream, "usage_chunk": usage, "future": future}

    def _chat_weights(self, model: str, caller):
        """(engine, decode batcher, LoRA snapshot) of `model`: a name of the training model or of a sampling-only one
        (no snapshot), or a ``trio://`` URI the caller may see (the training model with its weights; 404 for another
        key's, as for a missing one; 409 for one trained on another base)."""
        if model.startswith("trio://"):
            record = self.registry.checkpoint(model, caller)
            return self.engine.for_sampling, self.sampler, self._snapshot(record, with_optimizer=False)
        return *self.model_for(self._resolve_base_model(model)), None

    def _chat_prompt(self, tokenizer, chat: list[dict]) -> list[int]:
        if not getattr(tokenizer, "chat_template", None):
            raise _bad("this model's tokenizer has no chat template: use the PyTRIO sample API with token ids")
        try:
            text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        except Exception as error:  # noqa: BLE001 - a template that refuses these messages (roles, order)
            raise _bad(f"the model's chat template refused these messages: {error}") from None
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    def _chat_answer(self, job: dict, results) -> tuple[dict, list[dict] | None]:
        cid, created, model = f"chatcmpl-{secrets.token_hex(12)}", int(time.time()), job["model"]
        completion_tokens = sum(len(r.tokens) for r in results)
        usage = {
            "prompt_tokens": len(job["prompt"]),
            "completion_tokens": completion_tokens,
            "total_tokens": len(job["prompt"]) + completion_tokens,
        }
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": r.text},
                "finish_reason": r.stop_reason,  # "stop" or "length", OpenAI's names too
                "logprobs": None,
            }
            for i, r in enumerate(results)
        ]
        answer = {"id": cid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
                  "usage": usage}  # fmt: skip
        if not job["stream"]:
            return answer, None
        head = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model}
        chunks = []
        for i, r in enumerate(results):
            for delta, finish in (({"role": "assistant", "content": ""}, None), ({"content": r.text}, None),
                                  ({}, r.stop_reason)):  # fmt: skip
                chunks.append({**head, "choices": [{"index": i, "delta": delta, "finish_reason": finish}]})
        if job["usage_chunk"]:
            chunks.append({**head, "choices": [], "usage": usage})
        return answer, chunks


def sse_events(chunks: list[dict]) -> bytes:
    """Server-sent events of `chunks`, then ``data: [DONE]``, as OpenAI streams a chat completion."""
    return b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"
