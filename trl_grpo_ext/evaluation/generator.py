"""`HFGenerator`: batched `transformers` generation for `evaluate`, from a model path (with a LoRA adapter merged)
or over a model already in memory (a trainer's, `HFGenerator.borrowing`)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Sequence

from trl_grpo_ext.cpu.precision import bf16_autocast
from trl_grpo_ext.cpu.threads import govern_cpu_threads
from trl_grpo_ext.cpu.token_draws import fast_token_draws
from trl_grpo_ext.evaluation.problems import Prompt
from trl_grpo_ext.models import resolve_model


class HFGenerator:
    """Batched `transformers` generation with left padding; the chat template when the tokenizer has one."""

    def __init__(
        self,
        model: str,
        adapter: str | None = None,
        max_new_tokens: int = 256,
        temperature: float = 0.7,
        top_p: float = 1.0,
        seed: int = 0,
        device: str | None = None,
        bf16: bool = False,
        decode_engine: str = "generate",
    ):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = resolve_model(model)
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        tok_source = adapter if adapter and Path(adapter, "tokenizer_config.json").is_file() else path
        self.tokenizer = AutoTokenizer.from_pretrained(tok_source, padding_side="left")
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        if adapter:
            from peft import PeftModel

            from trl_grpo_ext.compat import merge_and_unload

            self.model = merge_and_unload(PeftModel.from_pretrained(self.model, adapter))
        self.model.to(self.device).eval()
        govern_cpu_threads(self.model)  # on the CPU: fewer threads while other processes are busy
        self._settings(max_new_tokens, temperature, top_p, seed, bf16, decode_engine)

    def _settings(
        self, max_new_tokens: int, temperature: float, top_p: float, seed: int, bf16: bool, decode_engine: str
    ) -> None:
        self.chat = bool(self.tokenizer.chat_template)
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.seed = seed
        # bf16 autocast around each generate call (the run's precision, `trl_grpo_ext.cpu.precision`); fp32 weights stay
        self.bf16 = bool(bf16)
        self.decode_engine = decode_engine  # the loop after the prompts are encoded (trl_grpo_ext.decode)
        self._calls = 0
        self.last_completion_tokens: list[int] | None = None

    @classmethod
    @contextlib.contextmanager
    def borrowing(
        cls,
        model,
        tokenizer,
        max_new_tokens: int,
        temperature: float = 0.7,
        top_p: float = 1.0,
        seed: int = 0,
        bf16: bool = False,
        decode_engine: str = "generate",
    ):
        """A generator over a model already in memory (a trainer's), for the duration of a `with` block: eval mode
        and left padding inside, the model's train/eval mode and the tokenizer's padding side restored after."""
        gen = cls.__new__(cls)
        gen.model, gen.tokenizer = model, tokenizer
        gen.device = str(next(model.parameters()).device)
        gen._settings(max_new_tokens, temperature, top_p, seed, bf16, decode_engine)
        was_training, side, pad = model.training, tokenizer.padding_side, tokenizer.pad_token
        model.eval()
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        try:
            yield gen
        finally:
            from trl_grpo_ext.decode import release_packed

            release_packed(model)  # the packed engine's copy of the weights: training changes them next
            tokenizer.padding_side = side
            if pad is None:
                tokenizer.pad_token = None
            model.train(was_training)

    def _text(self, prompt: Prompt) -> str:
        if isinstance(prompt, str):
            return prompt
        if not self.chat:
            raise ValueError("chat messages given to a model without a chat template; build text prompts")
        return self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)

    def generate(self, prompts: Sequence[Prompt], num_samples: int, greedy: bool) -> list[list[str]]:
        import torch

        # imported with the model, not with this module: trl_grpo_ext.prefix loads torch and transformers
        from trl_grpo_ext.prefix import shared_prefix_generate
        from trl_grpo_ext.prefix.attention import install as install_attention

        install_attention()  # CPU bf16 decode steps as one packed attention call (trl_grpo_ext.cpu.decode_attention)

        texts = [self._text(p) for p in prompts]
        # Templated text already holds its special tokens; adding BOS again would shift the prompt.
        templated = not isinstance(prompts[0], str)
        enc = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=not templated)
        enc = {k: v.to(self.device) for k, v in enc.items()}
        kwargs: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "num_return_sequences": num_samples,
            "pad_token_id": self.tokenizer.pad_token_id,
        }
        if greedy:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            kwargs.update(do_sample=True, temperature=self.temperature, top_p=self.top_p, top_k=0)
            # One seed per call: sampled results reproduce for the same data, batch size and k.
            torch.manual_seed(self.seed + self._calls)
        self._calls += 1
        # `generate` with each shared prompt token (the one-shot prefix all prompts share) encoded once per batch;
        # each prompt repeated as num_return_sequences would repeat it (trl_grpo_ext.prefix, docs/prefix_sharing.md)
        rows = [ids[mask.bool()].tolist() for ids, mask in zip(enc["input_ids"], enc["attention_mask"], strict=True)]
        del kwargs["num_return_sequences"]
        rows = [row for row in rows for _ in range(num_samples)]
        # one autocast region for the whole call: each weight is cast to bf16 once, not at every decode step; sampled
        # tokens drawn as torch.multinomial draws them, vectorised (trl_grpo_ext.cpu.token_draws)
        with torch.no_grad(), bf16_autocast(self.bf16, torch.device(self.device).type), fast_token_draws():
            out = shared_prefix_generate(self.model, rows, engine=self.decode_engine, **kwargs)
        new = out[:, enc["input_ids"].shape[1] :]
        # Tokens up to the end of each completion (padding after EOS excluded), for the mean length.
        self.last_completion_tokens = (
            (new != self.tokenizer.pad_token_id).sum(dim=1).tolist() if num_samples == 1 else None
        )
        decoded = self.tokenizer.batch_decode(new, skip_special_tokens=True)
        return [decoded[i * num_samples : (i + 1) * num_samples] for i in range(len(prompts))]
