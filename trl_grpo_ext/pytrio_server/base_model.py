"""The base model under a LoRA checkpoint: its name and a fingerprint of its weights.

An adapter is only meaningful on the weights it was trained on. Every checkpoint records the server's base model when
it is saved (`BaseModel`, in its record); a server whose base differs refuses to load, sample from, resume or teach
with it (`mismatch`). Names can differ for the same weights (a copied folder, a hub id and its cache folder) and match
for different ones (two servers' stand-ins under one served name), so the fingerprint decides.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

FINGERPRINT_SCHEME = "sha256-bf16"


@dataclass(frozen=True)
class BaseModel:
    name: str  # the model as the server was given it: a folder, a hub id
    fingerprint: str  # `weights_fingerprint`; "" for a checkpoint saved before checkpoints recorded their base

    def short(self) -> str:
        """The fingerprint as messages show it (scheme and 12 hex digits)."""
        return self.fingerprint[: len(FINGERPRINT_SCHEME) + 13] if self.fingerprint else "unknown"


UNKNOWN_BASE = BaseModel("", "")  # a checkpoint saved before checkpoints recorded their base


def weights_fingerprint(model: torch.nn.Module) -> str:
    """SHA-256 over every parameter of `model` (name, shape, values rounded to bf16), in name order.

    Rounded to bf16 so a model loaded in float32 and in bfloat16 (``--dtype``) fingerprints alike, as its adapters
    fit both; a float16 load rounds differently and fingerprints apart. Call it before PEFT wraps the model (LoRA
    layers rename the base weights) and before the frozen linears are cast for bf16 sampling.
    """
    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        values = param.detach().to(device="cpu", dtype=torch.bfloat16).contiguous()
        digest.update(f"{name}:{tuple(values.shape)};".encode())
        digest.update(values.view(torch.int16).numpy())
    return f"{FINGERPRINT_SCHEME}:{digest.hexdigest()}"


def mismatch(uri: str, trained_on: BaseModel, served: BaseModel) -> str | None:
    """The one-line refusal of checkpoint `uri`, trained on `trained_on`, on a server serving `served`; None when the
    weights are the same (or the checkpoint's base is unknown: `trained_on.fingerprint` is "")."""
    if not trained_on.fingerprint or trained_on.fingerprint == served.fingerprint:
        return None
    return (
        f"checkpoint {uri} was trained on base model {trained_on.name!r} ({trained_on.short()}), but this server "
        f"serves {served.name!r} ({served.short()}): an adapter only fits the weights it was trained on. Use it on a "
        f"server started with --model {trained_on.name}"
    )
