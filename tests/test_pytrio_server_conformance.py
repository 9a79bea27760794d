"""Conformance: scripted clients that use the local PyTRIO server the way the public agentic RL chapters use the
hosted service (multi-turn tool calls parsed from sampled ``text``, a teacher's ``compute_logprobs``, custom losses
through ``forward_backward_custom``, PPO thresholds, ``grad_clip_norm``, resume from ``save_state``, micro-batches),
each over sockets with the real pytrio client on the tiny test model; and a vision GRPO step with image chunks on a
tiny Qwen3.5 image-text model. Numbers are compared in fp32."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
import torch
from conftest import build_tiny_model

trio = pytest.importorskip("pytrio")

from pytrio.errors.base import PyTrioError  # noqa: E402
from pytrio.errors.event import EventFailedError  # noqa: E402
from pytrio_versions import run_id  # noqa: E402

pytestmark = pytest.mark.slow

SEQUENCES = [[1, 5, 9, 14, 3, 7, 8, 11, 4], [1, 2, 3, 6, 10, 13], [1, 7, 7, 12, 5, 9, 20, 21]]
PROMPT_LEN = 3  # the first PROMPT_LEN tokens of each sequence are its prompt


def test_the_client_is_one_the_server_supports():
    """The installed client is in the `pytrio` extra's range; in a cell that pins one (``TRL_GRPO_EXT_EXPECT_PYTRIO``,
    `make test-pytrio028`) it is that one, so the cell cannot run the newest client unnoticed."""
    import tomllib
    from importlib.metadata import version
    from pathlib import Path

    from packaging.requirements import Requirement

    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    (extra,) = [
        r for r in map(Requirement, pyproject["project"]["optional-dependencies"]["pytrio"]) if r.name == "pytrio"
    ]
    installed = version("pytrio")
    assert extra.specifier.contains(installed), (installed, str(extra))
    expected = os.environ.get("TRL_GRPO_EXT_EXPECT_PYTRIO")
    assert expected is None or installed == expected, (installed, expected)


def _client(server):
    """A service client of `server` (the `make_server` fixture pointed the process's client at the last one made)."""
    return trio.ServiceClient()


def _training_client(server, seed=3, rank=8):
    return _client(server).create_lora_training_client(base_model=server.model_alias, rank=rank, seed=seed)


def _grads(server, tc):
    params = server.engine.runs[run_id(tc)].params
    return {name: p.grad.detach().clone() for name, p in params if p.grad is not None}


def _params(server, tc):
    return {name: p.detach().clone() for name, p in server.engine.runs[run_id(tc)].params}


def _close(actual, expected, rtol=1e-4):
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * float(expected.abs().max()) + 1e-12)


def _current_logprobs(tc, sequences=SEQUENCES):
    """Per-target log-probs of the run's current weights (a `forward` without gradient), one array per sequence."""
    data = [
        trio.Datum(model_input=trio.ModelInput.from_ints(s[:-1]), loss_fn_inputs={"target_tokens": s[1:]})
        for s in sequences
    ]
    out = tc.forward(data, "cross_entropy").result()
    return [np.asarray(o["logprobs"].to_numpy(), dtype=np.float64) for o in out.loss_fn_outputs]


def _rl_data(sampler_logprobs, advantages, sequences=SEQUENCES):
    """RL datums as the chapters build them: prompt targets carry advantage 0, completion targets the group
    advantage; `sampler_logprobs` are the log-probs the sampler reported."""
    data = []
    for seq, lp, adv in zip(sequences, sampler_logprobs, advantages, strict=True):
        n = len(seq) - 1
        a = np.full(n, adv, dtype=np.float32)
        a[: PROMPT_LEN - 1] = 0.0
        inputs = {
            "target_tokens": np.array(seq[1:], dtype=np.int64),
            "logprobs": np.asarray(lp, dtype=np.float32),
            "advantages": a,
        }
        data.append(trio.Datum(model_input=trio.ModelInput.from_ints(seq[:-1]), loss_fn_inputs=inputs))
    return data


