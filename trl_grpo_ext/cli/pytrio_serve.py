"""`trl-grpo-ext pytrio-serve`: run the local PyTRIO server in the foreground until Ctrl-C."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import typing
from dataclasses import Field, dataclass, fields

from trl_grpo_ext.pytrio_server.config import API_KEY_ENV, ServerConfig, read_api_key_file


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options: `--model` and the keys by hand (each feeds several fields, or a file), every other one derived
    from a `ServerConfig` field that names a flag (`config.option`): its type, default and help."""
    parser.add_argument(
        "--model",
        required=True,
        action="append",
        help="model folder, hub id, or 'embedded' (SmolLM2-135M-Instruct). Repeat it to serve more base models: "
        "the first is trained (LoRA), the others are served for sampling and log-probs only (e.g. a distillation "
        "teacher: create_sampling_client(base_model=<its path or folder name>) + compute_logprobs); NAME=MODEL "
        "also answers to NAME (e.g. Qwen/Qwen3-8B=outputs/teacher for a script written for the hosted service)",
    )
    parser.add_argument(
        "--api-key-file",
        default=None,
        help="file of the bearer tokens clients send, one key per line, one line per client: each client sees only "
        "its own sessions, runs and checkpoints (safest: keys never show in `ps`); else --api-key, else "
        f"${API_KEY_ENV}, else a random key printed once at start",
    )
    parser.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help=f"a client key itself, repeatable (visible in `ps` to other users: prefer --api-key-file or ${API_KEY_ENV})",
    )
    parser.add_argument(
        "--admin-key-file",
        default=None,
        help="file of admin keys, one per line: an admin sees and may act on every client's objects",
    )
    for spec in config_flags():
        parser.add_argument(spec.flag, **spec.argument())
    parser.add_argument("--log-level", default="INFO", help="logging level")


@dataclass(frozen=True)
class FlagSpec:
    """A `ServerConfig` field as a ``pytrio-serve`` option (its ``flag`` metadata): ``args.<field name>`` holds it."""

    field: Field
    kind: type  # the value's type: int, float, str, bool, or tuple (a repeatable option)

    @property
    def flag(self) -> str:
        return self.field.metadata["flag"]

    @property
    def unit(self) -> tuple[str, int] | None:
        return self.field.metadata.get("unit")

    def default(self):
        """The option's default: the field's (in the option's unit), or its own ``cli_default``."""
        meta, default = self.field.metadata, self.field.default
        if "cli_default" in meta:
            return meta["cli_default"]
        if self.unit and default is not None:
            return default / self.unit[1]
        return list(default) if self.kind is tuple else default

    def argument(self) -> dict:
        """`argparse.ArgumentParser.add_argument`'s keywords for this option."""
        meta, default = self.field.metadata, self.default()
        shown = "" if default is None or self.kind in (bool, tuple) else f" (default {_shown(default)})"
        unit = f"; in {self.unit[0]}" if self.unit else ""
        text = meta.get("cli_help") or meta["help"]
        # argparse formats help with %: a literal one is doubled
        keywords = {"dest": self.field.name, "help": f"{text}{unit}{shown}".replace("%", "%%")}
        if self.kind is bool:  # a switch: --name turns a False default on, --no-name a True default off
            return {**keywords, "action": "store_false" if self.flag.startswith("--no-") else "store_true"}
        if meta.get("choices"):  # argparse shows them as the metavar
            return {**keywords, "type": self.kind, "default": default, "choices": meta["choices"]}
        keywords["metavar"] = meta.get("metavar") or self.flag[2:].upper().replace("-", "_")
        if self.kind is tuple:
            return {**keywords, "action": "append", "default": default}
        return {**keywords, "type": float if self.unit else self.kind, "default": default}

    def value(self, parsed):
        """The field's value from the parsed option."""
        if self.unit and parsed is not None:
            return int(parsed * self.unit[1])
        return tuple(parsed) if self.kind is tuple else parsed


def config_flags() -> list[FlagSpec]:
    """Every `ServerConfig` field with a flag, in field order."""
    hints = typing.get_type_hints(ServerConfig)
    return [FlagSpec(f, _kind(hints[f.name])) for f in fields(ServerConfig) if f.metadata.get("flag")]


def _kind(hint) -> type:
    """int, float, str, bool or tuple for a field's annotation (``X | None`` is X; ``str | bool`` a choice, str)."""
    if typing.get_origin(hint) is tuple:
        return tuple
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    return str if str in args else args[0]


def _shown(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _config(args: argparse.Namespace) -> tuple[ServerConfig, bool]:
    """The server config from the command line; also whether the key was chosen by the user. ValueError if bad."""
    keys = [*(read_api_key_file(args.api_key_file) if args.api_key_file else []), *args.api_key]
    if not keys and os.environ.get(API_KEY_ENV):
        keys = [os.environ[API_KEY_ENV]]
    admin_keys = read_api_key_file(args.admin_key_file) if args.admin_key_file else []
    config = ServerConfig(
        model=args.model[0],
        sampling_models=tuple(args.model[1:]),
        api_key=keys[0] if keys else None,
        api_keys=tuple(keys[1:]),
        admin_keys=tuple(admin_keys),
        **{spec.field.name: spec.value(getattr(args, spec.field.name)) for spec in config_flags()},
    )
    return config, bool(keys)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:  # every option is checked before the model loads
        config, chosen_key = _config(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.api_key:
        logging.warning("--api-key is visible to other users in `ps`; prefer --api-key-file or $%s", API_KEY_ENV)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        logging.warning("binding %s exposes the server beyond this machine; anyone with the key can train", args.host)

    from trl_grpo_ext.pytrio_server import LocalPyTrioServer  # torch, starlette: after the arguments are checked
    from trl_grpo_ext.pytrio_server.storage import StorageError

    stop = threading.Event()
    # installed before the address is printed: a supervisor may send SIGTERM as soon as it reads it
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        server = LocalPyTrioServer(config).start()
    except StorageError as error:  # the storage folder's key refused: one line saying what to do
        print(f"error: {error}", file=sys.stderr)
        return 2
    names = ", ".join(sorted(server.aliases))
    print(f"PyTRIO local server: {server.base_url}  model: {server.model_alias} ({server.model_id})", flush=True)
    print(f"  base_model may be any of: {names}", flush=True)
    for model in server.sampling_models.values():
        print(f"  for sampling and log-probs only: {', '.join(sorted(model.names))}", flush=True)
    clients = 1 + len(set(config.api_keys) - {config.api_key})
    if clients > 1 or config.admin_keys:
        print(f"  {clients} client keys, each seeing only its own sessions, runs and checkpoints; "
              f"{len(set(config.admin_keys))} admin keys", flush=True)  # fmt: skip
    if config.keep_checkpoints:
        print(f"  checkpoints: the newest {config.keep_checkpoints} of each kind kept per training run, older "
              f"ones deleted (--keep-checkpoints)", flush=True)  # fmt: skip
    else:
        print(f"  checkpoints: all kept in {server.storage} (--keep-checkpoints N deletes older ones)", flush=True)
    print(f"  export PYTRIO_BASE_URL={server.base_url}", flush=True)
    if not chosen_key:  # a generated key is shown once so the user can copy it; a chosen key is never echoed
        print(f"  export PYTRIO_API_KEY={server.api_key}", flush=True)
    else:
        print("  export PYTRIO_API_KEY=<the key you configured>", flush=True)
    try:
        while not stop.wait(0.5):  # short waits keep the main thread responsive to signals
            pass
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0
