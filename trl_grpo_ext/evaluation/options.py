"""The eval options, defined once: `EvalOptions` (which problems, how to generate, cache and progress) and `EvalRun`
(plus the model, a model to compare with and the output file: one `trl-grpo-ext eval`).

Read by `trl-grpo-ext eval` (its flags are generated from the fields here, `add_eval_arguments`), by a sweep's
`evaluate:` mapping (checked by `sweep_eval_options`, turned back into flags by `eval_cli_args`) and by the
recipes' before/after eval (`recipe_eval_options`).
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field

from trl_grpo_ext.decode import ENGINES as DECODE_ENGINES
from trl_grpo_ext.evaluation.problems import EMBEDDED_DATA, GSM8K_TEST
from trl_grpo_ext.task.spec import data_field

# Problems per generate() call of the recipes' before/after eval (the CLI's default is `EvalOptions.batch_size`).
RECIPE_EVAL_BATCH_SIZE = 32


@dataclass
class EvalOptions:
    """Which problems an eval runs on and how it generates: everything but the model."""

    data: str = field(
        default=EMBEDDED_DATA,
        metadata={
            "help": f"'{EMBEDDED_DATA}' (offline reasoning-gym eval split), '{GSM8K_TEST}', or a JSONL of "
            "question/answer rows"
        },
    )
    tasks: str | None = field(
        default=None,
        metadata={
            "help": f"with --data {EMBEDDED_DATA}: reasoning-gym task mix, as the recipe's synthetic_tasks (e.g. "
            "chain_sum_easy,chain_sum)"
        },
    )
    limit: int | None = field(default=None, metadata={"help": "evaluate the first N problems only"})
    k: int = field(default=1, metadata={"help": "samples per problem for maj@k / pass@k (1: greedy only)"})
    batch_size: int = field(default=8, metadata={"help": "problems per generate() call"})
    max_new_tokens: int = field(default=256, metadata={"help": "token limit of each completion"})
    temperature: float = field(default=0.7, metadata={"help": "sampling temperature for the k samples"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling for the k samples"})
    seed: int = field(default=0, metadata={"help": "seed of the k samples (and of a JSONL file's problem order)"})
    decode_engine: str = field(
        default="generate",
        metadata={
            "help": "the decode loop: 'generate' (transformers') or 'packed' (a static KV cache and prepacked "
            "weights: Llama-layout fp32 models on the CPU; elsewhere generate decodes), docs/decode.md"
        },
    )
    # the data spec's option (its name and default); the help describes the CLI's --no_one_shot flag
    one_shot: bool = data_field(
        "one_shot", help="prompt without the one-shot worked example (the training default includes it)"
    )
    cache: bool = field(
        default=True,
        metadata={
            "help": "always generate: do not read or write the greedy-eval cache ($TRL_GRPO_EXT_CACHE/eval); "
            "greedy-only evals (k=1) of a model with known files are cached"
        },
    )
    progress: bool = field(
        default=True, metadata={"help": "no progress bar (there is none either when the output is not a terminal)"}
    )

    def __post_init__(self):
        if self.limit is not None and self.limit < 1:
            raise ValueError("--limit must be >= 1")
        if self.batch_size < 1 or self.k < 1:
            raise ValueError("--batch_size and --k must be >= 1")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.decode_engine not in DECODE_ENGINES:
            raise ValueError(f"--decode_engine must be one of {', '.join(DECODE_ENGINES)}, got {self.decode_engine!r}")


@dataclass(kw_only=True)
class EvalRun(EvalOptions):
    """One `trl-grpo-ext eval` invocation's settings; `evaluation.run_eval` does the work."""

    model: str = field(metadata={"help": "'embedded', a local path or a hub id (a run's output_dir works)"})
    adapter: str | None = field(default=None, metadata={"help": "LoRA adapter folder to apply on top of --model"})
    compare_model: str | None = field(
        default=None, metadata={"help": "a second model evaluated on the same problems as the 'before' model"}
    )
    out: str = field(
        default="eval_results.jsonl",
        metadata={"help": "per-problem results (JSONL); the summary goes next to it as <stem>_summary.json"},
    )
    # the command's own default: the faster loop where it applies (docs/decode.md); the recipes' eval follows
    # their GRPOConfig.decode_engine instead
    decode_engine: str = field(
        default="packed",
        metadata={
            "help": "the decode loop: 'packed' (default: a static KV cache and prepacked weights, for "
            "Llama-layout fp32 models on the CPU; elsewhere generate decodes and says why) or 'generate' "
            "(transformers'), docs/decode.md"
        },
    )

    def engine_line(self) -> str:
        """The command's first line: which decode loop runs and why."""
        if self.decode_engine == "generate":
            return "decode engine: generate (transformers' generate, --decode_engine generate)"
        return (
            f"decode engine: {self.decode_engine} (trl-grpo-ext eval's default: the same greedy answers as "
            "transformers' generate in about 0.6 of its time on a CPU, docs/decode.md; where it does not apply, "
            "generate decodes and the reason is logged; --decode_engine generate runs generate)"
        )