def test_agentopsd_names_each_policy_snapshot_by_the_sampling_clients_task_id(make_server):
    """09-AgentOPSD's train.py names each policy snapshot ``str(sampling_client.task_id)`` right after
    ``save_weights_and_get_sampling_client()``: pytrio 0.2.8's name of a sampling run's id, which 0.2.9 renamed
    ``sampling_run_cuid``. With 0.2.8 (the chapters' pin; `make test-pytrio028`) it is the server's sampling run of
    that snapshot, which samples; with 0.2.9 the attribute is gone, so that chapter needs 0.2.8."""
    from importlib.metadata import version

    from packaging.version import Version

    server = make_server(bf16=False)
    sampler = _training_client(server).save_weights_and_get_sampling_client()
    if Version(version("pytrio")) >= Version("0.2.9"):
        assert not hasattr(sampler, "task_id")
        return
    snapshot_id = str(sampler.task_id)  # as 09-AgentOPSD/train.py reads it
    assert server.registry.sampling_runs[snapshot_id].source_checkpoint_uri.startswith("trio://")
    params = trio.SamplingParams(max_tokens=4, seed=0)
    assert len(sampler.sample(trio.ModelInput.from_ints(SEQUENCES[0]), 2, params).result().sequences) == 2


# --------------------------------------------------------------------------------------------------------------
# (a) multi-turn tool loop, parsed from sampled text (search-r1 / retool style)

TOOL_CALL = re.compile(
    r"<tool_call>\s*<function=search>\s*<parameter=query>\s*(.*?)\s*</parameter>\s*</function>\s*</tool_call>",
    re.DOTALL,
)


def parse_turn(text):
    """A protocol parser as strict as the chapters': one call and nothing after ``</tool_call>``, else an answer
    (no call at all) or invalid."""
    calls = list(TOOL_CALL.finditer(text))
    if not calls:
        return ("invalid", None) if "<tool_call>" in text else ("answer", text.strip())
    if len(calls) != 1 or text[calls[0].end() :].strip():
        return "invalid", None
    return "tool", calls[0].group(1).strip()


def test_multi_turn_tool_loop_parses_calls_from_text(make_server):
    server = make_server(bf16=False)
    service = _client(server)
    tok = service.create_sampling_client(base_model=server.model_alias).get_tokenizer()
    eos = tok.eos_token_id
    chat = lambda messages, gen=True: tok.apply_chat_template(  # noqa: E731
        messages, tokenize=True, add_generation_prompt=gen, return_dict=False
    )
    call = "<tool_call>\n<function=search>\n<parameter=query>\n3 + 4\n</parameter>\n</function>\n</tool_call>"
    messages = [{"role": "user", "content": "What is 3 + 4?"}]
    prompt1 = list(chat(messages))
    completion1 = tok.encode(call, add_special_tokens=False) + [eos]
    observation = list(chat([*messages, {"role": "assistant", "content": call}, {"role": "tool", "content": "7"}]))
    observation = observation[len(prompt1) + len(completion1) :]
    prompt2 = prompt1 + completion1 + observation
    completion2 = tok.encode("Answer: 7", add_special_tokens=False) + [eos]
    # the model is first taught the format (the chapters start from a model that knows it)
    tc = _training_client(server, rank=32)
    sft = []
    for prompt, completion in ((prompt1, completion1), (prompt2, completion2)):
        full = prompt + completion
        weights = [0.0] * (len(prompt) - 1) + [1.0] * len(completion)
        sft.append(
            trio.Datum(
                model_input=trio.ModelInput.from_ints(full[:-1]),
                loss_fn_inputs={"target_tokens": full[1:], "weights": weights},
            )
        )
    adam = trio.AdamParams(learning_rate=1e-2)
    for _ in range(80):
        tc.forward_backward(sft, "cross_entropy").result()
        tc.optim_step(adam).result()
    sampler = tc.save_weights_and_get_sampling_client()
    params = trio.SamplingParams(max_tokens=len(completion1) + 8, temperature=1.0, seed=0, stop=[tok.eos_token])
    # turn 1: a tool call, its text ending at </tool_call> though the tokens end on EOS
    first = sampler.sample(trio.ModelInput.from_ints(prompt1), num_samples=1, sampling_params=params).result()
    seq = first.sequences[0]
    assert seq.tokens == completion1 and seq.stop_reason == "stop"
    assert seq.text == call and not any(s in seq.text for s in tok.all_special_tokens)
    kind, query = parse_turn(seq.text)
    assert (kind, query) == ("tool", "3 + 4")
    assert parse_turn(tok.decode(seq.tokens)) == ("invalid", None)  # what a text with the stop token would give
    # turn 2: the next prompt continues from the sampled tokens plus the tool observation; the answer ends the loop
    next_prompt = prompt1 + list(seq.tokens) + observation
    second = sampler.sample(trio.ModelInput.from_ints(next_prompt), num_samples=1, sampling_params=params).result()
    answer = second.sequences[0]
    assert answer.tokens == completion2 and answer.stop_reason == "stop"
    assert parse_turn(answer.text) == ("answer", "Answer: 7")
    # a multi-turn trajectory trains as one datum whose sampled tokens carry their sampler log-probs
    full = next_prompt + list(answer.tokens)
    lp = np.zeros(len(full) - 1, dtype=np.float32)
    adv = np.zeros(len(full) - 1, dtype=np.float32)
    for start, s in ((len(prompt1), seq), (len(next_prompt), answer)):
        lp[start - 1 : start - 1 + len(s.tokens)] = s.logprobs
        adv[start - 1 : start - 1 + len(s.tokens)] = 1.0
    datum = trio.Datum(
        model_input=trio.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={"target_tokens": full[1:], "logprobs": lp, "advantages": adv},
    )
    out = tc.forward_backward([datum], "importance_sampling").result()
    got = out.loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_allclose(got[adv != 0], lp[adv != 0], atol=1e-4)  # the trainer sees what the sampler sampled


