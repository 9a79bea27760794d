"""On-policy distillation on the PyTRIO path: the teacher's sampling client and ``compute_logprobs`` in the loop,
parity with the TRL path on scripted tokens and log-probs, and a distillation run on the local server."""

from __future__ import annotations

import math
from collections import defaultdict
from concurrent.futures import Future

import pytest
import torch

from trl_grpo_ext.grpo.distillation import DistillationSpec
from trl_grpo_ext.pytrio.batch import build_train_batch
from trl_grpo_ext.pytrio.calls import PyTrioLoopError
from trl_grpo_ext.pytrio.config import PyTrioGRPOConfig
from trl_grpo_ext.pytrio.loop import GRPOLoop
from trl_grpo_ext.pytrio.types import Rollout, ScoredBatch
from trl_grpo_ext.trl import distillation as trl_distillation

SPEC = {"teacher": "teacher-model", "coef": 0.7, "reward_coef": 0.3, "discount": 0.8}
# scripted: 2 prompts x 2 completions, ragged lengths, one empty completion
PROMPTS = [(5, 6, 7), (8, 9)]
ROLLOUT_PROMPTS = [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1]]  # prompt-major, 2 completions each
COMPLETIONS = [(11, 12, 13), (14,), (15, 16), ()]
STUDENT = [[-0.25, -1.5, -0.125], [-2.0], [-0.5, -0.75], []]
TEACHER = [[-0.5, -1.0, -0.375], [-1.25], [-0.5, -2.5], []]
REWARD_ADVANTAGES = [0.75, -0.75, 0.5, -0.5]


def config(**kwargs):
    base = dict(num_generations=2, per_device_train_batch_size=4, max_steps=2, reward_funcs=["boxed"])
    return PyTrioGRPOConfig(**{**base, **kwargs})


def done(value):
    future = Future()
    future.set_result(value)
    return future


class ScriptedTeacher:
    """A teacher sampling client answering ``compute_logprobs`` from the script (None at the first position, as
    the service answers), recording what it was asked."""

    def __init__(self, corrupt=False):
        self.asked = []
        self.corrupt = corrupt

    def compute_logprobs(self, model_input):
        tokens = model_input.to_ints()
        self.asked.append(tokens)
        for prompt, completion, teacher in zip(ROLLOUT_PROMPTS, COMPLETIONS, TEACHER, strict=True):
            if completion and tokens == list(prompt) + list(completion):
                prompt_part = [None] + [-3.0] * (len(prompt) - 1)
                return done(prompt_part + (teacher[:-1] if self.corrupt else teacher))
        raise AssertionError(f"unexpected prompt {tokens}")


class ScriptedService:
    def __init__(self, teacher):
        self.teacher = teacher
        self.created = []

    def create_sampling_client(self, base_model, model_path=None):
        self.created.append((base_model, model_path))
        return self.teacher


def scored_batch():
    rollouts = [Rollout(p, c, tuple(s), "stop") for p, c, s in zip(ROLLOUT_PROMPTS, COMPLETIONS, STUDENT, strict=True)]
    per_func = torch.zeros(4, 1)
    return ScoredBatch([{"prompt": "a"}, {"prompt": "b"}], rollouts, per_func, per_func[:, 0],
                       list(REWARD_ADVANTAGES), [False, False])  # fmt: skip


def pytrio_advantages(spec=SPEC, mode="sync"):
    teacher = ScriptedTeacher()
    service = ScriptedService(teacher)
    loop = GRPOLoop(config(distillation=spec, mode=mode), service_client=service, rows=[])
    scored = scored_batch()
    metrics = loop.teacher.distill(scored)
    assert service.created == [(spec["teacher"], spec.get("teacher_model_path"))]
    assert len(teacher.asked) == 3  # the empty completion is not asked about
    return scored, metrics


class _Model:
    training = True


