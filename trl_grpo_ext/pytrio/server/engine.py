"""The model side of the local PyTRIO server: one transformers model, one PEFT LoRA adapter per training run.

All training runs share the base weights; each run owns a named LoRA adapter and an AdamW optimizer over it.
Sampler snapshots are frozen copies of adapter weights (`LoraSnapshot`); sampling copies a snapshot into a
per-LoRA-shape "sampler slot" adapter, so snapshots never move while their run keeps training.
A single re-entrant lock serialises every use of the model: PEFT's active adapter is global state.
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
import random
import threading
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from trl_grpo_ext.compat import cache_keyword, output_cache, set_active_adapter
from trl_grpo_ext.pytrio.server.losses import LossSpec, per_token_loss

logger = logging.getLogger(__name__)

ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
UNEMBED_MODULES = ("lm_head",)
# Tinker scales LoRA by a fixed alpha of 32 for every rank; we do the same so learning rates carry over.
LORA_ALPHA = 32
_SNAPSHOT_IDS = itertools.count(1)
ADAPTER_FILE = "adapter_model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
META_FILE = "trio_checkpoint.json"
# Leading tokens forward/backward rows must share before they are encoded once: below this the extra model call
# costs more than the tokens it saves.
MIN_SHARED_PREFIX = 8


def next_snapshot_uid() -> int:
    """A fresh weights identity (the snapshot cache and sampler slots key on it)."""
    return next(_SNAPSHOT_IDS)


class EngineError(Exception):
    """A request the engine cannot serve; `code` is what the client sees as the event error code."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class LoraSettings:
    rank: int
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True

    @property
    def shape_key(self) -> str:
        """Adapters with the same key have identical parameter shapes and can share a sampler slot."""
        return f"r{self.rank}_m{int(self.train_mlp)}_a{int(self.train_attn)}_u{int(self.train_unembed)}"


@dataclass
class LoraSnapshot:
    """Frozen adapter weights (PEFT state-dict keys, no adapter name) plus optional optimizer state."""

    lora: LoraSettings
    weights: dict[str, torch.Tensor]
    optimizer: dict | None = None
    step: int = 0
    uid: int = field(default_factory=lambda: next(_SNAPSHOT_IDS))

    def save(self, folder: Path, base_model: str, peft_config) -> int:
        """Write a PEFT-loadable adapter folder (+ optimizer state); returns the bytes written."""
        from safetensors.torch import save_file

        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.weights.items()}, str(folder / ADAPTER_FILE))
        cfg = copy.deepcopy(peft_config)
        cfg.base_model_name_or_path = base_model
        cfg.save_pretrained(str(folder))
        if self.optimizer is not None:
            torch.save(self.optimizer, folder / OPTIMIZER_FILE)
        (folder / META_FILE).write_text(json.dumps({"lora": asdict(self.lora), "step": self.step}))
        return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())

    @classmethod
    def load(cls, folder: Path, with_optimizer: bool) -> LoraSnapshot:
        from safetensors.torch import load_file

        meta = json.loads((folder / META_FILE).read_text())
        optimizer = None
        if with_optimizer:
            if not (folder / OPTIMIZER_FILE).is_file():
                raise EngineError("checkpoint_has_no_optimizer", f"checkpoint {folder.name} holds no optimizer state")
            optimizer = torch.load(folder / OPTIMIZER_FILE, weights_only=False)
        return cls(LoraSettings(**meta["lora"]), load_file(str(folder / ADAPTER_FILE)), optimizer, meta.get("step", 0))


@dataclass
class TrainingRun:
    run_id: str
    adapter: str
    lora: LoraSettings
    params: list[tuple[str, torch.nn.Parameter]]
    optimizer: torch.optim.Optimizer
    step: int = 0
    pending_tokens: int = field(default=0)


@dataclass
class ForwardDatum:
    tokens: list[int]
    targets: list[int]
    weights: list[float] | None = None
    old_logprobs: list[float] | None = None
    advantages: list[float] | None = None


