"""Colocated vLLM on the CPU, for real: run by tests/test_vllm_cpu.py as a subprocess (vLLM spawns its engine, so
this runs under ``if __name__ == "__main__"``). Prints one JSON line (``RESULT {...}``) that the test checks.

    python tests/vllm_cpu_run.py sync MODEL_DIR OUT_DIR [lora]  # the weight sync after an optimizer step
    python tests/vllm_cpu_run.py train LOSS MODEL_DIR OUT_DIR  # 2 GRPO steps with vLLM's IS correction
                                        # (LOSS "cispo+lora": with LoRA adapters; "cispo+reuse": num_iterations=2;
                                        # "cispo+async": 3 asynchronous steps, server mode)

``--server URL`` (last): TRL's server mode against the vLLM server at URL instead of colocate mode.
"""

import json
import math
import sys

SERVER = None  # the vLLM server's URL in server mode (`--server URL`), else None: colocate


def _config(out_dir, **overrides):
    from trl_grpo_ext.trl.config import GRPOConfig

    options = dict(
        output_dir=out_dir,
        use_cpu=True,
        bf16=False,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_max_model_length=256,
        vllm_importance_sampling_correction=True,
        num_generations=4,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=1,
        max_completion_length=12,
        max_steps=2,
        learning_rate=1e-2,  # large: one step moves the log-probs far more than the engines differ
        temperature=1.0,
        beta=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
    )
    if SERVER:
        options.update(vllm_mode="server", vllm_server_base_url=SERVER, vllm_server_timeout=60)
    options.update(overrides)
    return GRPOConfig(**options)


def _dataset():
    from datasets import Dataset

    prompts = [[{"role": "user", "content": f"What is {a} + {b}?"}] for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]]
    return Dataset.from_dict({"prompt": prompts * 4})


def _digit_reward(completions, **kwargs):
    """More digits, more reward: varied within a group, so the advantages are not all zero."""
    text = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(sum(ch.isdigit() for ch in t)) for t in text]


def _trainer(model_dir, out_dir, lora=False, **overrides):
    from peft import LoraConfig

    from trl_grpo_ext.trl.trainer import GRPOTrainer

    peft_config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]) if lora else None
    return GRPOTrainer(
        model=model_dir,
        reward_funcs=_digit_reward,
        args=_config(out_dir, **overrides),
        train_dataset=_dataset(),
        peft_config=peft_config,
    )


def _sample(trainer, prompt_ids):
    """vLLM's completions and its log-prob of each sampled token (temperature 1: the model's own distribution)."""
    if SERVER:
        out = trainer.vllm_generation.vllm_client.generate(
            prompt_ids, temperature=1.0, max_tokens=8, logprobs=0,
            generation_kwargs={"min_tokens": 8, "ignore_eos": True, "seed": 0},
        )  # fmt: skip
        return out["completion_ids"], [[step[0] for step in row] for row in out["logprobs"]]
    from vllm import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=8, min_tokens=8, ignore_eos=True, logprobs=0, seed=0)
    outputs = trainer.vllm_generation.llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params)
    completions, logps = [], []
    for output in outputs:
        sample = output.outputs[0]
        completions.append(list(sample.token_ids))
        logps.append([step[token].logprob for token, step in zip(sample.token_ids, sample.logprobs, strict=True)])
    return completions, logps


def _trainer_logps(model, prompt_ids, completions):
    """The trainer model's log-prob of each completion token, teacher-forced."""
    import torch

    result = []
    with torch.no_grad():
        for prompt, completion in zip(prompt_ids, completions, strict=True):
            ids = torch.tensor([prompt + completion])
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
            token_logps = torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
            result.append(token_logps.tolist())
    return result


def _max_gap(a, b):
    return max(abs(x - y) for row_a, row_b in zip(a, b, strict=True) for x, y in zip(row_a, row_b, strict=True))


