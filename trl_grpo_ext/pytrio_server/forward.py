"""Forward and forward/backward of the local server: right-padded batches, prompt-prefix sharing, per-token losses.

`ForwardBackward` is the part of `ModelEngine` that runs ``trainer.forward`` / ``trainer.forward_backward`` data
(`ForwardDatum`) on a run's adapter. Data run in chunks of at most ``max_batch_tokens`` padded tokens; within a chunk,
rows that share a token prefix (a GRPO group's prompt) encode it once through the prefix engine the TRL path uses
(`trl_grpo_ext.prefix`): `plan_token_rows` groups them (two levels: a head common to all groups, then each group's
prompt), `pack_rows` lays them out as segments of one packed forward, its cost model keeps the right-padded batch
where that is cheaper, and `PackedBatch.row_reads` says where each row's positions lie in the output. Outputs and
gradients equal the unshared computation to float rounding (tests/test_pytrio_server_prefix.py).

Data with images (`ForwardDatum.vision`, `images.VisionInput`) step aside from both: each runs alone, unpadded and
unshared, through the whole image-text model (vision tower included); positions that would score an image placeholder
carry no target (`images.mask_image_targets`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from trl_grpo_ext.prefix import log_fallback_once
from trl_grpo_ext.prefix.packing import PackedBatch, fit_to, pack_rows, packed_beats_padded
from trl_grpo_ext.prefix.plan import plan_token_rows
from trl_grpo_ext.pytrio_server.errors import EngineError
from trl_grpo_ext.pytrio_server.images import VisionInput, mask_image_targets
from trl_grpo_ext.pytrio_server.loss_fns import LossSpec, per_token_loss

# Leading tokens forward/backward rows must share before they form a group whose prompt is encoded once: fewer
# save less than a segment of the packed layout costs.
MIN_SHARED_PREFIX = 8


def _counted(logprobs: torch.Tensor, targets: torch.Tensor, auto_shift: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) log-probs zeroed where no target counts, and that mask: padding and -100 targets never count, nor,
    with `auto_shift`, the first label (no position predicts it)."""
    valid = targets != -100
    if auto_shift:
        valid[:, 0] = False
    return torch.where(valid, logprobs, torch.zeros_like(logprobs)), valid


@dataclass
class ForwardDatum:
    tokens: list[int]
    targets: list[int]
    weights: list[float] | None = None
    old_logprobs: list[float] | None = None
    advantages: list[float] | None = None
    vision: VisionInput | None = None  # the images of an image-text input (`tokens` hold their placeholders)