@dataclass
class SampleResult:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str
    text: str | None = None


class ModelEngine:
    """Loads `model_path` once and serves training runs and samplers on it."""

    def __init__(
        self,
        model_path: str,
        *,
        device: str | None = None,
        dtype: str = "float32",
        max_batch_tokens: int = 4096,
        share_prefix: bool = True,
        min_shared_prefix: int = MIN_SHARED_PREFIX,
    ):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_path = str(model_path)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        torch_dtype = getattr(torch, dtype, None)
        if not isinstance(torch_dtype, torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}")
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch_dtype)
        model.to(self.device)
        model.eval()  # no dropout: forward and forward_backward must see the same function
        for p in model.parameters():
            p.requires_grad_(False)
        self.base = model
        # read before PEFT wraps the layers: LoRA-wrapped linears are no longer nn.Linear
        self._linear_names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        self.peft = None
        self.lock = threading.RLock()
        self.runs: dict[str, TrainingRun] = {}
        self._slots: dict[str, str] = {}  # LoRA shape key -> sampler adapter name
        self._slot_content: dict[str, int] = {}  # sampler adapter -> uid of the snapshot loaded in it
        self._stop_ids = self._default_stop_ids()
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_seq_len = int(getattr(model.config, "max_position_embeddings", 0) or 0) or None
        # padded tokens per forward/backward batch: bounds the (batch, length, vocab) logits held for backward
        self.max_batch_tokens = max(1, int(max_batch_tokens))
        # forward/backward: rows sharing >= min_shared_prefix leading tokens encode them once (`_pieces`)
        self.share_prefix = bool(share_prefix)
        self.min_shared_prefix = max(1, int(min_shared_prefix))
        from trl_grpo_ext.prefix import sharing_unsupported_reason

        self.prefix_sharing_reason = sharing_unsupported_reason(model)  # None where the shared forward is exact
        self._cache_kw = cache_keyword(model)

    # ---------------------------------------------------------------- adapters
    def _module_names(self, lora: LoraSettings) -> list[str]:
        wanted = (ATTN_MODULES if lora.train_attn else ()) + (MLP_MODULES if lora.train_mlp else ())
        wanted += UNEMBED_MODULES if lora.train_unembed else ()
        found = [m for m in wanted if m in self._linear_names]
        if not found:
            raise EngineError("invalid_lora_config", f"no LoRA target modules {list(wanted)} in {self.model_path}")
        return found

    def peft_config(self, lora: LoraSettings):
        from peft import LoraConfig

        return LoraConfig(
            r=lora.rank, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=self._module_names(lora), bias="none"
        )

    def _add_adapter(self, name: str, lora: LoraSettings) -> None:
        from peft import get_peft_model

        config = self.peft_config(lora)
        # A seeded run gets the same LoRA A init however many runs were created before it.
        devices = [self.device.index] if self.device.type == "cuda" and self.device.index is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(lora.seed if lora.seed is not None else random.randrange(2**31))
            if self.peft is None:
                self.peft = get_peft_model(self.base, config, adapter_name=name)
            else:
                self.peft.add_adapter(name, config)

    def _adapter_params(self, name: str) -> list[tuple[str, torch.nn.Parameter]]:
        tag = f".{name}."
        params = [(n.replace(tag, "."), p) for n, p in self.peft.named_parameters() if tag in n]
        return sorted(params, key=lambda item: item[0])

    def _activate(self, name: str, trainable: bool) -> None:
        set_active_adapter(self.peft, name, trainable)
        if trainable:
            for _, p in self.runs_by_adapter(name).params:
                p.requires_grad_(True)

    def runs_by_adapter(self, adapter: str) -> TrainingRun:
        for run in self.runs.values():
            if run.adapter == adapter:
                return run
        raise KeyError(adapter)

    def _export(self, adapter: str) -> dict[str, torch.Tensor]:
        from peft.utils import get_peft_model_state_dict

        # save_embedding_layers=False: with lm_head targeted PEFT would otherwise copy the full output matrix
        state = get_peft_model_state_dict(self.peft, adapter_name=adapter, save_embedding_layers=False)
        return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}

    def _import(self, adapter: str, weights: dict[str, torch.Tensor]) -> None:
        from peft.utils import set_peft_model_state_dict

        result = set_peft_model_state_dict(self.peft, weights, adapter_name=adapter)
        missing = [k for k in getattr(result, "missing_keys", []) if f".{adapter}." in k and "lora_" in k]
        if missing:
            raise EngineError(
                "checkpoint_mismatch", f"checkpoint lacks {len(missing)} LoRA tensors, e.g. {missing[0]}"
            )

    # ---------------------------------------------------------------- training runs
    def create_run(self, run_id: str, lora: LoraSettings, source: LoraSnapshot | None = None, load_optimizer=False):
        with self.lock:
            if run_id in self.runs:
                raise EngineError("run_already_initialized", f"training run {run_id} is already initialized")
            if source is not None and source.lora.shape_key != lora.shape_key:
                raise EngineError("checkpoint_mismatch", f"checkpoint LoRA {source.lora} does not match {lora}")
            adapter = "run_" + run_id.replace("-", "_")
            self._add_adapter(adapter, lora)
            if source is not None:
                self._import(adapter, source.weights)
            params = self._adapter_params(adapter)
            for _, p in params:
                p.requires_grad_(False)
            optimizer = torch.optim.AdamW(
                [p for _, p in params], lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0
            )
            run = TrainingRun(run_id, adapter, lora, params, optimizer)
            if source is not None:
                run.step = source.step
                if load_optimizer:
                    if source.optimizer is None:
                        raise EngineError("checkpoint_has_no_optimizer", "checkpoint holds no optimizer state")
                    names = source.optimizer.get("param_names")
                    if names != [n for n, _ in params]:
                        raise EngineError(
                            "checkpoint_mismatch", "optimizer state does not match the adapter parameters"
                        )
                    # a copy: torch keeps same-device tensors as they are, and Adam updates its moments in
                    # place, which would otherwise rewrite the checkpoint for the next run restored from it
                    optimizer.load_state_dict(copy.deepcopy(source.optimizer["state_dict"]))
            self.runs[run_id] = run
            return run

    def _run(self, run_id: str) -> TrainingRun:
        run = self.runs.get(run_id)
        if run is None:
            raise EngineError("run_not_initialized", f"training run {run_id} has no initialized trainer")
        return run

    def snapshot(self, run_id: str, with_optimizer: bool) -> LoraSnapshot:
        with self.lock:
            run = self._run(run_id)
            optimizer = None
            if with_optimizer:
                optimizer = {
                    "state_dict": copy.deepcopy(run.optimizer.state_dict()),
                    "param_names": [n for n, _ in run.params],
                }
            return LoraSnapshot(run.lora, self._export(run.adapter), optimizer, run.step)

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
        logits = self.peft(input_ids=ids, attention_mask=mask).logits.float()
        if auto_shift:
            # position i predicts target i + 1; the first label has no predicting position
            logits = torch.cat([logits.new_zeros(logits.shape[0], 1, logits.shape[-1]), logits[:, :-1]], dim=1)
        valid = targets != -100
        if auto_shift:
            valid[:, 0] = False
        gathered = torch.log_softmax(logits, dim=-1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return torch.where(valid, gathered, torch.zeros_like(gathered)), valid

    def _padded(self, rows: list[list[float]], width: int, dtype: torch.dtype, fill: float = 0) -> torch.Tensor:
        """Rows right-padded with `fill` to `width`, as one (len(rows), width) tensor on the engine's device."""
        out = torch.full((len(rows), width), fill, dtype=dtype)
        for i, row in enumerate(rows):
            out[i, : len(row)] = torch.tensor(row, dtype=dtype)
        return out.to(self.device)

    def _chunks(self, data: list[ForwardDatum]) -> list[list[ForwardDatum]]:
        """Consecutive groups whose padded size stays within `max_batch_tokens` (bounds the logits' memory)."""
        chunks: list[list[ForwardDatum]] = []
        current: list[ForwardDatum] = []
        width = 0
        for datum in data:
            grown = max(width, len(datum.tokens))
            if current and grown * (len(current) + 1) > self.max_batch_tokens:
                chunks.append(current)
                current, grown = [], len(datum.tokens)
            current.append(datum)
            width = grown
        if current:
            chunks.append(current)
        return chunks

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
            from trl_grpo_ext.prefix import log_fallback_once

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
        head_cache = head_logits = None
        if head:
            out = self.peft(input_ids=torch.tensor([groups[0][0].tokens[:head]], device=self.device), use_cache=True)
            head_cache, head_logits = output_cache(out), out.logits.float()
        results = []
        for data, length in zip(groups, shared, strict=True):
            tokens = data[0].tokens
            if head:
                cache, prefix_logits = _copy_cache(head_cache), head_logits
                if length > head:
                    ids = torch.tensor([tokens[head:length]], device=self.device)
                    out = self.peft(input_ids=ids, attention_mask=torch.ones(1, length, dtype=torch.long, device=self.device),
                                    position_ids=torch.arange(head, length, device=self.device)[None], use_cache=True,
                                    **{self._cache_kw: cache})  # fmt: skip
                    cache, prefix_logits = output_cache(out), torch.cat([head_logits, out.logits.float()], dim=1)
            else:
                out = self.peft(input_ids=torch.tensor([tokens[:length]], device=self.device), use_cache=True)
                cache, prefix_logits = output_cache(out), out.logits.float()  # (1, length, V)
            results.append(self._suffix_target_logprobs(data, length, cache, prefix_logits, auto_shift))
        return results

    def _suffix_target_logprobs(self, data, shared: int, cache, prefix_logits: torch.Tensor, auto_shift: bool):
        """Rows `data` continuing a cached one-row prefix of `shared` tokens whose logits are `prefix_logits`."""
        n_rows = len(data)
        lengths = [len(d.tokens) for d in data]
        width = max(lengths)
        cache.batch_repeat_interleave(n_rows)
        suffix_width = width - shared
        ids = self._padded([d.tokens[shared:] for d in data], suffix_width, torch.long)
        mask = (torch.arange(width) < torch.tensor(lengths).unsqueeze(1)).long().to(self.device)
        positions = (shared + torch.arange(suffix_width, device=self.device)).expand(n_rows, -1)
        out = self.peft(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                        **{self._cache_kw: cache})  # fmt: skip
        suffix_logits = out.logits.float()  # (rows, width - shared, V)
        targets = self._padded([d.targets for d in data], width, torch.long, fill=-100)
        # the target each position's logits score: its own (no shift) or the next position's (auto_shift)
        scored = torch.cat([targets[:, 1:], targets.new_full((n_rows, 1), -100)], 1) if auto_shift else targets
        index = scored.clamp(min=0).unsqueeze(-1)
        head = torch.log_softmax(prefix_logits, dim=-1).expand(n_rows, -1, -1).gather(-1, index[:, :shared])
        tail = torch.log_softmax(suffix_logits, dim=-1).gather(-1, index[:, shared:])
        gathered = torch.cat([head, tail], dim=1).squeeze(-1)
        if auto_shift:  # position i reports the logits of position i - 1 scoring target i
            gathered = torch.cat([gathered.new_zeros(n_rows, 1), gathered[:, :-1]], dim=1)
        valid = targets != -100
        if auto_shift:
            valid[:, 0] = False
        return torch.where(valid, gathered, torch.zeros_like(gathered)), valid

    def forward(self, run_id: str, data: list[ForwardDatum], spec: LossSpec, *, backward: bool, auto_shift: bool):
        """Per-datum outputs (``logprobs``, ``elementwise_loss`` as float arrays) and summed metrics.

        The loss of the call is the sum over data and counted tokens; gradients accumulate into the run's
        adapter until `optim_step`. Data run as right-padded batches (`_chunks`), which leaves the sum unchanged.
        """
        with self.lock:
            run = self._run(run_id)
            for datum in data:  # before any backward: a bad datum must not leave half a batch of gradients
                self._check_tokens(datum)
            self._activate(run.adapter, trainable=backward)
            outputs, loss_sum, token_count = [], 0.0, 0
            for chunk in self._chunks([d for d in data if d.tokens]):
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

    def optim_step(self, run_id: str, adam: dict) -> dict[str, float]:
        with self.lock:
            run = self._run(run_id)
            params = [p for _, p in run.params]
            grads = [p.grad for p in params if p.grad is not None]
            grad_norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))) if grads else 0.0
            clip = float(adam.get("grad_clip_norm", 0.0))
            if clip > 0 and grads:
                torch.nn.utils.clip_grad_norm_(params, clip)
            for group in run.optimizer.param_groups:
                group["lr"] = float(adam["learning_rate"])
                group["betas"] = (float(adam["beta1"]), float(adam["beta2"]))
                group["eps"] = float(adam["eps"])
                group["weight_decay"] = float(adam["weight_decay"])
            if grads:
                run.optimizer.step()
            run.optimizer.zero_grad(set_to_none=True)
            run.step += 1
            tokens, run.pending_tokens = run.pending_tokens, 0
            return {
                "grad_norm": grad_norm,
                "learning_rate": float(adam["learning_rate"]),
                "step": float(run.step),
                "train_tokens": float(tokens),
            }

    def drop_run(self, run_id: str) -> None:
        with self.lock:
            run = self.runs.pop(run_id, None)
            if run is not None and self.peft is not None:
                with warnings.catch_warnings():  # PEFT warns when the deleted adapter was the active one
                    warnings.simplefilter("ignore", UserWarning)
                    self.peft.delete_adapter(run.adapter)

    # ---------------------------------------------------------------- sampling
    def _default_stop_ids(self) -> set[int]:
        ids = set()
        for value in (getattr(self.base.generation_config, "eos_token_id", None), self.tokenizer.eos_token_id):
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        return ids

    def _use_snapshot(self, snapshot: LoraSnapshot | None):
        """Make `snapshot` the active adapter (or disable adapters for the base model); returns a context."""
        import contextlib

        if snapshot is None:
            if self.peft is None:
                return self.base, contextlib.nullcontext()
            return self.peft, self.peft.disable_adapter()
        key = snapshot.lora.shape_key
        slot = self._slots.get(key)
        if slot is None:
            slot = f"sampler_{key}"
            self._add_adapter(slot, snapshot.lora)
            self._slots[key] = slot
        if self._slot_content.get(slot) != snapshot.uid:
            self._import(slot, snapshot.weights)
            self._slot_content[slot] = snapshot.uid
        set_active_adapter(self.peft, slot, trainable=False)
        return self.peft, contextlib.nullcontext()

    @staticmethod
    def _sampling_distribution(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
        """Log-probabilities of the distribution actually sampled from (temperature, top-k, top-p applied)."""
        if temperature <= 0:  # greedy: a point mass on the argmax
            out = torch.full_like(logits, float("-inf"))
            return out.scatter(-1, logits.argmax(-1, keepdim=True), 0.0)
        logits = logits / temperature
        if top_k is not None and top_k > 0 and top_k < logits.shape[-1]:
            kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if top_p is not None and 0 < top_p < 1:
            sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
            cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
            drop = cumulative - torch.softmax(sorted_logits, dim=-1) >= top_p  # keep the token that crosses top_p
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
        return torch.log_softmax(logits, dim=-1)

    def check_sample(self, spec: SampleSpec) -> None:
        """Raise `EngineError` for a request this engine cannot sample (before it joins a batch)."""
        prompt = spec.prompt
        if not prompt or max(prompt) >= self.vocab_size or min(prompt) < 0:
            raise EngineError("token_out_of_range", f"prompt token ids must lie in [0, {self.vocab_size})")
        if self.max_seq_len and len(prompt) + spec.max_tokens > self.max_seq_len:
            raise EngineError(
                "sequence_too_long", f"prompt {len(prompt)} + max_tokens {spec.max_tokens} exceeds {self.max_seq_len}"
            )
        if spec.num_samples < 1 or spec.max_tokens < 0:
            raise EngineError("invalid_sampling_params", "num_samples must be >= 1 and max_tokens >= 0")

    def sample(self, snapshot: LoraSnapshot | None, prompt: list[int], *, num_samples: int, **params):
        """Sample `num_samples` continuations of `prompt` (`SampleSpec` fields as keywords), on its own.

        The same computation as the request inside a `DecodeBatch` shared with others.
        """
        spec = SampleSpec(list(prompt), num_samples, **params)
        self.check_sample(spec)
        batch = DecodeBatch(self, snapshot)
        rows = batch.admit(spec)
        while batch.requests:
            batch.step()
        return rows.results(self.tokenizer)

    def _ends_with_stop(self, tokens: list[int], stop: list[str]) -> bool:
        # Checked after every token, so a stop string can only have appeared in the newest one: a short
        # decoded tail is enough to see it.
        tail = self.tokenizer.decode(tokens[-(max(len(s) for s in stop) + 8) :])
        return any(s in tail for s in stop)

    def prompt_logprobs(self, snapshot: LoraSnapshot | None, prompt: list[int], topk: int = 0):
        """``[None, log p(x_1 | x_0), ...]`` and, with ``topk``, the top-k (token, logprob) per position."""
        with self.lock:
            model, ctx = self._use_snapshot(snapshot)
            with ctx, torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt], device=self.device)).logits[0].float()
            logp = torch.log_softmax(logits, dim=-1)
        targets = torch.tensor(prompt[1:], device=logp.device)
        values = logp[:-1].gather(-1, targets.unsqueeze(-1)).squeeze(-1).tolist() if len(prompt) > 1 else []
        top = None
        if topk > 0:
            top_v, top_i = torch.topk(logp[:-1], min(topk, logp.shape[-1]), dim=-1)
            top = [None] + [list(zip(i.tolist(), v.tolist(), strict=True)) for i, v in zip(top_i, top_v, strict=True)]
        return [None, *values], top


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
        self.done = [False] * n
        self.last = torch.zeros(n, dtype=torch.long, device=device)  # the token each row feeds next
        self.steps = 0

    @property
    def finished(self) -> bool:
        return all(self.done) or self.steps >= self.spec.max_tokens

    def draw(self, engine: ModelEngine) -> None:
        spec = self.spec
        dist = engine._sampling_distribution(self.logits, spec.temperature, spec.top_k, spec.top_p)
        nxt = torch.multinomial(dist.exp(), 1, generator=self.generator).squeeze(-1)
        chosen = dist.gather(-1, nxt.unsqueeze(-1)).squeeze(-1)
        for i in range(spec.num_samples):
            if self.done[i]:
                continue
            tok = int(nxt[i])
            self.tokens[i].append(tok)
            self.logps[i].append(float(chosen[i]))
            if tok in self.stop_ids or (self.stop and engine._ends_with_stop(self.tokens[i], self.stop)):
                self.done[i], self.reasons[i] = True, "stop"
        self.last = nxt
        self.steps += 1

    def results(self, tokenizer) -> list[SampleResult]:
        return [
            SampleResult(t, lp, r, tokenizer.decode(t) if self.spec.return_text else None)
            for t, lp, r in zip(self.tokens, self.logps, self.reasons, strict=True)
        ]


