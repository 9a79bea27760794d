"""A tiny model that calls a tool: the conftest model with the tool-call strings as tokens and weights that follow a
script (a bigram table written into the embeddings and the LM head), so TRL's tool loop runs on CPU in seconds.

After the generation prompt's last token the model opens a tool call or answers, about half the time each; a tool
call is ``<tool_call>``, the call's JSON (one token), ``</tool_call>``, then end of turn; an answer is one token, then
end of turn. Every other token is left to the random weights. It is a real model: generation, TRL's log-prob forward
and the packed shared-prefix forward all compute the same logits.
"""

from pathlib import Path

import trl

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
CALL_JSON = '\n{"name": "calculate", "arguments": {"expression": "3 * 4"}}\n'
ANSWER = "The answer is \\boxed{12}."
QWEN_TEMPLATE = Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja"


def build_tool_model(path, strength: float = 6.0, seed: int = 0) -> str:
    """Write the scripted tool-calling model to `path` (built on `conftest.build_tiny_model`)."""
    import torch
    from conftest import build_tiny_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    build_tiny_model(path, seed=seed)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_tokens([CALL_OPEN, CALL_CLOSE, CALL_JSON, ANSWER])
    tokenizer.chat_template = QWEN_TEMPLATE.read_text()
    model = AutoModelForCausalLM.from_pretrained(path)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    model.config.max_position_embeddings = 2048  # the tool schema in the system prompt is long; RoPE has no table
    ids = {text: tokenizer.convert_tokens_to_ids(text) for text in (CALL_OPEN, CALL_CLOSE, CALL_JSON, ANSWER)}
    newline = tokenizer.encode("\n", add_special_tokens=False)
    assert len(newline) == 1
    eos = tokenizer.eos_token_id
    # token -> the tokens it leads to (equal odds among them)
    script = {
        newline[0]: [ids[CALL_OPEN], ids[ANSWER]],
        ids[CALL_OPEN]: [ids[CALL_JSON]],
        ids[CALL_JSON]: [ids[CALL_CLOSE]],
        ids[CALL_CLOSE]: [eos],
        ids[ANSWER]: [eos],
    }
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    with torch.no_grad():
        generator = torch.Generator().manual_seed(seed)
        for new in ids.values():  # new tokens: small random rows like the others
            embed[new] = torch.randn(embed.size(1), generator=generator) * 0.02
            head[new] = torch.randn(head.size(1), generator=generator) * 0.02
        for dim, (token, successors) in enumerate(script.items()):
            embed[token].zero_()
            embed[token, dim] = 1.0  # one direction per scripted token, dominant after the final RMSNorm
            for successor in successors:
                head[successor, dim] = strength
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
