"""A short supervised warm-up that teaches a small model 03-search-r1's tool-call format.

SmolLM2-135M-Instruct (the package's embedded model) never writes the chapter's call
``<tool_call><function=search><parameter=query>...`` by itself, so a GRPO run on it never searches. This script
fine-tunes it on the warm-up questions of ``make_data.py`` (none of them a training question), two assistant turns
each, rendered with the chapter's own ``protocol.py`` (its system prompt, chat rendering and tool messages, imported
from ``--chapter-dir``, not copied) and its ``search.format_item`` for the tool result:

1. after the question: ``<tool_call>\\n<function=search>\\n<parameter=query>\\nQUERY\\n</parameter>\\n</function>
   \\n</tool_call>`` and the end-of-turn token;
2. after that call and the search result: ``Answer: ANSWER`` and the end-of-turn token.

Only those assistant tokens are trained. The system prompt every prompt starts with is encoded once (no gradient)
and its key/value cache reused, so each example costs its question and answer only. The result is saved as a model
folder (weights, tokenizer, chat template unchanged) for ``trl-grpo-ext pytrio-serve --model``:

    OMP_NUM_THREADS=1 python examples/agentic_rl_lab/warmup.py --chapter-dir agentic-rl-lab/03-search-r1 \\
        --data /tmp/arl-data/search_r1/warmup.jsonl --out /tmp/arl-warm-smollm2

It needs ``transformers`` and ``torch``, and the chapter's imports (``deepseek-search``, ``httpx``,
``python-dotenv``) for its ``search.py``.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
import time
from pathlib import Path

TOOL_CALL = "<tool_call>\n<function=search>\n<parameter=query>\n{query}\n</parameter>\n</function>\n</tool_call>"


def load_rows(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as file:
        return [json.loads(line) for line in file if line.strip()]


def build_examples(tokenizer, rows: list[dict]) -> list[tuple[list[int], list[int]]]:
    """(prompt tokens, target tokens) pairs: the chapter's rendering, two turns per question."""
    from protocol import build_next_prompt, build_prompt, initial_messages, tool_message
    from search import SearchItem, format_item

    end = tokenizer.encode(tokenizer.eos_token, add_special_tokens=False)
    examples = []
    for index, row in enumerate(rows):
        messages = initial_messages(row["question"])
        prompt = build_prompt(tokenizer, messages)
        call = TOOL_CALL.format(query=row["query"])
        call_tokens = tokenizer.encode(call, add_special_tokens=False) + end
        examples.append((prompt, call_tokens))
        url = "https://en.wikipedia.org/wiki/" + row["title"].replace(" ", "_")
        content = format_item(SearchItem(row["title"], row["text"], source="Wikipedia", url=url), 1)
        next_prompt = build_next_prompt(
            tokenizer,
            messages,
            call,
            prompt,
            call_tokens,
            tool_message(f"search-{index}-0-1", content),
        )
        answer_tokens = tokenizer.encode(f"Answer: {row['answer']}", add_special_tokens=False) + end
        examples.append((next_prompt, answer_tokens))
    return examples


def shared_prefix(sequences: list[list[int]]) -> int:
    length = min(len(seq) for seq in sequences)
    for position in range(length):
        token = sequences[0][position]
        if any(seq[position] != token for seq in sequences):
            return position
    return length


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chapter-dir", type=Path, required=True, help="the agentic-rl-lab 03-search-r1 folder")
    parser.add_argument("--data", type=Path, required=True, help="warmup.jsonl from make_data.py")
    parser.add_argument("--out", type=Path, required=True, help="folder to save the warmed-up model in")
    parser.add_argument("--base", default="embedded", help="model folder, or 'embedded' (SmolLM2-135M-Instruct)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not (args.chapter_dir / "protocol.py").is_file():
        raise SystemExit(f"error: {args.chapter_dir} has no protocol.py (pass the 03-search-r1 folder)")
    if args.epochs < 1 or not args.learning_rate > 0:
        raise SystemExit("error: --epochs must be >= 1 and --learning-rate > 0")
    rows = load_rows(args.data)
    if not rows:
        raise SystemExit(f"error: {args.data} is empty")
    sys.path.insert(0, str(args.chapter_dir.resolve()))

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = args.base
    if base == "embedded":
        from trl_grpo_ext.models import embedded_model_path

        base = str(embedded_model_path())
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    examples = build_examples(tokenizer, rows)
    prefix_len = shared_prefix([prompt for prompt, _ in examples])
    prefix = examples[0][0][:prefix_len]
    print(f"{len(examples)} examples from {len(rows)} questions; shared prompt prefix {prefix_len} tokens")

    model.eval()  # no dropout; the prefix cache below is computed once, without gradient
    with torch.no_grad():
        prefix_cache = model(torch.tensor([prefix]), use_cache=True).past_key_values
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.0)
    order = list(range(len(examples)))
    rng = random.Random(args.seed)
    started = time.perf_counter()
    for epoch in range(args.epochs):
        rng.shuffle(order)
        total, count = 0.0, 0
        for index in order:
            prompt, target = examples[index]
            tokens = prompt[prefix_len:] + target
            labels = [-100] * (len(prompt) - prefix_len) + target
            input_ids = torch.tensor([tokens])
            positions = torch.arange(prefix_len, prefix_len + len(tokens)).unsqueeze(0)
            output = model(
                input_ids=input_ids,
                past_key_values=copy.deepcopy(prefix_cache),
                position_ids=positions,
                use_cache=True,
            )
            logits = output.logits[0, :-1]
            target_ids = torch.tensor(labels[1:])
            loss = torch.nn.functional.cross_entropy(logits, target_ids, ignore_index=-100)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            total += loss.item()
            count += 1
        print(f"epoch {epoch + 1}/{args.epochs}: mean loss {total / count:.4f} ({time.perf_counter() - started:.0f}s)")

    model.eval()
    with torch.no_grad():
        prompt, _ = examples[0]
        generated = model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False)
        print("greedy after warm-up:", repr(tokenizer.decode(generated[0, len(prompt) :])))
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
