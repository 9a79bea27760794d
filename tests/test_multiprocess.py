"""Two processes (accelerate launch, gloo on CPU) train exactly as one process on the same global batch.

For each new loss type (importance_sampling, cispo, ppo) and two schedules (two iterations per generation, so the
second step is off-policy and the clipping bounds bite; two accumulated micro-batches per optimizer step), one
`accelerate launch --multi_gpu --num_processes 2` run of `tests/multiprocess_grpo.py` must match the same steps in
one process: logged loss and grad_norm, the all-reduced gradient of every optimizer step, frac_degenerate and the
advantages with their degenerate groups zeroed. Completions vary in length, so the processes hold different token
counts (TRL's cross-process token normalisation), and one prompt group straddles the two processes.

Two machines (docs/gpu.md's "Several machines", one process each, gloo on this host) must match one process too:
started by hand with their ranks, and by `srun` on the test SLURM cluster's two nodes (`.ci/slurm_up.sh`).
"""

import math
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "multiprocess_grpo.py"
sys.path.insert(0, str(WORKER.parent))

import multiprocess_grpo as worker  # noqa: E402

from trl_grpo_ext.experiments.launch.commands import log_tail  # noqa: E402

# Metrics that must agree step by step. Per-micro-batch means (entropy, ratio_mean, clip fractions) are averaged
# over micro-batches whose composition TRL shuffles, so they are compared where a step is one micro-batch.
STEP_KEYS = ("loss", "grad_norm", "reward", "reward_std", "frac_reward_zero_std", "frac_degenerate", "train_tokens")
ONE_MICRO_BATCH_KEYS = ("entropy", "ratio_mean", "clip_low_frac", "clip_high_frac", "clipped_ratio_mean")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tiny_model_path, tmp_path_factory):
    """{'one': {name: record}, 'two': {name: record}} for every schedule-loss_type pair."""
    import torch

    out = tmp_path_factory.mktemp("multiprocess")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("ACCELERATE_USE_CPU", None)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_ip", "127.0.0.1", "--main_process_port", str(_free_port()),
           str(WORKER), "--model", tiny_model_path, "--out", str(out / "two")]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, errors="replace", timeout=300, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    worker.run(tiny_model_path, str(out / "one"))
    names = [f"{s}-{loss}" for s in worker.SCHEDULES for loss in worker.LOSS_TYPES]
    return {size: {n: torch.load(out / size / f"{n}.pt") for n in names} for size in ("one", "two")}


def _close(a, b, rel=1e-4, abs_=1e-6):
    return math.isclose(a, b, rel_tol=rel, abs_tol=abs_)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", list(worker.SCHEDULES))
@pytest.mark.parametrize("loss_type", worker.LOSS_TYPES)
def test_two_processes_match_one(runs, schedule, loss_type):
    import torch

    name = f"{schedule}-{loss_type}"
    one, two = runs["one"][name], runs["two"][name]
    assert (one["world_size"], two["world_size"]) == (1, 2)
    assert len(one["log_history"]) == len(two["log_history"]) == worker.SCHEDULES[schedule]["max_steps"]
    keys = STEP_KEYS + (ONE_MICRO_BATCH_KEYS if worker.SCHEDULES[schedule]["gradient_accumulation_steps"] == 1 else ())
    for row_one, row_two in zip(one["log_history"], two["log_history"], strict=True):
        for key in keys:
            if key in row_one or key in row_two:
                assert _close(row_one[key], row_two[key]), (name, row_one["step"], key, row_one[key], row_two[key])

    assert len(one["grads"]) == len(two["grads"]) == worker.SCHEDULES[schedule]["max_steps"]
    for step, (g_one, g_two) in enumerate(zip(one["grads"], two["grads"], strict=True), start=1):
        assert g_one.abs().max() > 0
        torch.testing.assert_close(g_two, g_one, rtol=1e-4, atol=1e-7, msg=lambda m, s=step: f"{name} step {s}: {m}")

    assert len(one["advantages"]) == len(two["advantages"]) > 0
    for a_one, a_two in zip(one["advantages"], two["advantages"], strict=True):
        assert a_one.shape == a_two.shape == (worker.COMPLETIONS_PER_GENERATION,)
        torch.testing.assert_close(a_two, a_one, rtol=1e-5, atol=1e-7)
        assert torch.equal(a_one == 0, a_two == 0)  # the same groups zeroed, exactly


