"""The PyTRIO loop's phases on their own, against scripted clients: sampling submitted apart from collected (keyed
by the step and the sampler), scoring as a pure function, the optimizer step's call order per mode, checkpoints."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from trl_grpo_ext.pytrio.calls import PyTrioLoopError, ServiceLostError
from trl_grpo_ext.pytrio.checkpoints import save_checkpoint, save_final_weights, start_training_client
from trl_grpo_ext.pytrio.config import PyTrioGRPOConfig
from trl_grpo_ext.pytrio.optim import optimizer_step
from trl_grpo_ext.pytrio.sampling import collect_samples, submit_samples
from trl_grpo_ext.pytrio.scoring import RewardSetup, score_rollouts
from trl_grpo_ext.pytrio.types import Rollout, StepTimes, TokenRows, TrainBatch
from trl_grpo_ext.runs import PYTRIO_STATE_FILENAME
from trl_grpo_ext.runs.loop_state import load_loop_state


def cfg(**kw):
    base = dict(num_generations=2, per_device_train_batch_size=4, max_steps=2, reward_funcs=["boxed"])
    return PyTrioGRPOConfig(**{**base, **kw})


class Answer:
    """A pytrio future that says when its result is read (into the shared ``events``)."""

    def __init__(self, events, name, value):
        self.events, self.name, self.value = events, name, value

    def result(self, timeout=None):
        self.events.append(("result", self.name))
        if isinstance(self.value, BaseException):
            raise self.value
        return self.value


class ScriptedSampler:
    """Answers ``sample`` with ``num_samples`` one-token completions: token = 100 + the prompt's first token."""

    def __init__(self):
        self.events = []

    def sample(self, model_input, num_samples, sampling_params, return_text):
        tokens = model_input.to_ints()
        name = f"sample {tokens[0]}"
        self.events.append(("submit", name, sampling_params.seed))
        seqs = [SimpleNamespace(tokens=[100 + tokens[0]], logprobs=[-0.5], stop_reason="stop")] * num_samples
        return Answer(self.events, name, SimpleNamespace(sequences=seqs))


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_sampling_is_submitted_then_collected(mode):
    config = cfg(mode=mode)
    sampler = ScriptedSampler()
    rows = [{"prompt": "a"}, {"prompt": "b"}]
    pending = submit_samples(config, sampler, rows, [[1, 2], [3]], step=5, first_index=2)
    assert (pending.step, pending.sampler, pending.rows) == (5, sampler, rows)
    submitted = [e for e in sampler.events if e[0] == "submit"]
    # async: every request in flight before anything is waited for; sync: nothing sent until collected
    assert len(submitted) == (2 if mode == "async" else 0) and not [e for e in sampler.events if e[0] == "result"]
    rollouts = collect_samples(config, pending)
    assert [r.prompt_tokens for r in rollouts] == [(1, 2), (1, 2), (3,), (3,)]  # prompt-major
    assert [r.completion_tokens for r in rollouts] == [(101,), (101,), (103,), (103,)]
    kinds = [e[0] for e in sampler.events]
    assert kinds == (["submit", "submit", "result", "result"] if mode == "async" else ["submit", "result"] * 2)
    seeds = [e[2] for e in sampler.events if e[0] == "submit"]
    again = ScriptedSampler()
    collect_samples(config, submit_samples(config, again, rows, [[1, 2], [3]], step=5, first_index=2))
    assert seeds == [e[2] for e in again.events if e[0] == "submit"] and len(set(seeds)) == 2  # (step, row) seeds
    other_step = ScriptedSampler()
    collect_samples(config, submit_samples(config, other_step, rows, [[1, 2], [3]], step=6, first_index=2))
    assert not set(seeds) & {e[2] for e in other_step.events if e[0] == "submit"}


def test_a_lost_service_while_collecting_is_a_service_lost_error():
    from pytrio.errors.control import ControlAPIError

    config = cfg(mode="async")

    class Gone:
        def sample(self, *args, **kwargs):
            return Answer([], "gone", ControlAPIError("Connection failed", retryable=True))

    pending = submit_samples(config, Gone(), [{"prompt": "a"}], [[1]], step=0)
    with pytest.raises(ServiceLostError, match=r"sample \(prompt 0\) failed"):
        collect_samples(config, pending)


class CharTokenizer:
    def batch_decode(self, ids, skip_special_tokens=True):
        return ["".join(chr(i) for i in row) for row in ids]


def length_reward(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]