# The flags of `trl-grpo-ext eval`, in the order its --help lists them.
CLI_ORDER = ("model", "adapter", "data", "tasks", "limit", "k", "batch_size", "max_new_tokens", "temperature",
             "top_p", "seed", "decode_engine", "one_shot", "out", "compare_model", "cache", "progress")  # fmt: skip
# Set by a sweep for each run it evaluates; everything else of `EvalRun` may stand in its `evaluate:` mapping.
SWEEP_SET = ("model", "adapter", "out")


def _fields() -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(EvalRun)}


def _value_type(name: str):
    """The type a flag's value is parsed with: int, float or str (an `X | None` field takes X)."""
    hint = typing.get_type_hints(EvalRun)[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def _flags(name: str) -> list[str]:
    """`--batch_size --batch-size`; a boolean that is on by default is turned off with `--no_x --no-x`."""
    spelled = f"no_{name}" if _fields()[name].default is True else name
    return [f"--{spelled}"] + ([f"--{spelled.replace('_', '-')}"] if "_" in spelled else [])


def add_eval_arguments(parser) -> None:
    """`trl-grpo-ext eval`'s flags, one per `EvalRun` field."""
    fields = _fields()
    for name in CLI_ORDER:
        f, help_text = fields[name], fields[name].metadata["help"]
        if f.default is True:
            parser.add_argument(*_flags(name), dest=name, action="store_false", help=help_text)
        elif f.default is dataclasses.MISSING:
            parser.add_argument(*_flags(name), required=True, help=help_text)
        else:
            parser.add_argument(*_flags(name), type=_value_type(name), default=f.default, help=help_text)


def eval_run_from_args(args) -> EvalRun:
    """The `EvalRun` of parsed `add_eval_arguments` flags (ValueError for values it refuses)."""
    return EvalRun(**{name: getattr(args, name) for name in _fields()})


def sweep_eval_options(options: dict, where: str = "") -> dict:
    """A sweep's `evaluate:` mapping, checked before any run starts: known keys only (`no_<key>: true` is read as
    `<key>: false`, as the flag is spelled), values an `EvalRun` accepts. Returns the mapping with field names."""
    fields = _fields()
    known = sorted(set(fields) - set(SWEEP_SET))
    out = {}
    for key, value in options.items():
        name = str(key)
        if name.startswith("no_") and name[3:] in fields and fields[name[3:]].default is True:
            name, value = name[3:], not value
        if name in SWEEP_SET:
            raise ValueError(f"{where}evaluate: '{key}' is set by the sweep for each run")
        if name not in fields:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ValueError(f"{where}evaluate: unknown option '{key}'{hint}; known: {', '.join(known)}")
        out[name] = value
    try:
        EvalRun(model="-", **out)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}evaluate: {err}") from None
    return out


def eval_cli_args(options: dict) -> list[str]:
    """The `trl-grpo-ext eval` flags that give `options` (field names, as `sweep_eval_options` returns them)."""
    fields = _fields()
    args = []
    for name in CLI_ORDER:
        if name not in options:
            continue
        value = options[name]
        if fields[name].default is True:
            args += [] if value else [_flags(name)[0]]
        elif value is not None:
            args += [_flags(name)[0], str(value)]
    return args


def recipe_eval_options(script_args, training_args) -> EvalOptions:
    """The recipes' before/after eval: greedy, `eval_max_new_tokens` (default `max_completion_length`) tokens,
    cached, its bars shown unless `disable_tqdm` (the option that hides TRL's training bar)."""
    return EvalOptions(
        max_new_tokens=script_args.eval_max_new_tokens or training_args.max_completion_length,
        batch_size=RECIPE_EVAL_BATCH_SIZE,
        decode_engine=getattr(training_args, "decode_engine", "generate"),
        progress=not getattr(training_args, "disable_tqdm", False),
    )
