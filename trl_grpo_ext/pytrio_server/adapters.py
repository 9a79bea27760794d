"""LoRA adapters of the local server's model: settings, frozen snapshots and their files, and the adapter table.

All training runs share the base weights; each run owns a named PEFT LoRA adapter (``run_<id>``). Sampler snapshots
are frozen copies of adapter weights (`LoraSnapshot`); sampling copies a snapshot into a per-LoRA-shape "sampler slot"
adapter (``sampler_<shape>``), so snapshots never move while their run keeps training. `LoraAdapters` is the part of
`ModelEngine` that manages them (it uses the engine's ``base``, ``peft``, ``device``, ``runs`` and slot tables).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import random
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from trl_grpo_ext.compat import set_active_adapter
from trl_grpo_ext.pytrio_server.base_model import short_name
from trl_grpo_ext.pytrio_server.errors import EngineError
from trl_grpo_ext.pytrio_server.optimizer_state import has_optimizer, load_optimizer, save_optimizer
from trl_grpo_ext.pytrio_server.storage import ADAPTER_FILE, CheckpointFolder

ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
# The projections of linear-attention (Gated DeltaNet) layers of hybrid models, trained with the attention ones:
# Qwen3.5's `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`, Qwen3-Next's fused `in_proj_qkvz`, `in_proj_ba`,
# and both families' `out_proj`. Only names the model has are targeted (a plain transformer has none of them).
LINEAR_ATTN_MODULES = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "in_proj_qkvz", "in_proj_ba", "out_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
UNEMBED_MODULES = ("lm_head",)
# Tinker scales LoRA by a fixed alpha of 32 for every rank; we do the same so learning rates carry over.
LORA_ALPHA = 32
_SNAPSHOT_IDS = itertools.count(1)
META_FILE = "trio_checkpoint.json"
META_LIMIT = 64 * 1024  # `META_FILE` holds the LoRA settings and a step: a larger one is not one


# Adapters are created on both sides of the model (training runs; sampler slots) from different threads; their
# initialisation seeds and draws from torch's process-wide generator.
_SEEDED_INIT = threading.Lock()


def next_snapshot_uid() -> int:
    """A fresh weights identity (the snapshot cache and sampler slots key on it)."""
    return next(_SNAPSHOT_IDS)


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
    uid: int = field(default_factory=next_snapshot_uid)

    def save(self, folder: Path, base_model: str, peft_config) -> int:
        """Write a PEFT-loadable adapter folder (+ optimizer state); returns the bytes written."""
        from safetensors.torch import save_file

        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.weights.items()}, str(folder / ADAPTER_FILE))
        cfg = copy.deepcopy(peft_config)
        cfg.base_model_name_or_path = base_model
        cfg.save_pretrained(str(folder))
        if self.optimizer is not None:
            save_optimizer(self.optimizer, folder)
        (folder / META_FILE).write_text(json.dumps({"lora": asdict(self.lora), "step": self.step}))
        return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())

    @classmethod
    def load(cls, folder: CheckpointFolder, with_optimizer: bool, checkpoint: str, memory=None) -> LoraSnapshot:
        """The snapshot saved in `folder` (`checkpoint`, its URI, names it in errors); no file is unpickled, and each
        file is read only as the server's own regular file (`CheckpointFolder`). `memory` (the server's
        `MemoryGate`) admits the conversion of an old optimizer pickle."""
        from safetensors.torch import load_file

        meta = json.loads(folder.read(META_FILE, META_LIMIT))
        optimizer = None
        if with_optimizer:
            if not has_optimizer(folder):
                raise EngineError("checkpoint_has_no_optimizer", f"checkpoint {checkpoint} holds no optimizer state")
            optimizer = load_optimizer(folder, checkpoint, memory)
        with folder.file_path(ADAPTER_FILE) as adapter:
            weights = load_file(str(adapter))
        return cls(LoraSettings(**meta["lora"]), weights, optimizer, meta.get("step", 0))


@dataclass
class TrainingRun:
    """A training run on the model: its adapter, that adapter's parameters (sorted by name) and AdamW optimizer."""

    run_id: str
    adapter: str
    lora: LoraSettings
    params: list[tuple[str, torch.nn.Parameter]]
    optimizer: torch.optim.Optimizer
    step: int = 0
    pending_tokens: int = 0  # tokens of the forward_backward calls since the last optimizer step


class LoraAdapters:
    """The adapter side of `ModelEngine`: PEFT adapters per training run and per sampler slot."""

    def _module_names(self, lora: LoraSettings) -> list[str]:
        wanted = (ATTN_MODULES + LINEAR_ATTN_MODULES if lora.train_attn else ()) + (
            MLP_MODULES if lora.train_mlp else ()
        )
        wanted += UNEMBED_MODULES if lora.train_unembed else ()
        found = [m for m in wanted if m in self._linear_names]
        if not found:
            # the model by its short name: the answer holds no path of the server's disk
            raise EngineError(
                "invalid_lora_config", f"no LoRA target modules {list(wanted)} in {short_name(self.model_path)!r}"
            )
        return found

    def peft_config(self, lora: LoraSettings):
        from peft import LoraConfig

        return LoraConfig(
            r=lora.rank, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=self._module_names(lora), bias="none"
        )

    def _add_adapter(self, name: str, lora: LoraSettings) -> None:
        from peft import get_peft_model

        config = self.peft_config(lora)
        # A seeded run gets the same LoRA A init however many runs were created before it, and whatever the other
        # side of the model does meanwhile: the seeded draws hold the process's RNG alone.
        devices = [self.device.index] if self.device.type == "cuda" and self.device.index is not None else []
        with _SEEDED_INIT, torch.random.fork_rng(devices=devices):
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

    def use_snapshot(self, snapshot: LoraSnapshot | None):
        """Make `snapshot` the active adapter (None: the base model, adapters disabled).

        Returns the model to call and a context to call it in; the caller holds the engine's lock.
        """
        if snapshot is None:
            # no adapter, or the active one was dropped (PEFT keeps its name): the LoRA layers skip it, and PEFT's
            # `disable_adapter` would fail looking it up
            if self.peft is None or self.peft.active_adapter not in self.peft.peft_config:
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
