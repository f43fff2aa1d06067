"""OpenAI's image generation, on the image base (docs/images.md):

    POST /v1/images/generations  {"prompt", "model"?, "n"?, "size"?, "response_format"?: "b64_json",
                                  "seed"?, "steps"?, "lora_scale"?, "lora-paths"?, "lora-scales"?}
                                 -> {"created", "data": [{"b64_json"}], "output_format": "png"}

``model`` is the image base's name or an image adapter's (``lora_scale`` scales
it); ``lora-paths`` / ``lora-scales`` are MLX Omni Server's fields, held to the
adapter directories. Images come back as base64 PNGs only: a ``url`` would need
mola to keep files and serve them.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from ...errors import InvalidRequest
from ...images.service import ImageAsk, ImageService

router = APIRouter()


class ImageRequest(BaseModel):
    """OpenAI's CreateImageRequest, with mola's and MLX Omni Server's extensions.
    Fields OpenAI has that change nothing here (quality, style, user, background,
    moderation) are taken and ignored."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    prompt: str
    model: str | None = None
    n: int | None = None
    size: str | None = None
    response_format: str | None = None  # b64_json only
    output_format: str | None = None  # png only
    stream: bool | None = None  # not streamed
    seed: int | None = None  # mola: the first image's seed (image i: seed + i)
    steps: int | None = None  # mola: denoising steps (default 4, FLUX.2-klein's)
    lora_scale: float | None = None  # mola: multiplies the adapter ``model`` names
    lora_paths: list[str] | None = Field(default=None, alias="lora-paths")
    lora_scales: list[float] | None = Field(default=None, alias="lora-scales")

    def ask(self) -> ImageAsk:
        if self.response_format not in (None, "b64_json"):
            raise InvalidRequest(f"response_format {self.response_format!r} is not served: mola returns images "
                                 "as base64 PNGs only ('b64_json').", param="response_format")
        if self.output_format not in (None, "png"):
            raise InvalidRequest(f"output_format {self.output_format!r} is not served; images are PNGs ('png').",
                                 param="output_format")
        if self.stream:
            raise InvalidRequest("stream is not served for images.", param="stream")
        return ImageAsk(prompt=self.prompt, model=self.model, n=self.n, size=self.size, seed=self.seed,
                        steps=self.steps, lora_scale=self.lora_scale, lora_paths=self.lora_paths,
                        lora_scales=self.lora_scales)


def image_service(request: Request) -> ImageService:
    service = getattr(request.app.state, "images", None)
    if service is None:
        raise InvalidRequest("This server serves no image model: start it with --image-model NAME=PATH "
                             "(docs/images.md).", param="model")
    return service


@router.post("/v1/images/generations")
async def generate_images(body: ImageRequest, request: Request) -> dict[str, Any]:
    service = image_service(request)
    images = await service.generate(body.ask())
    return {"created": int(time.time()), "data": [{"b64_json": b} for b in images], "output_format": "png"}
