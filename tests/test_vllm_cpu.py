"""TRL's vLLM generation on the CPU (``vllm-cpu``, `trl_grpo_ext.trl.vllm_cpu`), colocated and as a server, run for
real.

The engine tests need vLLM and skip without it; the "vllmcpu" cell (`make test-vllmcpu`, which sets
``TRL_GRPO_EXT_EXPECT_VLLM=1``) installs it, and there `test_vllm_is_installed_in_the_vllm_cell` fails instead of
letting them skip. Each engine run is a subprocess (tests/vllm_cpu_run.py): vLLM spawns its engine.
"""

import json
import math
import os
import socket
import subprocess
import sys
import time
import urllib.request
from importlib.util import find_spec
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import build_tiny_model

from trl_grpo_ext.experiments.launch.commands import log_tail
from trl_grpo_ext.trl.sampler_precision import SamplerPrecisionMixin
from trl_grpo_ext.trl.vllm_cpu import CPU_ENV_DEFAULTS, apply_cpu_env, colocated_vllm, lacks_weight_loaders

ROOT = Path(__file__).resolve().parents[1]
EMBEDDED_VLLM = ROOT / "recipes" / "gsm8k" / "embedded_vllm.yaml"
HAS_VLLM = find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(
    not HAS_VLLM, reason="vLLM is not installed here; `make test-vllmcpu` runs these with vllm-cpu"
)


def test_vllm_is_installed_in_the_vllm_cell():
    if os.environ.get("TRL_GRPO_EXT_EXPECT_VLLM") != "1":
        pytest.skip("not the vllmcpu cell (TRL_GRPO_EXT_EXPECT_VLLM unset)")
    from vllm.platforms import current_platform

    assert current_platform.is_cpu()


def test_the_cpu_settings_keep_what_the_user_set():
    assert apply_cpu_env({}) == CPU_ENV_DEFAULTS
    assert apply_cpu_env({"VLLM_CPU_KVCACHE_SPACE": "4"}) == {"VLLM_CPU_KVCACHE_SPACE": "4"}


def test_colocate_mode_and_missing_weight_loaders_are_detected():
    class Args:
        use_vllm, vllm_mode = True, "colocate"

    assert colocated_vllm(Args())
    Args.vllm_mode = "server"
    assert not colocated_vllm(Args())
    assert not colocated_vllm(None)
    layer = torch.nn.Linear(2, 2)
    assert lacks_weight_loaders(layer)
    for param in layer.parameters():
        param.weight_loader = None
    assert not lacks_weight_loaders(layer)


@pytest.mark.parametrize(
    ("accumulation", "steps_per_generation", "num_iterations", "loss_type", "rollout", "expected"),
    [
        (3, 3, 1, "dapo", False, True),  # the recipes: one generation batch per optimizer step
        (6, 3, 1, "cispo", False, True),  # two generation batches per optimizer step, both with the same weights
        (3, 3, 2, "dapo", False, False),  # each batch trained twice: the second pass is off-policy
        (4, 3, 1, "dapo", False, False),  # generation out of step with the optimizer
        (3, 3, 1, "vespo", False, False),  # vLLM's ratio inside vespo's gamma weights: TRL's
        (3, 3, 1, "dapo", True, False),  # a rollout_func's own log-probs: TRL's
    ],
)
def test_the_loss_corrects_vllm_only_where_every_batch_is_trained_with_the_weights_that_sampled_it(
    accumulation, steps_per_generation, num_iterations, loss_type, rollout, expected
):
    trainer = SimpleNamespace(
        use_vllm=True,
        vllm_importance_sampling_correction=True,
        args=SimpleNamespace(gradient_accumulation_steps=accumulation, steps_per_generation=steps_per_generation),
        num_iterations=num_iterations,
        loss_type=loss_type,
        rollout_func=(lambda *a: None) if rollout else None,
    )
    trainer._user_rollout = lambda: SamplerPrecisionMixin._user_rollout(trainer)
    assert SamplerPrecisionMixin._vllm_on_policy(trainer) is expected
    trainer.vllm_importance_sampling_correction = False  # no correction asked for: nothing to take over
    assert SamplerPrecisionMixin._vllm_on_policy(trainer) is False
    trainer.vllm_importance_sampling_correction, trainer.use_vllm = True, False  # transformers' generate samples
    assert SamplerPrecisionMixin._vllm_on_policy(trainer) is False


