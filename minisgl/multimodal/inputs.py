"""A vision-language request's images as the scheduler side carries them (`ImageInputs`): their 8-bit
patches and what turns them into the encoder's pixel rows (`PixelScale`, `pixel_rows`: on the device,
so that the host and the server's messages carry a byte a pixel, not the rows' eight), where their
placeholder tokens are in the prompt, the prompt's M-RoPE positions, and the prefix cache's keys of the
placeholder tokens; and what a prefill chunk takes of them
(`chunk_images`, `chunk_positions`). docs/vision.md.

M-RoPE (transformers' ``get_rope_index``): a text token's three positions (t, h, w) are equal and one
past the previous token's largest; an image's merged tokens, row by row, sit at t = s, h = s + row,
w = s + column, where s is where the image starts; the text after it starts at s + max(rows, columns).
Past the prompt every token is at its index plus `mrope_delta` (the prompt's largest position + 1 minus
its length), on all three axes.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from minisgl.core import ImageBatch, Req

if TYPE_CHECKING:
    from minisgl.models.config import ModelConfig

# prefix_key: a placeholder token's key is 2**31 plus 31 bits of a hash of its image and its index in it,
# past any vocabulary (ids < 2**24) and below LoRA's shift (2**32, minisgl.scheduler.batching)
IMAGE_KEY_BASE = 1 << 31


@dataclass(frozen=True)
class PixelScale:
    """What turns 8-bit patches into the encoder's float32 pixel rows (`pixel_rows`), from the folder's
    preprocessor config: the rescale factor (None: no rescale), each channel's mean and std (None: no
    normalization), the temporal patch (the still image is repeated over it)."""

    rescale: float | None
    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None
    temporal: int

    def numbers(self) -> torch.Tensor:
        """(2, C, 1) float32 mean and std on the host (`pixel_rows` takes them on the patches' device)."""
        assert self.mean is not None and self.std is not None
        return torch.tensor([self.mean, self.std], dtype=torch.float32).unsqueeze(-1)


def pixel_rows(patches: torch.Tensor, scale: PixelScale, numbers: torch.Tensor | None = None) -> torch.Tensor:
    """(patches, C, P * P) uint8 -> (patches, C * T * P * P) float32 rows, on the patches' device, as
    transformers computes them: the float64 product with the rescale factor rounded to float32, then
    (x - mean) / std in float32 (tensor operations: rounded alike on every device), over the temporal
    patch. `numbers`: `scale.numbers()` on that device (made here when not given)."""
    values = patches.to(torch.float32) if scale.rescale is None else patches.to(torch.float64) * scale.rescale
    values = values.to(torch.float32)
    if scale.mean is not None:
        numbers = scale.numbers().to(patches.device) if numbers is None else numbers
        values = (values - numbers[0]) / numbers[1]
    count, channels, size = patches.shape
    rows = values.unsqueeze(2).expand(count, channels, scale.temporal, size)
    return rows.reshape(count, channels * scale.temporal * size)


@dataclass(frozen=True)
class ProcessedImage:
    """One image ready for the vision encoder: `patches` (grid_h * grid_w, C, P * P) uint8, `scale` what
    makes its rows of them, and `grid_thw` (1, grid_h, grid_w); `num_tokens` placeholder tokens stand
    for it in the prompt."""

    patches: torch.Tensor
    scale: PixelScale
    grid_thw: tuple[int, int, int]
    num_tokens: int

    @property
    def pixel_values(self) -> torch.Tensor:
        """The encoder's (grid_h * grid_w, C * T * P * P) float32 rows, on the host."""
        return pixel_rows(self.patches, self.scale)


@dataclass(eq=False)
class ImageInputs:
    """The images of one prompt, in order. `pixels` (patches, C, P * P) uint8 and `grid_thw` (images, 3)
    on the host, `scale` what makes the encoder's rows of them (`pixel_rows`); `token_positions` the
    prompt positions of the placeholder tokens, image after image (one per embedding row of the
    encoder's output); `mrope_positions` (3, prompt length) and `mrope_delta` (see the module
    docstring); `cache_keys` one prefix-cache key per placeholder."""

    pixels: torch.Tensor
    scale: PixelScale
    grid_thw: torch.Tensor
    token_positions: list[int]
    mrope_positions: torch.Tensor
    mrope_delta: int
    cache_keys: list[int]

    @property
    def num_images(self) -> int:
        return self.grid_thw.shape[0]

    @classmethod
    def build(
        cls, prompt: Sequence[int], images: Sequence[ProcessedImage], image_token_id: int, merge_size: int
    ) -> ImageInputs:
        """The inputs of `prompt`, whose image_token_id tokens are the placeholders of `images` (each
        image's `num_tokens` of them, in order); ValueError where the counts differ."""
        where = [i for i, token in enumerate(prompt) if token == image_token_id]
        wanted = sum(image.num_tokens for image in images)
        if len({image.scale for image in images}) > 1:
            raise ValueError("the images of one prompt were preprocessed with different numbers")
        if len(where) != wanted:
            raise ValueError(
                f"the prompt has {len(where)} image placeholder tokens (id {image_token_id}) but its "
                f"{len(images)} image(s) need {wanted}: render the prompt with the model's chat template, "
                "each image's placeholder expanded to its number of tokens"
            )
        t, h, w = (list(range(len(prompt))) for _ in range(3))
        keys: list[int] = []
        shift, done = 0, 0  # shift: positions gained (< 0) so far; done: placeholders placed
        for image in images:
            _, grid_h, grid_w = image.grid_thw
            rows, cols = grid_h // merge_size, grid_w // merge_size
            first = where[done]
            if where[done + image.num_tokens - 1] != first + image.num_tokens - 1:
                raise ValueError(
                    f"the {image.num_tokens} placeholder tokens of an image must be consecutive in the prompt"
                )
            start = first + shift
            for k in range(image.num_tokens):
                t[first + k], h[first + k], w[first + k] = start, start + k // cols, start + k % cols
            shift += max(rows, cols) - image.num_tokens
            for j in range(first + image.num_tokens, len(prompt)):
                t[j] = h[j] = w[j] = j + shift
            keys += _token_keys(_image_digest(image), image.num_tokens)
            done += image.num_tokens
        return cls(
            pixels=images[0].patches if len(images) == 1 else torch.cat([image.patches for image in images]),
            scale=images[0].scale,
            grid_thw=torch.tensor([image.grid_thw for image in images], dtype=torch.int64),
            token_positions=where,
            mrope_positions=torch.tensor([t, h, w], dtype=torch.int64),
            mrope_delta=shift,
            cache_keys=keys,
        )

    def to_bytes(self) -> bytes:
        """The inputs as safetensors bytes (the server's front end sends them to the scheduler)."""
        from safetensors.torch import save

        tensors = {
            "pixels": self.pixels.contiguous(),
            "grid_thw": self.grid_thw,
            "token_positions": torch.tensor(self.token_positions, dtype=torch.int64),
            "mrope_positions": self.mrope_positions,
            "cache_keys": torch.tensor(self.cache_keys, dtype=torch.int64),
        }
        metadata = {"mrope_delta": str(self.mrope_delta), "scale": json.dumps(dataclasses.asdict(self.scale))}
        return save(tensors, metadata=metadata)

    @classmethod
    def from_bytes(cls, data: bytes) -> ImageInputs:
        """`to_bytes`' inputs back (safetensors: no code runs)."""
        from safetensors.torch import load

        tensors = load(data)
        metadata = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])["__metadata__"]
        scale = json.loads(metadata["scale"])
        scale.update({k: tuple(scale[k]) for k in ("mean", "std") if scale[k] is not None})
        return cls(
            pixels=tensors["pixels"],
            scale=PixelScale(**scale),
            grid_thw=tensors["grid_thw"],
            token_positions=tensors["token_positions"].tolist(),
            mrope_positions=tensors["mrope_positions"],
            mrope_delta=int(metadata["mrope_delta"]),
            cache_keys=tensors["cache_keys"].tolist(),
        )

    def prefix_key(self, key: list[int]) -> list[int]:
        """`key` (a prefix of the prompt's token ids) with each placeholder token replaced by its image's
        key: the same image after the same tokens gives the same key, another image another one."""
        for position, image_key in zip(self.token_positions, self.cache_keys):
            if position >= len(key):
                break
            key[position] = image_key
        return key


