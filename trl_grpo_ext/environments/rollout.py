"""Multi-turn rollouts for a sampler that is not TRL's (the PyTRIO path's building block): sample, run the tools a
turn calls, append their results, sample again, with the rules of TRL 1.16's ``GRPOTrainer._tool_call_loop`` (text
only), so a rollout gets the token ids, ``tool_mask``, log-probs and messages TRL would give it:

- tool results are appended as token ids (`tool_suffix_ids`: the chat template's tool turn and the next generation
  prompt), never re-tokenised, and carry ``tool_mask`` 0 and log-prob 0.0;
- at most ``max_iterations`` tool rounds; a round whose tool results would push the completion past
  ``max_completion_length`` (or the sequence to ``max_model_len``) is dropped and the rollout ends with the turn
  that called (its calls show as cut); the last turn is cut to the completion budget;
- a tool that raises, or a call of a tool the row does not have, gives ``{'error': ...}`` as TRL does.

The sampler, the parser of row i's turn (``parse(ids, prefix, i) -> message``) and the tools are passed in, so the same
driver serves any sampler; nothing here imports TRL or torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

# sample(prompts as token ids) -> (completion ids, their log-probs), one completion per prompt
Sampler = Callable[[list[list[int]]], tuple[list[list[int]], list[list[float]]]]


@dataclass
class Rollout:
    """One multi-turn completion: TRL's ``completion_ids``, ``tool_mask`` and log-probs, and the messages."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    tool_mask: list[int]
    messages: list[dict] = field(default_factory=list)


def tool_suffix_ids(tokenizer, tool_messages: Sequence[dict], chat_template: str | None = None) -> list[int]:
    """Token ids of the tool turn(s) after an assistant turn that ended with EOS, through the next generation
    prompt: the chat template rendered on a dummy conversation with and without them (TRL 1.16's rule,
    ``_get_tool_suffix_ids``, text only)."""
    calls = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
    dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    kwargs = dict(tokenize=True, return_dict=False, chat_template=chat_template)
    prefix = tokenizer.apply_chat_template(dummy, add_generation_prompt=False, **kwargs)
    full = tokenizer.apply_chat_template(dummy + list(tool_messages), add_generation_prompt=True, **kwargs)
    eos = [i for i, token in enumerate(prefix) if token == tokenizer.eos_token_id]
    if eos:
        prefix = prefix[: eos[-1] + 1]
    if full[: len(prefix)] != prefix:
        raise ValueError("the chat template's tool turn does not extend the assistant turn (not prefix-preserving)")
    return list(full[len(prefix) :])


def stop_reason(completion_ids: Sequence[int], stop_token_ids: Sequence[int]) -> str:
    """How a multi-turn completion ended, by TRL 1.16's rule for ``completions/clipped_ratio`` and
    ``mask_truncated_completions`` (``is_truncated``: its last token is not an EOS or the pad token): ``"length"``
    when it was cut (its last turn by the sampler's ``max_tokens`` or by the completion budget), else ``"stop"``."""
    return "length" if not completion_ids or completion_ids[-1] not in set(stop_token_ids) else "stop"


def run_tool_calls(tool_calls: Sequence[dict], tools: dict[str, Callable]) -> list[dict]:
    """The ``tool`` messages of one turn's calls (results as text; failures as TRL writes them)."""
    messages = []
    for call in tool_calls:
        if call.get("type") != "function":
            name, result = call.get("name", "unknown"), {"error": f"Unsupported tool call type: {call.get('type')}"}
        else:
            name = call["function"]["name"]
            try:
                if name not in tools:
                    raise ValueError(f"Tool {name} not found.")
                result = tools[name](**call["function"]["arguments"])
            except Exception as error:  # the model's mistake or the tool's: a message to the model
                result = {"error": str(error)}
        messages.append({"role": "tool", "name": name, "content": str(result)})
    return messages


def multi_turn_rollouts(
    prompt_ids: Sequence[list[int]],
    first_turns: tuple[list[list[int]], list[list[float]]],
    sample: Sampler,
    parse: Callable[[list[int], list[int], int], dict],
    suffix_ids: Callable[[list[dict]], list[int]],
    tools: Sequence[dict[str, Callable]],
    max_iterations: int | None,
    max_completion_length: int,
    max_model_len: int,
) -> list[Rollout]:
    """Continue each first turn (``first_turns``: its ids and log-probs) through its tool calls; `tools[i]` are row
    i's tools by name."""
    completion_ids = [list(ids) for ids in first_turns[0]]
    logprobs = [list(lps) for lps in first_turns[1]]
    tool_mask = [[1] * len(ids) for ids in completion_ids]
    completions = [[parse(ids, list(prompt_ids[i]), i)] for i, ids in enumerate(completion_ids)]
    pending = [i for i, c in enumerate(completions) if c[0].get("tool_calls")]
    rounds = 0
    cap = max_iterations if max_iterations is not None else float("inf")
    while pending and rounds < cap:
        extended, kept = [], []
        for i in pending:
            results = run_tool_calls(completions[i][-1]["tool_calls"], tools[i])
            ids = list(prompt_ids[i]) + completion_ids[i] + suffix_ids(results)
            if len(ids) - len(prompt_ids[i]) > max_completion_length or len(ids) >= max_model_len:
                continue  # this tool round does not fit: the rollout ends with the turn that called
            completions[i].extend(results)
            extended.append(ids)
            kept.append(i)
        if not kept:
            break
        new_ids, new_logprobs = sample(extended)
        next_pending = []
        for i, ids, turn, turn_logprobs in zip(kept, extended, new_ids, new_logprobs, strict=True):
            turn, turn_logprobs = list(turn), list(turn_logprobs)
            room = max_completion_length - (len(ids) - len(prompt_ids[i]))
            turn, turn_logprobs = turn[: max(0, room)], turn_logprobs[: max(0, room)]
            tool_length = len(ids) - len(prompt_ids[i]) - len(completion_ids[i])
            tool_mask[i] += [0] * tool_length + [1] * len(turn)
            logprobs[i] += [0.0] * tool_length + turn_logprobs
            completion_ids[i] = ids[len(prompt_ids[i]) :] + turn
            message = parse(turn, ids, i) if turn else {}
            if message:
                completions[i].append(message)
            if message.get("tool_calls"):
                next_pending.append(i)
        pending = next_pending
        rounds += 1
    return [
        Rollout(list(prompt_ids[i]), completion_ids[i], logprobs[i], tool_mask[i], completions[i])
        for i in range(len(completion_ids))
    ]
