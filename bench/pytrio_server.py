"""Local PyTRIO server: concurrent sampling (async loop) vs one request at a time (sync loop), forward/backward
with and without prompt-prefix sharing, and the cost of one request. Same model, same requests, alternated; a
benchmark, not a test.

1. Sampling through the real ``pytrio`` client: ``--prompts`` requests of ``--group`` samples x ``--completion-tokens``
   tokens, sent one after another (what ``mode: sync`` does) or all at once (``mode: async``; the server batches
   them, `trl_grpo_ext.pytrio_server.sampling`). Prints seconds per round and async/sync.
2. ``forward_backward`` (importance_sampling) of the GRPO-shaped batch (each prompt's ``--group`` completions share
   its ``--prompt-tokens``) with ``share_prefix`` on and off on the engine: seconds, ratio, and the largest
   log-prob difference between the two.
3. Requests whose model work is small (``--model tiny``): milliseconds per call, median of ``--requests``, for a
   Control read (``get_session``), a one-token ``sample`` and a ``forward`` event (submit + long poll) through the
   real client: the HTTP layer's cost per request. It needs nothing but `running_server`, so the same file run with
   another checkout first on ``sys.path`` (copy it into that checkout's bench/) measures that checkout's server.

Run on a quiet machine: ``OMP_NUM_THREADS=2 python bench/pytrio_server.py [--model embedded|tiny|PATH --repeats 3]``.
Its last line: ``async/sync sampling: <x>; shared/plain forward_backward: <y>``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    """`n` prompts of `length` tokens sharing a head (a system prompt's worth), like GRPO's chat prompts."""
    head = [(17 * j) % (vocab - 10) + 5 for j in range(length // 2)]
    return [head + [(31 * i + 7 * j) % (vocab - 10) + 5 for j in range(length - len(head))] for i in range(n)]


def bench_sampling(server, trio, prompts, args) -> tuple[float, float]:
    service = trio.ServiceClient()
    sampler = service.create_sampling_client(base_model=server.model_alias)
    # min_p-free plain sampling with a fixed seed per prompt: both modes do the same work
    params = [
        trio.SamplingParams(max_tokens=args.completion_tokens, seed=i, temperature=1.0) for i in range(len(prompts))
    ]
    inputs = [trio.ModelInput.from_ints(p) for p in prompts]
    sync_times, async_times = [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        for x, p in zip(inputs, params, strict=True):
            sampler.sample(x, num_samples=args.group, sampling_params=p).result()
        sync_times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        futures = [
            sampler.sample(x, num_samples=args.group, sampling_params=p) for x, p in zip(inputs, params, strict=True)
        ]
        for f in futures:
            f.result()
        async_times.append(time.perf_counter() - t0)
    service._runtime.shutdown()
    return statistics.median(sync_times), statistics.median(async_times)


def bench_requests(server, trio, args) -> dict[str, float]:
    service = trio.ServiceClient()
    rest = service.create_rest_client()
    sampler = service.create_sampling_client(base_model=server.model_alias)
    trainer = service.create_lora_training_client(base_model=server.model_alias, rank=4, seed=0)
    tokens = [1, 5, 9, 14, 3, 7]
    datum = trio.Datum(model_input=trio.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:]})  # fmt: skip
    prompt, one_token = trio.ModelInput.from_ints(tokens), trio.SamplingParams(max_tokens=1, seed=0)
    calls = {
        "control read": lambda: rest.get_session(service.service_session_cuid).result(),
        "sample 1 token": lambda: sampler.sample(prompt, sampling_params=one_token).result(),
        "forward event": lambda: trainer.forward([datum], "cross_entropy").result(),
    }
    times: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():  # warm-up: sessions, adapters, first connections
        call()
    for _ in range(args.requests):  # alternated, so load changes hit every kind alike
        for name, call in calls.items():
            t0 = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t0)
    service._runtime.shutdown()
    return {name: 1000 * statistics.median(t) for name, t in times.items()}


def bench_forward_backward(engine, prompts, args) -> tuple[float, float, float]:
    import torch

    from trl_grpo_ext.pytrio_server.adapters import LoraSettings
    from trl_grpo_ext.pytrio_server.forward import ForwardDatum
    from trl_grpo_ext.pytrio_server.loss_fns import parse_loss

    g = torch.Generator().manual_seed(0)
    data = []
    for p in prompts:
        for _ in range(args.group):
            completion = torch.randint(5, engine.vocab_size - 5, (args.completion_tokens,), generator=g).tolist()
            tokens = p + completion
            n = len(tokens)
            advantages = [0.0] * len(p) + [float(torch.randn((), generator=g))] * len(completion)
            data.append(ForwardDatum(tokens, tokens[1:] + [tokens[0]], None, [-1.0] * n, advantages))
    spec = parse_loss("importance_sampling", None)
    engine.create_run("bench", LoraSettings(rank=16, seed=0))
    times = {True: [], False: []}
    cpu = {True: [], False: []}  # process CPU time: less sensitive than wall time to other processes' load
    outputs = {}
    for _ in range(args.repeats):
        for share in (False, True):
            engine.share_prefix = share
            t0, c0 = time.perf_counter(), time.process_time()
            outputs[share], _ = engine.forward("bench", data, spec, backward=True, auto_shift=False)
            times[share].append(time.perf_counter() - t0)
            cpu[share].append(time.process_time() - c0)
            for _, p in engine.runs["bench"].params:
                p.grad = None
    engine.share_prefix = True
    diff = max(
        float(abs(a["logprobs"] - b["logprobs"]).max()) for a, b in zip(outputs[True], outputs[False], strict=True)
    )
    engine.drop_run("bench")
    print(f"forward_backward CPU time: plain {statistics.median(cpu[False]):.2f} s, "
          f"shared prefix {statistics.median(cpu[True]):.2f} s", flush=True)  # fmt: skip
    return statistics.median(times[False]), statistics.median(times[True]), diff


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded", help="'embedded' (SmolLM2-135M-Instruct), 'tiny' or a path")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=117)
    parser.add_argument("--completion-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=50, help="calls of each kind in the requests part")
    parser.add_argument("--only", choices=["sampling", "forward_backward", "requests"], default=None,
                        help="run one part")  # fmt: skip
    args = parser.parse_args()

    import pytrio as trio

    from trl_grpo_ext.pytrio_server import running_server

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model == "tiny":
            from conftest import build_tiny_model

            model = str(build_tiny_model(Path(tmp) / "tiny"))
        with running_server(model, ephemeral_storage=True) as server:
            server.configure_client(home=str(Path(tmp) / "home"))
            prompts = _prompts(args.prompts, args.prompt_tokens, server.engine.vocab_size)
            parts = []
            if args.only in (None, "sampling"):
                sync_s, async_s = bench_sampling(server, trio, prompts, args)
                print(f"sampling {args.prompts} prompts x {args.group} x {args.completion_tokens} tokens: "
                      f"sync {sync_s:.2f} s, async {async_s:.2f} s (batched: up to "
                      f"{server.sampler.max_requests_in_batch} requests per batch)", flush=True)  # fmt: skip
                parts.append(f"async/sync sampling: {async_s / sync_s:.2f}")
            if args.only in (None, "requests"):
                per_call = bench_requests(server, trio, args)
                print(f"requests (median of {args.requests}, ms): "
                      + ", ".join(f"{name} {ms:.1f}" for name, ms in per_call.items()), flush=True)  # fmt: skip
                parts.append("ms per request: " + " / ".join(f"{ms:.1f}" for ms in per_call.values()))
            if args.only in (None, "forward_backward"):
                plain_s, shared_s, diff = bench_forward_backward(server.engine, prompts, args)
                print(f"forward_backward {args.prompts * args.group} rows x {args.prompt_tokens}+"
                      f"{args.completion_tokens} tokens: plain {plain_s:.2f} s, shared prefix {shared_s:.2f} s, "
                      f"max |dlogp| {diff:.1e}", flush=True)  # fmt: skip
                parts.append(f"shared/plain forward_backward: {shared_s / plain_s:.2f}")
    print("; ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
