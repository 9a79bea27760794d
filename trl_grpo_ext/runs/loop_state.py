"""Resume bookkeeping of the PyTRIO loop: what to reload after a stop, kept next to `metrics.jsonl`.

The service holds the weights and optimizer state (`TrainingClient.save_state`); this side keeps, in
``<output_dir>/pytrio_state.json``, the checkpoint URI plus what only the loop knows: the number of optimizer
steps done and the position in the prompt stream. Sampling seeds derive from ``(seed, step)``, so a resumed run
draws what an uninterrupted one would. The file is replaced atomically: a run killed while saving leaves the
previous record.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trl_grpo_ext.runs import PYTRIO_STATE_FILENAME, atomic_write_json

STATE_VERSION = 1
# Settings that must not change across a resume: they define the model being trained and the data order.
PINNED_KEYS = ("base_model", "lora_r", "seed", "num_generations", "per_device_train_batch_size", "dataset_name")


@dataclass
class LoopState:
    step: int = 0
    data_position: int = 0
    extra_data_position: int = 0  # prompts dynamic sampling's extra rounds took from their own stream
    state_path: str | None = None
    sampler_path: str | None = None
    pinned: dict = field(default_factory=dict)
    curriculum: dict | None = None  # `Curriculum.state_dict()` with ``curriculum: true``
    checkpoints: list[dict] = field(default_factory=list)
    # asynchronous sampling: the batches drawn ahead for the steps after `step` (`pytrio.lookahead.SampleAhead.saved`)
    ahead: list[dict] = field(default_factory=list)
    version: int = STATE_VERSION

    @classmethod
    def from_dict(cls, data: dict) -> LoopState:
        if not isinstance(data, dict) or data.get("version") != STATE_VERSION:
            raise ValueError(
                f"unsupported loop state (version {data.get('version') if isinstance(data, dict) else None})"
            )
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        state = cls(**known)
        if not isinstance(state.step, int) or state.step < 0:
            raise ValueError(f"invalid step {state.step!r} in loop state")
        for name in ("data_position", "extra_data_position"):
            value = getattr(state, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"invalid {name} {value!r} in loop state")
        return state


def pinned_settings(config) -> dict:
    return {key: getattr(config, key) for key in PINNED_KEYS}


def save_loop_state(output_dir: str | Path, state: LoopState) -> Path:
    path = Path(output_dir) / PYTRIO_STATE_FILENAME
    atomic_write_json(path, asdict(state), indent=2, sort_keys=True)
    return path


def load_loop_state(output_dir: str | Path) -> LoopState | None:
    """The recorded state, or None when the directory holds none (a fresh run)."""
    path = Path(output_dir) / PYTRIO_STATE_FILENAME
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error}); remove it to start over") from None
    try:
        return LoopState.from_dict(data)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{path}: {error}") from None


def check_resumable(state: LoopState, config) -> None:
    """Refuse to resume into a different model or data order, with the differing keys named."""
    if not state.state_path:
        raise ValueError("the recorded loop state has no checkpoint URI to resume from")
    current = pinned_settings(config)
    pinned = state.pinned
    changed = {k: (pinned.get(k), current[k]) for k in current if k in pinned and pinned[k] != current[k]}
    if changed:
        detail = ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changed.items())
        raise ValueError(f"cannot resume: settings changed since the checkpoint ({detail}); use a new output_dir")
