"""Shared fixtures: a tiny, randomly initialised chat model saved to disk (no hub access)."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("SWANLAB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite compares runs bitwise (resume, parity); a thread count that follows CI's load changes only speed
# here, but torch does not promise the same reductions at every count: tests pin it (test_cpu_threads turns the
# governor on where it tests it).
os.environ.setdefault("TRL_GRPO_EXT_CPU_THREADS", "fixed")

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_model(path, vocab_size=512, seed=0, hidden_size=32, num_attention_heads=4, num_key_value_heads=2):
    """Write a tiny Llama-style causal LM and a BPE tokenizer trained on digits and math words to `path` (the vLLM
    tests use ``hidden_size=128, num_attention_heads=2``: a head size of 64, one vLLM's CPU attention supports)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<|pad|>", "<|im_start|>", "<|im_end|>"]
    corpus = [
        "What is 3 + 4? The answer is \\boxed{7}. Solve the problem step by step.",
        "Natalia sold 48 clips in April and half as many in May. #### 72",
        "<think> reasoning </think> so x = 18, 1,080 dollars $18 \\frac{1}{2} 0123456789",
        "user assistant system Put your final answer within \\boxed{}.",
    ] * 20
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(specials),
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|pad|>",
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]


def build_tiny_vision_model(path, seed=0, family="qwen3_5"):
    """Write a tiny random Qwen-VL style image-text model with `build_tiny_model`'s tokenizer plus the vision tokens,
    and its image processor (Pillow backend: 4-pixel patches, 2x2 merging, one image token per 8x8 pixels).
    `family`: "qwen3_5" (`Qwen3_5ForConditionalGeneration`: one linear-attention and one full-attention layer),
    "qwen3_vl" or "qwen2_5_vl"; each with a one-block vision tower."""
    import torch
    import transformers
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

    text_path = build_tiny_model(f"{path}-text", seed=seed)
    tokenizer = AutoTokenizer.from_pretrained(text_path)
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    start, image, end, video = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    text = {
        "vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 512,
        "pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }  # fmt: skip
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "patch_size": 4,
              "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 32}  # fmt: skip
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}
    if family == "qwen3_5":
        text.update(linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                    layer_types=["linear_attention", "full_attention"])  # fmt: skip
        vision.update(num_position_embeddings=64)
        config_class, model_class = transformers.Qwen3_5Config, transformers.Qwen3_5ForConditionalGeneration
    elif family == "qwen3_vl":
        text.update(rope_parameters={**rope, "mrope_interleaved": True})
        vision.update(num_position_embeddings=64, deepstack_visual_indexes=[0])
        config_class, model_class = transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration
    elif family == "qwen2_5_vl":
        text.update(rope_parameters=rope)
        vision.update(fullatt_block_indexes=[0], window_size=16)
        config_class, model_class = transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration
    else:
        raise ValueError(f"unknown family {family!r}")
    config = config_class(
        text_config=text, vision_config=vision, image_token_id=image, video_token_id=video,
        vision_start_token_id=start, vision_end_token_id=end,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = model_class(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    processor = Qwen2VLImageProcessorPil(
        patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=64, max_pixels=32 * 32
    )
    processor.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_vision_model_path(tmp_path_factory):
    """Path of a tiny random Qwen3.5 image-text model with its tokenizer and image processor."""
    return build_tiny_vision_model(tmp_path_factory.mktemp("tiny-vision") / "model")


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """Path of a tiny random chat model (Llama architecture, ~60k parameters) with a chat template."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    """One local PyTRIO server `ModelEngine` on the tiny model for a module's servers (model loading dominates), in
    fp32 whatever the CPU: the server tests compare numbers exactly (the bf16 variants make their own engines)."""
    from trl_grpo_ext.pytrio_server.engine import ModelEngine

    return ModelEngine(tiny_model_path, bf16=False)


@pytest.fixture
def make_server(engine, tiny_model_path, tmp_path):
    """``make(**ServerConfig options)``: a started local PyTRIO server on `engine` (storage under `tmp_path`), the
    process's pytrio client pointed at it; every server made is stopped after the test."""
    from trl_grpo_ext.pytrio_server import LocalPyTrioServer, ServerConfig

    started = []

    def make(**options):
        options.setdefault("storage_dir", str(tmp_path / "storage"))
        server = LocalPyTrioServer(ServerConfig(model=tiny_model_path, **options), engine=engine).start()
        server.configure_client(home=str(tmp_path / "trio-home"), retry_initial_delay_seconds=0.05)
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()


@pytest.fixture
def packed_layout(monkeypatch):
    """The prefix engine's cost model answering "packed" wherever rows share something: at the tiny model's shapes
    it keeps padded rows (one more attention call outweighs the few tokens saved), and these tests are of the packed
    path (the TRL trainer's and the local PyTRIO server's)."""
    monkeypatch.setattr("trl_grpo_ext.prefix.packing.packed_is_cheaper", lambda packed, padded: True)


@pytest.fixture
def prefix_engine_calls(monkeypatch):
    """Counts of the prefix engine's token-row planner and packed forwards that the local PyTRIO server's `forward`
    calls (``{"plan": n, "packed": m}``), so a test fails if the server stops sharing through the engine."""
    from trl_grpo_ext.prefix.packing import PackedBatch
    from trl_grpo_ext.pytrio_server import forward as server_forward

    calls = {"plan": 0, "packed": 0}
    plan, forward_kwargs = server_forward.plan_token_rows, PackedBatch.forward_kwargs

    def counted_plan(*args, **kwargs):
        calls["plan"] += 1
        return plan(*args, **kwargs)

    def counted_forward(self, model):
        calls["packed"] += 1
        return forward_kwargs(self, model)

    monkeypatch.setattr(server_forward, "plan_token_rows", counted_plan)
    monkeypatch.setattr(PackedBatch, "forward_kwargs", counted_forward)
    return calls