def run_sync(model_dir, out_dir, adapters="full"):
    """vLLM's log-probs match the trainer's before a step; after an optimizer step and the sync TRL calls, they
    match the trainer's updated model (and no longer the old one). `adapters` "lora": the step trains LoRA
    adapters, which the sync merges into the weights vLLM gets."""
    import torch

    trainer = _trainer(model_dir, out_dir, lora=adapters == "lora")
    if SERVER:  # a server other runs may have updated: the trainer's starting weights first
        trainer.vllm_generation.sync_weights()
    # vLLM's CPU worker turns torch.set_num_threads into a no-op; the trainer puts the real one back.
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    thread_control = torch.get_num_threads() == threads + 1
    torch.set_num_threads(threads)
    model = trainer.model
    tokenizer = trainer.processing_class
    prompt_ids = [tokenizer.apply_chat_template(p, add_generation_prompt=True) for p in _dataset()["prompt"][:4]]
    prompt_ids = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompt_ids]

    completions, vllm_before = _sample(trainer, prompt_ids)
    trainer_before = _trainer_logps(model, prompt_ids, completions)

    # One optimizer step that lowers the probability of the sampled completions.
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    rows = []
    for prompt, completion in zip(prompt_ids, completions, strict=True):
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
        rows.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None]).sum())
    torch.stack(rows).sum().backward()
    optimizer.step()
    trainer_after = _trainer_logps(model, prompt_ids, completions)

    stale_completions, vllm_stale = _sample(trainer, prompt_ids)  # not synced yet: vLLM holds the old weights
    trainer.vllm_generation.sync_weights()  # what TRL calls before generating after an optimizer step
    new_completions, vllm_after = _sample(trainer, prompt_ids)
    trainer_on_new = _trainer_logps(model, prompt_ids, new_completions)
    return {
        "weight_sync": trainer.vllm_weight_sync,
        "enforce_eager": _enforce_eager(trainer),
        "thread_control": thread_control,
        "gap_before": _max_gap(vllm_before, trainer_before),
        "step_moved": _max_gap(trainer_before, trainer_after),
        "stale_same_samples": stale_completions == completions,
        "stale_gap_to_old": _max_gap(vllm_stale, trainer_before),
        "gap_after": _max_gap(vllm_after, trainer_on_new),
        "mean_logp_before": sum(map(sum, trainer_before)) / 32,
        "mean_logp_after": sum(map(sum, trainer_after)) / 32,
    }


def _enforce_eager(trainer):
    """Whether the colocated engine was built eager (None in server mode: the server's own)."""
    llm = getattr(trainer.vllm_generation, "llm", None)
    return None if llm is None else llm.llm_engine.vllm_config.model_config.enforce_eager


def run_train(loss_type, model_dir, out_dir):
    """Two GRPO steps with `loss_type` and vLLM's importance-sampling correction; the logged metrics, the syncs and
    the log-prob forwards. ``<loss>+lora``: LoRA adapters, merged into each sync; ``<loss>+reuse``: each batch
    trained twice (``num_iterations=2``: off-policy, TRL's own correction)."""
    import torch

    loss_type, _, variant = loss_type.partition("+")
    overrides = {"num_iterations": 2} if variant == "reuse" else {}
    if variant == "async":  # asynchronous sampling from the server (server mode only), 3 steps
        overrides = {"async_sampling": True, "max_staleness": 1, "max_steps": 3}
    trainer = _trainer(model_dir, out_dir, lora=variant == "lora", loss_type=loss_type, **overrides)
    generation = trainer.vllm_generation
    sync, syncs = generation.sync_weights, []

    def counted_sync():  # the real sync, counted
        syncs.append(trainer.state.global_step)
        sync()

    generation.sync_weights = counted_sync
    logps, forwards = trainer._get_per_token_logps_and_entropies, []

    def counted_logps(*args, **kwargs):  # each log-prob forward, with whether it keeps a graph (the loss's)
        forwards.append({"step": trainer.state.global_step, "grad": torch.is_grad_enabled()})
        return logps(*args, **kwargs)

    trainer._get_per_token_logps_and_entropies = counted_logps
    trainer.train()
    steps = [entry for entry in trainer.state.log_history if "loss" in entry]
    return {
        "weight_sync": trainer.vllm_weight_sync,
        "steps": steps,
        "synced_at_steps": syncs,
        "forwards": forwards,
        "loss_corrects_vllm": trainer._loss_corrects_vllm,
    }


if __name__ == "__main__":
    mode, *rest = sys.argv[1:]
    if "--server" in rest:
        SERVER = rest[rest.index("--server") + 1]
        rest = rest[: rest.index("--server")]
    result = run_sync(*rest) if mode == "sync" else run_train(*rest)
    print("RESULT " + json.dumps(result, default=lambda v: None if isinstance(v, float) and math.isnan(v) else v))