class ForwardBackward:
    """The forward/backward side of `ModelEngine` (uses its ``decode`` / ``token_logprobs`` (`logprobs`),
    ``device``, ``lock``, ``vocab_size``, ``cache_kw``, ``prefix_sharing_reason``, its runs (``_run``,
    ``_activate``) and the ``max_batch_tokens`` / ``share_prefix`` / ``min_shared_prefix`` settings)."""

    def _check_tokens(self, datum: ForwardDatum) -> None:
        if datum.vision is not None and list(datum.tokens) != datum.vision.tokens:
            raise EngineError("invalid_input", "a datum with images must hold the tokens of its vision input")
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
            # position i predicts target i + 1; the first label has no predicting position (`_counted` masks it)
            hidden = torch.cat([hidden.new_zeros(hidden.shape[0], 1, hidden.shape[-1]), hidden[:, :-1]], dim=1)
        return _counted(self.token_logprobs(hidden, targets.clamp(min=0)), targets, auto_shift)

    def _image_target_logprobs(self, datum: ForwardDatum, auto_shift: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """`_batch_target_logprobs` of one datum with images: one unpadded forward of the image-text model."""
        targets = mask_image_targets(datum.targets, datum.vision, auto_shift)
        targets = torch.tensor([targets], dtype=torch.long, device=self.device)
        with self.layer_checkpointing(torch.is_grad_enabled() and len(datum.tokens) > self.checkpoint_tokens):
            hidden = self.vision_features(datum.vision, use_cache=False)
        if auto_shift:
            hidden = torch.cat([hidden.new_zeros(1, 1, hidden.shape[-1]), hidden[:, :-1]], dim=1)
        return _counted(self.token_logprobs(hidden, targets.clamp(min=0)), targets, auto_shift)

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
        # rows sharing a prefix run packed without layer recomputation (upper bound: all shared)
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

    def _plan(self, chunk: list[ForwardDatum]) -> tuple[PackedBatch | None, list[int], list[int]]:
        """The chunk's shared rows packed for one forward (``None`` when none share), those rows, and the others:
        the rows `plan_token_rows` groups, packed by `pack_rows`, where the cost model finds that cheaper than their
        right-padded batch. Otherwise every row is plain: exactly the computation without sharing."""
        everything = list(range(len(chunk)))
        if not self.share_prefix or len(chunk) < 2:
            return None, [], everything
        reason = self.prefix_sharing_reason
        if reason is not None:
            log_fallback_once(f"local PyTRIO server forward: {reason}")
            return None, [], everything
        sequences = [d.tokens for d in chunk]
        rows = plan_token_rows(sequences, self.min_shared_prefix)
        if rows.plan is None:
            return None, [], everything
        attn = self.base.config._attn_implementation
        packed = pack_rows(rows.plan, rows.completions(sequences), device=self.device, attn_implementation=attn)
        fit_to(packed, self.base)
        lengths = [len(sequences[i]) for i in rows.shared]
        # the LM head runs on every slot of either layout (log-probs of every position)
        if not packed_beats_padded(self.base, packed, lengths, max(lengths), every_position_scored=True):
            return None, [], everything
        return packed, list(rows.shared), list(rows.plain)

    def _packed_target_logprobs(self, data: list[ForwardDatum], packed: PackedBatch, auto_shift: bool):
        """`_batch_target_logprobs` of `data` from one forward of their packed layout.

        A shared position's output is computed once; the output layer runs on it once and each row reading it
        gathers its own target there (`PackedBatch.row_reads`), so rows may differ in their targets anywhere.
        """
        lengths = [len(d.tokens) for d in data]
        width = max(lengths)
        features, _ = self.decode(**packed.forward_kwargs(self.base), use_cache=False)
        features = features.reshape(-1, features.shape[-1])  # (bins * slots, F)
        slot, reader, readers = packed.row_reads(lengths)
        targets = self._padded([d.targets for d in data], width, torch.long, fill=-100)
        # the target each position's logits score: its own (no shift) or the next position's (auto_shift)
        scored = torch.cat([targets[:, 1:], targets.new_full((len(data), 1), -100)], 1) if auto_shift else targets
        inside = (
            torch.arange(width, device=self.device).unsqueeze(0) < torch.tensor(lengths, device=self.device)[:, None]
        )
        index = torch.zeros(features.shape[0], readers, dtype=torch.long, device=self.device)
        index[slot[inside], reader[inside]] = scored[inside].clamp(min=0)
        gathered = self.token_logprobs(features, index)[slot, reader]  # (rows, width)
        if auto_shift:  # position i reports the logits of position i - 1 scoring target i
            gathered = torch.cat([gathered.new_zeros(len(data), 1), gathered[:, :-1]], dim=1)
        return _counted(gathered, targets, auto_shift)

    def forward(
        self,
        run_id: str,
        data: list[ForwardDatum],
        spec: LossSpec,
        *,
        backward: bool,
        auto_shift: bool,
        budget: int | None = None,
        loss_scale: float = 1.0,
    ):
        """Per-datum outputs (``logprobs``, ``elementwise_loss`` as float arrays) and summed metrics.

        The loss of the call is the sum over data and counted tokens; gradients accumulate into the run's
        adapter until `optim_step`. Data run as right-padded batches (`_chunks`, each within `budget` bytes of
        working memory where one item alone is not above it), which leaves the sum unchanged. The gradient is that of
        ``loss_scale`` times the sum (`normalization.loss_scale`); the metrics stay the plain sum and count.
        """
        with self.lock:
            run = self._run(run_id)
            self.check_lengths([len(d.tokens) for d in data])
            for datum in data:  # before any backward: a bad datum must not leave half a batch of gradients
                self._check_tokens(datum)
            self._activate(run.adapter, trainable=backward)
            loss_sum, token_count = 0.0, 0
            by_index: dict[int, dict] = {}
            text = [i for i, d in enumerate(data) if d.tokens and d.vision is None]
            pieces: list[list[int]] = []  # indices into `data`: text chunks, then each datum with images alone
            start = 0
            for chunk in self._chunks([data[i] for i in text], backward, budget):
                pieces.append(text[start : start + len(chunk)])
                start += len(chunk)
            pieces.extend([i] for i, d in enumerate(data) if d.vision is not None)
            for indices in pieces:
                chunk = [data[i] for i in indices]
                if chunk[0].vision is not None:
                    packed, shared, plain = None, [], [0]
                else:
                    packed, shared, plain = self._plan(chunk)
                results = []  # (rows, logprobs, loss, per-token loss, mask)
                with torch.set_grad_enabled(backward):
                    # the loss is a sum: a backward per piece accumulates the same gradient
                    for rows, layout in ((shared, packed), (plain, None)):
                        if not rows:
                            continue
                        piece = [chunk[i] for i in rows]
                        if piece[0].vision is not None:
                            logprobs, valid = self._image_target_logprobs(piece[0], auto_shift)
                        elif layout is not None:
                            logprobs, valid = self._packed_target_logprobs(piece, layout, auto_shift)
                        else:
                            logprobs, valid = self._batch_target_logprobs(piece, auto_shift)
                        loss, loss_tok, mask = self._piece_loss(piece, spec, logprobs, valid)
                        if backward:
                            (loss * loss_scale if loss_scale != 1.0 else loss).backward()
                        results.append((rows, logprobs, loss, loss_tok, mask))
                for rows, logprobs, loss, loss_tok, mask in results:
                    logprobs_np, loss_np = logprobs.detach().cpu().numpy(), loss_tok.detach().cpu().numpy()
                    for row, i in enumerate(rows):
                        n = len(chunk[i].tokens)
                        by_index[indices[i]] = {"logprobs": logprobs_np[row, :n], "elementwise_loss": loss_np[row, :n]}
                    loss_sum += float(loss.detach())
                    token_count += int(mask.sum())
            # empty data (no tokens) keep their place with empty outputs
            empty = {"logprobs": np.zeros(0, np.float32), "elementwise_loss": np.zeros(0, np.float32)}
            outputs = [by_index.get(i) or dict(empty) for i in range(len(data))]
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