class StubTrainer(trl_distillation.DistillationMixin):
    """What `DistillationMixin._with_distillation` reads of a trainer, without a model."""

    def __init__(self, spec):
        self.distillation = DistillationSpec(**spec)
        self.model, self.teacher_model = _Model(), object()
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}


def trl_advantages(monkeypatch, spec=SPEC):
    """The TRL path on the same completions: right-padded (B, T) tensors as TRL builds them."""
    width = max(len(c) for c in COMPLETIONS)

    def padded(rows, fill=0.0):
        return torch.tensor([list(r) + [fill] * (width - len(r)) for r in rows], dtype=torch.float32)

    trainer = StubTrainer(spec)

    def completion_logps(_trainer, model, output, mode):
        return padded(TEACHER, -7.0) if model is trainer.teacher_model else padded(STUDENT, -9.0)

    monkeypatch.setattr(trl_distillation.internals, "completion_logps", completion_logps)
    output = {
        "completion_ids": padded(COMPLETIONS).long(),
        "completion_mask": padded([[1] * len(c) for c in COMPLETIONS]).long(),
        "advantages": torch.tensor(REWARD_ADVANTAGES),
    }
    out = trainer._with_distillation(output)
    metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    return out["advantages"], metrics


@pytest.mark.parametrize(
    "spec", [SPEC, {"teacher": "t"}, {"teacher": "t", "coef": 2.0, "discount": 1.0}], ids=["mixed", "pure", "sum"]
)
def test_both_paths_give_the_same_advantages(monkeypatch, spec):
    scored, pytrio_metrics = pytrio_advantages(spec)
    advantages, trl_metrics = trl_advantages(monkeypatch, spec)
    for i, row in enumerate(scored.token_advantages):
        assert len(row) == len(COMPLETIONS[i])
        torch.testing.assert_close(torch.tensor(row), advantages[i, : len(row)], rtol=0, atol=1e-5)
        assert torch.count_nonzero(advantages[i, len(row) :]) == 0
    for name, value in trl_metrics.items():
        assert pytrio_metrics[name] == pytest.approx(value, abs=1e-5), name
    assert set(trl_metrics) <= set(pytrio_metrics)


def test_hand_computed_pytrio_row():
    scored, metrics = pytrio_advantages({"teacher": "t", "coef": 1.0})
    # -(student - teacher) per token
    assert scored.token_advantages[0] == pytest.approx([-0.25, 0.5, -0.25])
    assert scored.token_advantages[3] == []
    assert metrics["distill/reverse_kl"] == pytest.approx((0.25 - 0.5 + 0.25 - 0.75 + 0.0 + 1.75) / 6)


def test_datums_carry_the_per_token_advantages():
    scored, _ = pytrio_advantages()
    c = config(distillation=SPEC)
    batch = build_train_batch(c, scored, 0)
    n = batch.token_rows.completion_tokens
    assert n == 6 and len(batch.datums) == 3
    first = batch.datums[0].loss_fn_inputs["advantages"].data
    assert first[-3:] == pytest.approx([a / n for a in scored.token_advantages[0]])  # built-in sum -> token mean
    assert batch.token_rows.advantages[0][-3:] == pytest.approx(scored.token_advantages[0])
    assert batch.train_tokens == sum(x != 0 for row in scored.token_advantages for x in row)


def test_a_short_teacher_answer_is_refused():
    loop = GRPOLoop(config(distillation=SPEC), service_client=ScriptedService(ScriptedTeacher(corrupt=True)), rows=[])
    with pytest.raises(PyTrioLoopError, match="teacher"):
        loop.teacher.distill(scored_batch())


