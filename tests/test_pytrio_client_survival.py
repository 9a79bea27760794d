"""The PyTRIO loop's side of a server that goes away, and of a full output disk, over real sockets.

The server is `trl-grpo-ext pytrio-serve` in a subprocess (one per start; killed with SIGKILL). The loop runs here, in
a thread, or as the recipe in a subprocess whose files are capped by a file-size limit (a full disk to the writes).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

trio = pytest.importorskip("pytrio")

from pytrio_versions import configure  # noqa: E402

from trl_grpo_ext.experiments.launch.commands import log_tail  # noqa: E402
from trl_grpo_ext.pytrio.config import PyTrioGRPOConfig  # noqa: E402
from trl_grpo_ext.pytrio.connection import close_service_client, service_answers  # noqa: E402
from trl_grpo_ext.pytrio.loop import GRPOLoop  # noqa: E402
from trl_grpo_ext.runs import CONFIG_FILENAME, METRICS_FILENAME, PYTRIO_STATE_FILENAME, read_metrics_file  # noqa: E402
from trl_grpo_ext.runs.loop_state import load_loop_state  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KEY = "survival-key-3a9b1c"
ROWS = [
    {"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": f"#### {a + b}"}
    for a, b in [(3, 4), (12, 30), (7, 8), (40, 2)]
]


class Served:
    """`pytrio-serve` on a fixed port and storage folder, started (again) and killed by the test."""

    def __init__(self, model: str, folder: Path):
        with socket.socket() as sock:  # a free port, kept across restarts
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.model, self.folder = model, folder
        (folder / "key").write_text(KEY + "\n")
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-c", "import sys; from trl_grpo_ext.cli import main; sys.exit(main())",
               "pytrio-serve", "--model", self.model, "--port", str(self.port), "--api-key-file",
               str(self.folder / "key"), "--storage-dir", str(self.folder / "storage")]  # fmt: skip
        log = open(self.folder / f"server-{self.starts}.log", "w")  # noqa: SIM115 - the process writes it
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 180
        while not service_answers(self.url, timeout=1):
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log()
            time.sleep(0.2)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def log(self) -> str:
        return log_tail(self.folder / f"server-{self.starts}.log")


@pytest.fixture(scope="module")
def served(tiny_model_path, tmp_path_factory):
    server = Served(tiny_model_path, tmp_path_factory.mktemp("served"))
    server.start()
    yield server
    server.kill()


@pytest.fixture
def client(served, tmp_path):
    configure(base_url=served.url, api_key=KEY, home=str(tmp_path / "trio-home"), retry_initial_delay_seconds=0.1)
    yield
    configure(retry_initial_delay_seconds=1.0)


def _config(tiny_model_path, out: Path, **kw) -> PyTrioGRPOConfig:
    options = dict(base_model=tiny_model_path, lora_r=4, num_generations=2, per_device_train_batch_size=4,
                   max_completion_length=8, max_steps=4, save_every=1, reward_funcs=["boxed"], seed=5,
                   output_dir=str(out), server_retry_budget_s=180)  # fmt: skip
    options.update(kw)
    return PyTrioGRPOConfig(**options)


class PausingLoop(GRPOLoop):
    """Stops before step `pause_at` until the test says go (so the server dies between two known steps)."""

    def __init__(self, *args, pause_at: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.pause_at, self.reached, self.go = pause_at, threading.Event(), threading.Event()

    def train_step(self, training_client, stream, step: int) -> dict:
        if step == self.pause_at and not self.reached.is_set():
            self.reached.set()
            assert self.go.wait(300)
        return super().train_step(training_client, stream, step)


def _wait_for(predicate, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.mark.slow
def test_the_loop_says_the_server_is_gone_and_continues_on_a_restarted_one(
    served, client, tiny_model_path, tmp_path, caplog
):
    caplog.set_level(logging.INFO)
    out = tmp_path / "run"
    loop = PausingLoop(_config(tiny_model_path, out), rows=ROWS, pause_at=2)
    result: list = []
    thread = threading.Thread(target=lambda: result.append(loop.run()), daemon=True)
    thread.start()
    assert loop.reached.wait(300), served.log()
    served.kill()  # steps 1 and 2 done and saved; the server dies without a word
    loop.go.set()
    _wait_for(lambda: "still no answer" in caplog.text, 60, "the loop's retry lines")
    served.start()  # the same port and storage: the new server finds the saved checkpoints
    thread.join(300)
    assert result and result[0]["steps"] == 4, caplog.text[-3000:]
    try:
        rows, skipped = read_metrics_file(out / METRICS_FILENAME)
        assert [r["step"] for r in rows] == [1, 2, 3, 4] and skipped == 0  # every step exactly once
        messages = [r.getMessage() for r in caplog.records if r.name.startswith("trl_grpo_ext")]
        gone = [m for m in messages if "stopped answering" in m]
        assert len(gone) == 1 and served.url in gone[0] and "server_retry_budget_s" in gone[0]
        assert any("answers again" in m for m in messages)
        assert any(m.startswith("resumed at step 2 from trio://") for m in messages)
        state = load_loop_state(out)
        assert state.step == 4 and [c["step"] for c in state.checkpoints] == [1, 2, 3, 4]
    finally:
        close_service_client(loop._service)


@pytest.mark.slow
def test_a_server_that_stays_away_stops_the_recipe_with_one_line(tiny_model_path, tmp_path, capsys):
    """Nothing answers on the port: the recipe says so, retries for its budget, then one `error:` line."""
    import importlib.util

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    spec = importlib.util.spec_from_file_location("gsm8k_pytrio_survival", ROOT / "recipes" / "gsm8k_pytrio.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    configure(api_key=KEY, home=str(tmp_path / "trio-home"), retry_initial_delay_seconds=0.1)
    args = ["--base_model", tiny_model_path, "--lora_r", "4", "--max_completion_length", "8", "--num_train_samples",
            "8", "--output_dir", str(tmp_path / "run"), "--pytrio_base_url", dead, "--server_retry_budget_s", "4"]  # fmt: skip
    started = time.monotonic()
    try:
        assert recipe.main(args) == 1
    finally:
        configure(retry_initial_delay_seconds=1.0)
    assert time.monotonic() - started < 60
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: the PyTRIO service at {dead} did not answer for ")
    assert "server_retry_budget_s=4" in err[-1] and "no checkpoint was saved yet" in err[-1]


_FILE_LIMIT = """
import resource, runpy, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead of killing us
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
def test_a_full_output_disk_is_one_error_line_and_no_partial_row(served, tiny_model_path, tmp_path):
    """The recipe with every file capped at a size that config.yaml and pytrio_state.json fit in and metrics.jsonl
    outgrows after a row or two: one `error:` line naming what is kept, exit 1, metrics.jsonl of whole rows only (a
    resume from there is what the restart test does)."""
    out = tmp_path / "run"
    args = [str(ROOT / "recipes" / "gsm8k_pytrio.py"), "--base_model", tiny_model_path, "--lora_r", "4",
            "--max_completion_length", "8", "--num_train_samples", "8", "--max_steps", "4", "--save_every", "1",
            "--output_dir", str(out), "--pytrio_base_url", served.url]  # fmt: skip
    env = {**os.environ, "PYTRIO_API_KEY": KEY, "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"}
    limit = 2048  # config.yaml ~1.7 KB, pytrio_state.json < 1 KB; metrics rows ~1 KB each
    proc = subprocess.run([sys.executable, "-c", _FILE_LIMIT, str(limit), *args], capture_output=True, text=True,
                          env=env, timeout=300)  # fmt: skip
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert err[-1].startswith(f"error: cannot write {METRICS_FILENAME} in {out} (File too large)"), err[-3:]
    assert "Traceback" not in proc.stderr and "resume: true" in err[-1]
    assert (out / CONFIG_FILENAME).stat().st_size < limit and (out / PYTRIO_STATE_FILENAME).stat().st_size < limit
    data = (out / METRICS_FILENAME).read_bytes()
    rows, skipped = read_metrics_file(out / METRICS_FILENAME)
    assert skipped == 0 and data.endswith(b"\n") == bool(data)  # whole rows only: the failing one is gone
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)) and len(rows) < 4
    state = load_loop_state(out)  # each row is logged before its step's checkpoint: the failing step has none
    kept = f"the checkpoint of step {state.step} is kept" if state else "no checkpoint was saved yet"
    assert kept in err[-1] and (state.step if state else 0) == len(rows)


