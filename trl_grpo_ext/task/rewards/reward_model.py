"""Reward models ("type B"): a `reward_funcs` entry that is a model folder or hub id, as in TRL.

TRL 1.16's `GRPOTrainer` takes a reward model's path in `reward_funcs`, loads it with
``AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)`` and its tokenizer with `AutoTokenizer`
(``__init__``), and scores a batch in ``_calculate_rewards``' `nn.Module` branch: prompt + completion rendered with
the reward tokenizer's chat template (`trl.data_utils.apply_chat_template`), tokenized right-padded without special
tokens, one forward under `torch.inference_mode`, ``logits[:, 0]``.

`RewardModelReward` is that, in one place for both paths: `load` mirrors TRL's loading (plus the recipe's
``reward_model: {dtype, device}``) and `__call__` mirrors the `nn.Module` branch, so the PyTRIO loop scores as TRL
does. The TRL path hands TRL the loaded model and tokenizer (`trl_reward_inputs`): TRL scores it itself. Both
paths then call the same model, whose forward honours ``batch_size`` (rows per forward) and ``max_length`` (tokens
kept per row, from the left: what a right-truncating tokenizer keeps), options TRL's scoring lacks.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields
from pathlib import Path

DTYPES = ("auto", "float32", "bfloat16", "float16")
# org/name, as the hub spells a repository: how an entry that is no local folder still names a model.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class RewardModelError(ValueError):
    """A `reward_funcs` entry that cannot be a reward model; the one-line message names the entry."""


@dataclass
class RewardModelOptions:
    """The recipe's ``reward_model:`` mapping (every reward model of the run)."""

    batch_size: int | None = None  # rows per forward; None: the whole batch at once, as TRL does
    max_length: int | None = None  # tokens kept per row; None: no truncation, as TRL does
    device: str | None = None  # 'cpu', 'cuda', 'cuda:1', ...; None: the PyTRIO loop's CPU, the TRL path's device
    dtype: str | None = None  # one of DTYPES; None: TRL's default (the checkpoint's dtype under transformers 5)

    @classmethod
    def from_mapping(cls, mapping) -> RewardModelOptions:
        mapping = mapping_option("reward_model", mapping)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(mapping) - known)
        if unknown:
            raise ValueError(f"reward_model: unknown key(s) {unknown}; valid: {sorted(known)}")
        options = cls(**mapping)
        problems = []
        for name in ("batch_size", "max_length"):
            value = getattr(options, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                problems.append(f"reward_model.{name}={value!r} must be an integer >= 1 or unset")
        if options.dtype is not None and options.dtype not in DTYPES:
            problems.append(f"reward_model.dtype={options.dtype!r} must be one of {', '.join(DTYPES)}")
        if options.device is not None and not (isinstance(options.device, str) and options.device.strip()):
            problems.append(f"reward_model.device={options.device!r} must be a device name such as 'cpu'")
        if problems:
            raise ValueError("; ".join(problems))
        return options


def mapping_option(name: str, value) -> dict:
    """A recipe option that holds a mapping: a dict from YAML, or a JSON object string from the command line."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"{name}: {value[:80]!r} is not a JSON object ({error.msg})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a mapping, got {type(value).__name__}")
    return dict(value)


def is_model_entry(entry) -> bool:
    """Whether a `reward_funcs` entry names a model rather than a reward: a local folder, or a hub id (org/name)."""
    if not isinstance(entry, str) or not entry.strip():
        return False
    entry = entry.strip()
    return Path(entry).expanduser().is_dir() or bool(_HUB_ID.match(entry))


def reward_model_name(entry: str) -> str:
    """TRL 1.16's name of a reward model (``get_config_model_id(config).split("/")[-1]``, the path it was loaded
    from): the ``<name>`` of ``rewards/<name>/mean`` on both paths."""
    return str(entry).split("/")[-1]


def check_reward_model(entry: str) -> str:
    """Read the entry's config (no weights) and check it is a sequence-classification model; returns the path or
    id to load. A missing folder, an unreachable hub id or a model of another kind raises `RewardModelError`."""
    from transformers import AutoConfig  # transformers: only for a run that has a reward model

    entry = entry.strip()
    local = Path(entry).expanduser()
    source = str(local) if local.is_dir() else entry
    try:
        config = AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as error:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise RewardModelError(
            f"reward_funcs entry {entry!r} is not a reward name and its model cannot be read: {first[:200]}"
        ) from None
    architectures = list(getattr(config, "architectures", None) or [])
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise RewardModelError(
            f"reward_funcs entry {entry!r} is not a sequence-classification reward model (architectures: "
            f"{', '.join(architectures) or 'none'}); TRL loads reward models with "
            "AutoModelForSequenceClassification(num_labels=1)"
        )
    labels = getattr(config, "num_labels", 1)
    if labels != 1:
        raise RewardModelError(
            f"reward_funcs entry {entry!r} has num_labels={labels}; a reward model scores with one logit"
        )
    return source


def _chunked_forward(forward, batch_size: int | None, max_length: int | None):
    """The model's forward, keeping ``max_length`` tokens per row and running ``batch_size`` rows at a time. TRL's
    scoring calls the model with the whole right-padded batch; so does `RewardModelReward`, so the two paths go
    through these options alike. The logits are concatenated in row order (the reward is ``logits[:, 0]``)."""
    import torch
    from transformers.modeling_outputs import SequenceClassifierOutputWithPast

    def bounded(input_ids=None, attention_mask=None, **kwargs):
        if max_length is not None and input_ids is not None and input_ids.shape[1] > max_length:
            input_ids = input_ids[:, :max_length]
            attention_mask = attention_mask[:, :max_length] if attention_mask is not None else None
        rows = input_ids.shape[0] if input_ids is not None else 0
        if batch_size is None or rows <= batch_size:
            return forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        logits = []
        for start in range(0, rows, batch_size):
            part = slice(start, start + batch_size)
            mask = attention_mask[part] if attention_mask is not None else None
            if mask is not None:  # drop the columns only other chunks' rows fill: the same logits, less work
                width = int(mask.sum(dim=1).max())
                ids, mask = input_ids[part, :width], mask[:, :width]
            else:
                ids = input_ids[part]
            logits.append(forward(input_ids=ids, attention_mask=mask, **kwargs).logits)
        return SequenceClassifierOutputWithPast(logits=torch.cat(logits))

    return bounded


class RewardModelReward:
    """A reward model as a reward function (`f(prompts, completions, **kwargs) -> list[float]`); see the module
    docstring. Construction reads the config only (a bad entry fails at once); the weights load on first use."""

    scored_after_vetoes = True  # in a hybrid, no forward is spent on a completion a veto scores anyway

    def __init__(self, entry: str, options: RewardModelOptions | None = None, chat_template_kwargs=None):
        self.entry = entry.strip()
        self.source = check_reward_model(self.entry)
        self.options = options or RewardModelOptions()
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.__name__ = reward_model_name(self.source)  # the path TRL is handed, so both paths name it alike
        self.model = None
        self.tokenizer = None

    def load(self):
        """(model, tokenizer) as TRL 1.16's ``GRPOTrainer.__init__`` loads a reward model given by path, with the
        recipe's dtype and device; the forward bounded by ``batch_size`` / ``max_length``. Loaded once."""
        if self.model is not None:
            return self.model, self.tokenizer
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        kwargs = {}
        if self.options.dtype is not None:
            kwargs["dtype"] = (
                self.options.dtype if self.options.dtype == "auto" else getattr(torch, self.options.dtype)
            )
        model = AutoModelForSequenceClassification.from_pretrained(self.source, num_labels=1, **kwargs)
        if self.options.device is not None:
            model = model.to(self.options.device)
        model.eval()
        tokenizer = AutoTokenizer.from_pretrained(self.source)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        # As TRL: the model scores the last non-padding token, which it finds through the config's pad token.
        model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
        if self.options.batch_size is not None or self.options.max_length is not None:
            model.forward = _chunked_forward(model.forward, self.options.batch_size, self.options.max_length)
        self.model, self.tokenizer = model, tokenizer
        return model, tokenizer

    def texts(self, prompts, completions) -> list[str]:
        """What the reward model reads, as TRL 1.16 builds it: the chat template over prompt + completion messages
        for conversational prompts, else the two strings joined."""
        from trl.data_utils import apply_chat_template, is_conversational

        if is_conversational({"prompt": prompts[0]}):
            return [
                apply_chat_template({"messages": p + c}, self.tokenizer, **self.chat_template_kwargs)["text"]
                for p, c in zip(prompts, completions, strict=True)
            ]
        return [p + c for p, c in zip(prompts, completions, strict=True)]

    def __call__(self, completions, prompts=None, **kwargs) -> list[float]:
        import torch

        model, tokenizer = self.load()
        if not completions:
            return []
        if prompts is None:
            raise ValueError(f"reward model {self.__name__!r} reads the prompts too; TRL passes them as `prompts`")
        inputs = tokenizer(
            text=self.texts(list(prompts), list(completions)),
            return_tensors="pt",
            padding=True,
            padding_side="right",
            add_special_tokens=False,
        ).to(model.device)
        with torch.inference_mode():
            return model(**inputs).logits[:, 0].float().tolist()


def trl_reward_inputs(funcs) -> tuple[list, list]:
    """``(reward_funcs, reward_processing_classes)`` for `trl.GRPOTrainer`: each `RewardModelReward` becomes its
    loaded model (TRL scores it, its own way) with its tokenizer; any other reward stays as it is, with None."""
    out, classes = [], []
    for func in funcs:
        if isinstance(func, RewardModelReward):
            model, tokenizer = func.load()
            out.append(model)
            classes.append(tokenizer)
        else:
            out.append(func)
            classes.append(None)
    return out, classes