def test_a_datum_takes_one_advantage_per_completion_token():
    from trl_grpo_ext.pytrio.datums import shifted_sequences

    seq = shifted_sequences([1, 2], [3, 4, 5], [-0.1, -0.2, -0.3], [0.5, -1.0, 2.0])
    assert seq["advantages"] == [0.0, 0.5, -1.0, 2.0]
    assert shifted_sequences([1, 2], [3, 4, 5], [-0.1, -0.2, -0.3], 0.5)["advantages"] == [0.0, 0.5, 0.5, 0.5]
    with pytest.raises(ValueError, match="2 advantages for 3 tokens"):
        shifted_sequences([1, 2], [3, 4, 5], [-0.1, -0.2, -0.3], [0.5, 1.0])
    with pytest.raises(ValueError, match="advantage is"):
        shifted_sequences([1, 2], [3, 4, 5], [-0.1, -0.2, -0.3], [0.5, float("nan"), 1.0])


# ------------------------------------------------------------------------------------------ on the local server

SECRET_KEY = "trio-local-opd-key-0123456789"


@pytest.fixture(scope="module")
def local_server(tiny_model_path, tmp_path_factory):
    from trl_grpo_ext.pytrio_server import LocalPyTrioServer, ServerConfig

    server = LocalPyTrioServer(ServerConfig(model=tiny_model_path, api_key=SECRET_KEY, ephemeral_storage=True))
    with server:
        server.configure_client(home=str(tmp_path_factory.mktemp("pytrio-home")))
        yield server


ROWS = [
    {"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": f"#### {a + b}"}
    for a, b in [(3, 4), (12, 30), (7, 8), (40, 2)]
]


@pytest.mark.slow
def test_distillation_run_on_the_local_server(local_server, tiny_model_path, tmp_path):
    """Teacher = the served base model, student = a fresh LoRA on it: at step 1 they are the same model, so the
    reverse KL is ~0 (sampler vs scorer rounding only); two steps train and log the distill metrics."""
    from trl_grpo_ext.runs import run_metrics

    c = PyTrioGRPOConfig(
        base_model=tiny_model_path,
        lora_r=4,
        num_generations=2,
        per_device_train_batch_size=4,
        max_completion_length=8,
        max_steps=2,
        save_every=0,
        reward_funcs=["boxed"],
        learning_rate=5e-3,
        output_dir=str(tmp_path / "run"),
        seed=3,
        distillation={"teacher": tiny_model_path},
    )
    summary = GRPOLoop(c, rows=ROWS).run()
    assert summary["steps"] == 2
    rows = run_metrics(c.output_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert abs(rows[0]["distill/reverse_kl"]) < 2e-2
    for row in rows:
        for name in ("distill/reverse_kl", "distill/teacher_logp", "distill/student_logp", "reward", "loss"):
            assert math.isfinite(row[name]), (name, row)


@pytest.mark.slow
def test_a_service_without_the_teacher_is_one_line(local_server, tiny_model_path, tmp_path):
    c = config(
        base_model=tiny_model_path, lora_r=4, output_dir=str(tmp_path / "run"), distillation={"teacher": "no-such"}
    )
    with pytest.raises(PyTrioLoopError) as caught:
        GRPOLoop(c, rows=ROWS).run()
    assert "teacher 'no-such'" in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.slow
def test_a_teacher_with_another_tokenizer_is_one_line(tiny_model_path, tmp_path):
    """With ``pytrio_base_url: local`` the loop's own server also serves the teacher; its tokenizer is compared with
    the student's before the first step. (Last in this module: it points the pytrio client at its own server.)"""
    from conftest import build_tiny_model

    from trl_grpo_ext.pytrio.loop import run_from_config

    other = build_tiny_model(tmp_path / "other-teacher", vocab_size=300)
    c = config(
        base_model=tiny_model_path,
        pytrio_base_url="local",
        lora_r=4,
        max_completion_length=8,
        output_dir=str(tmp_path / "run"),
        distillation={"teacher": other},
    )
    with pytest.raises(PyTrioLoopError) as caught:
        run_from_config(c, rows=ROWS)
    text = str(caught.value)
    assert "\n" not in text and other in text and tiny_model_path in text and "tokenizer" in text
