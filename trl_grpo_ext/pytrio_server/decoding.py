"""Sampling on the local server's model: a request's rows, decode batches shared by concurrent requests.

`Sampling` is the part of `ModelEngine` that samples a prompt (on its own) and scores prompt tokens; a `DecodeBatch`
holds the rows of several requests on one adapter snapshot and decodes them together, one token per row per step.
`server/sampling.py` feeds it concurrent requests. A request's tokens depend on its prompt, parameters and seed only
(`RequestRows`: its own generator, its own rows), never on its batch-mates.

A request with images (`SampleSpec.vision`) decodes in a batch of its own: its prefill runs the vision tower, and its
rows continue from 3D (M-RoPE) positions offset by the image's ``rope_delta``, which rows of other prompts do not share.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from trl_grpo_ext.compat import output_cache
from trl_grpo_ext.cpu.token_draws import multinomial
from trl_grpo_ext.grpo.sampling_distribution import SamplingSettings, processed_logprobs
from trl_grpo_ext.pytrio_server.adapters import LoraSnapshot
from trl_grpo_ext.pytrio_server.errors import EngineError
from trl_grpo_ext.pytrio_server.images import VisionInput


@dataclass
class SampleResult:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str
    text: str | None = None


@dataclass
class SampleSpec:
    """One sample request: `num_samples` continuations of `prompt` (``temperature`` 0 = greedy)."""

    prompt: list[int]
    num_samples: int
    max_tokens: int
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    return_text: bool = True
    vision: VisionInput | None = None  # the images of the prompt (`prompt` holds their placeholder tokens)


def default_stop_ids(model, tokenizer) -> set[int]:
    """The end-of-sequence ids of `model`'s generation config and of `tokenizer`: every request stops on them."""
    ids = set()
    for value in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


def sampling_distribution(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Log-probabilities of the distribution actually sampled from: greedy (``temperature`` 0) a point mass on the
    argmax, else the one definition both execution paths share (temperature, top-k, top-p applied,
    `trl_grpo_ext.grpo.sampling_distribution`; ``top_k`` -1 is off)."""
    if temperature <= 0:  # greedy: a point mass on the argmax
        out = torch.full_like(logits, float("-inf"))
        return out.scatter(-1, logits.argmax(-1, keepdim=True), 0.0)
    settings = SamplingSettings(temperature=temperature, top_k=max(int(top_k or 0), 0), top_p=float(top_p or 1.0))
    return processed_logprobs(logits, settings)


def ends_with_stop(tokenizer, tokens: list[int], stop: list[str]) -> bool:
    """Whether the decoded `tokens` end with one of the `stop` strings (checked after every drawn token)."""
    # Checked after every token, so a stop string can only have appeared in the newest one: a short
    # decoded tail is enough to see it.
    tail = tokenizer.decode(tokens[-(max(len(s) for s in stop) + 8) :])
    return any(s in tail for s in stop)


def completion_text(tokenizer, tokens: list[int], stop: list[str], stopped_by_token: bool) -> str:
    """A completion's ``text`` as the hosted service (and vLLM's defaults) return it: special tokens skipped, the
    stop token that ended it (EOS or a ``stop_token_ids`` id) and a matched stop string left out. The sequence's
    tokens and log-probs keep them: only the text is trimmed."""
    if stopped_by_token:
        tokens = tokens[:-1]
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    if stop and not stopped_by_token:
        found = [i for i in (text.find(s) for s in stop) if i >= 0]
        if found:  # the earliest match is the one that stopped it; a stop string never appears in the text
            text = text[: min(found)]
    return text


class Sampling:
    """The sampling side of `ModelEngine` (uses its ``lock``, ``device``, ``tokenizer``, ``stop_ids``, ``cache_kw``,
    `check_sample`, `use_snapshot` and, for prompt log-probs, ``decode`` / ``token_logprobs`` / ``token_topk``)."""

    def sample(self, snapshot: LoraSnapshot | None, prompt: list[int], *, num_samples: int, **params):
        """Sample `num_samples` continuations of `prompt` (`SampleSpec` fields as keywords), on its own.

        The same computation as the request inside a `DecodeBatch` shared with others.
        """
        spec = self.check_sample(SampleSpec(list(prompt), num_samples, **params))
        batch = DecodeBatch(self, snapshot)
        rows = batch.admit(spec)
        while batch.requests:
            batch.step()
        return rows.results(self.tokenizer)

    def prompt_logprobs(
        self, snapshot: LoraSnapshot | None, prompt: list[int], topk: int = 0, vision: VisionInput | None = None
    ):
        """``[None, log p(x_1 | x_0), ...]`` and, with ``topk``, the top-k (token, logprob) per position. With
        `vision` (`prompt` is then ``vision.tokens``), an image placeholder's position is None too."""
        with self.lock:
            _model, ctx = self.use_snapshot(snapshot)
            with ctx, torch.no_grad():
                if vision is not None:
                    features = self.vision_features(vision, use_cache=False)
                else:
                    features, _ = self.decode(input_ids=torch.tensor([prompt], device=self.device))
                features = features[0, :-1]  # position i scores token i + 1
                targets = torch.tensor(prompt[1:], device=self.device)
                values = self.token_logprobs(features, targets).tolist() if len(prompt) > 1 else []
                top = None
                if topk > 0:
                    top_v, top_i = self.token_topk(features, topk)
                    pairs = zip(top_i.tolist(), top_v.tolist(), strict=True)
                    top = [None] + [list(zip(i, v, strict=True)) for i, v in pairs]
        values = [None, *values]
        if vision is not None:
            values = [None if slot else v for v, slot in zip(values, vision.image_slots, strict=True)]
            if top is not None:
                top = [None if slot else t for t, slot in zip(top, vision.image_slots, strict=True)]
        return values, top