# --------------------------------------------------------------------------------------------------------------
# (b) on-policy distillation: the teacher's compute_logprobs on prompt + completion


@pytest.fixture(scope="module")
def teacher_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("conf-teacher") / "tiny-teacher", seed=1)


def _reference_logprobs(path, tokens):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None]).squeeze(-1)


def test_teacher_scores_student_samples_for_distillation(make_server, teacher_path):
    server = make_server(sampling_models=(teacher_path,), bf16=False)
    service = _client(server)
    student = _training_client(server)
    teacher = service.create_sampling_client(base_model=teacher_path)
    sampler = student.save_weights_and_get_sampling_client()
    prompt = [1, 5, 9, 14, 3]
    reply = sampler.sample(
        trio.ModelInput.from_ints(prompt), num_samples=3, sampling_params=trio.SamplingParams(max_tokens=6, seed=4)
    ).result()
    data = []
    for seq in reply.sequences:
        full = prompt + list(seq.tokens)
        teacher_lp = teacher.compute_logprobs(trio.ModelInput.from_ints(full)).result()
        assert teacher_lp[0] is None and len(teacher_lp) == len(full)
        expected = _reference_logprobs(teacher_path, full)
        torch.testing.assert_close(torch.tensor(teacher_lp[1:]), expected, rtol=0, atol=1e-4)
        # the student's own numbers differ from the teacher's: the reverse KL is a signal
        completion_teacher = np.array(teacher_lp[len(prompt) :], dtype=np.float32)
        student_lp = np.array(seq.logprobs, dtype=np.float32)
        assert np.abs(completion_teacher - student_lp).max() > 0.1
        adv = np.zeros(len(full) - 1, dtype=np.float32)
        adv[len(prompt) - 1 :] = completion_teacher - student_lp  # advantage = -(log p_student - log p_teacher)
        lp = np.zeros(len(full) - 1, dtype=np.float32)
        lp[len(prompt) - 1 :] = student_lp
        data.append(
            trio.Datum(
                model_input=trio.ModelInput.from_ints(full[:-1]),
                loss_fn_inputs={"target_tokens": full[1:], "logprobs": lp, "advantages": adv},
            )
        )
    out = student.forward_backward(data, "importance_sampling").result()
    assert np.isfinite(out.metrics["loss_sum"])
    assert _grads(server, student)
    step = student.optim_step(trio.AdamParams(learning_rate=1e-3)).result()
    assert step.metrics["grad_norm"] > 0


# --------------------------------------------------------------------------------------------------------------
# (c) CISPO / DAPO / GSPO written as custom losses (forward_backward_custom)


def cispo_sum(data, logprobs, config):
    """CISPO: -sg(clip(r, lo, hi)) * A * logp, summed over tokens."""
    total = torch.zeros(())
    for datum, lp in zip(data, logprobs, strict=True):
        old = torch.tensor(datum.loss_fn_inputs["logprobs"].to_numpy())
        adv = torch.tensor(datum.loss_fn_inputs["advantages"].to_numpy())
        ratio = torch.exp(lp - old).clamp(config["low"], config["high"]).detach()
        total = total - (ratio * adv * lp).sum()
    return total, {}


def dapo_sum(data, logprobs, config):
    """DAPO's clip-higher PPO token loss, summed over tokens (the token mean is the server's normalisation)."""
    total = torch.zeros(())
    for datum, lp in zip(data, logprobs, strict=True):
        old = torch.tensor(datum.loss_fn_inputs["logprobs"].to_numpy())
        adv = torch.tensor(datum.loss_fn_inputs["advantages"].to_numpy())
        ratio = torch.exp(lp - old)
        clipped = ratio.clamp(1 - config["eps_low"], 1 + config["eps_high"])
        total = total - torch.minimum(ratio * adv, clipped * adv).sum()
    return total, {}


