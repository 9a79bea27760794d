"""A checkpoint's AdamW state on disk without pickle: its tensors in safetensors, everything else in JSON.

A state checkpoint (``save_state``) holds the optimizer of its run as `OPTIMIZER_TENSORS` (the moments and step
counts, keyed ``state.<index>.<name>``) and `OPTIMIZER_META` (the parameter names, the param groups, which state
entries are tensors). Reading them runs no code a file could name: safetensors holds tensors only, JSON plain data,
and both are checked against the run's parameters before an optimizer takes them (`state_problems`).

Checkpoints saved before hold a pickle (`LEGACY_OPTIMIZER`, ``torch.save``). It is read once with torch's restricted
unpickler (``weights_only=True``: tensors and plain containers, no code), written again in the new format and removed;
one that holds anything else is refused with a clear error and left as it is. A pickle can name one object many times
and so stand for far more data than it holds (1.5 KB of shared lists wrote out as 5 MB of JSON, a few more levels
exhaust the memory): a file larger than the checkpoint's optimizer state can be (`state_limit`) is refused unread,
its conversion is admitted against the server's working-memory budget, and the plain data it writes out is bounded
(`MAX_PLAIN_ITEMS`, `MAX_PLAIN_DEPTH`). Every refusal is ``checkpoint_unreadable``.

Files are read through the checkpoint's `storage.CheckpointFolder` (regular files of the server's user only).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from pathlib import Path

import torch

from trl_grpo_ext.pytrio_server.errors import EngineError, without_paths
from trl_grpo_ext.pytrio_server.storage import ADAPTER_FILE, CheckpointFolder, StorageError
from trl_grpo_ext.runs import atomic_write_text

logger = logging.getLogger(__name__)

OPTIMIZER_TENSORS = "optimizer.safetensors"
OPTIMIZER_META = "optimizer.json"
LEGACY_OPTIMIZER = "optimizer.pt"  # torch.save pickles of checkpoints saved before; converted on first load
FORMAT = 1
_PLAIN = (bool, int, float, str, type(None))
# AdamW keeps two float32 moments per adapter weight (the adapter file holds each weight once, in float32 or less) and
# a step count per parameter: an optimizer file of a checkpoint holds at most this many times its adapter file, plus
# the slack of small entries
STATE_PER_ADAPTER = 4
STATE_SLACK = 16 * 1024 * 1024
CONVERSION_COPIES = 3  # a pickle's tensors, as read, then as written out (safetensors builds its bytes)
# Plain data in an optimizer state: its param groups (a few settings and one index per parameter) and per-parameter
# entries. A million values is far above any adapter's; nesting beyond a few levels is no optimizer's.
MAX_PLAIN_ITEMS = 1_000_000
MAX_PLAIN_DEPTH = 32


class _Budget:
    """What is left of `MAX_PLAIN_ITEMS` while one file's plain data is read or written out."""

    def __init__(self) -> None:
        self.items = MAX_PLAIN_ITEMS


def has_optimizer(folder: CheckpointFolder) -> bool:
    return folder.entry(OPTIMIZER_META) is not None or folder.entry(LEGACY_OPTIMIZER) is not None


def state_limit(folder: CheckpointFolder) -> int:
    """The most bytes an optimizer file of the checkpoint in `folder` can hold (a few times its adapter file)."""
    adapter = folder.entry(ADAPTER_FILE)
    return STATE_PER_ADAPTER * (adapter.st_size if adapter is not None else 0) + STATE_SLACK


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


def load_optimizer(folder: CheckpointFolder, checkpoint: str, memory=None) -> dict:
    """The optimizer state saved in `folder` (`save_optimizer`'s input); a legacy pickle is converted first, admitted
    against `memory` (the server's `MemoryGate`) when given.

    `checkpoint` names the checkpoint in error messages (never the folder: a client's business is its URI)."""
    limit = state_limit(folder)
    if folder.entry(OPTIMIZER_META) is None and folder.entry(LEGACY_OPTIMIZER) is not None:
        state = _convert_legacy(folder, checkpoint, limit, memory)
        if state is not None:
            return state
    return _load_files(folder, checkpoint, limit)