def test_service_lost_tells_an_outage_or_a_restart_from_a_failed_call():
    from pytrio.errors.control import ControlAPIError
    from pytrio.errors.event import EventFailedError

    from trl_grpo_ext.pytrio.connection import service_lost

    assert service_lost(ControlAPIError("Connection failed", retryable=True))  # no HTTP answer at all
    assert service_lost(ControlAPIError("unavailable", status_code=503, code="server_stopping"))
    assert service_lost(ControlAPIError("gone", status_code=404, code="training_run_not_found"))  # restarted
    assert not service_lost(ControlAPIError("bug", status_code=500, code="internal_error"))  # the call failed
    assert not service_lost(ControlAPIError("no", status_code=404, code="checkpoint_not_found"))
    assert not service_lost(ControlAPIError("key", status_code=401, code="unauthorized"))
    assert not service_lost(EventFailedError("ev", "insufficient_storage", "no space left"))
    assert not service_lost(RuntimeError("Connection failed"))


def test_service_outage_reports_each_retry_and_spends_its_budget_once(caplog):
    from trl_grpo_ext.pytrio.connection import ServiceOutage

    now = [0.0]
    answers = iter([False, False, True, False, False, False, False, False, False])
    outage = ServiceOutage("http://h:1", 20, probe=lambda url: next(answers), sleep=lambda s: now.__setitem__(0, now[0] + s),
                           clock=lambda: now[0])  # fmt: skip
    caplog.set_level(logging.INFO)
    assert outage.wait(RuntimeError("refused")) and now[0] == 1 + 2 + 4  # back off 1, 2, 4 s; answers on the 3rd
    assert outage.wait(RuntimeError("dropped again")) is False  # the same outage: its budget, its back-off
    assert now[0] == 20 and outage.attempts == 3 + 2  # 8 s, then the 5 s left
    lines = [r.getMessage() for r in caplog.records]
    assert sum("stopped answering" in line for line in lines) == 1 and "failed again (dropped again)" in lines[4]
    assert [line for line in lines if line.startswith("still no answer")][0].endswith("(retry 1; giving up at 20 s)")
    outage.over()  # a step completed: a later failure has the whole budget again
    assert outage.started is None and outage.elapsed() == 0
    assert ServiceOutage("http://h:1", 0, probe=lambda url: True).wait(RuntimeError("x")) is False