def gspo(data, logprobs, config):
    """GSPO: the sequence ratio exp(mean_t(logp - old)) over completion tokens, clipped PPO-style per sequence,
    averaged over sequences."""
    losses = []
    for datum, lp in zip(data, logprobs, strict=True):
        old = torch.tensor(datum.loss_fn_inputs["logprobs"].to_numpy())
        adv = torch.tensor(datum.loss_fn_inputs["advantages"].to_numpy())
        mask = adv != 0
        ratio = torch.exp((lp - old)[mask].mean())
        a = adv[mask][0]
        clipped = ratio.clamp(1 - config["eps"], 1 + config["eps"])
        losses.append(-torch.minimum(ratio * a, clipped * a))
    return torch.stack(losses).mean(), {"gspo/ratio": 1.0}


def _custom_vs_builtin(make_server, custom, config, builtin, builtin_config, data_for):
    server = make_server(bf16=False)
    a, b = _training_client(server, seed=7), _training_client(server, seed=7)
    current = _current_logprobs(a)
    data = data_for(current)
    a.forward_backward_custom(data, custom, config).result()
    b.forward_backward(data, builtin, loss_fn_config=builtin_config).result()
    return _grads(server, a), _grads(server, b), data


def test_cispo_as_a_custom_loss_matches_the_builtin_cispo(make_server):
    rng = np.random.default_rng(1)

    def data_for(current):  # sampler log-probs near the current ones, some ratios past the bounds
        return _rl_data([c + rng.normal(0, 0.4, len(c)) for c in current], [1.5, -0.8, 0.6])

    config = {"low": 0.9, "high": 1.1}
    custom, builtin, data = _custom_vs_builtin(
        make_server,
        cispo_sum,
        config,
        "cispo",
        {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
        data_for,
    )
    assert custom.keys() == builtin.keys() and custom
    # the builtin divides the summed loss by every valid target, the custom path (a cross_entropy event whose
    # weights are -dL/dlogp) by the targets with a non-zero weight: here those with a non-zero advantage
    n_adv = sum(int((d.loss_fn_inputs["advantages"].to_numpy() != 0).sum()) for d in data)
    n_all = sum(len(s) - 1 for s in SEQUENCES)
    assert n_adv < n_all
    for name, grad in builtin.items():
        _close(custom[name] * n_adv, grad * n_all)


def test_dapo_clip_higher_as_a_custom_loss_matches_ppo_with_thresholds(make_server):
    rng = np.random.default_rng(2)
    config = {"eps_low": 0.2, "eps_high": 0.28}
    kept = {}

    def data_for(current):
        data = _rl_data([c + rng.normal(0, 0.4, len(c)) for c in current], [1.0, -1.2, 0.5])
        # count the tokens whose loss has a gradient (ratio not clipped away): the custom path's denominator
        n_grad = n_all = 0
        for d, c in zip(data, current, strict=True):
            adv = d.loss_fn_inputs["advantages"].to_numpy()
            ratio = np.exp(c - d.loss_fn_inputs["logprobs"].to_numpy())
            clipped_away = np.where(adv > 0, ratio > 1 + config["eps_high"], ratio < 1 - config["eps_low"])
            n_grad += int(((adv != 0) & ~clipped_away).sum())
            n_all += len(adv)
        kept.update(n_grad=n_grad, n_all=n_all)
        return data

    custom, builtin, _ = _custom_vs_builtin(
        make_server,
        dapo_sum,
        config,
        "ppo",
        {"clip_low_threshold": 0.8, "clip_high_threshold": 1.28},
        data_for,
    )
    assert 0 < kept["n_grad"] < kept["n_all"]
    # the same summed loss; the builtin divides by every valid target, the custom path (a cross_entropy event whose
    # weights are -dL/dlogp) by the targets with a non-zero weight
    for name, grad in builtin.items():
        _close(custom[name] * kept["n_grad"], grad * kept["n_all"])


def test_gspo_as_a_custom_loss_on_policy_matches_importance_sampling(make_server):
    advantages = [1.0, -0.5, 2.0]

    def data_for(current):  # on policy: the sampler's log-probs are the trainer's, every sequence ratio is 1
        return _rl_data(current, advantages)

    server = make_server(bf16=False)
    a, b = _training_client(server, seed=7), _training_client(server, seed=7)
    data = data_for(_current_logprobs(a))
    out = a.forward_backward_custom(data, gspo, {"eps": 3e-4}).result()
    assert out.metrics["gspo/ratio"] == 1.0
    # at ratio 1 GSPO's gradient per token is -A_i / (|completion_i| * n_sequences): importance sampling with that
    # advantage per token (all completion tokens have a gradient, so both paths divide by the same count)
    scaled = []
    for d in data:
        adv = d.loss_fn_inputs["advantages"].to_numpy().copy()
        adv[adv != 0] /= (adv != 0).sum() * len(data)
        scaled.append(trio.Datum(model_input=d.model_input, loss_fn_inputs={**d.loss_fn_inputs, "advantages": adv}))
    b.forward_backward(scaled, "importance_sampling").result()
    custom, builtin = _grads(server, a), _grads(server, b)
    # importance sampling counts every valid target, the custom path those with a gradient (the completions)
    n_completion = sum(int((d.loss_fn_inputs["advantages"].to_numpy() != 0).sum()) for d in data)
    n_all = sum(len(s) - 1 for s in SEQUENCES)
    for name, grad in builtin.items():
        _close(custom[name] * n_completion, grad * n_all)


# --------------------------------------------------------------------------------------------------------------
# (d) PPO with loss_fn_config clip thresholds (retool / alfworld / AgentOPSD)


def test_ppo_loss_fn_config_thresholds_set_the_clipped_loss(make_server):
    server = make_server(bf16=False)
    tc = _training_client(server)
    rng = np.random.default_rng(3)
    current = _current_logprobs(tc)
    data = _rl_data([c + rng.normal(0, 0.4, len(c)) for c in current], [1.0, -1.0, 0.7])
    results = {}
    for lo, hi in ((0.8, 1.2), (0.95, 1.05), (0.5, 3.0)):
        out = tc.forward(data, "ppo", loss_fn_config={"clip_low_threshold": lo, "clip_high_threshold": hi}).result()
        total = 0.0
        for d, o in zip(data, out.loss_fn_outputs, strict=True):
            lp = o["logprobs"].to_numpy().astype(np.float64)
            old = d.loss_fn_inputs["logprobs"].to_numpy().astype(np.float64)
            adv = d.loss_fn_inputs["advantages"].to_numpy().astype(np.float64)
            ratio = np.exp(lp - old)
            expected = -np.minimum(ratio * adv, np.clip(ratio, lo, hi) * adv)
            np.testing.assert_allclose(o["elementwise_loss"].to_numpy(), expected, rtol=1e-5, atol=1e-6)
            total += expected.sum()
        assert out.metrics["loss_sum"] == pytest.approx(total, rel=1e-5)
        results[(lo, hi)] = out.metrics["loss_sum"]
    assert len({round(v, 6) for v in results.values()}) == 3  # the thresholds matter for this data
    with pytest.raises(EventFailedError, match="invalid_loss_config|clip"):
        tc.forward(data, "ppo", loss_fn_config={"clip_low_threshold": 1.2, "clip_high_threshold": 0.8}).result()


# --------------------------------------------------------------------------------------------------------------
# (e) AdamParams(grad_clip_norm=...)


def test_grad_clip_norm_reports_the_norm_and_shrinks_the_update(make_server):
    server = make_server(bf16=False)
    free, clipped = _training_client(server, seed=5), _training_client(server, seed=5)
    rng = np.random.default_rng(4)
    data = _rl_data([c + rng.normal(0, 0.2, len(c)) for c in _current_logprobs(free)], [1.0, -1.0, 0.5])
    lr, eps = 1e-2, 1.0  # an eps of the gradients' order keeps Adam's first step proportional to the gradient
    results, before, grads = {}, {}, {}
    for name, tc, clip in (("free", free, 0.0), ("clipped", clipped, None)):
        tc.forward_backward(data, "importance_sampling").result()
        grads[name] = _grads(server, tc)
        norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads[name].values())))
        if clip is None:
            clip = norm / 4
        before[name] = _params(server, tc)
        results[name] = tc.optim_step(trio.AdamParams(learning_rate=lr, eps=eps, grad_clip_norm=clip)).result()
        assert results[name].metrics["grad_norm"] == pytest.approx(norm, rel=1e-5)  # before clipping
    scale = 0.25
    after_free, after_clipped = _params(server, free), _params(server, clipped)
    for name, g in grads["free"].items():
        g = g.double()
        step_free = (before["free"][name] - after_free[name]).double()
        step_clipped = (before["clipped"][name] - after_clipped[name]).double()
        # Adam's first step is lr * g / (|g| + eps), with g the gradient after clipping
        _close(step_free, lr * g / (g.abs() + eps), rtol=1e-3)
        _close(step_clipped, lr * scale * g / (scale * g.abs() + eps), rtol=1e-3)
    moved_free = sum(float((before["free"][n] - after_free[n]).norm()) for n in grads["free"])
    moved_clipped = sum(float((before["clipped"][n] - after_clipped[n]).norm()) for n in grads["free"])
    assert 0 < moved_clipped < 0.5 * moved_free


