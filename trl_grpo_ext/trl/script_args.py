"""`ScriptArguments` of the GSM8K recipes and the strict YAML + CLI parsing they share.

TRL's parser applies YAML values as argparse defaults; a misspelt key would then be dropped by scripts that
ask for remaining strings. `parse_recipe_args` refuses it with the closest valid name instead.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import os
import types
import typing
from dataclasses import dataclass, field

from trl_grpo_ext.environments.data import environment_name_problems
from trl_grpo_ext.errors import raise_problems
from trl_grpo_ext.runs import load_yaml
from trl_grpo_ext.runs.tracking import (
    normalize_swanlab_mode,
    swanlab_mode_field,
    swanlab_mode_problems,
    swanlab_project_field,
)
from trl_grpo_ext.task.spec import DataSpec


@dataclass
class ScriptArguments(DataSpec):
    """Options of `recipes/gsm8k_grpo.py` beside GRPOConfig and ModelConfig: the data spec (`DataSpec`: data,
    prompt and reward options, shared with the PyTRIO path) plus this recipe's before/after eval and logging
    options."""

    dataset_test_split: str = field(default="test", metadata={"help": "Split used for the before/after eval."})
    eval_num_samples: int = field(
        default=0,
        metadata={"help": "Held-out problems scored greedily before and after training (0: no eval)."},
    )
    eval_max_new_tokens: int | None = field(
        default=None, metadata={"help": "Token limit of the before/after eval (default: max_completion_length)."}
    )
    swanlab_project: str = swanlab_project_field()
    swanlab_mode: str | None = swanlab_mode_field()
    environments: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Environments whose tools the model may call (multi-turn; TRL's environment_factory): "
            "calculator, retrieval, or both (rows alternate between them). Empty: single-turn."
        },
    )

    def __post_init__(self):
        # DataSpec.__post_init__ is replaced, not extended: its problems and this class's make one error line
        normalize_swanlab_mode(self)  # cloud -> online, with a deprecation warning
        problems = self.data_problems() + swanlab_mode_problems(self.swanlab_mode)
        entries = [self.environments] if isinstance(self.environments, str) else list(self.environments or [])
        # 'calculator,retrieval' as well as a list (like reward_funcs)
        self.environments = [name.strip() for entry in entries for name in str(entry).split(",") if name.strip()]
        problems += environment_name_problems(self.environments)
        if self.eval_num_samples < 0:
            problems.append(f"eval_num_samples must be >= 0, got {self.eval_num_samples}")
        raise_problems("script arguments", problems)


def _known_keys(parser) -> set[str]:
    keys = set()
    for action in parser._actions:
        keys.add(action.dest)
    return keys


def _unknown(names: list[str], known: set[str], prefix: str = "") -> str:
    """``'name' (did you mean 'closest' or 'next'?), ...`` for `names` (field names), each shown with `prefix`."""
    lines = []
    for name in names:
        close = difflib.get_close_matches(str(name), sorted(known), n=2, cutoff=0.6)
        hint = " or ".join(f"'{prefix}{c}'" for c in close)
        lines.append(f"'{prefix}{name}'" + (f" (did you mean {hint}?)" if close else ""))
    return ", ".join(lines)


def check_config_keys(config: dict, known: set[str], path: str) -> None:
    """Raise on YAML keys no dataclass defines, naming each with the closest valid key."""
    unknown = [key for key in config if key not in known and key != "env"]
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {_unknown(unknown, known)}")


def check_flags(argv: list[str], known: set[str]) -> None:
    """Raise on ``--flags`` no dataclass defines, naming each with the closest valid flag (before argparse, whose
    error names no alternative)."""
    fields = [arg[2:].split("=", 1)[0].replace("-", "_") for arg in argv if arg.startswith("--") and arg != "--config"]
    unknown = [name for name in fields if name not in known]
    if unknown:
        raise ValueError(f"unknown flag(s) {_unknown(unknown, known, '--')}")


def _field_types(dataclass_types) -> dict:
    """Resolved type of every field of `dataclass_types` (first definition wins, as in TrlParser)."""
    out = {}
    for cls in dataclass_types:
        try:
            hints = typing.get_type_hints(cls)
        except Exception:  # an unresolvable annotation in a library class: skip that class's checks
            continue
        for f in dataclasses.fields(cls):
            if f.init and f.name not in out and f.name in hints:
                out[f.name] = hints[f.name]
    return out


def _accepts(tp, value) -> bool | None:
    """Whether YAML `value` fits type `tp` the way argparse would take it; None when the type is not checked here."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        results = [_accepts(arg, value) for arg in typing.get_args(tp)]
        if any(results):
            return True
        return None if None in results else False
    if tp is type(None):
        return value is None
    if origin is typing.Literal:
        return value in typing.get_args(tp)
    if origin in (list, tuple):
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        items = value if isinstance(value, (list, tuple)) else [value]  # argparse takes one value for a list too
        if not args:
            return True
        checks = [_accepts(args[0], item) for item in items]
        return None if None in checks else all(checks)
    if tp is bool:
        return isinstance(value, bool) or (isinstance(value, str) and value.lower() in ("true", "false", "yes", "no"))
    if tp is int:
        return _parses(int, value)
    if tp is float:
        return _parses(float, value)
    if tp is str:
        return not isinstance(value, (list, dict))
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return value in {m.value for m in tp} or (isinstance(value, str) and value in tp.__members__)
    return None


