"""Local PyTRIO server: the OpenAI-compatible chat-completions route (``/api/openai/v1``), with the `openai` client."""

from __future__ import annotations

import pytest

trio = pytest.importorskip("pytrio")
openai = pytest.importorskip("openai")

KEY_A, KEY_B = "alice-" + "a" * 24, "bob-" + "b" * 24
MESSAGES = [{"role": "system", "content": "Solve it."}, {"role": "user", "content": "What is 3 + 4?"}]


@pytest.fixture
def server(make_server):
    return make_server(api_key=KEY_A, api_keys=(KEY_B,))


def _client(server, key=KEY_A):
    return openai.OpenAI(base_url=f"{server.base_url}/api/openai/v1", api_key=key, max_retries=0, timeout=120)


def _prompt(server, messages=MESSAGES):
    tok = server.engine.tokenizer
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def _pytrio_texts(sampler, server, n, **params):
    prompt = trio.ModelInput.from_ints(_prompt(server))
    out = sampler.sample(prompt, num_samples=n, sampling_params=trio.SamplingParams(**params)).result()
    return [s.text for s in out.sequences], [s.stop_reason for s in out.sequences], out


def test_chat_completion_is_the_sample_apis_completion(server):
    client = _client(server)
    sampler = trio.ServiceClient().create_sampling_client(base_model=server.model_alias)
    for params in ({"max_tokens": 8, "temperature": 0.0}, {"max_tokens": 10, "temperature": 1.0, "seed": 5}):
        texts, reasons, out = _pytrio_texts(sampler, server, 3, **params)
        answer = client.chat.completions.create(model=server.model_alias, messages=MESSAGES, n=3, **params)
        assert [c.message.content for c in answer.choices] == texts
        assert [c.finish_reason for c in answer.choices] == reasons
        assert [c.index for c in answer.choices] == [0, 1, 2] and answer.choices[0].message.role == "assistant"
        assert answer.usage.prompt_tokens == len(_prompt(server)) == out.input_tokens
        assert answer.usage.completion_tokens == out.output_tokens
        assert answer.model == server.model_alias and answer.object == "chat.completion"
    # max_completion_tokens is max_tokens' newer name; a stop string is left out of the text
    full = client.chat.completions.create(model=server.model_alias, messages=MESSAGES, max_completion_tokens=8,
                                          temperature=0)  # fmt: skip
    text = full.choices[0].message.content
    assert len(text) >= 4  # the tiny model's greedy tokens decode to a few characters
    stop = text[2:4]
    cut = client.chat.completions.create(
        model=server.model_alias, messages=MESSAGES, max_tokens=8, temperature=0, stop=[stop]
    )
    assert cut.choices[0].message.content == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_streaming_sends_the_same_completion_as_events(server):
    client = _client(server)
    params = {"model": server.model_alias, "messages": MESSAGES, "max_tokens": 9, "temperature": 1.0, "seed": 3}
    whole = client.chat.completions.create(n=2, **params)
    parts = {0: "", 1: ""}
    finish, roles, usage = {}, set(), None
    with client.chat.completions.create(n=2, stream=True, stream_options={"include_usage": True}, **params) as stream:
        for chunk in stream:
            assert chunk.object == "chat.completion.chunk"
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                parts[choice.index] += choice.delta.content or ""
                roles.add(choice.delta.role)
                if choice.finish_reason:
                    finish[choice.index] = choice.finish_reason
    assert [parts[0], parts[1]] == [c.message.content for c in whole.choices]
    assert [finish[0], finish[1]] == [c.finish_reason for c in whole.choices]
    assert "assistant" in roles and usage.total_tokens == whole.usage.total_tokens


def test_trio_checkpoint_models_are_the_keys_own(server):
    service = trio.ServiceClient()
    tc = service.create_lora_training_client(base_model=server.model_alias, rank=4, seed=2)
    tokens = _prompt(server)
    datum = trio.Datum(
        model_input=trio.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:]}
    )
    for _ in range(3):
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(trio.AdamParams(learning_rate=0.1)).result()
    path = tc.save_weights_for_sampler("chat").result().path
    assert path.startswith("trio://")
    sampler = service.create_sampling_client(server.model_alias, model_path=path)
    texts, _, _ = _pytrio_texts(sampler, server, 2, max_tokens=8, temperature=1.0, seed=9)
    mine = _client(server).chat.completions.create(model=path, messages=MESSAGES, n=2, max_tokens=8, seed=9)
    assert [c.message.content for c in mine.choices] == texts and mine.model == path
    # another key: exactly the answer of a checkpoint that does not exist
    with pytest.raises(openai.NotFoundError) as theirs:
        _client(server, KEY_B).chat.completions.create(model=path, messages=MESSAGES, max_tokens=4)
    with pytest.raises(openai.NotFoundError) as missing:
        _client(server, KEY_B).chat.completions.create(model=path + "x", messages=MESSAGES, max_tokens=4)
    assert theirs.value.body["code"] == missing.value.body["code"] == "checkpoint_not_found"
    with pytest.raises(openai.NotFoundError) as unknown:
        _client(server).chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=4)
    assert unknown.value.body["code"] == "model_not_found" and "--served-name" in unknown.value.body["message"]


