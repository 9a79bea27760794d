"""Forward and forward/backward of the local server: right-padded batches, prompt-prefix sharing, per-token losses.

`ForwardBackward` is the part of `ModelEngine` that runs ``trainer.forward`` / ``trainer.forward_backward`` data
(`ForwardDatum`) on a run's adapter. Data run in chunks of at most ``max_batch_tokens`` padded tokens; within a chunk,
rows that share a token prefix (a GRPO group's prompt) encode it once (`_pieces`, two levels: a head common to all
groups, then each group's prompt), and their suffixes run on copies of its KV cache. Outputs and gradients equal the
unshared computation to float rounding (tests/test_pytrio_server_prefix.py).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch

from trl_grpo_ext.prefix import log_fallback_once
from trl_grpo_ext.pytrio.server.errors import EngineError
from trl_grpo_ext.pytrio.server.losses import LossSpec, per_token_loss

# Leading tokens forward/backward rows must share before they are encoded once: below this the extra model call
# costs more than the tokens it saves.
MIN_SHARED_PREFIX = 8


@dataclass
class ForwardDatum:
    tokens: list[int]
    targets: list[int]
    weights: list[float] | None = None
    old_logprobs: list[float] | None = None
    advantages: list[float] | None = None


class ForwardBackward:
    """The forward/backward side of `ModelEngine` (uses its ``decode`` / ``token_logprobs`` (`logprobs`),
    ``device``, ``lock``, ``vocab_size``, ``cache_kw``, ``prefix_sharing_reason``, its runs (``_run``,
    ``_activate``) and the ``max_batch_tokens`` / ``share_prefix`` / ``min_shared_prefix`` settings)."""

    def _check_tokens(self, datum: ForwardDatum) -> None:
        if max(datum.tokens, default=0) >= self.vocab_size or min(datum.tokens, default=0) < 0:
            raise EngineError("token_out_of_range", f"input token ids must lie in [0, {self.vocab_size})")
        if any(t >= self.vocab_size or (t < 0 and t != -100) for t in datum.targets):
            raise EngineError("token_out_of_range", f"target token ids must lie in [0, {self.vocab_size}) or be -100")

    def _batch_target_logprobs(self, data: list[ForwardDatum], auto_shift: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-position log p(target) of a right-padded batch, (B, T), and the mask of valid target positions.

        Right padding keeps every real token's position ids and causal context as in a single-sequence forward;
        padded positions carry target -100, so they never count.
        """
        lengths = [len(d.tokens) for d in data]
        width = max(lengths)
        ids = self._padded([d.tokens for d in data], width, torch.long)
        targets = self._padded([d.targets for d in data], width, torch.long, fill=-100)
        # no mask when nothing is padded: the exact computation of an unpadded forward
        mask = None
        if min(lengths) < width:
            mask = (torch.arange(width) < torch.tensor(lengths).unsqueeze(1)).long().to(self.device)
        with self.layer_checkpointing(torch.is_grad_enabled() and ids.numel() > self.checkpoint_tokens):
            hidden, _ = self.decode(input_ids=ids, attention_mask=mask, use_cache=False)
        if auto_shift:
            # position i predicts target i + 1; the first label has no predicting position (masked below)
            hidden = torch.cat([hidden.new_zeros(hidden.shape[0], 1, hidden.shape[-1]), hidden[:, :-1]], dim=1)
        valid = targets != -100
        if auto_shift:
            valid[:, 0] = False
        gathered = self.token_logprobs(hidden, targets.clamp(min=0))
        return torch.where(valid, gathered, torch.zeros_like(gathered)), valid

    def _padded(self, rows: list[list[float]], width: int, dtype: torch.dtype, fill: float = 0) -> torch.Tensor:
        """Rows right-padded with `fill` to `width`, as one (len(rows), width) tensor on the engine's device."""
        out = torch.full((len(rows), width), fill, dtype=dtype)
        for i, row in enumerate(rows):
            out[i, : len(row)] = torch.tensor(row, dtype=dtype)
        return out.to(self.device)

    def _chunks(self, data: list[ForwardDatum], backward: bool, budget: int | None) -> list[list[ForwardDatum]]:
        """Consecutive groups whose padded size stays within `max_batch_tokens` (bounds the logits' memory) and
        whose working memory within `budget` bytes (None: no such bound)."""
        chunks, start = [], 0
        for rows, _width in self._chunk_shapes([len(d.tokens) for d in data], backward, budget):
            chunks.append(data[start : start + rows])
            start += rows
        return chunks

    def _chunk_shapes(self, lengths: list[int], backward: bool, budget: int | None) -> list[tuple[int, int]]:
        def fits(rows: int, width: int) -> bool:
            tokens_fit = rows * width <= self.max_batch_tokens
            return tokens_fit and (budget is None or self._chunk_bytes(rows, width, backward) <= budget)

        return chunk_shapes(lengths, fits)

    def _chunk_bytes(self, rows: int, width: int, backward: bool) -> int:
        tokens = rows * width
        # rows sharing a prefix run on its KV cache: their layers cannot be recomputed (upper bound: all shared)
        shared = self.share_prefix and rows > 1 and self.prefix_sharing_reason is None
        recomputed = not shared and self.can_checkpoint and tokens > self.checkpoint_tokens
        return self.memory_model.chunk_bytes(tokens, backward, recomputed)

    def forward_bytes(self, lengths: list[int], backward: bool, budget: int | None = None) -> int:
        """Working memory of a forward (and backward) over data of these token counts, chunked as `forward` chunks
        them under `budget`: its largest chunk's (above `budget` only when one item alone is)."""
        shapes = self._chunk_shapes([n for n in lengths if n], backward, budget)
        return max((self._chunk_bytes(rows, width, backward) for rows, width in shapes), default=0)

    def _piece_loss(self, piece: list[ForwardDatum], spec: LossSpec, logprobs: torch.Tensor, valid: torch.Tensor):
        """(summed loss, per-token loss, counted-token mask) of right-padded rows `logprobs` (B, T)."""
        width = logprobs.shape[1]
        mask = valid.clone()
        kwargs = {}
        if spec.name == "cross_entropy":
            weights = self._padded([d.weights for d in piece], width, logprobs.dtype)
            mask &= weights != 0
            kwargs["weights"] = weights
        else:
            kwargs["old_logprobs"] = self._padded([d.old_logprobs for d in piece], width, logprobs.dtype)
            advantages = self._padded([d.advantages for d in piece], width, logprobs.dtype)
            kwargs["advantages"] = advantages
            if spec.name == "dro":  # its quadratic penalty would otherwise train prompt tokens
                mask &= advantages != 0
        loss_tok, _ = per_token_loss(spec, logprobs, **kwargs)
        loss_tok = torch.where(mask, loss_tok, torch.zeros_like(loss_tok))
        loss = loss_tok.sum()
        if not torch.isfinite(loss):
            raise EngineError("non_finite_loss", f"loss is {loss.item()}; check logprobs and advantages")
        return loss, loss_tok, mask

    def _pieces(self, chunk: list[ForwardDatum]) -> list[tuple[list[int], int]]:
        """The chunk's rows as (indices, shared prefix length): groups that share at least `min_shared_prefix`
        leading tokens (encoded once, `_shared_target_logprobs`), then every other row in one plain batch (0).

        A chunk in which nothing is shared is one plain piece: exactly the computation without sharing.
        """
        everything = [(list(range(len(chunk))), 0)]
        if not self.share_prefix or len(chunk) < 2:
            return everything
        reason = self.prefix_sharing_reason
        if reason is not None:
            log_fallback_once(f"local PyTRIO server forward: {reason}")
            return everything
        groups: list[list] = []  # [member indices, representative tokens, shared length]
        for i, datum in enumerate(chunk):
            best, best_shared = None, 0
            for group in groups:
                shared = min(group[2], _common_prefix(group[1], datum.tokens), len(datum.tokens) - 1)
                # a row may not shorten a group's shared prefix (another prompt with the same system head would
                # otherwise pull the whole group down to the head): it starts its own group instead
                if shared > best_shared and (len(group[0]) == 1 or shared == group[2]):
                    best, best_shared = group, shared
            if best is not None and best_shared >= self.min_shared_prefix:
                best[0].append(i)
                best[2] = best_shared
            else:
                groups.append([[i], datum.tokens, len(datum.tokens) - 1])
        shared = [(g[0], g[2]) for g in groups if len(g[0]) > 1]
        plain = sorted(i for g in groups if len(g[0]) == 1 for i in g[0])
        if not shared:
            return everything
        return shared + ([(plain, 0)] if plain else [])

    def _head_length(self, chunk: list[ForwardDatum], groups: list[tuple[list[int], int]]) -> int:
        """Leading tokens common to every group of the chunk (system prompt, one-shot example): encoded once for
        all of them; 0 when fewer than `min_shared_prefix` or only one group."""
        if len(groups) < 2:
            return 0
        first = chunk[groups[0][0][0]].tokens
        head = min(shared for _, shared in groups)
        for rows, _ in groups[1:]:
            head = min(head, _common_prefix(first, chunk[rows[0]].tokens))
        return head if head >= self.min_shared_prefix else 0

    def _shared_target_logprobs(
        self, groups: list[list[ForwardDatum]], shared: list[int], head: int, auto_shift: bool
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`_batch_target_logprobs` of each group, whose rows' first ``shared[g]`` tokens are equal, those encoded
        once; with ``head > 0`` the first `head` tokens, common to all groups, are encoded once for all.

        Level 1, the head, runs as one row; level 2, each group's rest of prefix, as one row on a copy of the head's
        KV cache; that cache is repeated to the group's rows (a differentiable copy: every row's gradient flows back
        into the one prefix encoding) and the rows' suffixes run on top, right-padded, with their own positions.
        Log-probs at prefix positions come from the prefix's logits, gathered with each row's own targets.
        """
        head_cache = head_hidden = None
        if head:
            ids = torch.tensor([groups[0][0].tokens[:head]], device=self.device)
            head_hidden, head_cache = self.decode(input_ids=ids, use_cache=True)
        results = []
        for data, length in zip(groups, shared, strict=True):
            tokens = data[0].tokens
            if head:
                cache, prefix_hidden = _copy_cache(head_cache), head_hidden
                if length > head:
                    ids = torch.tensor([tokens[head:length]], device=self.device)
                    hidden, cache = self.decode(input_ids=ids, attention_mask=torch.ones(1, length, dtype=torch.long, device=self.device),
                                                position_ids=torch.arange(head, length, device=self.device)[None],
                                                use_cache=True, **{self.cache_kw: cache})  # fmt: skip
                    prefix_hidden = torch.cat([head_hidden, hidden], dim=1)
            else:
                ids = torch.tensor([tokens[:length]], device=self.device)
                prefix_hidden, cache = self.decode(input_ids=ids, use_cache=True)  # (1, length, H)
            results.append(self._suffix_target_logprobs(data, length, cache, prefix_hidden, auto_shift))
        return results

    def _suffix_target_logprobs(self, data, shared: int, cache, prefix_hidden: torch.Tensor, auto_shift: bool):
        """Rows `data` continuing a cached one-row prefix of `shared` tokens whose last hidden states are
        `prefix_hidden`."""
        n_rows = len(data)
        lengths = [len(d.tokens) for d in data]
        width = max(lengths)
        cache.batch_repeat_interleave(n_rows)
        suffix_width = width - shared
        ids = self._padded([d.tokens[shared:] for d in data], suffix_width, torch.long)
        mask = (torch.arange(width) < torch.tensor(lengths).unsqueeze(1)).long().to(self.device)
        positions = (shared + torch.arange(suffix_width, device=self.device)).expand(n_rows, -1)
        suffix_hidden, _ = self.decode(
            input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **{self.cache_kw: cache}
        )  # fmt: skip  (rows, width - shared, H)
        targets = self._padded([d.targets for d in data], width, torch.long, fill=-100)
        # the target each position's logits score: its own (no shift) or the next position's (auto_shift)
        scored = torch.cat([targets[:, 1:], targets.new_full((n_rows, 1), -100)], 1) if auto_shift else targets
        index = scored.clamp(min=0).unsqueeze(-1)
        # prefix positions: their logits once, each row's own target gathered from them ((shared, rows) -> (rows, shared))
        head = self.token_logprobs(prefix_hidden[0], index[:, :shared, 0].T).T
        tail = self.token_logprobs(suffix_hidden, index[:, shared:, 0])
        gathered = torch.cat([head, tail], dim=1)
        if auto_shift:  # position i reports the logits of position i - 1 scoring target i
            gathered = torch.cat([gathered.new_zeros(n_rows, 1), gathered[:, :-1]], dim=1)
        valid = targets != -100
        if auto_shift:
            valid[:, 0] = False
        return torch.where(valid, gathered, torch.zeros_like(gathered)), valid

    def forward(
        self,
        run_id: str,
        data: list[ForwardDatum],
        spec: LossSpec,
        *,
        backward: bool,
        auto_shift: bool,
        budget: int | None = None,
    ):
        """Per-datum outputs (``logprobs``, ``elementwise_loss`` as float arrays) and summed metrics.

        The loss of the call is the sum over data and counted tokens; gradients accumulate into the run's
        adapter until `optim_step`. Data run as right-padded batches (`_chunks`, each within `budget` bytes of
        working memory where one item alone is not above it), which leaves the sum unchanged.
        """
        with self.lock:
            run = self._run(run_id)
            self.check_lengths([len(d.tokens) for d in data])
            for datum in data:  # before any backward: a bad datum must not leave half a batch of gradients
                self._check_tokens(datum)
            self._activate(run.adapter, trainable=backward)
            outputs, loss_sum, token_count = [], 0.0, 0
            for chunk in self._chunks([d for d in data if d.tokens], backward, budget):
                chunk_outputs: list[dict | None] = [None] * len(chunk)
                pieces = self._pieces(chunk)
                groups = [(rows, shared) for rows, shared in pieces if shared]
                plain = [rows for rows, shared in pieces if not shared]
                results = []  # (rows, logprobs, loss, per-token loss, mask)
                with torch.set_grad_enabled(backward):
                    if groups:  # one backward for all groups: they may share the head's encoding
                        head = self._head_length(chunk, groups)
                        members = [[chunk[i] for i in rows] for rows, _ in groups]
                        shared_rows = self._shared_target_logprobs(members, [s for _, s in groups], head, auto_shift)
                        total = 0
                        for (rows, _), piece, (logprobs, valid) in zip(groups, members, shared_rows, strict=True):
                            loss, loss_tok, mask = self._piece_loss(piece, spec, logprobs, valid)
                            results.append((rows, logprobs, loss, loss_tok, mask))
                            total = total + loss
                        if backward:
                            total.backward()
                    for rows in plain:  # the loss is a sum: a backward per piece accumulates the same gradient
                        piece = [chunk[i] for i in rows]
                        logprobs, valid = self._batch_target_logprobs(piece, auto_shift)
                        loss, loss_tok, mask = self._piece_loss(piece, spec, logprobs, valid)
                        if backward:
                            loss.backward()
                        results.append((rows, logprobs, loss, loss_tok, mask))
                for rows, logprobs, loss, loss_tok, mask in results:
                    logprobs_np, loss_np = logprobs.detach().cpu().numpy(), loss_tok.detach().cpu().numpy()
                    for row, i in enumerate(rows):
                        n = len(chunk[i].tokens)
                        chunk_outputs[i] = {"logprobs": logprobs_np[row, :n], "elementwise_loss": loss_np[row, :n]}
                    loss_sum += float(loss.detach())
                    token_count += int(mask.sum())
                outputs.extend(chunk_outputs)
            if len(outputs) != len(data):  # empty data (no tokens) keep their place with empty outputs
                filled = iter(outputs)
                empty = {"logprobs": np.zeros(0, np.float32), "elementwise_loss": np.zeros(0, np.float32)}
                outputs = [dict(empty) if not d.tokens else next(filled) for d in data]
            if backward:
                run.pending_tokens += token_count
            return outputs, {"loss_sum": loss_sum, "token_count": token_count}


def chunk_shapes(lengths: list[int], fits) -> list[tuple[int, int]]:
    """(rows, padded width) of each chunk of consecutive data, a chunk growing while ``fits(rows, width)`` (a datum
    that fits nowhere is a chunk of its own)."""
    shapes: list[tuple[int, int]] = []
    rows = width = 0
    for length in lengths:
        grown = max(width, length)
        if rows and not fits(rows + 1, grown):
            shapes.append((rows, width))
            rows, grown = 0, length
        rows += 1
        width = grown
    if rows:
        shapes.append((rows, width))
    return shapes


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _copy_cache(cache):
    """A cache holding the same KV tensors as `cache`, which appending to leaves `cache` as it is (DynamicLayer's
    update concatenates into new tensors)."""
    twin = copy.copy(cache)
    twin.layers = [copy.copy(layer) for layer in cache.layers]
    return twin
