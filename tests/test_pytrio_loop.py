"""PyTRIO GRPO loop: pure parts (datums, advantages, rewards, config, resume bookkeeping) and, against the local
pytrio server on the tiny model, full GRPO runs per loss and mode, checkpoint + resume, and key hygiene."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from trl_grpo_ext.grpo.losses import group_advantages, policy_loss, token_level_mean
from trl_grpo_ext.pytrio.batch import build_train_batch
from trl_grpo_ext.pytrio.calls import PyTrioLoopError
from trl_grpo_ext.pytrio.config import PyTrioGRPOConfig
from trl_grpo_ext.pytrio.connection import redact
from trl_grpo_ext.pytrio.datums import build_datum, shifted_sequences
from trl_grpo_ext.pytrio.loss import builtin_loss_config, make_custom_loss
from trl_grpo_ext.pytrio.metrics import completion_metrics, reward_step_metrics
from trl_grpo_ext.pytrio.prompts import PromptStream
from trl_grpo_ext.pytrio.sampling import rollouts_from_response
from trl_grpo_ext.pytrio.scoring import advantages_for
from trl_grpo_ext.pytrio.types import Rollout, ScoredBatch, TokenRows
from trl_grpo_ext.runs import METRICS_FILENAME, run_metrics, truncate_metrics
from trl_grpo_ext.runs.loop_state import (
    LoopState,
    check_resumable,
    load_loop_state,
    pinned_settings,
    save_loop_state,
)

ROOT = Path(__file__).resolve().parents[1]


def cfg(**kw):
    base = dict(num_generations=4, per_device_train_batch_size=8, max_steps=2, reward_funcs=["boxed"])
    base.update(kw)
    return PyTrioGRPOConfig(**base)


# --------------------------------------------------------------------------------------------------------------
# datums
# --------------------------------------------------------------------------------------------------------------


def test_shifted_sequences_shift_and_padding():
    seq = shifted_sequences([10, 11, 12], [20, 21], [-0.5, -1.5], 2.0)
    assert seq["input"] == [10, 11, 12, 20]  # prompt + completion[:-1]
    assert seq["target_tokens"] == [0, 0, 20, 21]  # next token at every position, prompt part zero-padded
    assert seq["logprobs"] == [0.0, 0.0, -0.5, -1.5]
    assert seq["advantages"] == [0.0, 0.0, 2.0, 2.0]
    assert seq["mask"] == [0.0, 0.0, 1.0, 1.0]
    # the position holding the last prompt token predicts the first completion token
    assert seq["input"][2] == 12 and seq["target_tokens"][2] == 20


def test_single_token_prompt_and_completion():
    seq = shifted_sequences([5], [7], [-0.1], -1.0)
    assert seq["input"] == [5] and seq["target_tokens"] == [7] and seq["advantages"] == [-1.0]


@pytest.mark.parametrize(
    "prompt,tokens,logprobs,adv,match",
    [
        ([], [1], [-0.1], 1.0, "empty prompt"),
        ([1], [], [], 1.0, "empty completion"),
        ([1], [2, 3], [-0.1], 1.0, "1 logprobs for 2 tokens"),
        ([1], [2], [float("nan")], 1.0, "finite"),
        ([1], [2], [0.5], 1.0, "<= 0"),
        ([1], [-2], [-0.1], 1.0, "non-negative"),
        ([1], [2], [-0.1], float("inf"), "advantage"),
    ],
)
def test_shifted_sequences_rejects_bad_rollouts(prompt, tokens, logprobs, adv, match):
    with pytest.raises(ValueError, match=match):
        shifted_sequences(prompt, tokens, logprobs, adv)


def test_build_datum_passes_the_real_client_batch_planner():
    from pytrio.client.training_batch import plan_training_batch
    from pytrio.model.limits import TrainingLimits

    datums = [build_datum([1, 2, 3], [4, 5, 6], [-0.1, -0.2, -0.3], a) for a in (1.0, -1.0)]
    assert datums[0].loss_fn_inputs["target_tokens"].dtype == "int64"
    assert datums[0].loss_fn_inputs["advantages"].dtype == "float32"
    for loss in ("importance_sampling", "ppo", "cispo"):
        plan = plan_training_batch(
            datums, loss_fn=loss, auto_shift=False, limits=TrainingLimits(None, None, None), tokenizer_vocab_size=10
        )
        assert plan.totals.total_samples == 2
        assert plan.totals.total_advantage_tokens == 6  # completion tokens only


# --------------------------------------------------------------------------------------------------------------
# sampling replies
# --------------------------------------------------------------------------------------------------------------


def seq(tokens, logprobs, stop="stop"):
    return SimpleNamespace(tokens=tokens, logprobs=logprobs, stop_reason=stop)


def test_rollouts_from_response_checks_the_reply():
    ok = SimpleNamespace(sequences=[seq([1, 2], [-0.1, -0.2]), seq([], [], "stop")])
    rollouts = rollouts_from_response(ok, [9], 2)
    assert rollouts[0].completion_tokens == (1, 2) and rollouts[1].completion_tokens == ()
    with pytest.raises(PyTrioLoopError, match="asked for 3 completions, the service returned 2"):
        rollouts_from_response(ok, [9], 3)
    with pytest.raises(PyTrioLoopError, match="no sequences"):
        rollouts_from_response(SimpleNamespace(), [9], 2)
    bad = SimpleNamespace(sequences=[seq([1, 2], [-0.1]), seq([1], [-0.1])])
    with pytest.raises(PyTrioLoopError, match="completion 0 is malformed"):
        rollouts_from_response(bad, [9], 2)


# --------------------------------------------------------------------------------------------------------------
# rewards and advantages
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_are_the_shared_group_advantages(scale):
    totals = [1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0 + 1e-9, 2.0]
    c = cfg(scale_rewards=scale, degenerate_tol=1e-6)
    adv, degenerate = advantages_for(c, totals, [[t] for t in totals])
    expected, expected_deg = group_advantages(torch.tensor(totals), 4, scale, 1e-6, True)
    assert adv == pytest.approx(expected.tolist())
    assert degenerate == expected_deg.tolist() == [False, True]
    assert adv[4:] == [0.0] * 4
    if scale == "none":
        assert adv[:4] == pytest.approx([0.5, -0.5, -0.5, 0.5])  # mean-only, as the seed


def test_degenerate_reward_marks_groups_where_one_function_is_flat():
    c = cfg(reward_funcs=["boxed", "format"], degenerate_reward="boxed")
    per_func = [[1.0, 0.0], [1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [0.0, 0.0], [1.0, 0.0], [0.0, 0.0], [1.0, 0.0]]
    totals = [sum(r) for r in per_func]
    adv, degenerate = advantages_for(c, totals, per_func)
    assert degenerate == [True, False]
    assert adv[:4] == [0.0] * 4 and any(a != 0 for a in adv[4:])


def scored_batch(totals, advantages=None, degenerate=(False, False), lengths=None):
    n = len(totals)
    lengths = lengths or [2] * n
    rollouts = [
        Rollout((1, 2), tuple(range(3, 3 + k)), tuple([-0.5] * k), "length" if k == 3 else "stop") for k in lengths
    ]
    per_func = torch.tensor([[t] for t in totals])
    return ScoredBatch(
        [{"prompt": "p"}] * (n // 4),
        rollouts,
        per_func,
        per_func[:, 0],
        advantages if advantages is not None else [0.0] * n,
        list(degenerate),
    )


def test_reward_step_metrics_names_and_values():
    c = cfg()
    totals = [1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    m = reward_step_metrics(c, scored_batch(totals, degenerate=[False, True]), ["boxed_reward"])
    assert m["reward"] == pytest.approx(0.75)
    assert m["reward_std"] == pytest.approx(torch.tensor(totals).std().item())
    assert m["rewards/boxed_reward/mean"] == pytest.approx(0.75)
    assert m["frac_reward_zero_std"] == 0.5 and m["frac_degenerate"] == 0.5


def test_train_batch_skips_empty_completions_and_scales_builtin_advantages():
    totals = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    adv = [1.5, -0.5, -0.5, -0.5, 0.0, 0.0, 0.0, 0.0]
    lengths = [3, 0, 2, 1, 2, 2, 2, 2]
    scored = scored_batch(totals, adv, [False, True], lengths)
    builtin = build_train_batch(cfg(loss_type="importance_sampling"), scored, 0)
    assert len(builtin.datums) == 7 and len(builtin.token_rows.masks) == 7  # the empty completion has no datum
    assert builtin.train_tokens == 3 + 2 + 1  # tokens with a non-zero advantage
    n = builtin.token_rows.completion_tokens
    assert n == 3 + 2 + 1 + 4 * 2
    first = builtin.datums[0].loss_fn_inputs["advantages"].data
    assert first[-1] == pytest.approx(1.5 / n)  # the service sums over tokens: / n makes it the token mean
    assert builtin.token_rows.advantages[0][-1] == 1.5  # the local loss's rows keep the raw advantage
    custom = build_train_batch(cfg(loss_type="cispo"), scored, 0)
    assert custom.datums[0].loss_fn_inputs["advantages"].data[-1] == pytest.approx(1.5)
    with pytest.raises(PyTrioLoopError, match="step 3: every completion was empty"):
        build_train_batch(cfg(), scored_batch(totals, adv, lengths=[0] * 8), 2)
    m = completion_metrics(scored.rollouts)
    assert m["completions/mean_length"] == 14 / 8 and m["completions/min_length"] == 0
    assert m["completions/max_length"] == 3 and m["completions/clipped_ratio"] == 1 / 8


# --------------------------------------------------------------------------------------------------------------
# losses: the custom path calls trl_grpo_ext.grpo.losses; built-in sums become TRL's token mean
# --------------------------------------------------------------------------------------------------------------


def token_rows(advs=(1.0, -0.5)):
    rows = TokenRows()
    rows.add(shifted_sequences([1, 2], [3, 4, 5], [-0.3, -0.2, -0.9], advs[0]))
    rows.add(shifted_sequences([1, 2, 3], [6], [-1.1], advs[1]))
    return rows


@pytest.mark.parametrize("loss_type", ["importance_sampling", "ppo", "cispo"])
def test_custom_loss_is_policy_loss_token_mean(loss_type):
    c = cfg(loss_type=loss_type)
    rows = token_rows()
    new = [
        torch.tensor([0.0, -0.1, -0.4, -0.6], requires_grad=True),
        torch.tensor([0.0, 0.0, -0.7], requires_grad=True),
    ]
    record = {}
    loss, metrics = make_custom_loss(c, rows, record)(None, new)
    loss.backward()
    # reference: same math written directly on the completion tokens
    lp = torch.tensor([[-0.1, -0.4, -0.6], [-0.7, 0.0, 0.0]])
    old = torch.tensor([[-0.3, -0.2, -0.9], [-1.1, 0.0, 0.0]])
    adv = torch.tensor([[1.0] * 3, [-0.5, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    per_tok, ref_metrics = policy_loss(loss_type, lp, old, adv, mask, *c.clip_bounds)
    assert float(loss.detach()) == pytest.approx(float(token_level_mean(per_tok, mask)), abs=1e-6)
    assert metrics["ratio_mean"] == pytest.approx(float(ref_metrics["ratio_mean"]))
    assert record["loss"] == pytest.approx(float(loss.detach()))
    assert new[0].grad[0] == 0 and new[1].grad[:2].abs().sum() == 0  # prompt positions get no gradient
    if loss_type != "importance_sampling":
        assert {"clip_low_frac", "clip_high_frac", "clipped_ratio_mean"} <= set(metrics)


def test_builtin_sum_with_scaled_advantages_equals_token_mean():
    """The server sums built-in losses over tokens; advantages / N make that the token mean the TRL path uses."""
    rows = token_rows()
    n = rows.completion_tokens
    lp = torch.tensor([[0.0, -0.1, -0.4, -0.6], [0.0, 0.0, -0.7, 0.0]])
    old = torch.tensor([rows.old_logprobs[0], rows.old_logprobs[1] + [0.0]])
    adv = torch.tensor([rows.advantages[0], rows.advantages[1] + [0.0]])
    mask = torch.tensor([rows.masks[0], rows.masks[1] + [0.0]])
    for loss_type in ("importance_sampling", "ppo"):
        per_tok, _ = policy_loss(loss_type, lp, old, adv, mask)
        per_tok_scaled, _ = policy_loss(loss_type, lp, old, adv / n, mask)
        assert float((per_tok_scaled * mask).sum()) == pytest.approx(float(token_level_mean(per_tok, mask)))


def test_builtin_loss_config_uses_ratio_bounds():
    assert builtin_loss_config(cfg(loss_type="ppo", epsilon=0.1, epsilon_high=0.3)) == {
        "clip_low_threshold": pytest.approx(0.9),
        "clip_high_threshold": pytest.approx(1.3),
    }
    assert builtin_loss_config(cfg(loss_type="importance_sampling")) is None
    # one default on both paths (the shared GRPO spec): cispo's upper bound is 4.0 here too, not "None: 4.0"
    assert cfg(loss_type="cispo", cispo_clip_low=0.5).clip_bounds == (0.5, 4.0)


# --------------------------------------------------------------------------------------------------------------
# config
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"per_device_train_batch_size": 6}, "multiple of num_generations"),
        ({"beta": 0.1}, "beta"),
        ({"loss_type": "nope"}, "loss_type"),
        ({"mode": "fast"}, "mode"),
        ({"lora_r": 2}, "lora_r"),
        ({"scale_rewards": "std"}, "scale_rewards"),
        ({"reward_weights": [1.0, 2.0]}, "reward_weights"),
        ({"degenerate_reward": "format"}, "degenerate_reward"),
    ],
)
def test_config_rejects_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        cfg(**kw)


def test_config_mapping_and_schedule():
    c = cfg(per_device_train_batch_size=16, num_generations=4, max_steps=10, learning_rate=1.0)
    assert c.prompts_per_step == 4
    assert c.learning_rate_at(0) == c.learning_rate_at(9) == 1.0
    lin = cfg(max_steps=10, learning_rate=1.0, lr_scheduler_type="linear", warmup_ratio=0.2)
    assert [round(lin.learning_rate_at(s), 3) for s in (0, 1, 2, 9)] == [0.0, 0.5, 1.0, 0.125]


def test_recipe_yamls_parse_strictly(tmp_path):
    from trl import TrlParser

    for yaml_path in sorted((ROOT / "recipes" / "pytrio").glob("*.yaml")):
        (c,) = TrlParser((PyTrioGRPOConfig,)).parse_args_and_config(args=["--config", str(yaml_path)])
        assert isinstance(c, PyTrioGRPOConfig)
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_steps: 2\nnot_a_key: 1\n")
    with pytest.raises(ValueError, match="not_a_key"):
        TrlParser((PyTrioGRPOConfig,)).parse_args_and_config(args=["--config", str(bad)])


# --------------------------------------------------------------------------------------------------------------
# resume bookkeeping and key hygiene
# --------------------------------------------------------------------------------------------------------------


def test_prompt_stream_resumes_where_it_stopped():
    rows = [{"i": i} for i in range(5)]
    full = PromptStream(rows, seed=3)
    expected = [r["i"] for r in full.take(12)]
    first = PromptStream(rows, seed=3)
    head = [r["i"] for r in first.take(7)]
    rest = [r["i"] for r in PromptStream(rows, seed=3, position=first.position).take(5)]
    assert head + rest == expected
    assert sorted(expected[:5]) == list(range(5))  # each epoch is a permutation


def test_loop_state_roundtrip_truncation_and_pinning(tmp_path):
    c = cfg(output_dir=str(tmp_path))
    state = LoopState(step=4, data_position=8, state_path="trio://ckpt/4", pinned=pinned_settings(c))
    save_loop_state(tmp_path, state)
    loaded = load_loop_state(tmp_path)
    assert loaded.step == 4 and loaded.state_path == "trio://ckpt/4"
    check_resumable(loaded, c)
    with pytest.raises(ValueError, match="lora_r: 16 -> 8"):
        check_resumable(loaded, cfg(output_dir=str(tmp_path), lora_r=8))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 7)) + '{"st')
    assert truncate_metrics(tmp_path / METRICS_FILENAME, 4) == 2
    assert [r["step"] for r in run_metrics(tmp_path)] == [1, 2, 3, 4]
    (tmp_path / "pytrio_state.json").write_text("{broken")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_loop_state(tmp_path)


def test_redact_hides_the_key():
    key = "sk-test-0123456789abcdef"
    assert key not in redact(f"401 for key {key}", secrets=(key,))
    assert "abcdef0123456789" not in redact("Authorization: Bearer abcdef0123456789", secrets=())


# --------------------------------------------------------------------------------------------------------------
# against the local pytrio server (real pytrio client, tiny model)
# --------------------------------------------------------------------------------------------------------------

SECRET_KEY = "trio-local-SECRETKEY-7f3a9c1e5b"
TEST_REWARD = "pytrio_test_digits"


def _digits_reward(completions, **kwargs):
    """Fraction of digit characters: varies across a random model's samples, so groups carry a signal."""
    from trl_grpo_ext.task.answers import completion_text

    out = []
    for completion in completions:
        text = completion_text(completion)
        out.append(sum(ch.isdigit() for ch in text) / max(len(text), 1))
    return out