@pytest.mark.parametrize(
    ("params", "says"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"n": 0}, "num_samples"),
        ({"n": 10_000}, "max-num-samples"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 10**6}, "context"),
        ({"max_tokens": 4, "max_completion_tokens": 4}, "not both"),
        ({"seed": 2**70}, "seed"),
        ({"stop": [1, 2]}, "stop"),
        ({"logprobs": True}, "logprobs"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"extra_body": {"best_of": 3}}, "best_of"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "text"),
        ({"extra_body": {"stream": "yes"}}, "stream"),
    ],
)
def test_bad_parameters_are_400(server, params, says):
    request = {"model": server.model_alias, "messages": MESSAGES, "max_tokens": 4, **params}
    if "max_completion_tokens" in params:
        request.pop("max_tokens")
        request.update(params)
    with pytest.raises(openai.BadRequestError) as error:
        _client(server).chat.completions.create(**request)
    assert says in error.value.body["message"], error.value.body


def test_models_lists_the_served_names_and_keys_are_checked(server):
    listed = [m.id for m in _client(server).models.list()]
    assert listed == [server.model_alias]
    with pytest.raises(openai.AuthenticationError):
        _client(server, "not-a-key").models.list()
    with pytest.raises(openai.AuthenticationError):
        _client(server, "not-a-key").chat.completions.create(model=server.model_alias, messages=MESSAGES)


def test_the_listing_holds_the_keys_own_checkpoints_and_the_judge_reward_uses_one(server, monkeypatch):
    import asyncio

    from trl_grpo_ext.task.rewards.judge import make_judge_reward

    service = trio.ServiceClient()
    tc = service.create_lora_training_client(base_model=server.model_alias, rank=4, seed=2)
    path = tc.save_weights_for_sampler("judge").result().path
    assert [m.id for m in _client(server).models.list()] == [server.model_alias, path]
    assert [m.id for m in _client(server, KEY_B).models.list()] == [server.model_alias]  # not another key's
    monkeypatch.setenv("TRIO_JUDGE_KEY", KEY_A)
    judge = make_judge_reward({"base_url": f"{server.base_url}/api/openai/v1", "model": path,
                               "rubric": "Score the answer from 1 to 10.", "api_key_env": "TRIO_JUDGE_KEY",
                               "retries": 0, "max_tokens": 4})  # fmt: skip
    judge.preflight()  # the judge's start-up check: the server lists the model
    metrics = {}
    scores = asyncio.run(judge(["7", "8"], prompts=["What is 3 + 4?"] * 2, log_metric=metrics.__setitem__))
    assert len(scores) == 2  # the tiny model's replies rarely parse as a score: None is fine
    assert metrics["judge/requests"] == 2 and metrics["judge/failures"] == 0


def test_a_sampling_only_model_is_served_and_listed(make_server, tmp_path):
    """A model served for sampling only (`--model NAME=PATH`, a distillation teacher) answers chat completions under
    its name, as its PyTRIO sampler samples it, and `GET models` lists it."""
    from conftest import build_tiny_model

    teacher = build_tiny_model(tmp_path / "teacher", seed=1)
    server = make_server(api_key=KEY_A, sampling_models=(f"Qwen/Qwen3.6-27B={teacher}",))
    listed = [m.id for m in _client(server).models.list()]
    assert listed == [server.model_alias, "Qwen/Qwen3.6-27B"]
    sampler = trio.ServiceClient().create_sampling_client(base_model="Qwen/Qwen3.6-27B")
    texts, reasons, _ = _pytrio_texts(sampler, server, 2, max_tokens=8, temperature=1.0, seed=4)
    answer = _client(server).chat.completions.create(model="Qwen/Qwen3.6-27B", messages=MESSAGES, n=2, max_tokens=8,
                                                     temperature=1.0, seed=4)  # fmt: skip
    assert [c.message.content for c in answer.choices] == texts and answer.model == "Qwen/Qwen3.6-27B"
    student = _client(server).chat.completions.create(model=server.model_alias, messages=MESSAGES, n=2, max_tokens=8,
                                                      temperature=1.0, seed=4)  # fmt: skip
    assert [c.message.content for c in student.choices] != texts  # the teacher's own weights, not the student's
