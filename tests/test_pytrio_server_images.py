"""Image inputs of the local PyTRIO server on a tiny random Qwen3.5 image-text model (CPU, fp32; Qwen3-VL and
Qwen2.5-VL for sampling and prompt log-probs): sampling, prompt
log-probs and forward/backward of inputs with an image chunk equal a direct forward of the whole model, positions that
score an image placeholder carry no loss, and bad images, wrong ``expected_tokens`` and images sent to a text-only
model are refused with a clear error."""

from __future__ import annotations

import io
import struct
import zlib

import pytest
import torch
from PIL import Image
from pytrio.protocol.actor.model_input import WireEncodedTextChunk, WireImageChunk

from trl_grpo_ext.pytrio_server import images
from trl_grpo_ext.pytrio_server.adapters import LoraSettings
from trl_grpo_ext.pytrio_server.errors import EngineError
from trl_grpo_ext.pytrio_server.forward import ForwardDatum
from trl_grpo_ext.pytrio_server.loss_fns import parse_loss

IMAGE_TOKENS = 8  # a 20x28 (w x h) image, resized to 16x32: 4x8 patches of 4 pixels, 2x4 tokens after 2x2 merging


def png(width=20, height=28, color=(10, 200, 30)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buffer, format="PNG")
    return buffer.getvalue()


def jpeg(width=20, height=28) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 90)).save(buffer, format="JPEG")
    return buffer.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims `width` x `height` pixels, with almost no pixel data (a decompression bomb's shape)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    )


def chunks(engine, data=None, fmt="png", expected=None, after="<|vision_end|> What is 3 + 4?"):
    """A prompt as a client that splits its rendered chat prompt at the image placeholder sends it."""
    tok = engine.tokenizer
    return [
        WireEncodedTextChunk(tokens=tok.encode("user <|vision_start|>")),
        WireImageChunk(data=data if data is not None else png(), format=fmt, expected_tokens=expected),
        WireEncodedTextChunk(tokens=tok.encode(after)),
    ]


@pytest.fixture(scope="module")
def vision_engine(tiny_vision_model_path):
    from trl_grpo_ext.pytrio_server.engine import ModelEngine

    return ModelEngine(tiny_vision_model_path, bf16=False)


def direct_logits(engine, vision, extra=(), adapter_model=None) -> torch.Tensor:
    """Logits of the whole model on `vision`'s input (+ `extra` tokens), as transformers runs it on its own: the
    model computes its 3D positions from ``mm_token_type_ids`` itself."""
    ids = torch.tensor([vision.tokens + list(extra)])
    model = adapter_model if adapter_model is not None else engine.base
    return (
        model(
            input_ids=ids,
            pixel_values=vision.pixel_values,
            image_grid_thw=vision.image_grid_thw,
            mm_token_type_ids=(ids == vision.image_token_id).int(),
        )
        .logits[0]
        .float()
    )


def test_an_image_chunk_becomes_its_placeholder_tokens(vision_engine):
    vision = vision_engine.vision_input(chunks(vision_engine, expected=IMAGE_TOKENS))
    assert sum(vision.image_slots) == IMAGE_TOKENS
    first = vision.image_slots.index(True)
    assert vision.tokens[first - 1] == vision_engine.tokenizer.convert_tokens_to_ids("<|vision_start|>")
    assert vision.tokens[first + IMAGE_TOKENS] == vision_engine.tokenizer.convert_tokens_to_ids("<|vision_end|>")
    # the count a client gets as 09-vision-grpo computes it (processor patches // merge_size**2)
    processor = vision_engine.image_processor
    assert processor.get_number_of_image_patches(28, 20, images_kwargs={}) // processor.merge_size**2 == IMAGE_TOKENS
    assert vision_engine.vision_input(chunks(vision_engine, data=jpeg(), fmt="jpeg")).image_grid_thw.shape == (1, 3)


def test_sampled_group_logprobs_equal_a_direct_forward(vision_engine):
    vision = vision_engine.vision_input(chunks(vision_engine, expected=IMAGE_TOKENS))
    results = vision_engine.sample(None, vision.tokens, num_samples=4, max_tokens=6, seed=5, vision=vision)
    assert len(results) == 4 and len({tuple(r.tokens) for r in results}) > 1
    with torch.no_grad():
        for r in results:
            logits = direct_logits(vision_engine, vision, r.tokens[:-1])
            start = len(vision.tokens) - 1  # the last prompt position scores the first sampled token
            expected = torch.log_softmax(logits[start:], -1).gather(-1, torch.tensor(r.tokens)[:, None]).squeeze(-1)
            torch.testing.assert_close(torch.tensor(r.logprobs), expected, rtol=0, atol=1e-4)
    again = vision_engine.sample(None, vision.tokens, num_samples=4, max_tokens=6, seed=5, vision=vision)
    assert [r.tokens for r in again] == [r.tokens for r in results]  # same seed, same tokens


def test_prompt_logprobs_equal_a_direct_forward_and_skip_image_slots(vision_engine):
    vision = vision_engine.vision_input(chunks(vision_engine))
    values, top = vision_engine.prompt_logprobs(None, vision.tokens, topk=2, vision=vision)
    with torch.no_grad():
        logits = direct_logits(vision_engine, vision)[:-1]
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(vision.tokens[1:])[:, None]).squeeze(-1)
    assert values[0] is None and len(values) == len(vision.tokens)
    for i, (value, slot) in enumerate(zip(values, vision.image_slots, strict=True)):
        if i == 0 or slot:
            assert value is None and (top[i] is None)
        else:
            assert value == pytest.approx(float(expected[i - 1]), abs=1e-4)
            assert len(top[i]) == 2