def _load_files(folder: CheckpointFolder, checkpoint: str, limit: int) -> dict:
    """The optimizer state of the new format in `folder` (`load_optimizer`)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        meta = json.loads(folder.read(OPTIMIZER_META, limit))
        with folder.file_path(OPTIMIZER_TENSORS, limit) as path:
            tensors = load_file(str(path))
        return _from_files(meta, tensors, _Budget())
    except (OSError, StorageError, ValueError, KeyError, TypeError, RecursionError, SafetensorError) as error:
        raise _unreadable(checkpoint, error, folder.path) from None


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


def _from_files(meta: dict, tensors: dict[str, torch.Tensor], budget: _Budget) -> dict:
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"unknown optimizer format {meta.get('format') if isinstance(meta, dict) else meta!r}")
    names, groups, entries = meta["param_names"], meta["param_groups"], meta["state"]
    if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise ValueError("param_names must be a list of strings")
    if not (isinstance(groups, list) and all(isinstance(g, dict) for g in groups) and isinstance(entries, dict)):
        raise ValueError("param_groups must be a list of objects, state an object")
    groups = [_plain(group, "param_groups", budget) for group in groups]
    state = {}
    for index, values in entries.items():
        if not (index.isdigit() and isinstance(values, dict)):
            raise ValueError(f"state entry {index!r} is not a parameter index")
        state[int(index)] = {
            name: tensors[f"state.{index}.{name}"]
            if kind == "tensor"
            else _plain(kind, f"state.{index}.{name}", budget)
            for name, kind in values.items()
        }
    for group in groups:  # torch's Adam unpacks betas; JSON made the tuple a list
        if isinstance(group.get("betas"), list):
            group["betas"] = tuple(group["betas"])
    return {"state_dict": {"state": state, "param_groups": groups}, "param_names": names}


def _plain(value, where: str, budget: _Budget | None = None, depth: int = 0):
    """`value` if it is JSON's plain data (finite numbers, strings, booleans, None, lists and string-keyed objects of
    them; a tuple becomes a list), else ValueError naming `where`. Every value counts against `budget` (a new one
    when None), each time it is reached: a value named many times is written out as many times."""
    budget = budget if budget is not None else _Budget()
    budget.items -= 1
    if budget.items < 0:
        raise ValueError(f"{where} holds more than {MAX_PLAIN_ITEMS} values once written out")
    if depth > MAX_PLAIN_DEPTH:
        raise ValueError(f"{where} is nested deeper than {MAX_PLAIN_DEPTH} levels")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where} holds a non-finite number")
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v, where, budget, depth + 1) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _plain(v, f"{where}.{k}", budget, depth + 1) for k, v in value.items()}
    raise ValueError(f"{where} holds a {type(value).__name__}, not plain data")


def _convert_legacy(folder: CheckpointFolder, checkpoint: str, limit: int, memory) -> dict | None:
    """Read the pickled `LEGACY_OPTIMIZER` with torch's restricted unpickler and write it in the new format (the
    pickle is removed once the new files are complete); the state either way, or EngineError. None when the pickle
    is gone: another load (a thread, another server on the folder) converted it meanwhile, so the new files hold it."""
    legacy = folder.entry(LEGACY_OPTIMIZER)
    if legacy is None:
        return None
    size = legacy.st_size
    if size > limit:
        raise _unreadable(checkpoint, ValueError(f"it has {size} bytes, more than this adapter's state can ({limit})"))
    cost = CONVERSION_COPIES * size
    if memory is not None and cost > memory.budget:
        raise _unreadable(checkpoint, MemoryError(f"converting it needs about {cost} bytes, beyond the memory budget"))
    with memory.reserve(cost) if memory is not None else contextlib.nullcontext():
        try:
            with contextlib.ExitStack() as opened:
                try:
                    path = opened.enter_context(folder.file_path(LEGACY_OPTIMIZER, limit))
                except FileNotFoundError:  # converted by another load since `entry` saw it
                    return None
                state = torch.load(path, weights_only=True, map_location="cpu")
            if not (isinstance(state, dict) and isinstance(state.get("state_dict"), dict)):
                raise ValueError("it holds no optimizer state_dict")
            budget = _Budget()  # the same checks as a file in the new format, and one bound on what it writes out
            state = _from_files(_meta_of(state, budget), _tensors_of(state), budget)
        except Exception as error:  # noqa: BLE001 - the unpickler refuses with several types; one clear answer
            raise _unreadable(checkpoint, error, folder.path) from None
        try:
            # `save_optimizer` writes by path: an entry of either name (a link someone put there) is removed first,
            # never followed, so the files are written into this folder only
            for name in (OPTIMIZER_TENSORS, OPTIMIZER_META):
                folder.remove(name)
            save_optimizer(state, folder.pinned)  # its JSON written last and atomically: until then the pickle is read
            folder.remove(LEGACY_OPTIMIZER)
            logger.info(
                "checkpoint %s: optimizer state converted from its pickle to %s", checkpoint, OPTIMIZER_TENSORS
            )
        except (OSError, StorageError) as error:  # read-only storage: this load goes on, the pickle stays for the next
            logger.warning("checkpoint %s: optimizer state not converted (%s); loaded as read", checkpoint, error)
    return state


def _meta_of(state: dict, budget: _Budget) -> dict:
    entries = {
        str(index): {name: "tensor" if isinstance(v, torch.Tensor) else v for name, v in values.items()}
        for index, values in state["state_dict"].get("state", {}).items()
    }
    groups = [_plain(group, "param_groups", budget) for group in state["state_dict"].get("param_groups", [])]
    return {"format": FORMAT, "param_names": state.get("param_names"), "param_groups": groups, "state": entries}


def _tensors_of(state: dict) -> dict[str, torch.Tensor]:
    return {
        f"state.{index}.{name}": value
        for index, values in state["state_dict"].get("state", {}).items()
        for name, value in values.items()
        if isinstance(value, torch.Tensor)
    }


def _unreadable(checkpoint: str, error: BaseException, folder: Path | None = None) -> EngineError:
    reason = (str(error).strip().splitlines() or [""])[0]
    if folder is not None:
        reason = reason.replace(str(folder), checkpoint)
    reason = without_paths(reason)[:200]  # no local path, /proc/self/fd/N included
    return EngineError(
        "checkpoint_unreadable",
        f"the optimizer state of checkpoint {checkpoint} is not tensors and plain data ({type(error).__name__}: "
        f"{reason}); it was not loaded. Load its weights alone (load_state) or save the state again",
    )