# --------------------------------------------------------------------------------------------------------------
# (f) save_state, then resume


def test_resume_from_save_state_gives_identical_next_steps(make_server):
    server = make_server(bf16=False)
    service = _client(server)
    tc = _training_client(server, seed=9)
    rng = np.random.default_rng(5)
    data = _rl_data([c + rng.normal(0, 0.3, len(c)) for c in _current_logprobs(tc)], [1.0, -0.6, 0.4])
    adam = trio.AdamParams(learning_rate=5e-3, weight_decay=0.01, grad_clip_norm=1.0)
    for _ in range(2):
        tc.forward_backward(data, "ppo").result()
        tc.optim_step(adam).result()
    path = tc.save_state("mid").result().path

    def next_steps(client):
        out = []
        for _ in range(2):
            fb = client.forward_backward(data, "ppo").result()
            step = client.optim_step(adam).result()
            out.append((fb.metrics["loss_sum"], step.metrics["grad_norm"]))
        return out, _current_logprobs(client)

    expected_steps, expected_lp = next_steps(tc)
    resumed = service.create_training_client_from_state_with_optimizer(path)
    got_steps, got_lp = next_steps(resumed)
    assert got_steps == expected_steps
    for got, exp in zip(got_lp, expected_lp, strict=True):
        np.testing.assert_array_equal(got, exp)
    # weights only (what search-r1 resumes with): the next forward is the same, the optimizer starts fresh
    weights_only = service.create_training_client_from_state(path)
    resumed_again = service.create_training_client_from_state_with_optimizer(path)
    first = weights_only.forward_backward(data, "ppo").result()
    assert first.metrics["loss_sum"] == expected_steps[0][0]
    resumed_again.forward_backward(data, "ppo").result()
    fresh = weights_only.optim_step(adam).result()
    restored = resumed_again.optim_step(adam).result()
    assert fresh.metrics["grad_norm"] == restored.metrics["grad_norm"] == expected_steps[0][1]
    diff = [
        float((a - b).abs().max())
        for (a, b) in zip(_params(server, weights_only).values(), _params(server, resumed_again).values(), strict=True)
    ]
    assert max(diff) > 0  # Adam moments matter: a weights-only resume does not step like a full one