def _parses(kind, value) -> bool:
    if isinstance(value, bool) or isinstance(value, (list, dict)) or value is None:
        return False
    if kind is int and isinstance(value, float):
        return value.is_integer()
    try:
        kind(value)  # YAML 1.1 reads 4e-5 as a string; argparse converts it
    except (TypeError, ValueError):
        return False
    return True


def _type_name(tp) -> str:
    text = getattr(tp, "__name__", None) if typing.get_origin(tp) is None else None
    return text or str(tp).replace("typing.", "")


def check_config_types(config: dict, dataclass_types, path: str) -> None:
    """Raise on the first YAML value whose type its field cannot take, naming the key and the file."""
    hints = _field_types(dataclass_types)
    for key, value in config.items():
        tp = hints.get(key)
        if tp is None or _accepts(tp, value) is not False:
            continue
        raise ValueError(f"{path}: {key}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")


def _raise_value_error(message: str):
    raise ValueError(message)


def parse_recipe_args(argv: list[str] | None = None, default_config: str | None = None, dataclass_types=None):
    """(script_args, training_args, model_args) from `--config recipe.yaml` and CLI flags (flags win).

    Without `--config`, `default_config` (the offline embedded recipe) is used.
    """
    import sys

    # trl loads in seconds: when parsing, not with this module (the sweep imports `ScriptArguments`)
    from trl import ModelConfig, TrlParser

    from trl_grpo_ext.trl.config import GRPOConfig

    argv = list(sys.argv[1:] if argv is None else argv)
    classes = dataclass_types or (ScriptArguments, GRPOConfig, ModelConfig)
    parser = TrlParser(classes)
    parser.error = _raise_value_error  # a bad flag value is one ValueError line, not usage text and SystemExit
    if "--config" not in argv and default_config:
        argv = ["--config", str(default_config), *argv]
    known = _known_keys(parser)
    check_flags(argv, known)
    if "--config" not in argv:
        return parser.parse_args_and_config(argv, fail_with_unknown_args=True)
    index = argv.index("--config")
    if index + 1 >= len(argv):
        raise ValueError("--config needs a YAML path")
    path = argv[index + 1]
    if not os.path.isfile(path):
        raise FileNotFoundError(f"recipe not found: {path}")
    config = load_yaml(path)  # the one YAML reader (`4e-5` is a number), not TrlParser's own yaml.safe_load
    check_config_keys(config, known, path)
    check_config_types(config, classes, path)
    # TRL 1.16 `TrlParser.parse_args_and_config` from here on, with the config read above: `env` set, the other
    # values applied as defaults (every key is known: checked above), then the command line parsed (flags win).
    env = config.pop("env", {})
    if not isinstance(env, dict):
        raise ValueError(f"{path}: env must be a mapping of variable: value")
    for key, value in env.items():
        os.environ[key] = str(value)
    parser.set_defaults_with_config(**config)
    return parser.parse_args_into_dataclasses(args=argv[:index] + argv[index + 2 :])