def check_images(config: ModelConfig, prompt: Sequence[int], images: ImageInputs | None) -> None:
    """Raises a ValueError naming the problem where a prompt and its images cannot run on the model of
    `config`: images for a text-only model, placeholder tokens without images, images of another prompt."""
    if images is None:
        if config.is_multimodal and config.image_token_id in prompt:
            raise ValueError(
                f"the prompt holds image placeholder tokens (id {config.image_token_id}) but no image was "
                "given: pass the images with the prompt (LLM.chat's image content parts)"
            )
        return
    if not config.is_multimodal:
        raise ValueError(f"images were given, but {config.why_no_images}")
    if images.mrope_positions.shape[1] != len(prompt):
        raise ValueError(
            f"the images were prepared for a prompt of {images.mrope_positions.shape[1]} tokens, not this "
            f"one of {len(prompt)}: build ImageInputs from this prompt"
        )


@dataclass(frozen=True)
class ImagePrompt:
    """A vision-language prompt: its token ids and their images (`minisgl.llm.LLM.chat_inputs`)."""

    token_ids: list[int]
    images: ImageInputs


def _image_digest(image: ProcessedImage) -> bytes:
    """What identifies an image's pixel values: a hash of its 8-bit patches, its grid and its scale."""
    digest = hashlib.sha256(image.patches.contiguous().numpy())
    digest.update(repr((image.grid_thw, image.scale)).encode())
    return digest.digest()