@pytest.mark.slow
def test_the_comparison_exercises_what_it_claims(runs):
    """Degenerate groups (exact and within tolerance) and a varied one; off-policy steps that clip; losses differ."""
    import torch

    iterations = {loss: runs["two"][f"iterations-{loss}"]["log_history"] for loss in worker.LOSS_TYPES}
    for rows in iterations.values():
        generation_rows = [r for r in rows if "frac_degenerate" in r]
        assert all(_close(r["frac_degenerate"], 2 / 3) for r in generation_rows)  # 2 of 3 groups, ours
        assert all(_close(r["frac_reward_zero_std"], 1 / 3) for r in generation_rows)  # TRL's exact test: 1 of 3
        assert abs(rows[1]["ratio_mean"] - 1) > 1e-3  # the second iteration is off-policy
    for loss in ("cispo", "ppo"):
        assert iterations[loss][1]["clip_low_frac"] + iterations[loss][1]["clip_high_frac"] > 0
    second = [iterations[loss][1]["loss"] for loss in worker.LOSS_TYPES]
    assert len({round(v, 6) for v in second}) == 3, second
    advantages = runs["two"]["iterations-ppo"]["advantages"][0]
    group = worker.NUM_GENERATIONS
    straddling = advantages[group : 2 * group]  # rows 4-7: two on each process
    assert (straddling != 0).all() and abs(float(straddling.sum())) < 1e-5
    assert torch.count_nonzero(advantages) == group


# docs/gpu.md's "Several machines": the same command on each machine with its rank. Two machines of one process
# each on this host over gloo (the CPU equivalent of two nodes), started by hand and by `srun` on the test SLURM
# cluster's two nodes, must train as one process on the same batch.
MULTINODE_RUN = "iterations-ppo"


def machine_command(machines: str, rank: str, ip: str, port: int, model: str, out: str) -> list[str]:
    """docs/gpu.md's multi-node `accelerate launch` (one process per machine, on the CPU) of `MULTINODE_RUN`."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", machines,
            "--num_processes", machines, "--machine_rank", rank, "--main_process_ip", ip,
            "--main_process_port", str(port), "--mixed_precision", "no", "--dynamo_backend", "no",
            str(WORKER), "--model", model, "--out", out, "--only", MULTINODE_RUN]  # fmt: skip


def launch_env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("ACCELERATE_USE_CPU", None)
    return env


@pytest.fixture(scope="module")
def one_process(tiny_model_path, tmp_path_factory):
    """`MULTINODE_RUN` in one process: what the machines together must reproduce."""
    import torch

    out = tmp_path_factory.mktemp("one-process")
    worker.run(tiny_model_path, str(out), only=MULTINODE_RUN)
    return torch.load(out / f"{MULTINODE_RUN}.pt")


def assert_trained_as_one(machines: list[Path], one: dict, logs: str) -> None:
    """Machine 1 joined machine 0's job (only machine 0 wrote a record; the job had 2 processes) and the gradients
    were all-reduced across the machines: each held half the batch, and every step's loss, grad norm and gradient
    equal the one-process run's."""
    import torch

    first, second = machines
    assert not (second / f"{MULTINODE_RUN}.pt").exists(), logs  # machine 1 was no main process of its own
    two = torch.load(first / f"{MULTINODE_RUN}.pt")
    assert (two["world_size"], two["num_processes"], one["num_processes"]) == (2, 2, 1)
    steps = worker.SCHEDULES[MULTINODE_RUN.split("-")[0]]["max_steps"]
    assert len(one["log_history"]) == len(two["log_history"]) == steps
    for row_one, row_two in zip(one["log_history"], two["log_history"], strict=True):
        assert "loss" in row_two and "grad_norm" in row_two
        for key in STEP_KEYS + ONE_MICRO_BATCH_KEYS:
            if key in row_one or key in row_two:
                assert _close(row_one[key], row_two[key]), (row_one["step"], key, row_one[key], row_two[key])
    for step, (g_one, g_two) in enumerate(zip(one["grads"], two["grads"], strict=True), start=1):
        assert g_one.abs().max() > 0
        torch.testing.assert_close(g_two, g_one, rtol=1e-4, atol=1e-7, msg=lambda m, s=step: f"step {s}: {m}")


