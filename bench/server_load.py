"""Local PyTRIO server under load: sampling throughput and latency at 1/4/16/64 clients, the same beside a hostile
client sending bad requests the whole time, and the server's resident memory before, at its peak and after.

The server runs as ``trl-grpo-ext pytrio-serve`` in its own process (its RSS is its own); clients are threads, each
with its own HTTP connection, sending sample requests one after another over real sockets. The hostile client cycles
through malformed requests (NaN temperature, a seed beyond range, stop token ids out of the vocabulary, a prompt too
long for the context, too many samples, ...): each must get a 4xx, and the others' error rate must stay 0.

Run on a quiet machine: ``OMP_NUM_THREADS=1 python bench/server_load.py`` (embedded model). ``--quick`` is a smoke
run on a tiny random model with a handful of requests. Last line:
``server load: <r> req/s at 64 clients, p99 <s> s, errors 0 with a hostile client, RSS after/baseline <x>``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

KEY = "bench-server-load-key"
HOSTILE = [  # (what, changes to a good request body)
    ("temperature NaN", {"sampling_params": {"max_tokens": 4, "temperature": math.nan}}),
    ("seed 2**70", {"sampling_params": {"max_tokens": 4, "seed": 2**70}}),
    ("stop [123]", {"sampling_params": {"max_tokens": 4, "stop": [123]}}),
    ("stop_token_ids out of vocabulary", {"sampling_params": {"max_tokens": 4, "stop_token_ids": [10**9]}}),
    ("prompt token out of vocabulary", {"prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 10**9]}]}}),
    ("max_tokens beyond the context", {"sampling_params": {"max_tokens": 10**7}}),
    ("too many samples", {"num_samples": 10**6}),
    ("top-k logprobs 49152", {"topk_prompt_logprobs": 49152, "return_prompt_logprobs": True}),
    ("top_p 0", {"sampling_params": {"max_tokens": 4, "top_p": 0}}),
    ("not JSON", None),
]


def _status(pid: int, key: str) -> float:
    """A /proc/<pid>/status figure in GB."""
    with open(f"/proc/{pid}/status", encoding="ascii") as file:
        for line in file:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024**2
    raise KeyError(key)


def start_server(model: str, budget_gb: float | None) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "trl_grpo_ext.cli", "pytrio-serve", "--model", model, "--port", "0",
               "--log-level", "WARNING"]  # fmt: skip
    if budget_gb is not None:
        command += ["--memory-budget-gb", str(budget_gb)]
    env = {**os.environ, "TRL_GRPO_EXT_PYTRIO_API_KEY": KEY, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
    for line in process.stdout:
        if line.startswith("PyTRIO local server:"):
            return process, line.split()[3]
    raise RuntimeError(f"the server did not start (exit status {process.wait()})")


def sampling_run(base_url: str) -> tuple[str, dict]:
    import httpx

    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=base_url, timeout=600) as client:
        sid = client.post("/api/openapi/v1/service-sessions", json={"sdk_version": "bench"}, headers=auth).json()
        alias = client.get("/api/models", headers=auth).json()["items"][0]["alias"]
        run = client.post(f"/api/openapi/v1/service-sessions/{sid['service_session_cuid']}/sampling-runs",
                          json={"base_model": alias}, headers=auth).json()  # fmt: skip
    token = {"Authorization": f"Bearer {run['actor_jwt']['token']}", "Content-Type": "application/json"}
    return f"{base_url}/actor/v1/sampling-runs/{run['sampling_run_cuid']}/sample", token


def good_body(client: int, i: int, args) -> dict:
    prompt = [(31 * client + 7 * i + 5 * j) % 390 + 10 for j in range(args.prompt_tokens)]  # any vocabulary
    return {"request_id": f"c{client}-{i}", "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
            "sampling_params": {"max_tokens": args.max_tokens, "seed": client * 1000 + i}, "num_samples": 1}  # fmt: skip


def run_level(url: str, headers: dict, clients: int, hostile: bool, args) -> dict:
    """`clients` threads, `args.requests` sample requests each; with `hostile`, one more thread sends bad ones."""
    import httpx

    latencies: list[float] = []
    errors: list[str] = []
    hostile_answers: list[int] = []
    lock = threading.Lock()
    done = threading.Event()

    def good(c: int) -> None:
        with httpx.Client(timeout=600) as client:
            for i in range(args.requests):
                start = time.perf_counter()
                try:
                    answer = client.post(url, content=json.dumps(good_body(c, i, args)), headers=headers)
                    ok = answer.status_code == 200 and len(answer.json()["sequences"]) == 1
                    why = f"{answer.status_code} {answer.text[:120]}"
                except Exception as error:  # noqa: BLE001 - a benchmark counts every failure
                    ok, why = False, repr(error)
                with lock:
                    (latencies.append(time.perf_counter() - start) if ok else errors.append(why))

    def bad() -> None:
        with httpx.Client(timeout=600) as client:
            for _what, changes in itertools.cycle(HOSTILE):
                if done.is_set():
                    return
                if changes is None:
                    content = b'{"request_id": "x", "prompt": '
                else:
                    content = json.dumps({**good_body(999, 0, args), **changes}).encode()
                try:
                    status = client.post(url, content=content, headers=headers).status_code
                except Exception:  # noqa: BLE001
                    status = 0
                with lock:
                    hostile_answers.append(status)

    threads = [threading.Thread(target=good, args=(c,)) for c in range(clients)]
    attacker = threading.Thread(target=bad) if hostile else None
    if attacker:  # already sending when the others start
        attacker.start()
        deadline = time.monotonic() + 30
        while not hostile_answers and time.monotonic() < deadline:
            time.sleep(0.01)
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    done.set()
    if attacker:
        attacker.join()
    ordered = sorted(latencies)
    p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)] if ordered else float("nan")
    return {
        "clients": clients,
        "hostile": hostile,
        "requests": len(latencies) + len(errors),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "req_per_s": len(latencies) / wall,
        "p50_s": statistics.median(ordered) if ordered else float("nan"),
        "p99_s": p99,
        "hostile_requests": len(hostile_answers),
        "hostile_not_4xx": sum(1 for s in hostile_answers if not 400 <= s < 500),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--clients", default="1,4,16,64", help="client counts, comma-separated")
    parser.add_argument("--requests", type=int, default=4, help="sample requests per client and level")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--memory-budget-gb", type=float, default=None)
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny random model, 1 request per client")
    args = parser.parse_args()
    if args.quick:
        from conftest import build_tiny_model

        args.model = build_tiny_model(Path(tempfile.mkdtemp(prefix="server-load-")))
        args.requests, args.max_tokens, args.prompt_tokens = 1, 4, 8
    levels = [int(c) for c in args.clients.split(",")]
    process, base_url = start_server(args.model, args.memory_budget_gb)
    try:
        url, headers = sampling_run(base_url)
        run_level(url, headers, 1, False, argparse.Namespace(**{**vars(args), "requests": 1}))  # warm-up
        time.sleep(2)
        baseline = _status(process.pid, "VmRSS")
        with open(f"/proc/{process.pid}/clear_refs", "w") as file:  # the peak from here on
            file.write("5")
        results = [run_level(url, headers, c, hostile, args) for hostile in (False, True) for c in levels]
        peak = _status(process.pid, "VmHWM")
        time.sleep(3)  # the server hands freed memory back once idle
        after = _status(process.pid, "VmRSS")
    finally:
        process.terminate()
        process.wait(timeout=60)
    print(f"model {args.model}, {args.requests} requests per client of {args.prompt_tokens} prompt + "
          f"{args.max_tokens} new tokens, one sample each")  # fmt: skip
    print("| clients | hostile client | req/s | p50 s | p99 s | errors | hostile requests (not 4xx) |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['clients']} | {'yes' if r['hostile'] else 'no'} | {r['req_per_s']:.2f} | {r['p50_s']:.3f} | "
              f"{r['p99_s']:.3f} | {r['errors']} | {r['hostile_requests']} ({r['hostile_not_4xx']}) |")  # fmt: skip
        if r["first_error"]:
            print(f"  first error: {r['first_error']}")
    print(f"RSS baseline {baseline:.2f} GB, peak {peak:.2f} GB, after {after:.2f} GB")
    top = max(levels)
    calm = next(r for r in results if r["clients"] == top and not r["hostile"])
    hostile = next(r for r in results if r["clients"] == top and r["hostile"])
    errors = sum(r["errors"] for r in results if r["hostile"])
    print(f"(without the hostile client at {top} clients: {calm['req_per_s']:.2f} req/s, p99 {calm['p99_s']:.2f} s)")
    print(f"server load: {hostile['req_per_s']:.2f} req/s at {top} clients, p99 {hostile['p99_s']:.2f} s, "
          f"errors {errors} with a hostile client, RSS after/baseline {after / baseline:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