def test_the_run_summary_names_the_sampler_and_why():
    from trl_grpo_ext.trl.recipe import ENV_SAMPLER_REASON, run_sampler, sampler_choice

    config = "use_vllm: true set in the config"
    generate, vllm = SimpleNamespace(use_vllm=False), SimpleNamespace(use_vllm=True, vllm_mode="colocate")
    assert sampler_choice(generate, {}) == {"name": "generate", "reason": "use_vllm: false set in the config"}
    assert sampler_choice(vllm, {}) == {"name": "vllm", "vllm_mode": "colocate", "reason": config}
    # a launcher's reason for the sampler it chose (make train's measured default) ...
    env = {ENV_SAMPLER_REASON: "vllm:  measured faster\n here"}
    assert sampler_choice(vllm, env)["reason"] == "measured faster here"
    # ... is not claimed for another sampler that a command-line option chose instead
    assert (
        sampler_choice(generate, env)["reason"]
        == "use_vllm: false set in the config, overriding vllm (measured faster here)"
    )
    assert sampler_choice(vllm, {ENV_SAMPLER_REASON: " "})["reason"] == config  # empty: unset
    for bad in ("measured faster", "sglang: faster", "vllm: "):
        with pytest.raises(ValueError, match=ENV_SAMPLER_REASON):
            sampler_choice(vllm, {ENV_SAMPLER_REASON: bad})
    trainer = SimpleNamespace(vllm_weight_sync="reload_weights")
    assert run_sampler(trainer, vllm) == {
        "name": "vllm",
        "vllm_mode": "colocate",
        "reason": config,
        "weight_sync": "reload_weights",
    }


