"""A checkpoint's AdamW state on disk without pickle: its tensors in safetensors, everything else in JSON.

A state checkpoint (``save_state``) holds the optimizer of its run as `OPTIMIZER_TENSORS` (the moments and step
counts, keyed ``state.<index>.<name>``) and `OPTIMIZER_META` (the parameter names, the param groups, which state
entries are tensors). Reading them runs no code a file could name: safetensors holds tensors only, JSON plain data,
and both are checked against the run's parameters before an optimizer takes them (`state_problems`).

Checkpoints saved before hold a pickle (`LEGACY_OPTIMIZER`, ``torch.save``). It is read once with torch's restricted
unpickler (``weights_only=True``: tensors and plain containers, no code), written again in the new format and removed;
one that holds anything else is refused with a clear error and left as it is.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import torch

from trl_grpo_ext.pytrio_server.errors import EngineError
from trl_grpo_ext.runs import atomic_write_text

logger = logging.getLogger(__name__)

OPTIMIZER_TENSORS = "optimizer.safetensors"
OPTIMIZER_META = "optimizer.json"
LEGACY_OPTIMIZER = "optimizer.pt"  # torch.save pickles of checkpoints saved before; converted on first load
FORMAT = 1
_PLAIN = (bool, int, float, str, type(None))


def has_optimizer(folder: Path) -> bool:
    return (folder / OPTIMIZER_META).is_file() or (folder / LEGACY_OPTIMIZER).is_file()


def save_optimizer(state: dict, folder: Path) -> None:
    """Write `state` (``{"state_dict": optimizer.state_dict(), "param_names": [...]}``) into `folder`."""
    from safetensors.torch import save_file

    tensors, entries = {}, {}
    for index, values in state["state_dict"]["state"].items():
        entries[str(index)] = {}
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{index}.{name}"] = value.detach().to("cpu").contiguous()
                entries[str(index)][name] = "tensor"
            else:
                entries[str(index)][name] = _plain(value, f"state.{index}.{name}")
    meta = {
        "format": FORMAT,
        "param_names": list(state["param_names"]),
        "param_groups": [_plain(group, "param_groups") for group in state["state_dict"]["param_groups"]],
        "state": entries,
    }
    save_file(tensors, str(folder / OPTIMIZER_TENSORS))
    atomic_write_text(folder / OPTIMIZER_META, json.dumps(meta))  # last: its presence means both files are complete


def load_optimizer(folder: Path, checkpoint: str) -> dict:
    """The optimizer state saved in `folder` (`save_optimizer`'s input); a legacy pickle is converted first.

    `checkpoint` names the checkpoint in error messages (never the folder: a client's business is its URI)."""
    if not (folder / OPTIMIZER_META).is_file() and (folder / LEGACY_OPTIMIZER).is_file():
        return _convert_legacy(folder, checkpoint)
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        meta = json.loads((folder / OPTIMIZER_META).read_text())
        tensors = load_file(str(folder / OPTIMIZER_TENSORS))
        return _from_files(meta, tensors)
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as error:
        raise _unreadable(checkpoint, error, folder) from None


def state_problems(state: dict, params: list[tuple[str, torch.nn.Parameter]]) -> str | None:
    """Why `state` cannot be the AdamW state of `params` (names, one group over all of them, moments of each
    parameter's shape, finite numbers), or None. A hostile file must not reach `load_state_dict`, which checks none
    of the shapes."""
    if state.get("param_names") != [name for name, _ in params]:
        return "its parameter names do not match the adapter's"
    groups = state["state_dict"].get("param_groups")
    if not isinstance(groups, list) or len(groups) != 1 or groups[0].get("params") != list(range(len(params))):
        return "it does not hold one param group over the adapter's parameters"
    for index, values in state["state_dict"].get("state", {}).items():
        if not isinstance(index, int) or not 0 <= index < len(params) or not isinstance(values, dict):
            return f"state entry {index!r} names no parameter"
        shape = params[index][1].shape
        for name, value in values.items():
            if not isinstance(value, torch.Tensor):
                continue
            if not value.is_floating_point() or not bool(torch.isfinite(value).all()):
                return f"state.{index}.{name} is not a finite float tensor"
            if value.dim() and value.shape != shape:
                return f"state.{index}.{name} has shape {tuple(value.shape)}, its parameter {tuple(shape)}"
    return None


def _from_files(meta: dict, tensors: dict[str, torch.Tensor]) -> dict:
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"unknown optimizer format {meta.get('format') if isinstance(meta, dict) else meta!r}")
    names, groups, entries = meta["param_names"], meta["param_groups"], meta["state"]
    if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise ValueError("param_names must be a list of strings")
    if not (isinstance(groups, list) and all(isinstance(g, dict) for g in groups) and isinstance(entries, dict)):
        raise ValueError("param_groups must be a list of objects, state an object")
    state = {}
    for index, values in entries.items():
        if not (index.isdigit() and isinstance(values, dict)):
            raise ValueError(f"state entry {index!r} is not a parameter index")
        state[int(index)] = {
            name: tensors[f"state.{index}.{name}"] if kind == "tensor" else _plain(kind, f"state.{index}.{name}")
            for name, kind in values.items()
        }
    for group in groups:  # torch's Adam unpacks betas; JSON made the tuple a list
        if isinstance(group.get("betas"), list):
            group["betas"] = tuple(group["betas"])
    return {"state_dict": {"state": state, "param_groups": groups}, "param_names": names}


def _plain(value, where: str):
    """`value` if it is JSON's plain data (finite numbers, strings, booleans, None, lists and string-keyed objects of
    them; a tuple becomes a list), else ValueError naming `where`."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where} holds a non-finite number")
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v, where) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _plain(v, f"{where}.{k}") for k, v in value.items()}
    raise ValueError(f"{where} holds a {type(value).__name__}, not plain data")


def _convert_legacy(folder: Path, checkpoint: str) -> dict:
    """Read the pickled `LEGACY_OPTIMIZER` with torch's restricted unpickler and write it in the new format (the
    pickle is removed once the new files are complete); the state either way, or EngineError."""
    try:
        state = torch.load(folder / LEGACY_OPTIMIZER, weights_only=True, map_location="cpu")
        if not (isinstance(state, dict) and isinstance(state.get("state_dict"), dict)):
            raise ValueError("it holds no optimizer state_dict")
        state = _from_files(_meta_of(state), _tensors_of(state))  # the same checks as a file in the new format
    except Exception as error:  # noqa: BLE001 - the unpickler refuses with several types; one clear answer
        raise _unreadable(checkpoint, error, folder) from None
    try:
        save_optimizer(state, folder)  # its JSON written last and atomically: until then the pickle is what is read
        (folder / LEGACY_OPTIMIZER).unlink(missing_ok=True)
        logger.info("checkpoint %s: optimizer state converted from its pickle to %s", checkpoint, OPTIMIZER_TENSORS)
    except OSError as error:  # read-only storage: this load goes on, the pickle stays for the next one
        logger.warning("checkpoint %s: optimizer state not converted (%s); loaded as read", checkpoint, error)
    return state


def _meta_of(state: dict) -> dict:
    entries = {
        str(index): {name: "tensor" if isinstance(v, torch.Tensor) else v for name, v in values.items()}
        for index, values in state["state_dict"].get("state", {}).items()
    }
    groups = [_plain(group, "param_groups") for group in state["state_dict"].get("param_groups", [])]
    return {"format": FORMAT, "param_names": state.get("param_names"), "param_groups": groups, "state": entries}


def _tensors_of(state: dict) -> dict[str, torch.Tensor]:
    return {
        f"state.{index}.{name}": value
        for index, values in state["state_dict"].get("state", {}).items()
        for name, value in values.items()
        if isinstance(value, torch.Tensor)
    }


def _unreadable(checkpoint: str, error: BaseException, folder: Path) -> EngineError:
    reason = (str(error).strip().splitlines() or [""])[0].replace(str(folder), checkpoint)[:200]  # no local path
    return EngineError(
        "checkpoint_unreadable",
        f"the optimizer state of checkpoint {checkpoint} is not tensors and plain data ({type(error).__name__}: "
        f"{reason}); it was not loaded. Load its weights alone (load_state) or save the state again",
    )
