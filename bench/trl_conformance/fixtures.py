"""Offline stand-ins for the hub ids TRL's GRPO tests load: tiny random models and a tokenizer built here, saved
where ``from_pretrained`` looks under ``HF_HUB_OFFLINE=1`` (the hub cache layout of ``$HF_HUB_CACHE``), and the
``trl-internal-testing/zen`` prompt datasets (`zen_dataset`, served by `offline_plugin`).

    python bench/trl_conformance/fixtures.py TEST_FILE HUB_CACHE   # builds every id TEST_FILE names that it can

Ids of the form ``<org>/tiny-<Arch>For<CausalLM|SequenceClassification>[-version]`` are built from transformers'
own ``<Arch>For<Head>`` class at a tiny shape (the ids' architectures, not their weights or vocabularies); any
other id (vision models, full-size models for vLLM) is listed as not built, and the tests that load it fail or
skip the same way for TRL's classes and ours.
"""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

HEADS = ("CausalLM", "SequenceClassification")
MODEL_ID = re.compile(r"^[\w.-]+/tiny-(?P<arch>\w+?)For(?P<head>\w+?)(?:-[\d.]+)?$")
QUOTED_ID = re.compile(r"[\"']([\w.-]+/[\w.-]+)[\"']")
SNAPSHOT = "0" * 40  # the one revision of each stand-in

# Qwen's special tokens (chat, tools, thinking, padding), plus Llama 3's pad token, which a test sets by name.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
    "<|finetune_right_pad_id|>",
]

# The Zen of Python, as trl-internal-testing/zen splits it: 17 training lines and 2 test lines, each prompt the
# start of a line and its completion the rest (the tests read the prompts only).
ZEN = [
    ("Beautiful is better than", " ugly."),
    ("Explicit is", " better than implicit."),
    ("Simple is better", " than complex."),
    ("Complex", " is better than complicated."),
    ("Flat is better than", " nested."),
    ("Sparse is better", " than dense."),
    ("Readability", " counts."),
    ("Special cases aren't special", " enough to break the rules."),
    ("Although practicality beats", " purity."),
    ("Errors should never", " pass silently."),
    ("Unless explicitly", " silenced."),
    ("In the face of ambiguity, refuse", " the temptation to guess."),
    ("There should be one-- and preferably", " only one --obvious way to do it."),
    ("Although that way may not be", " obvious at first unless you're Dutch."),
    ("Now is better", " than never."),
    ("Although never is often better than", " *right* now."),
    ("If the implementation is hard to explain,", " it's a bad idea."),
    ("If the implementation is easy", " to explain, it may be a good idea."),
    ("Namespaces are one honking great", " idea -- let's do more of those!"),
]
ZEN_TRAIN = 17


def zen_dataset(name: str):
    """``load_dataset("trl-internal-testing/zen", name)``: a DatasetDict with train and test splits."""
    from datasets import Dataset, DatasetDict

    def rows(lines):
        if name == "standard_prompt_only":
            return {"prompt": [prompt for prompt, _ in lines]}
        if name == "conversational_prompt_only":
            return {"prompt": [[{"role": "user", "content": prompt}] for prompt, _ in lines]}
        raise ValueError(f"trl-internal-testing/zen: no offline stand-in for the {name!r} configuration")

    return DatasetDict(train=Dataset.from_dict(rows(ZEN[:ZEN_TRAIN])), test=Dataset.from_dict(rows(ZEN[ZEN_TRAIN:])))


def build_tokenizer(chat_template: str):
    """A byte-level BPE tokenizer trained on the Zen lines, with Qwen's special tokens and `chat_template`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [prompt + rest for prompt, rest in ZEN] + ['{"name": "multiply_tool", "arguments": {"a": 3, "b": 4}}']
    tok.train_from_iterator(corpus * 10, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>")
    tokenizer.chat_template = chat_template
    return tokenizer


def _chat_template(arch: str) -> str:
    """TRL's copy of the chat template of the id's family (Qwen3's for Qwen3 models, Qwen2.5's otherwise)."""
    import trl

    name = "qwen3.jinja" if arch.startswith("Qwen3") else "qwen2_5.jinja"
    return (Path(trl.__file__).parent / "chat_templates" / name).read_text()


def _tiny_config(config_class, vocab_size: int, tokenizer, head: str):
    wanted = dict(
        vocab_size=vocab_size,
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=4,
        max_position_embeddings=1024,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    parameters = inspect.signature(config_class.__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    kwargs = {key: value for key, value in wanted.items() if takes_any or key in parameters}
    if head == "SequenceClassification":
        kwargs["num_labels"] = 1
    return config_class(**kwargs)


def build_model(model_id: str, cache: Path, seed: int = 0) -> bool:
    """Save a tiny random model of `model_id`'s architecture and a tokenizer as its snapshot; False if the id is
    not of a form this builds."""
    import torch
    import transformers

    match = MODEL_ID.match(model_id)
    if not match or match["head"] not in HEADS:
        return False
    model_class = getattr(transformers, f"{match['arch']}For{match['head']}", None)
    if model_class is None:
        return False
    tokenizer = build_tokenizer(_chat_template(match["arch"]))
    config = _tiny_config(model_class.config_class, len(tokenizer), tokenizer, match["head"])
    torch.manual_seed(seed)
    model = model_class(config)
    if match["head"] == "CausalLM":
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.eos_token_id = tokenizer.eos_token_id
    repo = cache / f"models--{model_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / SNAPSHOT
    model.save_pretrained(snapshot)
    tokenizer.save_pretrained(snapshot)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(SNAPSHOT)
    return True


def hub_ids(test_file: Path) -> list[str]:
    """Every quoted ``org/name`` string of the test file, in order of first use."""
    return list(dict.fromkeys(QUOTED_ID.findall(test_file.read_text())))


def main(test_file: str, cache: str) -> None:
    cache_dir = Path(cache)
    built, left = [], []
    for model_id in hub_ids(Path(test_file)):
        if model_id == "trl-internal-testing/zen":
            continue  # served by offline_plugin
        (built if build_model(model_id, cache_dir) else left).append(model_id)
    print(f"offline fixtures: built {len(built)} tiny models in {cache_dir}")
    if left:
        print(
            f"offline fixtures: no stand-in for these quoted names (a test loading one fails or skips for both): {', '.join(left)}"
        )


if __name__ == "__main__":
    main(*sys.argv[1:])