@pytest.mark.slow
def test_two_machines_train_as_one_process(one_process, tiny_model_path, tmp_path):
    """`accelerate launch --num_machines 2 --machine_rank 0|1 --main_process_ip 127.0.0.1`, one per machine."""
    port = _free_port()
    machines = [tmp_path / f"machine-{rank}" for rank in (0, 1)]
    procs = []
    for rank, folder in enumerate(machines):  # log files, not pipes: a full pipe would stall its collectives
        folder.mkdir()
        log = open(folder / "launch.log", "w")  # noqa: SIM115 - closed below
        cmd = machine_command("2", str(rank), "127.0.0.1", port, tiny_model_path, str(folder))
        procs.append((subprocess.Popen(cmd, env=launch_env(), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT), log))
    try:
        codes = [proc.wait(timeout=300) for proc, _ in procs]
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
            log.close()
    logs = "\n".join(log_tail(folder / "launch.log") for folder in machines)
    assert codes == [0, 0], logs
    assert_trained_as_one(machines, one_process, logs)


# docs/gpu.md's SLURM script, with one CPU process per node in place of 8 GPUs
SBATCH_SCRIPT = """#!/bin/bash
#SBATCH --partition={partition} --nodes=2 --ntasks-per-node=1 --cpus-per-task=1
#SBATCH --job-name={name} --output={out}/slurm-%j.log --time=00:15:00
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
srun bash -c '{launch}'
"""


@pytest.mark.slow
def test_srun_on_two_nodes_trains_as_one_process(one_process, tiny_model_path, tmp_path):
    """docs/gpu.md's `srun bash -c 'accelerate launch ... --machine_rank $SLURM_NODEID'` on two SLURM nodes
    (`.ci/slurm_up.sh`: two slurmd on this host), each node's task one machine."""
    from slurm_cluster import MULTINODE_PARTITION, require_cluster

    require_cluster(MULTINODE_PARTITION, nodes=2)
    out = "MACHINE_FOLDER"  # each node writes to its own folder, machine-$SLURM_NODEID
    launch = machine_command("$SLURM_NNODES", "$SLURM_NODEID", "$MASTER_ADDR", _free_port(), tiny_model_path, out)
    # every word quoted for bash except the variables the task reads on its node (pytest's paths hold no quote)
    words = [w if w.startswith("$") else shlex.quote(w) for w in launch]
    words[launch.index(out)] = shlex.quote(f"{tmp_path}/machine-") + "$SLURM_NODEID"
    name = f"trl-grpo-ext-multinode-{os.getpid()}"
    script = tmp_path / "multinode.sbatch"
    script.write_text(SBATCH_SCRIPT.format(partition=MULTINODE_PARTITION, name=name, out=tmp_path,
                                           launch=" ".join(words)))  # fmt: skip
    try:
        done = subprocess.run(["sbatch", "--wait", f"--chdir={ROOT}", str(script)], env=launch_env(),
                              capture_output=True, text=True, timeout=600)  # fmt: skip
    finally:
        subprocess.run(["scancel", f"--name={name}"], capture_output=True)
    logs = "\n".join(log_tail(p) for p in tmp_path.glob("slurm-*.log"))
    assert done.returncode == 0, done.stdout + done.stderr + logs
    machines = [tmp_path / f"machine-{rank}" for rank in (0, 1)]
    assert_trained_as_one(machines, one_process, logs)