@pytest.mark.parametrize("auto_shift", [False, True])
def test_forward_backward_matches_a_direct_computation_without_loss_on_image_slots(vision_engine, auto_shift):
    engine = vision_engine
    prompt = engine.vision_input(chunks(engine))
    completion = engine.tokenizer.encode(" The answer is 7")
    # the datum's input as 09-vision-grpo builds it: the prompt's chunks, then the completion but its last token
    vision = engine.vision_input([*chunks(engine), WireEncodedTextChunk(tokens=completion[:-1])])
    tokens = vision.tokens
    assert tokens == prompt.tokens + completion[:-1]
    sequence = prompt.tokens + completion
    # hostile targets at the image positions: they must change nothing
    targets = sequence if auto_shift else sequence[1:]
    targets = [t if t != vision.image_token_id else 3 for t in targets][: len(tokens)]
    weights = [0.5 + (i % 3) for i in range(len(tokens))]
    run_id = f"img{int(auto_shift)}"
    run = engine.create_run(run_id, LoraSettings(rank=4, seed=1))
    spec = parse_loss("cross_entropy", None)
    outputs, metrics = engine.forward(
        run_id, [ForwardDatum(tokens, targets, weights, vision=vision)], spec, backward=True, auto_shift=auto_shift
    )
    got = {name: p.grad.clone() for name, p in run.params if p.grad is not None}
    assert got and all(torch.isfinite(g).all() for g in got.values())
    assert any(float(g.abs().max()) > 0 for g in got.values())
    for _, p in run.params:
        p.grad = None

    # the direct computation: the whole model with the run's adapter, positions scoring an image slot masked
    slots = torch.tensor(vision.image_slots)
    scored = slots if auto_shift else torch.cat([slots[1:], torch.tensor([False])])
    if auto_shift:
        scored[0] = True  # no position predicts the first label
    engine._activate(run.adapter, trainable=True)
    logits = direct_logits(engine, vision, adapter_model=engine.peft)
    if auto_shift:
        logits = torch.cat([logits.new_zeros(1, logits.shape[-1]), logits[:-1]])
    logprobs = torch.log_softmax(logits, -1).gather(-1, torch.tensor(targets)[:, None]).squeeze(-1)
    logprobs = torch.where(scored, torch.zeros_like(logprobs), logprobs)
    loss = -(logprobs * torch.tensor(weights)).sum()
    loss.backward()
    want = {name: p.grad.clone() for name, p in run.params if p.grad is not None}
    for _, p in run.params:
        p.grad = None
    engine.drop_run(run_id)

    out = outputs[0]
    assert float(metrics["loss_sum"]) == pytest.approx(float(loss.detach()), rel=1e-5)
    assert metrics["token_count"] == int((~scored).sum())
    assert (out["elementwise_loss"][scored.numpy()] == 0).all() and (out["logprobs"][scored.numpy()] == 0).all()
    torch.testing.assert_close(torch.tensor(out["logprobs"]), logprobs.detach(), rtol=0, atol=1e-5)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6)


