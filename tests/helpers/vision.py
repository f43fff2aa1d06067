"""Images in chat (mola/frontend/images_in.py) and vision-language bases:
image files made by PIL, a PNG whose header lies, data URLs, and whether
mlx-vlm may be missing (skipped, saying why) or must be there (CI:
MOLA_REQUIRE_VISION=1 fails instead)."""

from __future__ import annotations

import base64
import io
import os
import struct
import zlib

import pytest

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


INSTALL = "pip install -e '.[vision]' and pip install --no-deps mlx-vlm==0.7.10 (docs/vision.md)"


def _require(module: str, reason: str):
    """``module``, imported: a test module without it is skipped, saying why,
    or fails where MOLA_REQUIRE_VISION=1 (CI installs the vision extra)."""
    if os.environ.get("MOLA_REQUIRE_VISION") == "1":
        import importlib

        return importlib.import_module(module)  # CI: a missing module fails here
    return pytest.importorskip(module, reason=reason)


def require_mlx_vlm():
    """mlx_vlm (vision-language bases), or a skip saying how to install it."""
    return _require("mlx_vlm", f"vision-language bases need mlx-vlm: {INSTALL}")


def require_pillow():
    """PIL.Image (images in chat), or a skip saying how to install it."""
    return _require("PIL.Image", f"images in chat need pillow: {INSTALL}")


def image_bytes(fmt: str, size: tuple[int, int], color=(90, 160, 30), mode: str = "RGB", noise: bool = False) -> bytes:
    """A real image file of ``size`` in PIL's format ``fmt`` (PNG, JPEG, TIFF...):
    one colour, or seeded noise (which compresses badly: a larger file)."""
    from PIL import Image

    if noise:
        import numpy as np

        pixels = np.random.default_rng(0).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
        im = Image.fromarray(pixels, "RGB")
    else:
        im = Image.new(mode, size, color)
    out = io.BytesIO()
    im.save(out, format=fmt)
    return out.getvalue()


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def crafted_png(width: int, height: int) -> bytes:
    """A PNG whose IHDR claims ``width`` x ``height`` (8-bit RGB, CRC correct)
    followed by a few bytes of pixel data: a decoding bomb when the claim is
    huge, a truncated image when it is not."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    return PNG_SIGNATURE + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


def data_url(raw: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(raw).decode()}"
