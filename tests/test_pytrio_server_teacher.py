"""The local PyTRIO server serving a second base model for sampling and log-probs (a distillation teacher):
``create_sampling_client(base_model=teacher)`` + ``compute_logprobs`` over sockets with the pytrio client, the
teacher's numbers its own, training refused on it, per-key isolation and the shared memory budget kept."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_model

trio = pytest.importorskip("pytrio")

from pytrio_versions import run_id  # noqa: E402
from test_pytrio_server_isolation import API, Raw  # noqa: E402

from trl_grpo_ext.cli import pytrio_serve  # noqa: E402

pytestmark = pytest.mark.slow

KEY_A, KEY_B = "teacher-client-a-4f1d", "teacher-client-b-8e2c"
TOKENS = [1, 5, 9, 14, 3, 7, 11, 2, 8, 6]


@pytest.fixture(scope="module")
def teacher_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("teacher") / "tiny-teacher", seed=1)


def reference_logprobs(path, tokens):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None]).squeeze(-1)


def test_teacher_log_probs_over_sockets(make_server, teacher_path, tiny_model_path):
    server = make_server(sampling_models=(teacher_path,), api_keys=(KEY_A, KEY_B), bf16=False)
    a = trio.ServiceClient(api_key=KEY_A)
    teacher = a.create_sampling_client(base_model=teacher_path)
    got = teacher.compute_logprobs(trio.ModelInput.from_ints(TOKENS)).result()
    assert got[0] is None and len(got) == len(TOKENS)
    assert teacher.model_id == str(Path(teacher_path).resolve())  # the client loads the teacher's tokenizer from it
    expected = reference_logprobs(teacher_path, TOKENS)
    torch.testing.assert_close(torch.tensor(got[1:]), expected, rtol=0, atol=1e-4)
    # the student (the training model, on the shared engine of any precision) answers with its own weights
    student = a.create_sampling_client(base_model=server.model_alias)
    student_lp = torch.tensor(student.compute_logprobs(trio.ModelInput.from_ints(TOKENS)).result()[1:])
    torch.testing.assert_close(student_lp, reference_logprobs(tiny_model_path, TOKENS), atol=2e-2, rtol=0)
    assert (student_lp - expected).abs().max() > 0.1
    # by its folder name too; samples come from it
    by_name = a.create_sampling_client(base_model=Path(teacher_path).name)
    reply = by_name.sample(
        trio.ModelInput.from_ints(TOKENS[:4]), num_samples=2, sampling_params=trio.SamplingParams(max_tokens=4, seed=1)
    ).result()
    assert len(reply.sequences) == 2
    # training runs only on the main model; a checkpoint is an adapter of the main model
    with pytest.raises(Exception, match="sampling only"):
        a.create_lora_training_client(base_model=teacher_path, rank=4)
    tc = a.create_lora_training_client(base_model=server.model_alias, rank=4, seed=1)
    saved = tc.save_weights_for_sampler("s").result().path
    with pytest.raises(Exception, match="served without one"):
        a.create_sampling_client(base_model=teacher_path, model_path=saved)
    # listed with the served models, for sampling only
    assert a.get_supported_models() == [server.model_id, str(Path(teacher_path).resolve())]
    # per-key isolation: another client does not see A's teacher run
    b = Raw(server, KEY_B)
    rid = run_id(teacher)
    status, body = b.call("GET", f"{API}/sampling-runs/{rid}")
    missing = b.call("GET", f"{API}/sampling-runs/sr_0000000000000000")
    assert (status, body["code"]) == (missing[0], missing[1]["code"])
    assert status == 404


def test_teacher_requests_share_the_memory_budget(make_server, teacher_path):
    make_server(sampling_models=(teacher_path,), memory_budget_bytes=1024)
    teacher = trio.ServiceClient().create_sampling_client(base_model=teacher_path)
    with pytest.raises(Exception, match="memory|budget"):
        teacher.compute_logprobs(trio.ModelInput.from_ints(TOKENS)).result()


def test_unknown_model_and_repeated_flag(make_server, teacher_path):
    make_server(sampling_models=(f"Qwen/Qwen3-8B={teacher_path}",))
    # a script written for the hosted service names the teacher by the hosted id
    teacher = trio.ServiceClient().create_sampling_client(base_model="Qwen/Qwen3-8B")
    got = teacher.compute_logprobs(trio.ModelInput.from_ints(TOKENS)).result()
    assert len(got) == len(TOKENS) and teacher.model_id == str(Path(teacher_path).resolve())
    with pytest.raises(Exception, match="for sampling"):  # the error lists the sampling model's names
        trio.ServiceClient().create_sampling_client(base_model="no-such-model")
    parser = argparse.ArgumentParser()
    pytrio_serve.add_arguments(parser)
    config, _ = pytrio_serve._config(parser.parse_args(["--model", "embedded", "--model", teacher_path]))
    assert config.model == "embedded" and config.sampling_models == (teacher_path,)