@pytest.fixture(scope="module")
def local_pytrio(tiny_model_path, tmp_path_factory):
    from pytrio_faults import FaultInjector

    from trl_grpo_ext.pytrio_server import LocalPyTrioServer, ServerConfig
    from trl_grpo_ext.task.rewards import REWARD_REGISTRY, register_reward

    if TEST_REWARD not in REWARD_REGISTRY:
        register_reward(TEST_REWARD)(_digits_reward)
    home = tmp_path_factory.mktemp("pytrio-home")
    # the loop normalises its advantages itself and expects the plain sum, as the recipe's own server runs it
    config = ServerConfig(model=tiny_model_path, api_key=SECRET_KEY, ephemeral_storage=True, loss_normalization="sum")
    server = LocalPyTrioServer(config)
    server.faults = FaultInjector().install(server)  # test hook: error answers on demand (tests/pytrio_faults.py)
    with server:
        server.home = str(home)
        yield server
    REWARD_REGISTRY.pop(TEST_REWARD, None)  # other modules iterate over the registry


@pytest.fixture
def pytrio_client(local_pytrio):
    """pytrio pointed at the local server (pytrio's configuration is process-wide: set it for every test)."""
    local_pytrio.configure_client(home=local_pytrio.home)
    return local_pytrio


ROWS = [
    {"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": f"#### {a + b}"}
    for a, b in [(3, 4), (12, 30), (7, 8), (40, 2), (5, 5), (9, 11)]
]


