"""The event loop's side of images: a request's names and paths -> jobs on the
worker's queue -> base64 PNGs. Never touches an array.

Which LoRA a request uses:
* ``model``: the image base's name (or none) alone, or an image adapter's name
  (``--image-adapter NAME=PATH``) at its start scale times the request's ``lora_scale``;
* ``lora-paths`` / ``lora-scales`` (MLX Omni Server's fields): files stacked on top,
  each under the adapter policy of text adapters (mola.registry.sources: the
  ``--adapter-dir`` roots, ``--allow-any-adapter-path``), checked before anything
  at the path is opened.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import random
from dataclasses import dataclass
from pathlib import Path

from ..errors import InvalidAdapter, InvalidRequest, ModelNotFound
from ..registry.sources import AdapterSources
from .request import (
    ImageJob,
    LoRAUse,
    check_n,
    check_prompt,
    check_scale,
    check_seed,
    check_steps,
    pair_paths,
    parse_size,
)
from .worker import ImageWorker

log = logging.getLogger("mola.images")


@dataclass(frozen=True)
class ImageAsk:
    """A request's fields, as the route read them (each checked here)."""

    prompt: str
    model: str | None = None
    n: int | None = None
    size: str | None = None
    seed: int | None = None
    steps: int | None = None
    lora_scale: float | None = None
    lora_paths: list[str] | None = None
    lora_scales: list[float] | None = None


class ImageService:
    def __init__(self, name: str, worker: ImageWorker, sources: AdapterSources, adapters: dict[str, LoRAUse]):
        self.name = name  # the image base's model id
        self.worker = worker
        self.sources = sources
        self.adapters = adapters  # adapter name -> its file and start scale
        self._rng = random.Random()

    @classmethod
    def from_config(cls, config) -> ImageService:
        """The service a ServeConfig with an image model describes (not started)."""
        images = config.images
        sources = AdapterSources(
            adapter_dirs=config.adapter_dirs,
            named_paths=[a.path for a in images.adapters if Path(a.path).expanduser().exists()],
            allow_any_path=config.allow_any_adapter_path, allow_symlinks=config.allow_adapter_symlinks,
            resolver_dirs=[r.root for r in config.adapter_resolvers if r.kind == "dir"])
        adapters = {a.name: LoRAUse(lora_file(sources.resolve(a.path), a.name), a.scale) for a in images.adapters}
        worker = ImageWorker(images.model.path, images.dtype, images.max_batch, images.max_lora_rank)
        return cls(images.model.name, worker, sources, adapters)

    def start(self) -> None:
        """Load the model on the worker thread (blocking until loaded)."""
        self.worker.start()
        log.info("serving images from %s as %s (%d adapters)", self.worker.path, self.name, len(self.adapters))

    def stop(self) -> None:
        self.worker.stop()

    def jobs(self, ask: ImageAsk) -> list[ImageJob]:
        """The images ``ask`` wants, each checked (raising the 4xx error that names the field)."""
        prompt = check_prompt(ask.prompt)
        width, height = parse_size(ask.size)
        steps, n = check_steps(ask.steps), check_n(ask.n)
        seed = check_seed(ask.seed, self._rng)
        loras = self.named_lora(ask.model, ask.lora_scale)
        for path, scale in pair_paths(ask.lora_paths, ask.lora_scales):
            loras.append(LoRAUse(lora_file(self.sources.resolve_request_path(path), path, "lora-paths"), scale))
        return [ImageJob(prompt, seed + i, width, height, steps, tuple(loras)) for i in range(n)]

    def named_lora(self, model: str | None, lora_scale: float | None) -> list[LoRAUse]:
        if lora_scale is not None:
            lora_scale = check_scale(lora_scale, "lora_scale")
        if model is None or model == self.name:
            if lora_scale is not None:
                raise InvalidRequest(f"lora_scale scales an image adapter; model {model or self.name!r} is the "
                                     "base (name an adapter as model, or use lora-paths and lora-scales).",
                                     param="lora_scale")
            return []
        if model not in self.adapters:
            raise ModelNotFound(model)
        use = self.adapters[model]
        return [LoRAUse(use.path, use.scale * (1.0 if lora_scale is None else lora_scale))]

    async def generate(self, ask: ImageAsk) -> list[str]:
        """The request's images, base64 PNGs, in order."""
        future = self.worker.submit(self.jobs(ask))
        pngs = await asyncio.wrap_future(future)
        return [base64.b64encode(p).decode("ascii") for p in pngs]


def lora_file(real: str, given: str, param: str = "model") -> str:
    """The .safetensors file of an image LoRA at ``real``: the file, or the only
    .safetensors file of a directory."""
    path = Path(real)
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if len(files) != 1:
            raise InvalidAdapter(f"the image LoRA directory {given!r} must hold one .safetensors file; it holds "
                                 f"{len(files)}.", param=param)
        path = files[0]
    if path.suffix != ".safetensors":
        raise InvalidAdapter(f"an image LoRA is a .safetensors file; {given!r} is not.", param=param)
    return str(path)
