"""Shared-prefix forward+backward against TRL's at GPU-like shapes: vanilla `trl.GRPOTrainer` vs ours, alternated.

Per shape, one micro-batch of G rows goes through each trainer's ``_get_per_token_logps_and_entropies`` (TRL 1.16's
hook; ours packs the rows when the cost model says so, else runs TRL's code) with gradients, then a backward of
a loss on the log-probs and entropies. The two trainers hold identical copies of one randomly initialised model
and are timed alternately in one process (TRL, ours, ours, TRL, ...), so a neighbour's load hits both alike; a
shape's ratio is the median over repetitions of ours/TRL within each back-to-back pair, its seconds the medians.
Shapes: G in {4, 8, 16}; every row's prompt is a shared head of S in {100, 400} tokens (system prompt,
few-shot example) plus one of two 50-token questions (G/2 rows each, as in a shuffled micro-batch of two
groups); completions uniform in [64, 1024], all 1024, or uniform in [64, 512] tokens.

Per shape it prints seconds (median), ours/TRL, memory and the layout ours ran (``packed`` or ``padded``, the
cost model's pick) and the share of our time spent building the layout (planning, packing, index tensors). Memory
is the peak allocated on CUDA; on CPU, which keeps no peak, the bytes of tensors saved for the backward (the
activations held at the forward's end, parameters excluded), a proxy for the peak. Last line:
``prefix shapes: worst ours/TRL <x>, G=8 short-completion ours/TRL <y>`` (x: the worst shape where ours ran the
packed layout; where the cost model kept TRL's padded one, ours ran TRL's forward and those ratios, printed
apart, are timing noise; y: the worst of the G=8, [64, 512] shapes). Targets: x <= 1.00, y <= 0.60, our memory never above TRL's.

Models: ``tiny`` (random Qwen2, hidden 64, 2 layers: attention-bound, the hard case), ``embedded`` (the
embedded SmolLM2-135M, fp32), ``qwen2.5-0.5b-shape`` (random weights of Qwen2.5-0.5B-Instruct's shape, no
download: for ``--device cuda --dtype bfloat16``). Attention: sdpa, and flex_attention / flash_attention_2 where
they run (flex has no backward on CPU; flash needs CUDA and flash-attn).

Runs: ``python bench/prefix_shapes.py`` (tiny and embedded, sdpa, CPU fp32: about 25 min on 2 idle cores);
``--quick`` (tiny model, fewer shapes, 1 repetition: a smoke test); on a GPU ``python bench/prefix_shapes.py
--device cuda --dtype bfloat16 --model qwen2.5-0.5b-shape --attn sdpa,flash_attention_2,flex_attention``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from gpu_offline import QWEN25_05B  # noqa: E402  (bench/, the script's own folder)

COMPLETIONS = {"u64-1024": (64, 1024), "all-1024": (1024, 1024), "u64-512": (64, 512)}
# The embedded model on CPU, without --full: (G, S, completions). It runs tens of seconds per pass on 2 cores, so
# its grid is cut to the short-completion target's shapes and the closest call (equal long completions, little
# shared) to keep the default run under half an hour. G=8 S=400 is left out: TRL's padded forward+backward at that
# shape (8 x 962 tokens, sdpa's CPU math kernel keeping every head's T x T weights for the backward) beside the
# model's copies outgrew the 24 GiB machine (killed by the OOM killer).
EMBEDDED_CPU_SHAPES = ((4, 100, "u64-512"), (4, 400, "u64-512"), (8, 100, "u64-512"), (4, 100, "all-1024"))
QUESTION = 50  # tokens of each distinct question after the shared head
# Qwen2.5-0.5B-Instruct's shape, as the offline GPU check writes it (one place); the token ids are our tokenizer's
QWEN_05B = {
    k: v for k, v in QWEN25_05B.items() if k not in ("architectures", "model_type", "bos_token_id", "eos_token_id")
}
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1024,
    max_position_embeddings=2048,
)


def build_model(name: str, dtype: torch.dtype, device: str, tokenizer_dir: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    if name == "embedded":
        from trl_grpo_ext.models import resolve_model

        path = resolve_model("embedded")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        return model.to(device), AutoTokenizer.from_pretrained(path)
    shape = {"tiny": TINY, "qwen2.5-0.5b-shape": QWEN_05B}[name]
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    config = Qwen2Config(**shape, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    model = Qwen2ForCausalLM(config).to(dtype=dtype, device=device)
    return model, tokenizer


def build_trainers(model, tokenizer, attn: str, group: int, dtype, device: str, tmp: str):
    """Vanilla `trl.GRPOTrainer` and ours (default prefix options) on identical copies of `model`."""
    import trl
    from datasets import Dataset

    import trl_grpo_ext
    from trl_grpo_ext.trl.config import GRPOConfig

    common = dict(
        report_to="none",
        use_cpu=device == "cpu",
        bf16=dtype == torch.bfloat16,
        per_device_train_batch_size=group,
        num_generations=group,
        gradient_checkpointing=False,
        max_completion_length=1024,
        disable_tqdm=True,
    )
    data = Dataset.from_dict({"prompt": ["What is 1 + 1?"] * group})
    trainers = {}
    for name, cls, config in (
        ("TRL", trl.GRPOTrainer, trl.GRPOConfig),
        ("ours", trl_grpo_ext.GRPOTrainer, GRPOConfig),
    ):
        copy_ = copy.deepcopy(model)
        copy_.config._attn_implementation = attn
        args = config(output_dir=os.path.join(tmp, name), **common)
        trainer = cls(copy_, [lambda completions, **kw: [0.0] * len(completions)], args=args, train_dataset=data,
                      processing_class=tokenizer)  # fmt: skip
        trainer.model.train()
        trainers[name] = trainer
    return trainers


def make_batch(vocab: int, group: int, shared: int, completions: tuple[int, int], seed: int, device: str):
    """TRL's layout of one micro-batch: (input_ids, attention_mask, logits_to_keep)."""
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(3, vocab, (shared,), generator=g)
    questions = [torch.randint(3, vocab, (QUESTION,), generator=g) for _ in range(2)]
    lo, hi = completions
    lengths = torch.randint(lo, hi + 1, (group,), generator=g).tolist()
    width = max(lengths)
    prompt = shared + QUESTION
    ids = torch.randint(3, vocab, (group, prompt + width), generator=g)
    mask = torch.ones_like(ids)
    for row, n in enumerate(lengths):
        ids[row, :prompt] = torch.cat([head, questions[row % 2]])
        mask[row, prompt + n :] = 0
        ids[row, prompt + n :] = 0
    return ids.to(device), mask.to(device), width