def loop_config(tmp_path, **kw):
    base = dict(
        base_model="tiny",  # replaced by the fixture's path
        lora_r=4,
        num_generations=4,
        per_device_train_batch_size=8,
        max_completion_length=12,
        max_steps=2,
        save_every=1,
        reward_funcs=[TEST_REWARD, "boxed"],
        learning_rate=5e-3,
        output_dir=str(tmp_path / "run"),
        seed=7,
    )
    base.update(kw)
    return PyTrioGRPOConfig(**base)


def run_loop(config, stop_after=None, **kw):
    """Train `config` on ROWS; with `stop_after`, stop after that many steps, as a kill would (`StoppingLoop`)."""
    from stopping_loop import StoppingLoop

    from trl_grpo_ext.pytrio.loop import GRPOLoop

    if stop_after is not None:
        return StoppingLoop(config, rows=ROWS, stop_after=stop_after, **kw).run()
    return GRPOLoop(config, rows=ROWS, **kw).run()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("loss_type", ["importance_sampling", "ppo", "cispo"])
def test_full_grpo_loop_on_local_server(pytrio_client, tiny_model_path, tmp_path, loss_type, mode):
    c = loop_config(tmp_path, base_model=tiny_model_path, loss_type=loss_type, mode=mode)
    summary = run_loop(c)
    assert summary["steps"] == 2 and summary["sampler_path"] and summary["state_path"]
    rows = run_metrics(c.output_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        for key in (
            "reward",
            "reward_std",
            f"rewards/{_digits_reward.__name__}/mean",
            "rewards/boxed_reward/mean",
            "frac_degenerate",
            "frac_reward_zero_std",
            "train_tokens",
            "ratio_mean",
            "loss",
            "learning_rate",
            "step_time",
            "completions/mean_length",
            "grad_norm",
        ):
            assert key in row, key
        # sampler and trainer hold the same weights within a step: a misaligned shift would move this far from 1
        assert row["ratio_mean"] == pytest.approx(1.0, abs=2e-3)
        if loss_type != "importance_sampling":
            assert row["clip_low_frac"] is not None and row["clip_high_frac"] is not None
    assert any(r["train_tokens"] > 0 for r in rows)
    assert any(r["grad_norm"] > 0 for r in rows)  # the loss reached the adapter
    state = load_loop_state(c.output_dir)
    assert state.step == 2 and state.data_position == 2 * c.prompts_per_step


@pytest.mark.slow
def test_custom_loss_path_matches_builtin_loss(pytrio_client, tiny_model_path):
    """importance_sampling as the server's built-in (sum with advantages / N) and as forward_backward_custom
    (trl_grpo_ext.grpo.losses token mean) move the weights the same way."""
    import pytrio as trio

    from trl_grpo_ext.pytrio.loss import make_custom_loss

    c = cfg(loss_type="importance_sampling", max_grad_norm=0.0)
    rollouts = [([1, 2, 3], [4, 5, 6, 7], 1.0), ([1, 2], [8, 9], -1.0), ([3, 1, 2], [10, 11, 12], 0.5)]
    service = trio.ServiceClient()
    clients = [service.create_lora_training_client(tiny_model_path, rank=4, seed=11) for _ in range(2)]
    probe = [build_datum(p, t, [-1.0] * len(t), 0.0) for p, t, _ in rollouts]
    before = [
        list(o["logprobs"].data) for o in clients[0].forward(probe, "importance_sampling").result().loss_fn_outputs
    ]
    # probe the sampled logprobs as the old policy, so the ratio starts at 1
    rows = TokenRows()
    datums_builtin = []
    n_tokens = sum(len(t) for _, t, _ in rollouts)
    for (p, t, a), lp in zip(rollouts, before, strict=True):
        old = lp[len(p) - 1 :]
        rows.add(shifted_sequences(p, t, old, a))
        datums_builtin.append(build_datum(p, t, old, a / n_tokens))
    # eps >> |grad| keeps Adam's first step linear in the gradient, so a wrong loss scale would show
    adam = trio.AdamParams(learning_rate=1.0, eps=1.0, beta1=0.9, beta2=0.999, grad_clip_norm=0.0)
    clients[0].forward_backward(datums_builtin, "importance_sampling").result()
    clients[1].forward_backward_custom(datums_builtin, make_custom_loss(c, rows, {})).result()
    after = []
    for client in clients:
        client.optim_step(adam).result()
        after.append(
            [list(o["logprobs"].data) for o in client.forward(probe, "importance_sampling").result().loss_fn_outputs]
        )
    delta = [torch.tensor(sum(a, [])) - torch.tensor(sum(before, [])) for a in after]
    assert delta[0].abs().max() > 1e-4  # the step did something
    assert torch.allclose(delta[0], delta[1], rtol=0.05, atol=1e-6)


@pytest.mark.slow
def test_stop_after_checkpoint_then_resume(pytrio_client, tiny_model_path, tmp_path):
    c = loop_config(tmp_path, base_model=tiny_model_path, max_steps=4, save_every=2, mode="async")
    stopped = run_loop(c, stop_after=3)  # steps 1, 2 (checkpoint), 3, then the process "dies"
    assert stopped["stopped_at"] == 3
    assert [r["step"] for r in run_metrics(c.output_dir)] == [1, 2, 3]
    assert load_loop_state(c.output_dir).step == 2
    resumed_config = loop_config(
        tmp_path, base_model=tiny_model_path, max_steps=4, save_every=2, mode="async", resume=True
    )
    summary = run_loop(resumed_config)
    assert summary["steps"] == 4
    steps = [r["step"] for r in run_metrics(c.output_dir)]
    assert steps == [1, 2, 3, 4]  # step 3 re-run once, its stale row dropped
    state = load_loop_state(c.output_dir)
    assert state.data_position == 4 * c.prompts_per_step
    assert [ck["step"] for ck in state.checkpoints] == [2, 4]
    # a resume with a different model shape is refused before anything runs
    with pytest.raises(ValueError, match="lora_r"):
        run_loop(loop_config(tmp_path, base_model=tiny_model_path, max_steps=5, lora_r=8, resume=True))


@pytest.mark.slow
def test_api_key_never_written_or_logged(pytrio_client, tiny_model_path, tmp_path, caplog, capfd):
    import logging

    caplog.set_level(logging.DEBUG)
    c = loop_config(tmp_path, base_model=tiny_model_path, max_steps=1, report_to="swanlab", swanlab_mode="offline")
    run_loop(c)
    captured = capfd.readouterr()
    assert SECRET_KEY not in captured.out + captured.err
    assert SECRET_KEY not in caplog.text
    files = [p for p in Path(c.output_dir).rglob("*") if p.is_file()]
    assert any(p.name == "metrics.jsonl" for p in files) and any("swanlog" in str(p) for p in files)
    for path in files:
        assert SECRET_KEY.encode() not in path.read_bytes(), path

    # a rejected key: the error names the problem, not the key
    import pytrio as trio

    from trl_grpo_ext.pytrio.connection import create_service_client

    wrong = "trio-wrong-KEY-0011223344"
    trio.configure(api_key=wrong)
    with pytest.raises(RuntimeError) as info:
        create_service_client()
    assert wrong not in str(info.value) and "Could not open a PyTRIO session" in str(info.value)


@pytest.mark.slow
def test_service_failure_is_a_clear_error_and_keeps_the_checkpoint(pytrio_client, tiny_model_path, tmp_path):
    import pytrio as trio

    c = loop_config(tmp_path, base_model=tiny_model_path, max_steps=3, save_every=1, request_timeout_s=60)
    run_loop(c, stop_after=1)
    trio.configure(retry_max_attempts=1, sampling_retry_timeout_seconds=0.5, retry_initial_delay_seconds=0.0)
    pytrio_client.faults.add("/sample", status=500, times=10**6)  # every retry fails (cleared below)
    try:
        with pytest.raises(PyTrioLoopError, match="sample"):
            run_loop(
                loop_config(
                    tmp_path, base_model=tiny_model_path, max_steps=3, save_every=1, resume=True, request_timeout_s=60
                )
            )
    finally:
        pytrio_client.faults.faults.clear()
        trio.configure(retry_max_attempts=3, sampling_retry_timeout_seconds=900, retry_initial_delay_seconds=1.0)
    state = load_loop_state(c.output_dir)
    assert state.step == 1 and state.state_path  # nothing lost: the next resume starts from the checkpoint
    assert [r["step"] for r in run_metrics(c.output_dir)] == [1]


def load_recipe():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gsm8k_pytrio", ROOT / "recipes" / "gsm8k_pytrio.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    return recipe


@pytest.mark.slow
def test_recipe_runs_end_to_end_offline_from_one_command(pytrio_client, tiny_model_path, tmp_path, capfd, caplog):
    """`recipes/gsm8k_pytrio.py` without --config (its `main`, in this process to spare the test budget a second
    torch import): the embedded default starts its own local server, generates the data offline, trains, saves."""
    import logging
    import re

    caplog.set_level(logging.DEBUG)
    out = tmp_path / "recipe-run"
    # no --config: the embedded default (recipes/pytrio/embedded.yaml, pytrio_base_url: local), model shrunk
    args = [
        "--base_model",
        tiny_model_path,
        "--lora_r",
        "4",
        "--max_steps",
        "2",
        "--save_every",
        "1",
        "--max_completion_length",
        "8",
        "--num_train_samples",
        "16",
        "--output_dir",
        str(out),
    ]
    assert load_recipe().main(args) == 0
    captured = capfd.readouterr()
    summary = json.loads(captured.out[captured.out.index("{") :])
    assert summary["steps"] == 2 and summary["sampler_path"].startswith("trio://")
    assert [r["step"] for r in run_metrics(out)] == [1, 2]
    # what `hybrid` reports through TRL's log_metric reaches metrics.jsonl here too
    assert "rewards/hybrid_reward/vetoed" in run_metrics(out)[0]
    assert "step 2/2" in caplog.text
    # the server's random key
    assert not re.search(r"trio-local-[A-Za-z0-9_\-]{8,}", captured.out + captured.err + caplog.text)
    # resume with a new local server (its checkpoint records come from disk under the run's output_dir)
    assert load_recipe().main([*args, "--max_steps", "3", "--resume", "true"]) == 0
    assert [r["step"] for r in run_metrics(out)] == [1, 2, 3]
    assert "resumed at step 2" in caplog.text


def test_recipe_default_is_the_offline_embedded_yaml(tmp_path, monkeypatch):
    recipe = load_recipe()
    seen = {}

    def fake_run(config, loop):
        seen["config"], seen["rows"] = config, loop._rows  # the inputs were checked (data loaded) before this
        return {}

    monkeypatch.setattr(recipe, "run_from_config", fake_run)
    assert recipe.main(["--num_train_samples", "8", "--output_dir", str(tmp_path / "run")]) == 0
    from trl import TrlParser

    (expected,) = TrlParser((PyTrioGRPOConfig,)).parse_args_and_config(
        args=[
            "--config",
            str(ROOT / "recipes/pytrio/embedded.yaml"),
            "--num_train_samples",
            "8",
            "--output_dir",
            str(tmp_path / "run"),
        ]
    )
    assert seen["config"] == expected
    assert seen["config"].pytrio_base_url == "local" and seen["config"].base_model == "embedded"
    assert len(seen["rows"]) == 8
    assert not (tmp_path / "run").exists()


def test_recipe_reports_bad_config_in_one_line(tmp_path, capsys):
    recipe = load_recipe()
    args = ["--config", str(ROOT / "recipes/pytrio/embedded.yaml"), "--output_dir", str(tmp_path)]
    assert recipe.main(args + ["--per_device_train_batch_size", "6"]) == 2
    assert "multiple of num_generations" in capsys.readouterr().err
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("max_steps: 1\nlearning_rat: 0.1\n")
    assert recipe.main(["--config", str(bad_yaml)]) == 2
    assert "learning_rat" in capsys.readouterr().err
    bad_yaml.write_text("max_steps: many\n")
    assert recipe.main(["--config", str(bad_yaml)]) == 2
    err = capsys.readouterr().err
    assert "max_steps" in err and "bad.yaml" in err


def test_failing_rerun_loads_no_model_and_keeps_the_previous_run_files(tmp_path, capsys, monkeypatch):
    """Bad values, data, reward names, model paths or a refused resume: one `error:` line, exit 2, before the
    local server starts (no model loads) and before anything in output_dir is written."""
    import trl_grpo_ext.pytrio.connection as connection

    def no_server(*args, **kwargs):
        raise AssertionError("the local server started (it loads the model) before the inputs were checked")

    monkeypatch.setattr(connection, "local_server", no_server)
    out = tmp_path / "run"
    out.mkdir()
    previous = {"metrics.jsonl": '{"step": 1, "reward": 0.5}\n', "config.yaml": "max_steps: 1\n"}
    for name, text in previous.items():
        (out / name).write_text(text)
    save_loop_state(
        out,
        LoopState(
            step=1,
            data_position=3,
            state_path="trio://x",
            pinned=pinned_settings(
                cfg(base_model="embedded", lora_r=16, seed=0, num_generations=4, per_device_train_batch_size=12)
            ),
        ),
    )
    state_before = (out / "pytrio_state.json").read_text()
    bad_data = tmp_path / "bad.jsonl"
    bad_data.write_text('{"question": "1 + 1?", "answer": "#### 2"}\n{"question": "Name it", "answer": "twelve"}\n')
    recipe = load_recipe()
    base = ["--output_dir", str(out), "--num_train_samples", "8"]
    cases = [
        (["--temperature", "0"], "temperature"),
        (["--reward_funcs", "boxed,nope"], "nope"),
        (["--dataset_name", str(bad_data)], "row 1"),
        (["--dataset_name", str(tmp_path / "missing.jsonl")], "missing.jsonl"),
        (["--num_train_sample", "8"], "'--num_train_sample' (did you mean '--num_train_samples'"),
        (["--base_model", str(tmp_path / "no-such-model")], "no-such-model"),
        (["--resume", "true", "--lora_r", "8"], "lora_r: 16 -> 8"),
    ]
    for extra, match in cases:
        assert recipe.main(base + extra) == 2, extra
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and match in err and len(err.splitlines()) == 1, (extra, err)
        for name, text in previous.items():
            assert (out / name).read_text() == text, (extra, name)
        assert (out / "pytrio_state.json").read_text() == state_before
        assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "metrics.jsonl", "pytrio_state.json"]