# --------------------------------------------------------------------------------------------------------------
# (g) one logical batch split into micro-batches


def test_a_logical_batch_split_by_max_batch_size_gives_the_same_gradient(make_server, tmp_path):
    whole_server = make_server(bf16=False)
    split_server = make_server(bf16=False, max_batch_size=1)
    group = [*SEQUENCES, [1, 4, 4, 9, 2, 2, 5]]
    grads = {}
    for name, server in (("whole", whole_server), ("split", split_server)):
        server.configure_client(home=str(tmp_path / f"home-{name}"), retry_initial_delay_seconds=0.05)
        tc = _training_client(server, seed=11)
        current = _current_logprobs(tc, group)
        noise = np.random.default_rng(6)
        data = _rl_data([c + noise.normal(0, 0.3, len(c)) for c in current], [1.0, -1.0, 0.5, -0.5], group)
        out = tc.forward_backward(data, "ppo", loss_fn_config={"clip_low_threshold": 0.8, "clip_high_threshold": 1.28})
        out = out.result()
        assert len(out.loss_fn_outputs) == len(group)
        grads[name] = (_grads(server, tc), out.metrics["loss_sum"])
    (whole, whole_loss), (split, split_loss) = grads["whole"], grads["split"]
    assert split_loss == pytest.approx(whole_loss, rel=1e-5)
    assert whole.keys() == split.keys() and whole
    for name, grad in whole.items():
        _close(split[name], grad)


# --------------------------------------------------------------------------------------------------------------
# (h) vision GRPO (09-vision-grpo style): image chunks split at the rendered prompt's image placeholder