def test_expected_tokens_mismatch_is_refused(vision_engine):
    with pytest.raises(EngineError, match="expected_tokens is 5, but the model's processor makes 8") as error:
        vision_engine.vision_input(chunks(vision_engine, expected=5))
    assert error.value.code == "image_tokens_mismatch"


def test_images_sent_to_a_text_only_model_are_refused(engine):
    with pytest.raises(EngineError, match="has no vision tower") as error:
        engine.vision_input(chunks(engine))
    assert error.value.code == "images_not_supported"


@pytest.mark.parametrize(
    ("data", "fmt", "code", "message"),
    [
        (b"\x89PNG\r\n\x1a\n not really a png", "png", "invalid_image", "cannot decode the png image"),
        (b"GIF89a....", "png", "invalid_image", "not a png image"),
        (jpeg(), "png", "invalid_image", "not a png image"),
        (png(), "jpeg", "invalid_image", "not a jpeg image"),
        (png_header_only(5000, 5000), "png", "image_too_large", "5000x5000 pixels exceeds the limit of"),
        (png_header_only(20000, 20000), "png", "image_too_large", "decompression bomb"),
    ],
    ids=["truncated", "gif", "jpeg-as-png", "png-as-jpeg", "too-many-pixels", "pillow-bomb"],
)
def test_malformed_images_are_refused(vision_engine, data, fmt, code, message):
    with pytest.raises(EngineError, match=message) as error:
        vision_engine.vision_input(chunks(vision_engine, data=data, fmt=fmt))
    assert error.value.code == code


def test_oversized_image_bytes_and_bombs_are_refused(vision_engine, monkeypatch):
    monkeypatch.setattr(images, "MAX_IMAGE_BYTES", 64)
    with pytest.raises(EngineError, match="bytes exceeds the limit of 64 bytes") as error:
        vision_engine.vision_input(chunks(vision_engine))
    assert error.value.code == "image_too_large"
    monkeypatch.undo()
    # Pillow's own decompression-bomb limit, where below ours, is a refusal too (Pillow alone would only warn)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 400)  # 560 pixels: above it, below twice it
    with pytest.raises(EngineError, match="20x28 pixels exceeds the limit of 400 pixels") as error:
        vision_engine.vision_input(chunks(vision_engine))
    assert error.value.code == "image_too_large"


def test_transparent_pixels_are_composited_onto_white(vision_engine):
    buffer = io.BytesIO()
    Image.new("RGBA", (20, 28), (0, 0, 0, 0)).save(buffer, format="PNG")
    transparent = vision_engine.vision_input(chunks(vision_engine, data=buffer.getvalue()))
    white = vision_engine.vision_input(chunks(vision_engine, data=png(color=(255, 255, 255))))
    assert torch.equal(transparent.pixel_values, white.pixel_values)


def test_placeholder_ids_in_text_chunks_are_refused(vision_engine):
    bad = chunks(vision_engine)
    bad[0] = WireEncodedTextChunk(tokens=[*bad[0].tokens, vision_engine.base.config.image_token_id])
    with pytest.raises(EngineError, match="may not hold the image placeholder") as error:
        vision_engine.vision_input(bad)
    assert error.value.code == "invalid_tokens"


def test_mask_image_targets_positions():
    class Vision:
        image_slots = [False, False, True, True, False]

    targets = [10, 11, 12, 13, 14]
    assert images.mask_image_targets(targets, Vision(), auto_shift=False) == [10, -100, -100, 13, 14]
    assert images.mask_image_targets(targets, Vision(), auto_shift=True) == [10, 11, -100, -100, 14]
    assert images.mask_image_targets(targets, None, auto_shift=False) == targets