class DecodeBatch:
    """Rows of several sample requests on one adapter snapshot, decoded together one token per row per `step`.

    Decoding is memory-bound (every step reads all weights), so one step for many rows costs about what one step
    for a few does. Each request is prefilled on its own (its prompt encoded once, the cache expanded to its
    `num_samples` rows: exactly what a request alone does), then its cache joins the batch's, left-padded to the
    longest row, with explicit positions and a padding mask. Requests join between steps and leave when done.
    """

    def __init__(self, engine: ModelEngine, snapshot: LoraSnapshot | None):
        self.engine = engine
        self.snapshot = snapshot
        self.uid = snapshot.uid if snapshot is not None else None
        self.requests: list[RequestRows] = []  # in row order
        self.cache = None
        self.mask: torch.Tensor | None = None  # (rows, cached slots): 1 real, 0 left padding
        self.positions: torch.Tensor | None = None  # (rows,): position of the token each row feeds next

    @property
    def rows(self) -> int:
        return sum(r.spec.num_samples for r in self.requests)

    def can_join(self, snapshot: LoraSnapshot | None) -> bool:
        """Whether a request on `snapshot` can join: same weights, and a cache this class can pad and concatenate."""
        if (snapshot.uid if snapshot is not None else None) != self.uid:
            return False
        return self.cache is None or all(type(layer) is _dynamic_layer_type() for layer in self.cache.layers)

    def admit(self, spec: SampleSpec) -> RequestRows:
        engine, n = self.engine, spec.num_samples
        with engine.lock:
            model, ctx = engine._use_snapshot(self.snapshot)
            with ctx, torch.no_grad():
                prompt = torch.tensor([spec.prompt], device=engine.device)
                out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
                cache, logits = output_cache(out), out.logits[:, -1].float()
                if n > 1:
                    cache.batch_repeat_interleave(n)
        rows = RequestRows(spec, logits.expand(n, -1), engine.device, engine._stop_ids)
        length = len(spec.prompt)
        mask = torch.ones(n, length, dtype=torch.long, device=engine.device)
        positions = torch.full((n,), length, dtype=torch.long, device=engine.device)
        if self.cache is None:
            self.cache, self.mask, self.positions = cache, mask, positions
        else:
            width = max(self.mask.shape[1], length)
            for mine, theirs in zip(self.cache.layers, cache.layers, strict=True):
                mine.keys = torch.cat([_left_pad(mine.keys, width), _left_pad(theirs.keys, width)])
                mine.values = torch.cat([_left_pad(mine.values, width), _left_pad(theirs.values, width)])
            self.mask = torch.cat([_left_pad(self.mask, width, dim=1), _left_pad(mask, width, dim=1)])
            self.positions = torch.cat([self.positions, positions])
        self.requests.append(rows)
        return rows

    def step(self) -> list[RequestRows]:
        """Draw one token for every row, retire the requests that are done (returned), advance the others."""
        engine = self.engine
        for rows in self.requests:
            if not rows.finished:  # max_tokens 0: nothing to draw
                rows.draw(engine)
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
            model, ctx = engine._use_snapshot(self.snapshot)
            with ctx, torch.no_grad():
                out = model(
                    input_ids=ids,
                    attention_mask=self.mask,
                    position_ids=self.positions.unsqueeze(-1),
                    use_cache=True,
                    logits_to_keep=1,
                    **{engine._cache_kw: self.cache},
                )
        self.cache, self.positions = output_cache(out), self.positions + 1
        logits = out.logits[:, -1].float()
        start = 0
        for rows in self.requests:
            n = rows.spec.num_samples
            rows.logits = logits[start : start + n]
            start += n
        return finished


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