def test_pytrio_rows_are_the_trl_recipe_rows(tmp_path):
    from trl_grpo_ext.pytrio.rows import load_train_rows
    from trl_grpo_ext.task.data import load_dataset_split

    data = tmp_path / "train.jsonl"
    data.write_text(
        "".join(json.dumps({"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"}) + "\n" for i in range(5))
        + json.dumps({"question": "Why?", "answer": "because"})
        + "\n"
    )
    c = cfg(dataset_name=str(data), num_train_samples=None, on_malformed="drop", one_shot=False)
    rows = load_train_rows(c)
    assert rows == load_dataset_split(str(data), num_samples=None, one_shot=False, on_malformed="drop").to_list()
    assert len(rows) == 5 and set(rows[0]) == {"prompt", "question", "answer"}
    with pytest.raises(ValueError, match="row 5 has an unparseable answer"):
        load_train_rows(cfg(dataset_name=str(data)))
    synthetic = load_train_rows(cfg(num_train_samples=6, synthetic_tasks="chain_sum:1", seed=3))
    trl_rows = load_dataset_split("synthetic", num_samples=6, tasks="chain_sum:1", seed=3).to_list()
    assert synthetic == trl_rows and {r["task"] for r in synthetic} == {"chain_sum"}


def test_prompt_format_is_the_data_specs_on_this_path_too(tiny_model_path, tmp_path):
    """`prompt_format` (DataSpec) decides the PyTRIO prompts as it does the TRL recipe's: `auto` gives chat messages
    with a chat template and plain text without one (the rows built again once the tokenizer says so), `chat`
    without a template is one line, a bad value is refused with the config."""
    from transformers import AutoTokenizer

    from trl_grpo_ext.pytrio.loop import GRPOLoop
    from trl_grpo_ext.task.data import load_dataset_split

    chat_tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    plain_tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    plain_tokenizer.chat_template = None
    spec = dict(num_train_samples=4, synthetic_tasks="chain_sum:1", seed=3, output_dir=str(tmp_path / "run"))

    def rows_after_prepare(tokenizer, **kw):
        loop = GRPOLoop(cfg(**spec, **kw), tokenizer=tokenizer)
        loop.check_inputs()
        loop.prepare(training_client=None)
        return loop._rows, [loop.prompts(row) for row in loop._rows]

    text = load_dataset_split("synthetic", num_samples=4, tasks="chain_sum:1", seed=3, chat=False).to_list()
    messages = load_dataset_split("synthetic", num_samples=4, tasks="chain_sum:1", seed=3, chat=True).to_list()
    rows, tokens = rows_after_prepare(plain_tokenizer)  # auto, no template: the TRL recipe's text rows
    assert rows == text and isinstance(rows[0]["prompt"], str)
    assert tokens[0] == plain_tokenizer(rows[0]["prompt"], add_special_tokens=False)["input_ids"]
    assert rows_after_prepare(chat_tokenizer)[0] == messages  # auto with a template: chat messages
    assert rows_after_prepare(chat_tokenizer, prompt_format="text")[0] == text
    with pytest.raises(ValueError, match="prompt_format: chat, but the tokenizer has no chat template"):
        rows_after_prepare(plain_tokenizer, prompt_format="chat")
    with pytest.raises(ValueError, match="prompt_format must be one of"):
        cfg(prompt_format="markdown")
    assert not (tmp_path / "run").exists()  # nothing written by any of it