def _token_keys(digest: bytes, count: int) -> list[int]:
    """The keys of an image's `count` placeholder tokens: 31 bits each of an extendable hash of `digest`."""
    data = hashlib.shake_128(digest).digest(4 * count)
    return [IMAGE_KEY_BASE + (value >> 1) for value in struct.unpack(f"<{count}I", data)]


def batch_positions(reqs: Sequence[Req], starts: Sequence[int], ends: Sequence[int]) -> list[int]:
    """The positions of a batch computing tokens [starts[i], ends[i]) of each request: where it computes
    a prompt token of an image request, the (t, h, w) rows of every token, flattened (3 x tokens);
    otherwise one per token, index + `mrope_delta` (t = h = w: the plain rotary embedding, so decode
    batches keep 1D positions and their CUDA graphs)."""
    prompt_lens = [0 if req.images is None else req.images.mrope_positions.shape[1] for req in reqs]
    shifted = [
        list(range(start + d, end + d))
        for req, start, end in zip(reqs, starts, ends)
        for d in [0 if req.images is None else req.images.mrope_delta]
    ]
    if all(start >= n for start, n in zip(starts, prompt_lens)):
        return [p for row in shifted for p in row]
    axes: list[list[int]] = [[], [], []]
    for req, start, end, row, n in zip(reqs, starts, ends, shifted, prompt_lens):
        prompt = req.images.mrope_positions[:, start:end].tolist() if start < n else [[], [], []]
        for axis in range(3):
            axes[axis] += prompt[axis] + row[len(prompt[axis]) :]
    return axes[0] + axes[1] + axes[2]


def chunk_images(
    reqs: Sequence[Req], starts: Sequence[int], ends: Sequence[int], encode, device: torch.device
) -> ImageBatch | None:
    """The image embeddings that a prefill batch computing tokens [starts[i], ends[i]) of each request
    takes (None where no image token is among them). `encode(reqs)` runs the vision encoder once over
    the images of the requests whose first chunk that needs them this batch holds (one result per
    request); a request keeps its output until its last image token is computed."""
    spans = []  # (request, first and last index of its placeholders in this batch, its first row)
    offset = 0  # the batch row of each request's first token
    for req, start, end in zip(reqs, starts, ends):
        images: ImageInputs | None = req.images
        if images is not None:
            lo = bisect.bisect_left(images.token_positions, start)
            hi = bisect.bisect_left(images.token_positions, end)
            if hi > lo:
                spans.append((req, lo, hi, offset - start))
        offset += end - start
    if not spans:
        return None
    fresh = [req for req, *_ in spans if req.image_embeds is None]
    if fresh:
        for req, out in zip(fresh, encode(fresh)):
            req.image_embeds = out
    rows: list[int] = []
    embeds: list[torch.Tensor] = []
    deepstack: list[list[torch.Tensor]] = []
    for req, lo, hi, shift in spans:
        full, stack = req.image_embeds
        rows += [shift + p for p in req.images.token_positions[lo:hi]]
        embeds.append(full[lo:hi])
        deepstack.append([d[lo:hi] for d in stack])
        if hi == len(req.images.token_positions):  # the batch holds what it needs of them
            req.image_embeds = None
    index = torch.tensor(rows, dtype=torch.int64, pin_memory=device.type == "cuda")
    return ImageBatch(
        index.to(device, non_blocking=True),
        torch.cat(embeds),
        [torch.cat(layer) for layer in zip(*deepstack)],
    )
