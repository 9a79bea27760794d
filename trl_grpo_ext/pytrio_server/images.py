"""Image inputs of the local server: decoding a client's image chunks safely, and the model inputs they become.

A PyTRIO ``ModelInput`` may hold ``ImageChunk``s (png or jpeg bytes, base64 in JSON, raw bytes in MessagePack, with the
client's ``expected_tokens``) beside its token chunks. On an image-text model (a transformers
``...ForConditionalGeneration`` with a vision tower, Qwen-VL style: Qwen3.5, Qwen3-VL, Qwen2.5-VL) each image becomes
as many copies of the model's image placeholder token as its processor makes tokens of it (the client's
``expected_tokens``), and its pixels go to the vision tower (`VisionInput`). The client's text around the image carries the vision start/end tokens of the chat
template, as a client that splits the rendered prompt at the placeholder sends them.

Every image is checked before the model sees it (`decode_image`): its bytes at most `MAX_IMAGE_BYTES`, its signature
and Pillow's format the declared one, its size at most `MAX_IMAGE_PIXELS` pixels (and Pillow's own
decompression-bomb limit, ``PIL.Image.MAX_IMAGE_PIXELS``) before any pixel is decoded. The processor's token count
must equal ``expected_tokens`` (when sent): a client that counted differently would see its log-probs and loss at the
wrong positions.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import torch

from trl_grpo_ext.pytrio_server.errors import EngineError

MAX_IMAGE_BYTES = 16 * 1024 * 1024  # encoded bytes of one image
MAX_IMAGE_PIXELS = 4096 * 4096  # width x height of one image, checked from its header before decoding
MAX_IMAGES_PER_INPUT = 16  # image chunks in one model input
SIGNATURES = {"png": (b"\x89PNG\r\n\x1a\n",), "jpeg": (b"\xff\xd8\xff",)}
PILLOW_FORMATS = {"png": "PNG", "jpeg": "JPEG"}


class ImageInputError(EngineError):
    """A bad image chunk (undecodable, too large, wrong format, token count mismatch, or a text-only model)."""


def decode_image(data: bytes, fmt: str, where: str = "image"):
    """The RGB `PIL.Image` of `data` declared as `fmt` ("png" or "jpeg"), or `ImageInputError` saying what is wrong."""
    from PIL import Image

    if fmt not in SIGNATURES:
        raise ImageInputError("invalid_image", f"{where}: format must be png or jpeg, got {fmt!r}")
    if not isinstance(data, (bytes, bytearray)) or not data:
        raise ImageInputError("invalid_image", f"{where}: image data must be non-empty bytes")
    if len(data) > MAX_IMAGE_BYTES:
        raise ImageInputError(
            "image_too_large", f"{where}: {len(data)} bytes exceeds the limit of {MAX_IMAGE_BYTES} bytes per image"
        )
    if not bytes(data[:8]).startswith(SIGNATURES[fmt]):
        raise ImageInputError("invalid_image", f"{where}: the bytes are not a {fmt} image (wrong signature)")
    try:
        image = Image.open(io.BytesIO(bytes(data)), formats=[PILLOW_FORMATS[fmt]])  # reads the header only
        width, height = image.size
        # Pillow's decompression-bomb limit counts as ours (it would only warn below twice its value); no global
        # warnings filter is changed: request threads decode concurrently
        limit = min(MAX_IMAGE_PIXELS, Image.MAX_IMAGE_PIXELS or MAX_IMAGE_PIXELS)
        if width * height > limit:
            raise ImageInputError(
                "image_too_large", f"{where}: {width}x{height} pixels exceeds the limit of {limit} pixels per image"
            )
        image.load()
        return _rgb(image)
    except ImageInputError:
        raise
    except Image.DecompressionBombError as error:
        raise ImageInputError("image_too_large", f"{where}: {error}") from None
    except Exception as error:  # noqa: BLE001 - any undecodable image is the client's error
        raise ImageInputError("invalid_image", f"{where}: cannot decode the {fmt} image: {error}") from None


def _rgb(image):
    """`image` in RGB, transparency composited onto white (what transformers' ``convert_to_rgb`` does, and what a
    client that renders its image onto white before encoding it sends)."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


@dataclass
class VisionInput:
    """A model input with images, as the model takes it: the token sequence with each image's placeholder tokens
    (``tokens``), the vision tower's inputs, and the 3D (M-RoPE) positions of every token."""

    tokens: list[int]
    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor  # (images, 3)
    image_token_id: int
    position_ids: torch.Tensor  # (3, 1, len(tokens))
    rope_delta: int  # position of the token after the input minus its index (decoding continues from there)
    patches: int  # vision tower positions, for the memory estimate

    @property
    def image_slots(self) -> list[bool]:
        """Whether each position of `tokens` is an image placeholder."""
        return [t == self.image_token_id for t in self.tokens]

    def model_kwargs(self, device: torch.device) -> dict:
        """Keyword arguments of one forward of the image-text model on this input, its 3D positions given (the
        model would otherwise keep them between calls, shared by every request)."""
        ids = torch.tensor([self.tokens], device=device)
        return {
            "input_ids": ids,
            "pixel_values": self.pixel_values.to(device),
            "image_grid_thw": self.image_grid_thw.to(device),
            "mm_token_type_ids": (ids == self.image_token_id).int(),
            "position_ids": self.position_ids.to(device),
        }


