"""What one image request asks for, checked at the boundary. Plain Python: no
arrays, no mflux; the route builds an :class:`ImageJob` and the worker runs it."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from ..errors import InvalidRequest

SIZE_STEP = 16  # FLUX.2: 8x VAE downsampling, then 2x2 patches
MIN_SIDE = 64
MAX_SIDE = 1024
MAX_STEPS = 50
DEFAULT_STEPS = 4  # FLUX.2-klein is distilled for 4 steps (mflux's default)
MAX_N = 4
MAX_PROMPT_CHARS = 4000
MAX_LORAS = 8  # LoRA files one request may stack
MAX_SEED = 2**32 - 1  # mflux seeds mx.random.key with it


@dataclass(frozen=True)
class LoRAUse:
    """One LoRA file of a request, at a scale: delta = scale * (x @ A) @ B."""

    path: str  # the checked real path of the .safetensors file
    scale: float


@dataclass(frozen=True)
class ImageJob:
    """One image to make: one row of a batch."""

    prompt: str
    seed: int
    width: int
    height: int
    steps: int
    loras: tuple[LoRAUse, ...] = ()  # empty: the base alone; several: a stack, summed

    @property
    def shape_key(self) -> tuple[int, int, int]:
        """Rows batch together when they share these: (width, height, steps)."""
        return self.width, self.height, self.steps


def parse_size(size: str | None) -> tuple[int, int]:
    """"WxH" (each a multiple of 16 in 64..1024) -> (width, height); None or "auto": 1024x1024."""
    if size is None or size == "auto":
        return MAX_SIDE, MAX_SIDE
    w, sep, h = str(size).partition("x")
    if not (sep and w.isdigit() and h.isdigit()):
        raise InvalidRequest(f"size must be 'WIDTHxHEIGHT' such as '512x512', got {size!r}.", param="size")
    width, height = int(w), int(h)
    for side in (width, height):
        if not (MIN_SIDE <= side <= MAX_SIDE and side % SIZE_STEP == 0):
            raise InvalidRequest(f"size {size!r}: each side must be a multiple of {SIZE_STEP} from {MIN_SIDE} "
                                 f"to {MAX_SIDE}.", param="size")
    return width, height


def check_steps(steps: int | None) -> int:
    if steps is None:
        return DEFAULT_STEPS
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
        raise InvalidRequest(f"steps must be an integer from 1 to {MAX_STEPS}, got {steps!r}.", param="steps")
    return steps


def check_n(n: int | None) -> int:
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise InvalidRequest(f"n must be an integer from 1 to {MAX_N}, got {n!r}.", param="n")
    return n


def check_seed(seed: int | None, rng: random.Random) -> int:
    """The request's seed (image i gets seed + i), or a random one."""
    if seed is None:
        return rng.randrange(MAX_SEED - MAX_N)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED - MAX_N:
        raise InvalidRequest(f"seed must be an integer from 0 to {MAX_SEED - MAX_N}, got {seed!r}.", param="seed")
    return seed


def check_prompt(prompt: str) -> str:
    if not isinstance(prompt, str) or not prompt.strip():
        raise InvalidRequest("prompt must be a non-empty string.", param="prompt")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise InvalidRequest(f"prompt is {len(prompt)} characters; at most {MAX_PROMPT_CHARS}.", param="prompt")
    return prompt


def check_scale(value, param: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequest(f"{param} must be a finite number, got {value!r}.", param=param)
    if abs(value) > 100:
        raise InvalidRequest(f"{param} must lie in -100..100, got {value!r}.", param=param)
    return float(value)


def pair_paths(paths: list[str] | None, scales: list[float] | None) -> list[tuple[str, float]]:
    """MLX Omni Server's ``lora-paths`` and ``lora-scales`` -> (path, scale) pairs
    (scales default to 1.0 each, as mflux's)."""
    if paths is None:
        if scales is not None:
            raise InvalidRequest("lora-scales needs lora-paths.", param="lora-scales")
        return []
    if not isinstance(paths, list) or not all(isinstance(p, str) and p for p in paths):
        raise InvalidRequest("lora-paths must be a list of .safetensors paths.", param="lora-paths")
    if len(paths) > MAX_LORAS:
        raise InvalidRequest(f"lora-paths names {len(paths)} files; at most {MAX_LORAS}.", param="lora-paths")
    if scales is None:
        scales = [1.0] * len(paths)
    if not isinstance(scales, list) or len(scales) != len(paths):
        raise InvalidRequest(f"lora-scales must give one number per lora-paths entry ({len(paths)}).",
                             param="lora-scales")
    return [(p, check_scale(s, "lora-scales")) for p, s in zip(paths, scales)]