@contextlib.contextmanager
def memory_meter(model, device: str):
    """Yields a dict whose ``bytes`` is, after the block, the peak allocated (CUDA) or the bytes saved for the
    backward, parameters excluded (CPU)."""
    out = {"bytes": 0}
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        yield out
        torch.cuda.synchronize()
        out["bytes"] = torch.cuda.max_memory_allocated() - base
        return
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield out
    out["bytes"] = sum(seen.values())


class LayoutClock:
    """Seconds spent building the packed layout in our hook: packing (`pack_chunk`), the cost model
    (`choose_layout`), and the stream and index tensors (`PackedBatch.forward_kwargs`)."""

    def __init__(self, device: str, timer=time.perf_counter):
        from trl_grpo_ext.prefix import packing

        self.seconds, self.device, self.timer = 0.0, device, timer
        self._targets = [(packing, "pack_chunk"), (packing, "choose_layout"), (packing.PackedBatch, "forward_kwargs")]
        self._originals = {(owner, name): getattr(owner, name) for owner, name in self._targets}

    def __enter__(self):
        def timed(original):
            def wrapper(*args, **kwargs):
                self._sync()
                start = self.timer()
                out = original(*args, **kwargs)
                self._sync()
                self.seconds += self.timer() - start
                return out

            return wrapper

        for (owner, name), original in self._originals.items():
            setattr(owner, name, timed(original))
        return self

    def __exit__(self, *exc):
        for (owner, name), original in self._originals.items():
            setattr(owner, name, original)

    def _sync(self):
        if self.device == "cuda":
            torch.cuda.synchronize()


