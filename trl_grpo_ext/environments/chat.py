"""The chat side of tool use for both paths: a chat template that renders tool calls (`use_tool_chat_template`)
and the parser of a sampled turn into TRL's message (`turn_parser`, TRL 1.16's ``parse_response`` on the
tokenizer's response schema)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


def use_tool_chat_template(tokenizer) -> bool:
    """A chat template that renders tool calls: the model's own when it does, else TRL's Qwen 2.5 template for a
    ChatML model (the embedded SmolLM2 is one); any other model without one is a one-line ValueError. True when
    the template was replaced."""
    import trl
    from trl.chat_template_utils import supports_tool_calling

    if supports_tool_calling(tokenizer):
        return False
    if "<|im_start|>" not in tokenizer.get_vocab():
        raise ValueError("environments: the model's chat template renders no tool calls and it is not a ChatML model")
    tokenizer.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
    print("tools: the model's chat template renders no tool calls; using TRL's ChatML tool template (qwen2_5)")
    return True


def turn_parser(tokenizer, tools: list[Callable]) -> Callable[[list[int], list[int]], dict]:
    """``parse(ids, prefix) -> message`` of one sampled turn, its tool calls parsed as TRL parses them."""
    from trl.chat_template_utils import add_response_schema, parse_response

    if getattr(tokenizer, "response_template", None) is None and getattr(tokenizer, "response_schema", None) is None:
        add_response_schema(tokenizer)

    def parse(ids: list[int], prefix: list[int]) -> dict:
        return parse_response(tokenizer, ids, prefix=prefix, tools=tools)

    return parse