class RequestRows:
    """One request's rows in a `DecodeBatch`: its own generator, the next-token logits of its rows, the tokens so far.

    A request always draws from its own rows only, with its own generator, in the same order (every row each step
    until all its rows stopped), so its tokens are a function of its prompt, parameters and seed, not of the other
    requests in the batch.
    """

    def __init__(self, spec: SampleSpec, logits: torch.Tensor, device: torch.device, stop_ids: set[int]):
        self.spec = spec
        seed = spec.seed if spec.seed is not None else random.randrange(2**63)
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.logits = logits  # (num_samples, vocab): scores the next token of each row
        self.stop_ids = stop_ids | set(spec.stop_token_ids)
        self.stop = [s for s in spec.stop if s]
        n = spec.num_samples
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.logps: list[list[float]] = [[] for _ in range(n)]
        self.reasons = ["length"] * n
        self.stopped_by_token = [False] * n  # its last token is a stop id (left out of `text`)
        self.done = [False] * n
        self.last = torch.zeros(n, dtype=torch.long, device=device)  # the token each row feeds next
        self.steps = 0
        self.error: Exception | None = None  # set when drawing failed: the request leaves the batch with it

    @property
    def finished(self) -> bool:
        return self.error is not None or all(self.done) or self.steps >= self.spec.max_tokens

    def draw(self, tokenizer) -> None:
        spec = self.spec
        dist = sampling_distribution(self.logits, spec.temperature, spec.top_k, spec.top_p)
        nxt = multinomial(dist.exp(), 1, generator=self.generator).squeeze(-1)  # torch's draws, vectorised
        chosen = dist.gather(-1, nxt.unsqueeze(-1)).squeeze(-1)
        for i in range(spec.num_samples):
            if self.done[i]:
                continue
            tok = int(nxt[i])
            self.tokens[i].append(tok)
            self.logps[i].append(float(chosen[i]))
            if tok in self.stop_ids:
                self.done[i], self.reasons[i], self.stopped_by_token[i] = True, "stop", True
            elif self.stop and ends_with_stop(tokenizer, self.tokens[i], self.stop):
                self.done[i], self.reasons[i] = True, "stop"
        self.last = nxt
        self.steps += 1

    def results(self, tokenizer) -> list[SampleResult]:
        texts = [
            completion_text(tokenizer, t, self.stop if r == "stop" else [], by_token)
            if self.spec.return_text
            else None
            for t, r, by_token in zip(self.tokens, self.reasons, self.stopped_by_token, strict=True)
        ]
        return [
            SampleResult(t, lp, r, text)
            for t, lp, r, text in zip(self.tokens, self.logps, self.reasons, texts, strict=True)
        ]


