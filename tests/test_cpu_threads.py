"""CPU threads (trl_grpo_ext/cpu/threads.py): a short OpenMP spin (GOMP_SPINCOUNT) unless the user chose how OpenMP
threads wait, set before torch loads in the recipes and the console script; and the governor, which runs a CPU
model's forwards on the cores other processes leave free. bench/cpu_threads.py measures why."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trl_grpo_ext.cpu.threads import (
    DEFAULTS,
    MODE_ENV,
    USER_SETTINGS,
    CpuThreadGovernor,
    apply_cpu_thread_defaults,
    current_governor,
    govern_cpu_threads,
    governed,
    proc_reader,
)

ROOT = Path(__file__).resolve().parents[1]

# Records the OpenMP wait settings at the moment torch is first imported, then runs `code`.
_AT_TORCH_IMPORT = """
import os, sys
class Hook:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and "seen" not in globals():
            globals()["seen"] = sorted((k, os.environ[k]) for k in {names!r} if k in os.environ)
        return None
sys.meta_path.insert(0, Hook())
{code}
print("policy at torch import:", globals().get("seen"))
"""


def test_defaults_apply_when_the_user_set_none():
    env = {"OMP_NUM_THREADS": "3"}
    assert DEFAULTS == {"GOMP_SPINCOUNT": "10000"}  # what bench/cpu_threads.py measured (docs/recipes.md#cpu-threads)
    assert apply_cpu_thread_defaults(env) == DEFAULTS
    assert env == {"OMP_NUM_THREADS": "3", **DEFAULTS}  # the thread count is the user's


@pytest.mark.parametrize("name", USER_SETTINGS)
def test_a_user_setting_is_kept(name):
    value = "ACTIVE" if name == "OMP_WAIT_POLICY" else "1000"
    env = {name: value}
    assert apply_cpu_thread_defaults(env) == {}
    assert env == {name: value}


def _run(code):
    env = {k: v for k, v in os.environ.items() if k not in USER_SETTINGS}
    proc = subprocess.run(
        [sys.executable, "-c", _AT_TORCH_IMPORT.format(code=code, names=USER_SETTINGS)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


AT_IMPORT = f"policy at torch import: {sorted(DEFAULTS.items())}"


def test_the_trl_recipe_sets_the_defaults_before_torch_loads():
    out = _run("sys.path.insert(0, 'recipes'); import gsm8k_grpo")
    assert AT_IMPORT in out


def test_the_pytrio_recipe_sets_it_for_the_server_it_starts():
    out = _run("sys.path.insert(0, 'recipes'); import gsm8k_pytrio; import torch; print(os.environ['GOMP_SPINCOUNT'])")
    assert DEFAULTS["GOMP_SPINCOUNT"] in out.splitlines()


def test_the_console_script_sets_the_defaults():
    code = "from trl_grpo_ext.cli import main\ntry:\n    main(['eval', '--help'])\nexcept SystemExit:\n    pass\nimport torch"
    assert AT_IMPORT in _run(code)


# ------------------------------------------------------------------ the governor: thread count that follows the load


class FakeProc:
    """/proc readings the test writes: the machine's busy jiffies, this process's own, and the clock."""

    TICKS = 100

    def __init__(self):
        self.busy, self.own, self.t, self.reads = 0, 0, 1000.0, 0

    def read(self):
        self.reads += 1
        return self.busy, self.own, self.t

    def clock(self):
        return self.t

    def advance(self, seconds, own_cores, other_cores):
        self.t += seconds
        self.own += round(own_cores * seconds * self.TICKS)
        self.busy += round((own_cores + other_cores) * seconds * self.TICKS)


def _governor(cap=2, cores=2):
    fake = FakeProc()
    return fake, CpuThreadGovernor(cap, cores, fake.read, FakeProc.TICKS, clock=fake.clock)


def test_idle_machine_keeps_every_thread():
    fake, gov = _governor()
    for _ in range(5):
        fake.advance(1.0, own_cores=2.0, other_cores=0.1)
        assert gov.check() == 2
    assert gov.changes == 0


def test_a_busy_core_takes_a_thread_and_gives_it_back():
    fake, gov = _governor()
    fake.advance(1.0, own_cores=1.3, other_cores=0.7)  # 3 threads on 2 cores: the other gets its share
    assert gov.check() == 1
    fake.advance(1.0, own_cores=1.0, other_cores=1.0)  # now alone on its core: stays at 1, no flip-flop
    assert gov.check() == 1
    fake.advance(1.0, own_cores=1.0, other_cores=0.0)  # the other process ended
    assert gov.check() == 2
    assert (gov.changes, gov.lowest) == (2, 1)


def test_never_below_one_nor_above_the_cap():
    fake, gov = _governor(cap=2, cores=2)
    fake.advance(1.0, own_cores=0.7, other_cores=1.9)  # two busy processes on 2 cores
    assert gov.check() == 1
    fake, gov = _governor(cap=2, cores=8)  # the user/torch chose 2 of 8 cores: one busy core changes nothing
    fake.advance(1.0, own_cores=2.0, other_cores=1.0)
    assert gov.check() == 2
    fake, gov = _governor(cap=4, cores=8)
    fake.advance(1.0, own_cores=4.0, other_cores=4.9)  # 3 cores free
    assert gov.check() == 3


def test_a_flicker_changes_nothing():
    fake, gov = _governor()
    fake.advance(1.0, own_cores=2.0, other_cores=0.45)  # under half a core on average
    assert gov.check() == 2
    fake.advance(0.3, own_cores=2.0, other_cores=1.0)  # a shell command's 0.3 s burst ...
    assert gov.check() == 2  # ... is not read yet (once per second) ...
    fake.advance(0.7, own_cores=2.0, other_cores=0.0)
    assert gov.check() == 2  # ... and averages 0.3 core over the second
    assert gov.changes == 0


def test_proc_is_read_at_most_once_per_interval():
    fake, gov = _governor()
    reads = fake.reads
    for _ in range(100):  # a generation loop's token steps
        fake.advance(0.001, own_cores=2.0, other_cores=1.0)
        gov.check()
    assert fake.reads == reads  # 0.1 s: only the clock was read
    fake.advance(0.95, own_cores=2.0, other_cores=1.0)
    assert gov.check() == 1 and fake.reads == reads + 1


def test_busy_time_leaves_out_idle_and_iowait():
    from trl_grpo_ext.cpu.threads import _busy_fields

    assert _busy_fields("cpu0 1 2 3 1000 2000 4 5 6 7 8") == 1 + 2 + 3 + 4 + 5 + 6


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads Linux /proc")
def test_proc_reader_counts_this_process():
    import time

    read = proc_reader()
    before = time.monotonic()
    busy0, own0, t0 = read()
    cpu0 = time.process_time()
    # This thread's CPU clock, not process_time: the process's other threads (a server or torch pool an earlier
    # test left) add to process_time, which can then pass 0.3 s before this thread has burnt its share.
    end = time.thread_time() + 0.3
    while time.thread_time() < end:  # burn 0.3 s of CPU in this thread
        pass
    cpu1 = time.process_time()
    busy1, own1, t1 = read()
    after = time.monotonic()
    ticks = os.sysconf("SC_CLK_TCK")
    # our own jiffies are the process's CPU time as the kernel counts it (whole jiffies: 2 of rounding, 1 spare)
    assert own1 - own0 >= 0.2 * ticks
    assert abs((own1 - own0) - (cpu1 - cpu0) * ticks) <= 3
    assert busy1 - busy0 >= 0.5 * (own1 - own0)  # our own time is inside the machine's busy time
    assert before <= t0 < t1 <= after  # the reading's clock is the monotonic one


def test_no_proc_or_one_thread_installs_nothing(monkeypatch):
    from trl_grpo_ext.cpu import threads as cpu_threads

    def missing(cpus=None):
        raise FileNotFoundError("/proc/stat")

    monkeypatch.setattr(cpu_threads, "proc_reader", missing)
    assert CpuThreadGovernor.for_this_process(cap=4) is None
    monkeypatch.undo()
    assert CpuThreadGovernor.for_this_process(cap=1) is None


def test_who_chose_the_thread_count():
    launcher_argv = ["/venv/bin/python", "/venv/bin/accelerate", "launch", "train.py"]
    child = {"ACCELERATE_DYNAMO_BACKEND": "NO", "OMP_NUM_THREADS": "1"}
    assert governed({}, None)  # nobody set it: torch's default follows the load
    assert not governed({"OMP_NUM_THREADS": "2"}, None)  # exported by the user: kept
    assert governed(child, ({}, launcher_argv))  # accelerate picked the 1 by itself
    assert not governed(child, ({"OMP_NUM_THREADS": "1"}, launcher_argv))  # the user gave it to accelerate
    assert not governed(child, ({}, [*launcher_argv[:3], "--num_cpu_threads_per_process=2", "train.py"]))
    assert governed({"OMP_NUM_THREADS": "2", MODE_ENV: "auto"}, None)  # make train: follow the load anyway
    assert not governed({MODE_ENV: "Fixed"}, None)
    with pytest.raises(ValueError, match=f"{MODE_ENV}='adaptive': expected one of auto, fixed"):
        governed({MODE_ENV: "adaptive"}, None)


@pytest.fixture
def fake_governor(monkeypatch):
    """This process's governor over fake readings (cap 2 on 2 cores), installs allowed; torch's count restored."""
    import torch

    from trl_grpo_ext.cpu import threads as cpu_threads

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    fake, gov = _governor(cap=2, cores=2)
    monkeypatch.setattr(cpu_threads, "_governor", gov)
    monkeypatch.setenv(MODE_ENV, "auto")
    yield fake
    torch.set_num_threads(before)


def _hooked(model):
    from trl_grpo_ext.cpu.threads import _pre_forward

    return _pre_forward in model._forward_pre_hooks.values()


def test_the_forward_sets_the_thread_count_in_its_own_thread(fake_governor, tiny_model_path):
    import threading

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert govern_cpu_threads(model) is not None and _hooked(model)
    govern_cpu_threads(model)  # a second load site on the same model: still one hook
    assert len(model._forward_pre_hooks) == 1
    ids = torch.tensor([[1, 2, 3]])
    fake_governor.advance(1.0, own_cores=1.3, other_cores=0.7)
    seen = []

    def forward():  # as the PyTRIO server's request threads: a thread other than the one that loaded the model
        with torch.no_grad():
            model(input_ids=ids)
        seen.append(torch.get_num_threads())

    worker = threading.Thread(target=forward)
    worker.start()
    worker.join()
    assert seen == [1]
    # torch.set_num_threads is per thread: the main thread still has 2 until one of its forwards runs
    assert torch.get_num_threads() == 2
    with torch.no_grad():
        model(input_ids=ids)
    assert torch.get_num_threads() == 1
    fake_governor.advance(1.0, own_cores=1.0, other_cores=0.0)
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))  # PEFT wraps the hooked model
    with torch.no_grad():
        peft_model(input_ids=ids)
    assert torch.get_num_threads() == 2


def test_each_cpu_model_load_installs_it(fake_governor, tiny_model_path, monkeypatch):
    from types import SimpleNamespace

    from trl_grpo_ext.evaluation.generator import HFGenerator
    from trl_grpo_ext.pytrio_server.engine import ModelEngine
    from trl_grpo_ext.trl.recipe import load_model

    model_args = SimpleNamespace(dtype="float32", model_revision=None, attn_implementation=None)
    training_args = SimpleNamespace(gradient_checkpointing=False, use_cpu=True, trust_remote_code=False)
    assert _hooked(load_model(tiny_model_path, model_args, training_args))  # the TRL recipe
    assert _hooked(HFGenerator(tiny_model_path, max_new_tokens=2, device="cpu").model)  # evaluate
    assert _hooked(ModelEngine(tiny_model_path, device="cpu", concurrent_sampling=False).base)  # the PyTRIO server
    # the server with sampling beside training: each side's lock sets its share of the governor's count instead
    beside = ModelEngine(tiny_model_path, device="cpu")
    assert not _hooked(beside.base) and not _hooked(beside.for_sampling.base)
    monkeypatch.setattr(current_governor(), "check", lambda: 5)
    assert (beside.for_sampling.lock.threads(), beside.lock.threads()) == (2, 3)
    monkeypatch.setenv(MODE_ENV, "fixed")
    assert not _hooked(load_model(tiny_model_path, model_args, training_args))
    assert not _hooked(HFGenerator(tiny_model_path, max_new_tokens=2, device="cpu").model)
    monkeypatch.setenv(MODE_ENV, "auto")
    gpu_args = SimpleNamespace(gradient_checkpointing=False, use_cpu=False, trust_remote_code=False)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)  # a GPU run: the model moves there later
    assert not _hooked(load_model(tiny_model_path, model_args, gpu_args))


def test_a_bad_switch_is_one_line_before_any_model_loads(monkeypatch, capsys):
    from trl_grpo_ext.cli import main

    monkeypatch.setenv(MODE_ENV, "sometimes")
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--model", "/nonexistent"])
    assert exit_info.value.code == 2
    assert f"error: {MODE_ENV}='sometimes': expected one of auto, fixed" in capsys.readouterr().err
    from types import SimpleNamespace

    from trl_grpo_ext.cpu.threads import configure_cpu_threads

    with pytest.raises(ValueError, match=MODE_ENV):  # the TRL recipe: inside its one-line `error:` block
        configure_cpu_threads(SimpleNamespace(use_cpu=True))


def test_the_run_summary_says_when_the_count_followed_the_load(fake_governor, tmp_path, capsys):
    from types import SimpleNamespace

    from trl_grpo_ext.cpu.threads import current_governor
    from trl_grpo_ext.trl.recipe import report_run

    trainer = SimpleNamespace(is_world_process_zero=lambda: True)
    args = SimpleNamespace(output_dir=str(tmp_path))
    assert "torch_threads_governor" in report_run(trainer, args)
    idle = capsys.readouterr().out
    assert "2 torch threads)" in idle  # idle: no change, nothing more said
    assert "last digits" not in idle and "bit for bit" not in idle
    fake_governor.advance(1.0, own_cores=1.3, other_cores=0.7)
    current_governor().check()
    summary = report_run(trainer, args)
    assert summary["torch_threads"] == 2 and summary["torch_threads_governor"] == {"changes": 1, "lowest": 1}
    out = capsys.readouterr().out
    assert "2 torch threads, down to 1 while other processes were busy)" in out
    # its last lines: the figures may differ from an idle run's, and how to repeat a run bit for bit
    changed, repeat = out.rstrip("\n").splitlines()[-2:]
    assert "changed 1 time(s)" in changed and "may differ in the last digits from an idle run's (2 threads" in changed
    assert "bit for bit" in repeat and f"{MODE_ENV}=fixed OMP_NUM_THREADS=2" in repeat