IMAGE_PAD_TOKEN = "<|image_pad|>"
VISION_PROMPT = (
    "<|im_start|>user\nWhat is 3 + 4? <|vision_start|><|image_pad|><|vision_end|>\n"
    "Put your final answer within \\boxed{}.<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def vision_server(tiny_vision_model_path, tmp_path_factory):
    from trl_grpo_ext.pytrio_server import LocalPyTrioServer, ServerConfig
    from trl_grpo_ext.pytrio_server.engine import ModelEngine

    tmp = tmp_path_factory.mktemp("vision-server")
    engine = ModelEngine(tiny_vision_model_path, bf16=False)
    server = LocalPyTrioServer(
        ServerConfig(model=tiny_vision_model_path, storage_dir=str(tmp / "storage")), engine=engine
    ).start()
    yield server
    server.stop()


def _encode_image(image, image_processor, expected_tokens=None):
    """The image as a PyTRIO chunk with the client's own count of its tokens (09-vision-grpo's `encode_image`)."""
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    patches = image_processor.get_number_of_image_patches(image.height, image.width, images_kwargs={})
    counted = patches // int(image_processor.merge_size) ** 2
    return trio.ImageChunk(data=buffer.getvalue(), format="png", expected_tokens=expected_tokens or counted)


def _vision_prompt_chunks(tokenizer, image_processor, image, expected_tokens=None):
    before_image, after_image = VISION_PROMPT.split(IMAGE_PAD_TOKEN)
    return [
        trio.types.EncodedTextChunk(tokens=tokenizer.encode(before_image, add_special_tokens=False)),
        _encode_image(image, image_processor, expected_tokens),
        trio.types.EncodedTextChunk(tokens=tokenizer.encode(after_image, add_special_tokens=False)),
    ]


def test_vision_grpo_step_samples_and_trains_on_image_prompts(vision_server, tiny_vision_model_path, tmp_path):
    from PIL import Image
    from transformers import AutoImageProcessor

    vision_server.configure_client(home=str(tmp_path / "trio-home"), retry_initial_delay_seconds=0.05)
    tc = _training_client(vision_server)
    tokenizer = tc.get_tokenizer()
    image_processor = AutoImageProcessor.from_pretrained(tiny_vision_model_path, backend="pil")
    prompt_chunks = _vision_prompt_chunks(tokenizer, image_processor, Image.new("RGB", (20, 28), (10, 200, 30)))
    prompt = trio.ModelInput(chunks=prompt_chunks)
    prompt_length = len(prompt)
    sampler = tc.save_weights_and_get_sampling_client()
    params = trio.SamplingParams(max_tokens=6, temperature=1.0, seed=11, stop="<|im_end|>")
    response = sampler.sample(prompt=prompt, num_samples=4, sampling_params=params, return_text=True).result()
    assert response.input_tokens == prompt_length
    assert len(response.sequences) == 4 and all(len(s.tokens) == len(s.logprobs) > 0 for s in response.sequences)

    rewards = [float(i % 2) for i in range(4)]
    mean = sum(rewards) / len(rewards)
    datums = []
    for sequence, reward in zip(response.sequences, rewards, strict=True):
        tokens, logprobs = list(sequence.tokens), [float(v) for v in sequence.logprobs]
        observation_length = prompt_length - 1
        datums.append(
            trio.Datum(
                model_input=trio.ModelInput(chunks=[*prompt_chunks, trio.types.EncodedTextChunk(tokens=tokens[:-1])]),
                loss_fn_inputs={
                    "target_tokens": np.asarray([0] * observation_length + tokens, dtype=np.int64),
                    "logprobs": np.asarray([0.0] * observation_length + logprobs, dtype=np.float32),
                    "advantages": np.asarray(
                        [0.0] * observation_length + [reward - mean] * len(tokens), dtype=np.float32
                    ),
                },
            )
        )
    result = tc.forward_backward(datums, loss_fn="importance_sampling").result()
    assert all(np.isfinite(float(v)) for v in result.metrics.values())
    grads = _grads(vision_server, tc)
    assert grads and all(torch.isfinite(g).all() for g in grads.values())
    assert any(float(g.abs().max()) > 0 for g in grads.values())
    # on-policy: the trainer's log-probs of the completion are the sampler's (same weights, same image)
    for out, sequence in zip(result.loss_fn_outputs, response.sequences, strict=True):
        trained = np.asarray(out["logprobs"].to_numpy(), dtype=np.float64)
        assert len(trained) == prompt_length - 1 + len(sequence.tokens)
        np.testing.assert_allclose(trained[prompt_length - 1 :], sequence.logprobs, rtol=0, atol=1e-4)
    tc.optim_step(trio.AdamParams(learning_rate=1e-3)).result()

    # a client that counts the image's tokens differently is told so, for sampling and training alike
    wrong = _vision_prompt_chunks(tokenizer, image_processor, Image.new("RGB", (20, 28)), expected_tokens=5)
    with pytest.raises(PyTrioError, match="expected_tokens is 5, but the model's processor makes 8") as error:
        sampler.sample(prompt=trio.ModelInput(chunks=wrong), num_samples=1, sampling_params=params).result()
    assert error.value.status_code == 400
    garbage = [wrong[0], trio.ImageChunk(data=b"\x89PNG\r\n\x1a\n" + b"\0" * 40, format="png"), wrong[2]]
    with pytest.raises(PyTrioError, match="cannot decode the png image") as error:
        sampler.sample(prompt=trio.ModelInput(chunks=garbage), num_samples=1, sampling_params=params).result()
    assert error.value.status_code == 400
    datum = trio.Datum(
        model_input=trio.ModelInput(chunks=wrong),
        loss_fn_inputs={"target_tokens": np.zeros(len(trio.ModelInput(chunks=wrong)), dtype=np.int64)},
    )
    with pytest.raises(EventFailedError, match="expected_tokens is 5"):
        tc.forward_backward([datum], loss_fn="cross_entropy").result()


def test_images_sent_to_a_text_only_server_are_refused(make_server):
    import io

    from PIL import Image

    server = make_server(bf16=False)
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buffer, format="PNG")
    prompt = trio.ModelInput(
        chunks=[
            trio.types.EncodedTextChunk(tokens=[1, 5, 9]),
            trio.ImageChunk(data=buffer.getvalue(), format="png", expected_tokens=1),
        ]
    )
    sampler = _client(server).create_sampling_client(base_model=server.model_alias)
    with pytest.raises(PyTrioError, match="has no vision tower") as error:
        sampler.sample(prompt=prompt, num_samples=1, sampling_params=trio.SamplingParams(max_tokens=2)).result()
    assert error.value.status_code == 400