def test_without_vision_an_image_text_checkpoint_serves_its_language_model(vision_engine, tiny_vision_model_path):
    from trl_grpo_ext.pytrio_server.engine import ModelEngine

    text_engine = ModelEngine(tiny_vision_model_path, bf16=False, vision=False)
    assert not text_engine.accepts_images and type(text_engine.base).__name__ == "Qwen3_5ForCausalLM"
    with pytest.raises(EngineError, match="has no vision tower") as error:
        text_engine.vision_input(chunks(text_engine))
    assert error.value.code == "images_not_supported"
    # the same language model either way: text prompts score the same
    prompt = text_engine.tokenizer.encode("What is 3 + 4? The answer is 7")
    with_vision, _ = vision_engine.prompt_logprobs(None, prompt)
    without, _ = text_engine.prompt_logprobs(None, prompt)
    assert without[0] is None and with_vision[0] is None
    torch.testing.assert_close(torch.tensor(without[1:]), torch.tensor(with_vision[1:]), rtol=0, atol=1e-5)


@pytest.mark.parametrize("bf16_sampling", [False, True])
def test_bf16_engines_take_images(vision_engine, tiny_vision_model_path, bf16_sampling):
    """bf16 autocast in training (and, with ``bf16_sampling``, bf16 frozen linears, the vision tower's included):
    every image path runs, and its numbers are the fp32 engine's to bf16 rounding."""
    from trl_grpo_ext.pytrio_server.engine import ModelEngine

    engine = ModelEngine(tiny_vision_model_path, bf16=True, bf16_sampling=bf16_sampling)
    assert engine.autocast_bf16 and engine.sample_bf16 == bf16_sampling
    vision = engine.vision_input(chunks(engine))
    got, _ = engine.prompt_logprobs(None, vision.tokens, vision=vision)
    want, _ = vision_engine.prompt_logprobs(None, vision.tokens, vision=vision)
    assert [g is None for g in got] == [w is None for w in want]
    assert max(abs(g - w) for g, w in zip(got, want, strict=True) if g is not None) < 0.05
    assert len(engine.sample(None, vision.tokens, num_samples=2, max_tokens=3, seed=1, vision=vision)) == 2
    run = engine.create_run("bf16", LoraSettings(rank=4, seed=0))
    datum = ForwardDatum(vision.tokens, [*vision.tokens[1:], 5], [1.0] * len(vision.tokens), vision=vision)
    _, metrics = engine.forward("bf16", [datum], parse_loss("cross_entropy", None), backward=True, auto_shift=False)
    assert metrics["token_count"] == len(vision.tokens) - sum(vision.image_slots)
    assert all(torch.isfinite(p.grad).all() for _, p in run.params if p.grad is not None)


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen2_5_vl"])
def test_other_qwen_vl_families_sample_and_score_images_as_a_direct_forward(tmp_path, family):
    from conftest import build_tiny_vision_model

    from trl_grpo_ext.pytrio_server.engine import ModelEngine

    engine = ModelEngine(build_tiny_vision_model(tmp_path / family, family=family), bf16=False)
    assert engine.accepts_images and engine.base.config.model_type == family
    vision = engine.vision_input(chunks(engine, expected=IMAGE_TOKENS))
    results = engine.sample(None, vision.tokens, num_samples=3, max_tokens=5, seed=2, vision=vision)
    values, _ = engine.prompt_logprobs(None, vision.tokens, vision=vision)
    with torch.no_grad():
        for r in results:
            logits = direct_logits(engine, vision, r.tokens[:-1])[len(vision.tokens) - 1 :]
            expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r.tokens)[:, None]).squeeze(-1)
            torch.testing.assert_close(torch.tensor(r.logprobs), expected, rtol=0, atol=1e-4)
        logits = direct_logits(engine, vision)[:-1]
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(vision.tokens[1:])[:, None]).squeeze(-1)
    scored = [(v, float(e)) for v, e in zip(values[1:], expected, strict=True) if v is not None]
    assert len(scored) == len(vision.tokens) - 1 - IMAGE_TOKENS
    assert max(abs(v - e) for v, e in scored) < 1e-4
