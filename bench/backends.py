"""One GRPO step on the TRL path vs the PyTRIO path (local pytrio server), same model and batch, alternated.

- TRL: `trl_grpo_ext.GRPOTrainer` with a LoRA adapter built by the server's own `peft_config` (same rank, alpha,
  target modules; no lm_head adapter on either side, TRL cannot train one), ``loss_type=importance_sampling``;
- PyTRIO: `trl_grpo_ext.pytrio.loop.GRPOLoop.train_step` through the real ``pytrio`` client against
  `trl_grpo_ext.pytrio_server` running in this process (127.0.0.1), built-in ``importance_sampling``.

Same prompts, ``num_generations``, ``max_completion_length``, temperature; learning rate 0 so both keep sampling
from the same policy and do the same expected work every step. The steps alternate (TRL step k, then PyTRIO
step k, from a TRL callback), so neighbours' load on a shared machine hits both alike. First step of each dropped.

Prints the median step-time ratio PyTRIO / TRL (target <= 1.5x; wall and CPU time) and where the PyTRIO step's
time goes: client-side wall time per phase, the server's compute inside it (engine calls timed in-process) and
the rest (HTTP, serialisation, event polling, checkpoint files).

Run: ``OMP_NUM_THREADS=2 python bench/backends.py [--model embedded|tiny --steps 6]``.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import PrinterCallback, TrainerCallback  # noqa: E402

TARGET = 1.5


def rows(n: int = 32) -> list[dict]:
    from trl_grpo_ext.task.data.prompts import build_prompt

    return [
        {"prompt": build_prompt(f"What is {i} + {i % 7 + 3}?"), "answer": f"#### {i + i % 7 + 3}"} for i in range(n)
    ]


class EngineClock:
    """Wraps the in-process server's sampler and engine methods to time the compute the PyTRIO path waits for.

    Concurrent calls (async sampling share a decode batch) overlap, so each name's time is the union of its calls'
    intervals, not their sum."""

    def __init__(self, server):
        self.intervals = defaultdict(list)
        # Sampling goes through the server's batcher (concurrent requests share a decode batch), not engine.sample.
        targets = [(server.sampler, "sample"), *((server.engine, n) for n in ("forward", "optim_step", "snapshot"))]
        for obj, name in targets:
            original = getattr(obj, name)

            def timed(*a, _original=original, _name=name, **kw):
                start = time.perf_counter()
                try:
                    return _original(*a, **kw)
                finally:
                    self.intervals[_name].append((start, time.perf_counter()))

            setattr(obj, name, timed)

    @staticmethod
    def _union(spans) -> float:
        total, end = 0.0, float("-inf")
        for a, b in sorted(spans):
            if b <= end:
                continue
            total += b - max(a, end)
            end = b
        return total

    def take(self) -> dict:
        out = {name: self._union(spans) for name, spans in self.intervals.items()}
        self.intervals = defaultdict(list)
        return out


class Alternate(TrainerCallback):
    """Times each TRL step, then runs one PyTRIO step right after it (outside the TRL step's clock)."""

    def __init__(self, pytrio_step):
        self.pytrio_step = pytrio_step
        self.trl_wall, self.trl_cpu, self.pytrio = [], [], []

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = (time.perf_counter(), time.process_time())

    def on_step_end(self, args, state, control, **kwargs):
        self.trl_wall.append(time.perf_counter() - self._start[0])
        self.trl_cpu.append(time.process_time() - self._start[1])
        self.pytrio.append(self.pytrio_step(state.global_step - 1))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="embedded", help="'embedded' (SmolLM2-135M-Instruct), 'tiny' or a path")
    parser.add_argument("--steps", type=int, default=6, help="steps per path (first one dropped)")
    parser.add_argument("--batch", type=int, default=8, help="completions per step (per_device_train_batch_size)")
    parser.add_argument("--group", type=int, default=4, help="num_generations")
    parser.add_argument("--completion-length", type=int, default=48, help="max_completion_length")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (both paths)")
    args = parser.parse_args(argv)

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    from trl_grpo_ext.models import resolve_model
    from trl_grpo_ext.pytrio.config import PyTrioGRPOConfig
    from trl_grpo_ext.pytrio.loop import GRPOLoop
    from trl_grpo_ext.pytrio_server import running_server
    from trl_grpo_ext.pytrio_server.engine import LoraSettings
    from trl_grpo_ext.trl.config import GRPOConfig
    from trl_grpo_ext.trl.trainer import GRPOTrainer

    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "tiny":
            from conftest import build_tiny_model

            model_path = build_tiny_model(Path(tmp) / "tiny")
        else:
            model_path = resolve_model(args.model)
        data = rows()
        print(
            f"model {args.model}  torch threads {torch.get_num_threads()}  batch {args.batch} "
            f"({args.batch // args.group} prompts x {args.group})  max_completion_length {args.completion_length}"
        )

        with running_server(model_path) as server:
            server.configure_client(home=tmp)
            clock = EngineClock(server)
            pcfg = PyTrioGRPOConfig(
                base_model=model_path,
                lora_r=args.rank,
                num_generations=args.group,
                per_device_train_batch_size=args.batch,
                max_completion_length=args.completion_length,
                learning_rate=0.0,
                loss_type="importance_sampling",
                mode="async",
                max_steps=args.steps,
                reward_funcs=["boxed"],
                output_dir=str(Path(tmp) / "pytrio"),
                seed=0,
            )
            loop = GRPOLoop(pcfg, rows=data)
            import pytrio as trio

            # TRL cannot put LoRA on lm_head (it reads lm_head.weight directly): both paths leave it out
            training_client = trio.ServiceClient().create_lora_training_client(
                model_path, rank=args.rank, seed=0, train_unembed=False
            )
            stream = loop.prepare(training_client)

            def pytrio_step(step):
                clock.take()
                start = time.perf_counter(), time.process_time()
                metrics = loop.train_step(training_client, stream, step)
                return {
                    "wall": time.perf_counter() - start[0],
                    "cpu": time.process_time() - start[1],
                    "metrics": metrics,
                    "engine": clock.take(),
                }

            tcfg = GRPOConfig(
                output_dir=str(Path(tmp) / "trl"),
                report_to="none",
                use_cpu=True,
                bf16=False,
                loss_type="importance_sampling",
                per_device_train_batch_size=args.batch,
                num_generations=args.group,
                max_completion_length=args.completion_length,
                max_steps=args.steps,
                logging_steps=1,
                save_strategy="no",
                disable_tqdm=True,
                learning_rate=0.0,
                seed=0,
            )
            peft_config = server.engine.peft_config(LoraSettings(rank=args.rank, train_unembed=False))
            from trl_grpo_ext.task.rewards import get_reward_funcs

            trainer = GRPOTrainer(
                model_path,
                get_reward_funcs(["boxed"]),
                args=tcfg,
                train_dataset=Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in data]),
                peft_config=peft_config,
            )
            trainer.remove_callback(PrinterCallback)
            alt = Alternate(pytrio_step)
            trainer.add_callback(alt)
            trainer.train()
            trl_lengths = [v for v in trainer.state.log_history if "completions/mean_length" in v]

        trl_wall, trl_cpu = alt.trl_wall[1:], alt.trl_cpu[1:]
        py = alt.pytrio[1:]
        py_wall, py_cpu = [p["wall"] for p in py], [p["cpu"] for p in py]
        med = statistics.median
        print(f"\nstep time, median of {len(py)} alternated steps each (first dropped)")
        print(f"  {'':8s} {'TRL':>9s} {'PyTRIO':>9s} {'ratio':>7s}")
        ok = True
        for label, a, b in (("wall", trl_wall, py_wall), ("CPU", trl_cpu, py_cpu)):
            ratio = med(b) / med(a)
            ok &= ratio <= TARGET if label == "wall" else True
            print(f"  {label:8s} {med(a):8.2f}s {med(b):8.2f}s {ratio:6.2f}x")
        trl_len = (
            statistics.mean(v["completions/mean_length"] for v in trl_lengths[1:])
            if len(trl_lengths) > 1
            else float("nan")
        )
        py_len = statistics.mean(p["metrics"]["completions/mean_length"] for p in py)
        print(f"  mean completion length: TRL {trl_len:.1f}  PyTRIO {py_len:.1f} tokens")
        ratio = med(py_wall) / med(trl_wall)
        print(f"  PyTRIO / TRL wall: {ratio:.2f}x (target <= {TARGET}x) {'ok' if ratio <= TARGET else 'OVER'}")

        print("\nwhere the PyTRIO step's time goes (median seconds; server = engine compute timed in-process)")
        phases = [
            ("save_weights", ("snapshot",)),
            ("sampling", ("sample",)),
            ("rewards", ()),
            ("forward_backward", ("forward",)),
            ("optim_step", ("optim_step",)),
        ]
        print(f"  {'phase':18s} {'client':>8s} {'server':>8s} {'other':>8s}")
        for phase, engine_names in phases:
            client = med([p["metrics"][f"time/{phase}"] for p in py])
            server_time = med([sum(p["engine"].get(n, 0.0) for n in engine_names) for p in py])
            print(f"  {phase:18s} {client:8.3f} {server_time:8.3f} {client - server_time:8.3f}")
        total_other = med([p["wall"] - sum(p["engine"].values()) for p in py])
        print(
            f"  {'whole step':18s} {med(py_wall):8.3f} {med([sum(p['engine'].values()) for p in py]):8.3f} "
            f"{total_other:8.3f}"
        )
    print("\ntarget met" if ok else "\ntarget missed (see OVER)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
