"""The rows of a vision-language base (mola.models.vision), as the runner
feeds them: a prefill batch's input embeddings, the images' features merged
into its image rows, and every row's multimodal positions [3, G, W]; a decode
step's positions, each row's cache offset plus its rope delta.

An image row's embeddings and positions over its whole prompt are computed
once, when its prefill starts (the vision tower runs then, on the engine
thread); each chunk takes its columns of them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from ..models.vision import decode_positions
from .sequence import Sequence


@dataclass(frozen=True)
class VisionPrompt:
    """A prompt's images as mlx-vlm's processor made them (on the tokenizer
    thread): what the vision tower takes, and what the prompt cache keys."""

    # The processor's image arrays by its names, as numpy: pixel_values (Qwen2-VL: [N, C * T * P * P]
    # patches; Idefics3: [1, I, C, H, W] tiles), image_grid_thw [I, 3], pixel_attention_mask, ...
    arrays: dict[str, Any]
    hashes: tuple[str, ...]  # sha256 of each image's source bytes
    num_image_tokens: int  # of the prompt's tokens, those the images' features replace


@dataclass
class ImageRows:
    """One image row of a prefill batch, over its prefilled tokens."""

    embeds: mx.array | None  # [L, D] input embeddings, image features merged in; None: the tokens' own
    positions: np.ndarray  # [3, L] int multimodal positions


def start_rows(model, routing, members: list[Sequence], done: list[int]) -> list[ImageRows | None]:
    """Each member's ImageRows (None: a text row); sets each image row's
    ``rope_delta``. The vision tower runs for a member whose images are not
    all in its first ``done`` tokens (those its cache holds already): for
    the others, only their positions are computed. The embedding runs under
    the member's own routing (an embedding LoRA)."""
    rows: list[ImageRows | None] = []
    for s, d in zip(members, done):
        if s.vision is None:
            rows.append(None)
            continue
        tokens, arrays = s.context[:-1], {k: mx.array(a) for k, a in s.vision.arrays.items()}
        if d > max((i for i, t in enumerate(tokens) if t == model.image_token_id), default=-1):  # cached: no tower
            embeds, (positions, s.rope_delta) = None, model.image_positions(tokens, arrays)
        else:
            routing.set([s.slot], [s.lora_scale])
            embeds, positions, s.rope_delta = model.image_rows(tokens, arrays)
            mx.eval(embeds)
            embeds = embeds[0]
        positions = np.array(positions[:, 0, :]) if positions is not None \
            else np.broadcast_to(np.arange(len(tokens))[None], (3, len(tokens)))  # a 1-D family's: the index
        rows.append(ImageRows(embeds, positions))
    return rows


def prefill_inputs(model, batch, tokens: mx.array, start: int, end: int) -> dict:
    """The model's ``embeds`` [G, W, D] (None when no row has an image) and
    ``positions`` [3, G, W] of columns [start, end) of a PrefillBatch whose
    member i starts at position ``done[i]``; ``tokens`` [G, W] are those columns'."""
    rows, done = batch.images, batch.done
    G, W = tokens.shape
    positions = np.arange(start, end)[None, :] + np.array(done)[:, None]  # [G, W] text positions
    positions = np.broadcast_to(positions[None], (3, G, W)).copy()
    if all(r is None for r in rows):
        return {"embeds": None, "positions": mx.array(positions)}
    plain = model.model.embed_tokens(tokens)  # [G, W, D]
    out = []
    for i, r in enumerate(rows):
        if r is None:
            out.append(plain[i])
            continue
        first, last = done[i] + start, min(done[i] + end, r.positions.shape[1])
        n = max(0, last - first)  # real columns; the rest is right padding
        positions[:, i, :n] = r.positions[:, first:last]
        if r.embeds is None:  # its images are in the cached prefix: these columns are text
            out.append(plain[i])
            continue
        out.append(mx.concatenate([r.embeds[first:last], plain[i, n:]]) if n < W else r.embeds[first:last])
    return {"embeds": mx.stack(out), "positions": mx.array(positions)}


def decode_inputs(cache: list, rows: list[Sequence]) -> dict:
    """The model's ``positions`` [3, B, 1] of a decode step: each row's
    tokens so far plus its rope delta (0: a text row)."""
    deltas = mx.array([s.rope_delta for s in rows], dtype=mx.int32)  # [B]
    return {"positions": decode_positions(cache, deltas, 1)}


def check_vision_engine(config, path) -> None:
    """A vision base's rows need what mola's engine gives every row of it:
    ModelLoadError naming the setting it does not serve one with."""
    from ..errors import ModelLoadError

    if config.speculative is not None:
        raise ModelLoadError(f"{path} is a vision model; mola does not decode one speculatively (a verify "
                             "pass would need each row's multimodal positions): serve it without --speculative")
    if config.kv_quant is not None:
        raise ModelLoadError(f"{path} is a vision model; mlx-vlm's attention does not read mola's quantized "
                             "KV cache: serve it without --kv-bits")