def memory_positions(tokens: int, vision: VisionInput | None) -> int:
    """Positions an input costs in the server's memory estimates: its tokens, plus for an input with images its
    vision tower's positions (counted as tokens: an estimate of the tower's working memory)."""
    return tokens + (vision.patches if vision is not None else 0)


class ImageInputs:
    """The part of `ModelEngine` that turns chunks with images into a `VisionInput` (uses ``base``,
    ``image_processor`` (None on a text-only model) and ``model_path``)."""

    image_processor = None

    @property
    def accepts_images(self) -> bool:
        return self.image_processor is not None

    def vision_features(self, vision: VisionInput, **kwargs) -> torch.Tensor:
        """(1, T, F) per-position features of `vision` with the active adapter, as `TokenLogprobs.decode` gives them
        for tokens: the last hidden states where the output layer runs apart (``split_head``), else the logits."""
        inputs = vision.model_kwargs(self.device)
        if self.split_head:
            return self.base.model(**inputs, **kwargs).last_hidden_state
        return (self.peft if self.peft is not None else self.base)(**inputs, **kwargs).logits

    def vision_input(self, chunks: list) -> VisionInput:
        """`VisionInput` of pytrio wire chunks (``type`` "encoded_text" with ``tokens``, or "image" with ``data``,
        ``format``, ``expected_tokens``), or `ImageInputError`."""
        if not self.accepts_images:
            raise ImageInputError(
                "images_not_supported",
                f"the served model {self.model_path} has no vision tower: it takes text (token) chunks only",
            )
        images = [c for c in chunks if getattr(c, "type", "") == "image"]
        if len(images) > MAX_IMAGES_PER_INPUT:
            raise ImageInputError(
                "too_many_images", f"{len(images)} image chunks exceed the limit of {MAX_IMAGES_PER_INPUT} per input"
            )
        config = self.base.config
        image_id = int(config.image_token_id)
        merge = int(self.image_processor.merge_size)
        tokens: list[int] = []
        pixels, grids = [], []
        for index, chunk in enumerate(chunks):
            where = f"chunks[{index}]"
            if getattr(chunk, "type", "") != "image":
                if image_id in chunk.tokens:
                    raise ImageInputError(
                        "invalid_tokens",
                        f"{where}: token chunks may not hold the image placeholder id {image_id} (send an image chunk)",
                    )
                tokens.extend(chunk.tokens)
                continue
            image = decode_image(chunk.data, chunk.format, where)
            out = self.image_processor(images=[image], return_tensors="pt")
            grid = out["image_grid_thw"]
            count = int(grid.prod()) // merge**2
            if chunk.expected_tokens is not None and chunk.expected_tokens != count:
                raise ImageInputError(
                    "image_tokens_mismatch",
                    f"{where}: expected_tokens is {chunk.expected_tokens}, but the model's processor makes {count} "
                    f"tokens of this {image.width}x{image.height} image",
                )
            tokens.extend([image_id] * count)
            pixels.append(out["pixel_values"])
            grids.append(grid)
        ids = torch.tensor([tokens])
        grid = torch.cat(grids)
        positions, delta = self.base.model.get_rope_index(ids, (ids == image_id).int(), image_grid_thw=grid)
        return VisionInput(
            tokens=tokens,
            pixel_values=torch.cat(pixels),
            image_grid_thw=grid,
            image_token_id=image_id,
            position_ids=positions,
            rope_delta=int(delta.reshape(-1)[0]),
            patches=int(sum(int(g.prod()) for g in grid)),
        )


def load_image_processor(model_path: str, config):
    """The image processor of an image-text checkpoint (Pillow backend: no torchvision needed), or None for a model
    without a vision tower."""
    if getattr(config, "vision_config", None) is None or getattr(config, "image_token_id", None) is None:
        return None
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(model_path, backend="pil")


def is_image_text(config) -> bool:
    """Whether `config` is one of an image-text model this server runs with its vision tower (Qwen-VL style: an
    image placeholder token, 3D positions from ``get_rope_index``)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return (
        getattr(config, "vision_config", None) is not None
        and getattr(config, "image_token_id", None) is not None
        and config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
        and config.model_type.startswith(("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5"))
    )


def mask_image_targets(targets: list[int], vision: VisionInput | None, auto_shift: bool) -> list[int]:
    """`targets` with -100 (no log-prob, no loss, not counted) wherever the token a position scores is an image
    placeholder: the placeholder's id says nothing of the image, so predicting it is no training signal. Without
    `auto_shift` position i scores the input's token i + 1; with it, label i is the input's token i."""
    if vision is None:
        return targets
    slots = vision.image_slots
    offset = 0 if auto_shift else 1
    return [-100 if i + offset < len(slots) and slots[i + offset] else target for i, target in enumerate(targets)]