def test_a_malformed_sampler_reason_is_one_line_before_the_model_loads(tmp_path, monkeypatch, capsys):
    import importlib.util

    from trl_grpo_ext.trl.recipe import ENV_SAMPLER_REASON

    spec = importlib.util.spec_from_file_location("gsm8k_grpo_sampler", ROOT / "recipes" / "gsm8k_grpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setenv(ENV_SAMPLER_REASON, "faster")
    out = tmp_path / "run"
    assert module.main(["--config", str(EMBEDDED_VLLM), "--output_dir", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {ENV_SAMPLER_REASON}='faster' must read"), err
    assert not out.exists()


@pytest.fixture(scope="module")
def vllm_model(tmp_path_factory):
    return build_tiny_model(
        tmp_path_factory.mktemp("vllm-model"), hidden_size=128, num_attention_heads=2, num_key_value_heads=1
    )


def test_server_mode_off_cuda_is_detected():
    from trl_grpo_ext.trl.vllm_cpu import server_vllm_off_cuda

    def args(mode, device):
        return SimpleNamespace(use_vllm=True, vllm_mode=mode, device=torch.device(device))

    assert server_vllm_off_cuda(args("server", "cpu"))
    assert not server_vllm_off_cuda(args("server", "cuda"))  # TRL's NCCL transfer
    assert not server_vllm_off_cuda(args("colocate", "cpu"))
    assert not server_vllm_off_cuda(SimpleNamespace(use_vllm=False, vllm_mode="server", device=torch.device("cpu")))


@needs_vllm
def test_the_server_command_is_trls_through_vllms_api_server_module():
    from trl_grpo_ext.trl.vllm_cpu import serve_command

    command = serve_command(["--model", "some/model", "--port", "8123", "--max_model_len", "256"])
    assert command[1:5] == ["-m", "vllm.entrypoints.openai.api_server", "--model", "some/model"]
    assert command[command.index("--port") + 1] == "8123" and command[command.index("--max-model-len") + 1] == "256"
    assert "--logprobs-mode" in command and "processed_logprobs" in command  # TRL's settings kept


def _run(*args, cwd):
    # VLLM_CPU_CI_ENV: vLLM's own CPU CI setting, tracing the model without compiling it (and no warm-up run), which
    # saves a minute per engine on 2 cores; the embedded recipe's test below runs the compiled default.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "VLLM_CPU_CI_ENV": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "vllm_cpu_run.py"), *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


@needs_vllm
@pytest.mark.parametrize("adapters", ["full", "lora"])
def test_sampling_after_an_optimizer_step_uses_the_new_weights(vllm_model, tmp_path, adapters):
    result = _run("sync", vllm_model, tmp_path / "out", adapters, cwd=tmp_path)
    assert result["weight_sync"] == "reload_weights"  # the CPU backend's repacked weights have no loader
    assert result["enforce_eager"]  # built eager on the CPU (vllm_cpu.CPU_ENGINE_KWARGS): TRL's config can't say so
    assert result["thread_control"]  # torch.set_num_threads still works after vLLM's worker started
    # vLLM samples from the trainer's model: its log-prob of each sampled token is the trainer's, up to the
    # engines' numerical gap, before the step ...
    assert result["gap_before"] < 0.05
    # ... the step moves the log-probs far more than that gap, and lowers the sampled completions' log-probs ...
    assert result["step_moved"] > 10 * max(result["gap_before"], 0.01)
    assert result["mean_logp_after"] < result["mean_logp_before"]
    # ... before the sync vLLM still samples from the old weights (same seed: same completions, same log-probs) ...
    assert result["stale_same_samples"] and result["stale_gap_to_old"] < 0.05
    # ... and after the sync its log-probs are those of the updated trainer model.
    assert result["gap_after"] < 0.05


def _loss_forwards(result) -> dict[int, list[bool]]:
    """Per optimizer step (0-based), whether each log-prob forward kept a graph (the loss's) or not (no-grad)."""
    by_step = {}
    for forward in result["forwards"]:
        by_step.setdefault(forward["step"], []).append(forward["grad"])
    return by_step


@needs_vllm
@pytest.mark.parametrize("loss_type", ["cispo", "importance_sampling", "ppo"])
def test_two_grpo_steps_with_our_loss_and_vllms_correction_from_the_losss_forward(vllm_model, tmp_path, loss_type):
    """On-policy (each batch trained with the weights that sampled it), the correction is computed from the loss's
    own forward: TRL's extra no-grad forward of the batch does not run, and the correction is logged."""
    result = _run("train", loss_type, vllm_model, tmp_path / "out", cwd=tmp_path)
    assert result["weight_sync"] == "reload_weights"
    assert result["loss_corrects_vllm"]
    steps = result["steps"]
    assert [s["step"] for s in steps] == [1, 2]
    # one log-prob forward per step, the loss's (8 completions, one micro-batch); TRL would add a no-grad one
    assert _loss_forwards(result) == {0: [True], 1: [True]}
    for step in steps:
        assert math.isfinite(step["loss"])
        assert "sampling/importance_sampling_ratio/mean" not in step  # TRL's correction is off ...
        assert 0 < step["sampling/is_ratio_raw/min"] <= step["sampling/is_ratio_raw/max"]  # ... this one ran
        # the log-prob forwards of vLLM's completions ran on the prefix-sharing path (the chat template's header)
        assert step["prefix/shared_fraction"] > 0 and step["prefix/saved_tokens"] > 0
    assert 1 in result["synced_at_steps"]  # step 2's generation got step 1's weights
    # Step 2 sampled after step 1's update (learning rate 1e-2 on a tiny model): with stale weights in vLLM the
    # sampler-trainer KL would be the size of the update; synced, it stays the engines' numerical gap.
    assert steps[1]["sampling/sampler_kl"] < 0.01


@needs_vllm
def test_trls_own_vllm_correction_where_a_batch_is_trained_twice(vllm_model, tmp_path):
    """``num_iterations=2``: the second pass trains on a batch the first pass's update has moved away from, so the
    trainer's log-probs of the sampled policy come from TRL's no-grad forward, and TRL corrects as it does."""
    result = _run("train", "cispo+reuse", vllm_model, tmp_path / "out", cwd=tmp_path)
    assert not result["loss_corrects_vllm"]
    steps = result["steps"]
    assert [s["step"] for s in steps] == [1, 2]
    # step 1 generates: TRL's no-grad forward, then the loss's; step 2 reuses the batch: the loss's alone
    assert _loss_forwards(result) == {0: [False, True], 1: [True]}
    assert math.isfinite(steps[0]["sampling/importance_sampling_ratio/mean"])
    assert "sampling/is_ratio_raw/mean" not in steps[0]
    assert all(math.isfinite(step["loss"]) for step in steps)


@needs_vllm
def test_the_embedded_vllm_recipe_trains(tmp_path):
    """recipes/gsm8k/embedded_vllm.yaml as `make train SAMPLER=vllm` runs it (the embedded model, colocated vLLM
    compiled as TRL builds it, bf16 auto), shortened: 2 steps of 8 completions, no eval."""
    out = tmp_path / "run"
    overrides = ["--max_steps", "2", "--gradient_accumulation_steps", "1", "--max_completion_length", "16"]
    overrides += ["--eval_num_samples", "0", "--output_dir", str(out)]
    reason = "vllm: SAMPLER=vllm given to make train"  # as `make train SAMPLER=vllm` sets it
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TRL_GRPO_EXT_SAMPLER_REASON": reason}
    env.pop("VLLM_CPU_CI_ENV", None)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "gsm8k_grpo.py"), "--config", str(EMBEDDED_VLLM), *overrides],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "weight sync via reload_weights" in proc.stdout + proc.stderr
    assert "sampler: vLLM, colocate mode (SAMPLER=vllm given to make train)" in proc.stdout
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["sampler"] == {
        "name": "vllm",
        "vllm_mode": "colocate",
        "reason": "SAMPLER=vllm given to make train",
        "weight_sync": "reload_weights",
    }
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    for step in steps:
        assert math.isfinite(step["loss"])
        # bf16 vLLM against the trainer: a small gap, corrected from the loss's forward (the recipe is on-policy)
        assert 0 <= step["sampling/sampler_kl"] < 0.05
        assert math.isfinite(step["sampling/is_ratio_raw/mean"])
        assert "sampling/importance_sampling_ratio/mean" not in step


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_server(vllm_model, tmp_path_factory):
    """TRL's vLLM server for `vllm_model` on the CPU (`python -m trl_grpo_ext.trl.vllm_cpu`, `trl vllm-serve`'s
    command), its URL once it answers."""
    port = _free_port()
    log = tmp_path_factory.mktemp("vllm-server") / "server.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "VLLM_CPU_CI_ENV": "1"}
    command = [sys.executable, "-m", "trl_grpo_ext.trl.vllm_cpu", "--model", vllm_model, "--host", "127.0.0.1"]
    command += ["--port", str(port), "--max_model_len", "256", "--enforce_eager", "true"]
    with open(log, "w") as out:
        server = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            assert server.poll() is None, log_tail(log, 80)
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, log_tail(log, 80)
            time.sleep(2)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


@needs_vllm
def test_server_mode_sampling_after_an_optimizer_step_uses_the_new_weights(vllm_model, vllm_server, tmp_path):
    """TRL's server mode with the trainer on the CPU: the weights reach the server through its reload_weights."""
    result = _run("sync", vllm_model, tmp_path / "out", "full", "--server", vllm_server, cwd=tmp_path)
    assert result["weight_sync"] == "server reload_weights from a file"
    assert result["gap_before"] < 0.05
    assert result["step_moved"] > 10 * max(result["gap_before"], 0.01)
    assert result["stale_same_samples"] and result["stale_gap_to_old"] < 0.05  # not synced yet: the old weights
    assert result["gap_after"] < 0.05  # synced: the updated trainer model's log-probs


@needs_vllm
def test_server_mode_two_grpo_steps_with_our_loss_and_vllms_correction(vllm_model, vllm_server, tmp_path):
    result = _run("train", "cispo", vllm_model, tmp_path / "out", "--server", vllm_server, cwd=tmp_path)
    assert result["weight_sync"] == "server reload_weights from a file"
    assert result["loss_corrects_vllm"] and _loss_forwards(result) == {0: [True], 1: [True]}
    steps = result["steps"]
    assert [s["step"] for s in steps] == [1, 2]
    for step in steps:
        assert math.isfinite(step["loss"])
        assert 0 < step["sampling/is_ratio_raw/min"] <= step["sampling/is_ratio_raw/max"]
    assert 1 in result["synced_at_steps"]
    assert all(step["prefix/shared_fraction"] > 0 for step in steps)  # prefix sharing under the server too
    # synced after step 1 (learning rate 1e-2): step 2's sampler-trainer KL stays the engines' numerical gap
    assert steps[1]["sampling/sampler_kl"] < 0.01


@needs_vllm
def test_server_mode_asynchronous_steps_sample_ahead_and_hand_each_version_over_once(
    vllm_model, vllm_server, tmp_path
):
    """async_sampling with the vLLM server as the sampler: step k+1's batch drawn by the server while step k trains,
    each version of the weights reaching the server once, between two batches, the server's log-probs the old ones."""
    result = _run("train", "cispo+async", vllm_model, tmp_path / "out", "--server", vllm_server, cwd=tmp_path)
    steps = result["steps"]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert [s["sample/staleness_max"] for s in steps] == [0, 1, 1]
    assert result["synced_at_steps"] == [0, 1, 2]  # versions 0, 1, 2: each handed over once
    assert _loss_forwards(result) == {0: [True], 1: [True], 2: [True]}  # no extra forward for old log-probs
    for step in steps:
        assert math.isfinite(step["loss"])
        assert "sampling/importance_sampling_ratio/mean" not in step  # TRL's separate correction is off
    # step 3 trained a batch drawn by version 1 (learning rate 1e-2): its ratio moved off 1 and was logged
    assert step["sample/is_ratio/staleness_1"] != pytest.approx(1.0, abs=1e-4)