def test_scoring_is_a_function_of_rows_rollouts_and_the_reward_setup():
    config = cfg(scale_rewards="none")
    setup = RewardSetup([length_reward], ["length_reward"], torch.tensor([1.0]), CharTokenizer())
    rows = [{"prompt": "p", "answer": "1"}, {"prompt": "q", "answer": "2"}]
    completions = [(65,), (65, 66, 67), (65, 66), (65, 66)]
    rollouts = [Rollout((1,), c, tuple([-0.1] * len(c)), "stop") for c in completions]
    first = score_rollouts(config, setup, rows, rollouts)
    second = score_rollouts(config, setup, rows, rollouts)
    assert first.rewards.tolist() == second.rewards.tolist() == [1.0, 3.0, 2.0, 2.0]
    assert first.advantages == second.advantages == [-1.0, 1.0, 0.0, 0.0]
    assert first.degenerate == [False, True] and first.rows is rows and first.rollouts is rollouts


class ScriptedTrainer:
    """A training client recording when each call is submitted and answered."""

    def __init__(self):
        self.events = []

    def forward_backward(self, datums, loss_type, loss_fn_config=None):
        self.events.append(("submit", "forward_backward"))
        return Answer(self.events, "forward_backward", SimpleNamespace(loss_fn_outputs=[], metrics={"loss_mean": 0.5}))

    def forward_backward_custom(self, datums, loss_fn):
        self.events.append(("submit", "forward_backward_custom"))
        return Answer(self.events, "forward_backward_custom", SimpleNamespace(metrics={}))

    def optim_step(self, adam):
        self.events.append(("submit", "optim_step"))
        self.adam = adam
        return Answer(self.events, "optim_step", SimpleNamespace(metrics={"grad_norm": 2.0}))


@pytest.mark.parametrize(
    "mode, loss_type, order",
    [
        ("async", "ppo", ["submit fb", "submit optim_step", "result fb", "result optim_step"]),
        ("sync", "ppo", ["submit fb", "result fb", "submit optim_step", "result optim_step"]),
        ("sync", "cispo", ["submit fbc", "result fbc", "submit optim_step", "result optim_step"]),
    ],
)
def test_the_optimizer_step_queues_optim_step_behind_forward_backward_in_async_mode(mode, loss_type, order):
    config = cfg(mode=mode, loss_type=loss_type, adam_beta2=0.95)
    trainer = ScriptedTrainer()
    batch = TrainBatch(datums=[object()], token_rows=TokenRows(), train_tokens=1)
    times = StepTimes()
    loss_metrics, optim_metrics = optimizer_step(config, trainer, batch, 0.25, times)
    short = {"forward_backward": "fb", "forward_backward_custom": "fbc", "optim_step": "optim_step"}
    assert [f"{kind} {short[name]}" for kind, name in trainer.events] == order
    assert optim_metrics == {"grad_norm": 2.0}
    assert trainer.adam.learning_rate == 0.25 and trainer.adam.beta2 == 0.95
    # the built-in loss without per-datum log-probs falls back to the service's loss; the custom loss fills its
    # record only when the service runs it
    assert loss_metrics == ({"loss": 0.5} if loss_type == "ppo" else {})
    assert times.forward_backward >= 0.0 and times.optim_step >= 0.0


class ScriptedCheckpoints:
    def __init__(self, path="trio://run/weights/step-000002"):
        self.path, self.saved = path, []

    def save_state(self, name, overwrite=False):
        self.saved.append(name)
        return Answer([], "save_state", SimpleNamespace(path=self.path))

    def save_weights_for_sampler(self, name):
        return Answer([], "save_weights_for_sampler", SimpleNamespace(path=f"trio://run/sampler_weights/{name}"))


def test_checkpoints_record_the_loop_state(tmp_path):
    config = cfg(output_dir=str(tmp_path))

    class Service:
        def create_lora_training_client(self, base_model, rank, seed):
            self.asked = (base_model, rank, seed)
            return ScriptedCheckpoints()

    service = Service()
    client, state = start_training_client(service, config, None)
    assert service.asked == (config.base_model, config.lora_r, config.seed) and state.step == 0
    save_checkpoint(config, client, state, 2, data_position=4, curriculum={"tasks": {}})
    assert client.saved == ["step-000002"]
    loaded = load_loop_state(tmp_path)
    assert (loaded.step, loaded.data_position, loaded.state_path) == (2, 4, "trio://run/weights/step-000002")
    assert loaded.curriculum == {"tasks": {}} and [c["step"] for c in loaded.checkpoints] == [2]
    save_final_weights(config, client, state)
    assert json.loads((tmp_path / PYTRIO_STATE_FILENAME).read_text())["sampler_path"].endswith("/final")
    with pytest.raises(PyTrioLoopError, match="save_state returned no checkpoint path"):
        save_checkpoint(config, ScriptedCheckpoints(path=""), state, 3, data_position=6, curriculum=None)
    assert load_loop_state(tmp_path).step == 2  # nothing recorded for a checkpoint that was not saved