class DecodeBatch:
    """Rows of several sample requests on one adapter snapshot, decoded together one token per row per `step`.

    Decoding is memory-bound (every step reads all weights), so one step for many rows costs about what one step
    for a few does. Each request is prefilled on its own (its prompt encoded once, the cache expanded to its
    `num_samples` rows: exactly what a request alone does), then its cache joins the batch's, left-padded to the
    longest row, with explicit positions and a padding mask. Requests join between steps and leave when done.
    """

    def __init__(self, engine: Sampling, snapshot: LoraSnapshot | None):
        self.engine = engine
        self.snapshot = snapshot
        self.uid = snapshot.uid if snapshot is not None else None
        self.requests: list[RequestRows] = []  # in row order
        self.cache = None
        self.mask: torch.Tensor | None = None  # (rows, cached slots): 1 real, 0 left padding
        self.positions: torch.Tensor | None = None  # (rows,): position of the token each row feeds next
        self.rope_delta = 0  # a request with images: its rows' rotary positions run this far from their indices
        self.has_images = False

    @property
    def rows(self) -> int:
        return sum(r.spec.num_samples for r in self.requests)

    def can_join(self, snapshot: LoraSnapshot | None, spec: SampleSpec | None = None) -> bool:
        """Whether a request on `snapshot` can join: same weights, and a cache this class can pad and concatenate
        (neither it nor the batch has images)."""
        if (snapshot.uid if snapshot is not None else None) != self.uid:
            return False
        if self.has_images or (spec is not None and spec.vision is not None):
            return False
        return self.cache is None or all(type(layer) is _dynamic_layer_type() for layer in self.cache.layers)

    def admit(self, spec: SampleSpec) -> RequestRows:
        engine, n = self.engine, spec.num_samples
        with engine.lock:
            model, ctx = engine.use_snapshot(self.snapshot)
            with ctx, torch.no_grad():
                if spec.vision is not None:
                    if self.requests:
                        raise EngineError("sampling_failed", "a request with images decodes in a batch of its own")
                    out = model(**spec.vision.model_kwargs(engine.device), use_cache=True, logits_to_keep=1)
                    self.has_images, self.rope_delta = True, spec.vision.rope_delta
                else:
                    prompt = torch.tensor([spec.prompt], device=engine.device)
                    out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
                cache, logits = output_cache(out), out.logits[:, -1].float()
                if n > 1:
                    repeat_rows(cache, n)
        rows = RequestRows(spec, logits.expand(n, -1), engine.device, engine.stop_ids)
        length = len(spec.prompt)
        mask = torch.ones(n, length, dtype=torch.long, device=engine.device)
        positions = torch.full((n,), length, dtype=torch.long, device=engine.device)
        if self.cache is None:
            self.cache, self.mask, self.positions = cache, mask, positions
        else:  # joined tensors built first, then swapped in: a request failing here leaves the batch as it was
            width = max(self.mask.shape[1], length)
            joined = [
                (torch.cat([_left_pad(mine.keys, width), _left_pad(theirs.keys, width)]),
                 torch.cat([_left_pad(mine.values, width), _left_pad(theirs.values, width)]))
                for mine, theirs in zip(self.cache.layers, cache.layers, strict=True)
            ]  # fmt: skip
            mask = torch.cat([_left_pad(self.mask, width, dim=1), _left_pad(mask, width, dim=1)])
            positions = torch.cat([self.positions, positions])
            for layer, (keys, values) in zip(self.cache.layers, joined, strict=True):
                layer.keys, layer.values = keys, values
            self.mask, self.positions = mask, positions
        self.requests.append(rows)
        return rows

    def step(self) -> list[RequestRows]:
        """Draw one token for every row, retire the requests that are done (returned), advance the others."""
        engine = self.engine
        for rows in self.requests:
            if not rows.finished:  # max_tokens 0: nothing to draw
                try:
                    rows.draw(engine.tokenizer)
                except Exception as error:  # noqa: BLE001 - this request fails alone; its batch-mates go on
                    rows.error = error
        finished = [r for r in self.requests if r.finished]
        if finished:
            keep, start = [], 0
            for rows in self.requests:
                n = rows.spec.num_samples
                if not rows.finished:
                    keep.extend(range(start, start + n))
                start += n
            self.requests = [r for r in self.requests if not r.finished]
            if not self.requests:
                self.cache = self.mask = self.positions = None
                self.has_images, self.rope_delta = False, 0
                return finished
            index = torch.tensor(keep, dtype=torch.long, device=engine.device)
            self.cache.batch_select_indices(index)
            self.mask, self.positions = self.mask[index], self.positions[index]
            width = int(self.mask.sum(1).max())  # slots no remaining row uses are dropped
            if width < self.mask.shape[1]:
                cut = self.mask.shape[1] - width
                for layer in self.cache.layers:
                    layer.keys, layer.values = layer.keys[:, :, cut:], layer.values[:, :, cut:]
                self.mask = self.mask[:, cut:]
        ids = torch.cat([r.last for r in self.requests]).unsqueeze(-1)
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], 1)], dim=1)
        with engine.lock:
            model, ctx = engine.use_snapshot(self.snapshot)
            with ctx, torch.no_grad():
                out = model(
                    input_ids=ids,
                    attention_mask=self.mask,
                    position_ids=(self.positions + self.rope_delta).unsqueeze(-1),
                    use_cache=True,
                    logits_to_keep=1,
                    **{engine.cache_kw: self.cache},
                )
        self.cache, self.positions = output_cache(out), self.positions + 1
        logits = out.logits[:, -1].float()
        start = 0
        for rows in self.requests:
            n = rows.spec.num_samples
            rows.logits = logits[start : start + n]
            start += n
        return finished


def repeat_rows(cache, n: int) -> None:
    """Each batch row of `cache` repeated `n` times in place (`batch_repeat_interleave`'s order), for every layer
    type: attention keys and values (the layer's own method), and the conv and recurrent states of the
    linear-attention layers of hybrid models (Qwen3.5, Qwen3-Next), whose layers have no such method, or one that
    repeats only their attention part."""
    for layer in cache.layers:
        if hasattr(layer, "batch_repeat_interleave"):
            layer.batch_repeat_interleave(n)
        elif not hasattr(layer, "recurrent_states"):
            raise EngineError("unsupported_cache", f"cannot sample several rows with a {type(layer).__name__} cache")
        for name in ("conv_states", "recurrent_states"):
            states = getattr(layer, name, None)
            if isinstance(states, dict):
                for key, tensor in states.items():
                    if isinstance(tensor, torch.Tensor):
                        states[key] = tensor.repeat_interleave(n, dim=0)


def _left_pad(tensor: torch.Tensor, width: int, dim: int = -2) -> torch.Tensor:
    """`tensor` with zeros prepended along `dim` up to `width`."""
    missing = width - tensor.shape[dim]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


def _dynamic_layer_type():
    from transformers.cache_utils import DynamicLayer

    return DynamicLayer