def forward_backward(trainer, ids, mask, keep, device: str, clock: LayoutClock | None = None, timer=time.perf_counter):
    """Seconds (by `timer`) and memory of one forward+backward through the trainer's log-prob hook."""
    model = trainer.model
    model.zero_grad(set_to_none=True)
    cmask = mask[:, -keep:].float()
    if device == "cuda":
        torch.cuda.synchronize()
    with memory_meter(model, device) as memory:
        start = timer()
        with clock or contextlib.nullcontext():
            logps, entropies, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, keep,
                                                                            compute_entropy=True)  # fmt: skip
        loss = (logps * cmask).sum() / cmask.sum() + 1e-3 * (entropies * cmask).sum() / cmask.sum()
        loss.backward()
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = timer() - start
    return seconds, memory["bytes"], logps.detach()


def warm_up(trainers, vocab, group, device):
    """One small forward+backward through each trainer (allocator, kernels, lazy imports) before timing."""
    ids, mask, keep = make_batch(vocab, group, 100, (64, 64), 0, device)
    for trainer in trainers.values():
        forward_backward(trainer, ids, mask, keep, device)


def run_shape(trainers, vocab, group, shared, completions, reps, seed, device, timer):
    ids, mask, keep = make_batch(vocab, group, shared, COMPLETIONS[completions], seed, device)
    times = {"TRL": [], "ours": [], "layout": []}
    memory = {}
    clock = LayoutClock(device, timer)
    stats_before = dict(trainers["ours"].__dict__.get("prefix_sharing_stats", {}))
    logps = {}
    for rep in range(reps):
        for name in ("TRL", "ours") if rep % 2 == 0 else ("ours", "TRL"):
            clock.seconds = 0.0
            seconds, nbytes, logps[name] = forward_backward(
                trainers[name], ids, mask, keep, device, clock if name == "ours" else None, timer
            )
            times[name].append(seconds)
            if name == "ours":
                times["layout"].append(clock.seconds)
            memory[name] = max(memory.get(name, 0), nbytes)
    stats = trainers["ours"].__dict__.get("prefix_sharing_stats", {})
    packed = stats.get("shared_chunks", 0) > stats_before.get("shared_chunks", 0)
    valid = mask[:, -keep:].bool()
    # per back-to-back pair, so a slow spell of the machine hits both sides of a ratio; the median over pairs (the
    # same trainer timed against itself spread 0.80-1.07 by the least of 9 repetitions, 0.97-1.01 by this)
    return {
        "TRL": statistics.median(times["TRL"]),
        "ours": statistics.median(times["ours"]),
        "ratio": statistics.median(a / b for a, b in zip(times["ours"], times["TRL"], strict=True)),
        "layout_s": statistics.median(times["layout"]),
        "mem_TRL": memory["TRL"],
        "mem_ours": memory["ours"],
        "layout": "packed" if packed else "padded",
        "logp_diff": (logps["TRL"] - logps["ours"])[valid].abs().max().item(),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, G 4/8, S 100, 1 repetition: smoke test")
    parser.add_argument("--full", action="store_true", help="every shape on every model (the embedded one too)")
    parser.add_argument("--model", default=None, help="tiny, embedded or qwen2.5-0.5b-shape (comma-separated)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--attn", default="sdpa", help="comma-separated attention implementations")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per trainer and shape")
    parser.add_argument("--groups", default=None, help="comma-separated G values (default 4,8,16)")
    parser.add_argument("--shared", default=None, help="comma-separated shared prompt lengths (default 100,400)")
    parser.add_argument("--completions", default=None, help=f"comma-separated of {', '.join(COMPLETIONS)}")
    parser.add_argument(
        "--clock",
        default="wall",
        choices=("wall", "cpu"),
        help="wall seconds, or this process's CPU seconds (steadier on a loaded machine; 1 torch thread, CPU only)",
    )
    args = parser.parse_args(argv)
    if args.clock == "cpu" and (args.device != "cpu" or torch.get_num_threads() != 1):
        parser.error("--clock cpu needs --device cpu and one torch thread (OMP_NUM_THREADS=1)")
    timer = time.process_time if args.clock == "cpu" else time.perf_counter
    logging.getLogger("trl_grpo_ext.prefix").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    from conftest import build_tiny_model

    dtype = getattr(torch, args.dtype)
    models = (args.model or ("tiny" if args.quick else "tiny,embedded")).split(",")
    groups = [int(g) for g in (args.groups or ("4,8" if args.quick else "4,8,16")).split(",")]
    shareds = [int(x) for x in (args.shared or ("100" if args.quick else "100,400")).split(",")]
    completions = (args.completions or ("u64-512,all-1024" if args.quick else ",".join(COMPLETIONS))).split(",")
    attns = args.attn.split(",")
    if args.device == "cpu" and "flex_attention" in attns:
        print("flex_attention: skipped on CPU (torch's FlexAttention has no backward on CPU)")
        attns = [a for a in attns if a != "flex_attention"]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_dir = build_tiny_model(Path(tmp) / "tokenizer")
        for model_name in models:
            grid = [(g, sh, c) for g in groups for sh in shareds for c in completions]
            if model_name == "embedded" and args.device == "cpu" and not args.full:
                grid = [shape for shape in grid if shape in EMBEDDED_CPU_SHAPES]
            model, tokenizer = build_model(model_name, dtype, args.device, tokenizer_dir)
            for attn in attns:
                print(f"\n== {model_name}, {attn}, {args.device} {args.dtype}, {args.clock} seconds ==")
                print(f"{'G':>3}{'S':>5}{'completions':>12}{'TRL s':>9}{'ours s':>9}{'ours/TRL':>10}"
                      f"{'TRL MiB':>9}{'ours MiB':>9}{'layout':>8}{'layout %':>9}{'logp diff':>11}")  # fmt: skip
                # repetitions: the embedded model runs tens of seconds per pass on 2 CPU cores
                reps = args.reps or (1 if args.quick else 2 if model_name == "embedded" else 9)
                for group in dict.fromkeys(g for g, _, _ in grid):
                    trainers = build_trainers(model, tokenizer, attn, group, dtype, args.device, tmp)
                    warm_up(trainers, model.config.vocab_size, group, args.device)
                    for _, shared, comp in [shape for shape in grid if shape[0] == group]:
                        r = run_shape(trainers, model.config.vocab_size, group, shared, comp, reps, group + shared,
                                      args.device, timer)  # fmt: skip
                        r.update(model=model_name, attn=attn, G=group, S=shared, completions=comp)
                        results.append(r)
                        print(f"{group:>3}{shared:>5}{comp:>12}{r['TRL']:>9.3f}{r['ours']:>9.3f}"
                              f"{r['ratio']:>10.2f}{r['mem_TRL'] / 2**20:>9.1f}"
                              f"{r['mem_ours'] / 2**20:>9.1f}{r['layout']:>8}"
                              f"{100 * r['layout_s'] / r['ours']:>8.1f}%{r['logp_diff']:>11.1e}",
                              flush=True)  # fmt: skip
                    del trainers
            del model
    # Where the cost model picked TRL's padded layout, ours ran TRL's own forward (plus the choice, the `layout %`
    # column): those ratios are timing noise around identical computations, reported apart; "worst" is over the
    # shapes where the computations differ.
    packed = [r for r in results if r["layout"] == "packed"]
    padded = [r for r in results if r["layout"] == "padded"]
    worst = max(packed, key=lambda r: r["ratio"]) if packed else None
    short = [r for r in results if r["G"] == 8 and r["completions"] == "u64-512"]
    over = [r for r in results if r["mem_ours"] > r["mem_TRL"]]
    layout_share = max((r["layout_s"] / r["ours"] for r in packed), default=0.0)
    if padded:
        ratios = [r["ratio"] for r in padded]
        print(f"\npadded layout (TRL's own forward, the cost model's pick) on {len(padded)} of {len(results)} shapes: "
              f"ours/TRL {min(ratios):.2f}-{max(ratios):.2f}, timing noise around identical computations; "
              f"choosing it took at most {100 * max(r['layout_s'] / r['ours'] for r in padded):.1f}% of the time")  # fmt: skip
    if worst is not None:
        print(f"worst packed shape: {worst['model']} {worst['attn']} G={worst['G']} S={worst['S']} "
              f"{worst['completions']}")  # fmt: skip
    print(f"memory above TRL's: {len(over)} of {len(results)} shapes; layout building at most "
          f"{100 * layout_share:.1f}% of our forward+backward (packed shapes)")  # fmt: skip
    short_ratio = max(r["ratio"] for r in short) if short else float("nan")
    print(f"prefix shapes: worst ours/TRL {worst['ratio'] if worst else float('nan'):.2f}, G=8 short-completion "
          f"ours/TRL {short_ratio:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