def test_raw_prompt_logprobs_of_an_image_prompt_equal_the_engines(vision_server, tiny_vision_model_path):
    """pytrio 0.2.9's `compute_logprobs` refuses images in the client; a raw sample request asking for prompt
    log-probs (base64 image in JSON) gets them from the server, `null` at the image's placeholders."""
    import base64
    import io

    import httpx
    from PIL import Image

    engine = vision_server.engine
    buffer = io.BytesIO()
    Image.new("RGB", (20, 28), (90, 10, 200)).save(buffer, format="PNG")
    before, after = VISION_PROMPT.split(IMAGE_PAD_TOKEN)
    chunks = [
        {"type": "encoded_text", "tokens": engine.tokenizer.encode(before, add_special_tokens=False)},
        {"type": "image", "format": "png", "data": base64.b64encode(buffer.getvalue()).decode(), "expected_tokens": 8},
        {"type": "encoded_text", "tokens": engine.tokenizer.encode(after, add_special_tokens=False)},
    ]
    auth = {"Authorization": f"Bearer {vision_server.api_key}"}
    with httpx.Client(base_url=vision_server.base_url, timeout=60) as client:
        sid = client.post("/api/openapi/v1/service-sessions", json={"sdk_version": "x"}, headers=auth).json()
        run = client.post(
            f"/api/openapi/v1/service-sessions/{sid['service_session_cuid']}/sampling-runs",
            json={"base_model": vision_server.model_alias},
            headers=auth,
        ).json()
        token = {"Authorization": f"Bearer {run['actor_jwt']['token']}"}
        url = f"/actor/v1/sampling-runs/{run['sampling_run_cuid']}/sample"
        request = {
            "request_id": "r1",
            "prompt": {"chunks": chunks},
            "sampling_params": {"max_tokens": 1, "seed": 0},
            "return_prompt_logprobs": True,
        }
        answer = client.post(url, json=request, headers=token)
        bad = dict(request, prompt={"chunks": [chunks[0], dict(chunks[1], data="not base64!")]})
        refused = client.post(url, json=bad, headers=token)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    from pytrio.protocol.actor.model_input import WireModelInput

    vision = engine.vision_input(WireModelInput.model_validate({"chunks": chunks}).chunks)
    want, _ = engine.prompt_logprobs(None, vision.tokens, vision=vision)
    assert body["usage"]["input_tokens"] == len(vision.tokens)
    got = body["prompt_logprobs"]
    assert [v is None for v in got] == [v is None for v in want] and sum(v is None for v in got) == 9
    np.testing.assert_allclose([v for v in got if v is not None], [v for v in want if v is not None], atol=1e-6)
    assert refused.status_code == 400 and "base64" in refused.text
