"""Images in a chat request, decoded and bounded, with no HTTP in them.

A dialect turns each image part of a message into an :class:`ImageSource`
(what the request said: a data URL, a remote URL, or a media type and its
base64), unread. The pipeline then decodes each one off the event loop
(:func:`decode_source`) into an :class:`ImageInput`: a PIL RGB image, as
mlx-vlm's own ``load_image`` makes one (EXIF orientation applied), with the
SHA-256 of its source bytes (what the prompt cache keys its tokens by).

Every check runs before the next costs more: the count of images, then the
encoded size (before base64 is decoded), the decoded size, the media type,
then the size the image's header claims (read by ``PIL.Image.open``, which is
lazy) against the pixel bound, and only then are its pixels decoded. A
decoding bomb (a tiny PNG whose header claims 100,000 x 100,000 pixels) is
refused before any pixel buffer exists. PIL's own guard stays on behind this
check (it raises DecompressionBombError past twice ``Image.MAX_IMAGE_PIXELS``),
and truncated images are refused (``ImageFile.LOAD_TRUNCATED_IMAGES`` is left
False). Each refusal is an :class:`InvalidRequest` (a 400) naming the part
and the bound.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from ..config import VisionConfig
from ..errors import InvalidRequest

if TYPE_CHECKING:
    from PIL.Image import Image

# media type -> PIL's format name: what OpenAI and Anthropic take (png, jpeg, webp, gif: its first frame).
MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP",
               "image/gif": "GIF"}
FORMATS = tuple(sorted(set(MEDIA_TYPES.values())))
REMOTE_FLAG = "--allow-remote-images"
FETCH_SECONDS = 10.0  # a remote image's fetch: each wait, and the time after which nothing more is taken
MAX_REDIRECTS = 3  # redirects a remote image's fetch follows
_DATA_URL = re.compile(r"data:(?P<type>[^;,]*)(?P<params>(;[^;,]*)*),(?P<data>.*)", re.DOTALL)


@dataclass(frozen=True)
class ImageLimits:
    """What one request's images may be (`mola serve`'s --max-image-bytes,
    --max-image-pixels, --max-images-per-request, --allow-remote-images)."""

    max_bytes: int = VisionConfig.max_image_bytes  # an image's source bytes (20 MiB: OpenAI's bound is 20 MB)
    max_pixels: int = VisionConfig.max_image_pixels  # width x height of one image, read from its header
    max_images: int = VisionConfig.max_images_per_request  # images in one request, over all its messages
    allow_remote: bool = VisionConfig.allow_remote_images  # fetch http(s) image URLs (off: refused, a 400)

    def __post_init__(self):
        for name in ("max_bytes", "max_pixels", "max_images"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")

    @classmethod
    def of(cls, vision: VisionConfig) -> ImageLimits:
        """The limits `mola serve`'s flags set."""
        return cls(max_bytes=vision.max_image_bytes, max_pixels=vision.max_image_pixels,
                   max_images=vision.max_images_per_request, allow_remote=vision.allow_remote_images)


@dataclass(frozen=True)
class ImageSource:
    """An image part as a request gave it, not yet read: a ``url`` (``data:``
    or http(s)), or a ``media_type`` and its base64 ``data``. ``param`` is the
    request field it came from (errors name it)."""

    param: str
    url: str | None = None
    media_type: str | None = None
    data: str | None = None


@dataclass(frozen=True)
class ImageInput:
    """A decoded image: equal to another when its source bytes are (``image`` is not compared)."""

    image: Image = field(compare=False, repr=False)  # PIL, mode RGB, EXIF orientation applied
    sha256: str  # hex digest of the source bytes (the encoded file, not the pixels)
    width: int
    height: int
    nbytes: int  # the source bytes' length
    media_type: str  # what the bytes are, as PIL read them (image/png, ...)


def decode_source(source: ImageSource, limits: ImageLimits) -> ImageInput:
    """``source`` read, checked against ``limits`` and decoded (raises InvalidRequest)."""
    if source.url is not None:
        return decode_data_url(source.url, limits, limits.allow_remote, param=source.param)
    return decode_base64_source(source.media_type, source.data, limits, param=source.param)


def decode_data_url(url: str, limits: ImageLimits, allow_remote: bool = False,
                    param: str | None = None) -> ImageInput:
    """A ``data:image/...;base64,...`` URL (or, with ``allow_remote``, an
    http(s) URL fetched within ``limits.max_bytes``) as an ImageInput."""
    if not isinstance(url, str) or not url:
        raise InvalidRequest("An image URL must be a non-empty string.", param=param)
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("http", "https"):
        if not allow_remote:
            raise InvalidRequest(
                f"Remote image URLs are not fetched by this server ({_short(url)}): send the image inline "
                f"as a data: URL (base64), or start the server with {REMOTE_FLAG}.", param=param)
        return decode_bytes(_fetch(url, limits, param), None, limits, param)
    match = _DATA_URL.fullmatch(url) if scheme == "data" else None
    if match is None:
        raise InvalidRequest(f"Unsupported image URL {_short(url)}: expected a data: URL "
                             "('data:image/png;base64,...') or an http(s) URL.", param=param)
    if "base64" not in [p.strip().lower() for p in match["params"].split(";")]:
        raise InvalidRequest(f"The image data URL {_short(url)} is not base64: expected "
                             "'data:<media type>;base64,<data>'.", param=param)
    return decode_base64_source(match["type"].strip().lower() or None, match["data"], limits, param)


def decode_base64_source(media_type: str | None, data: str, limits: ImageLimits,
                         param: str | None = None) -> ImageInput:
    """Base64 ``data`` declared as ``media_type`` (Anthropic's base64 source) as an ImageInput."""
    if media_type is not None and media_type.lower() not in MEDIA_TYPES:
        raise InvalidRequest(f"Unsupported image media type {media_type!r}; supported: "
                             f"{', '.join(sorted(MEDIA_TYPES))}.", param=param)
    if not isinstance(data, str) or not data:
        raise InvalidRequest("The image's base64 data is missing or empty.", param=param)
    compact = "".join(data.split())  # line breaks inside base64 are common
    if len(compact) // 4 * 3 > limits.max_bytes + 3:  # refused before decoding
        raise _too_big(len(compact) // 4 * 3, limits, param)
    try:
        raw = base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError) as e:
        raise InvalidRequest(f"The image data is not valid base64 ({e}).", param=param) from None
    return decode_bytes(raw, media_type, limits, param)


def decode_bytes(raw: bytes, media_type: str | None, limits: ImageLimits, param: str | None = None) -> ImageInput:
    """An image file's bytes, checked (size, format, the header's pixels) before its pixels are decoded."""
    from PIL import Image, ImageOps

    if len(raw) > limits.max_bytes:
        raise _too_big(len(raw), limits, param)
    try:
        im = Image.open(io.BytesIO(raw), formats=FORMATS)  # lazy: the header only
    except Image.DecompressionBombError:  # PIL's own guard, past twice Image.MAX_IMAGE_PIXELS
        raise InvalidRequest(
            f"The image's header claims more than {2 * Image.MAX_IMAGE_PIXELS} pixels; at most "
            f"{limits.max_pixels} are taken per image (--max-image-pixels).", param=param) from None
    except Exception:  # UnidentifiedImageError, and whatever a format's header parser raises on bad bytes
        raise InvalidRequest(f"The image could not be read as any of {', '.join(FORMATS)} "
                             f"({len(raw)} bytes; declared {media_type or 'no media type'}).", param=param) from None
    width, height = im.size  # what the header claims
    if width < 1 or height < 1 or width * height > limits.max_pixels:
        raise InvalidRequest(
            f"The image's header claims {width} x {height} = {width * height} pixels; at most "
            f"{limits.max_pixels} are taken per image (--max-image-pixels).", param=param)
    try:
        im.load()  # the pixels, bounded by the size just checked
        rgb = ImageOps.exif_transpose(im).convert("RGB")  # as mlx_vlm.utils.load_image
    except Exception as e:  # PIL raises OSError, SyntaxError, ValueError, struct.error... on bad data
        raise InvalidRequest(f"The image is truncated or corrupt: its {im.format} data could not be "
                             f"decoded ({type(e).__name__}: {e}).", param=param) from None
    return ImageInput(image=rgb, sha256=hashlib.sha256(raw).hexdigest(), width=rgb.width, height=rgb.height,
                      nbytes=len(raw), media_type=Image.MIME.get(im.format, f"image/{im.format.lower()}"))


def count_images(messages: list[dict]) -> int:
    """Image parts in chat messages (sources or decoded)."""
    return sum(1 for m in messages if isinstance(m.get("content"), list)
               for part in m["content"] if part.get("type") == "image")


def first_image_param(messages: list[dict]) -> str | None:
    """The request field of the first image part (errors about images as a whole name it)."""
    return next((part["source"].param for m in messages if isinstance(m.get("content"), list)
                 for part in m["content"] if part.get("type") == "image" and "source" in part), None)


def check_count(messages: list[dict], limits: ImageLimits, param: str = "messages") -> int:
    """The request's images counted against ``limits.max_images`` (before any is decoded)."""
    n = count_images(messages)
    if n > limits.max_images:
        raise InvalidRequest(f"The request has {n} images; at most {limits.max_images} are taken per "
                             "request (--max-images-per-request).", param=param)
    return n


def decode_messages(messages: list[dict], limits: ImageLimits) -> list[dict]:
    """Chat messages whose image parts ``{"type": "image", "source": ImageSource}``
    become ``{"type": "image", "image": ImageInput}`` (run off the event loop)."""
    check_count(messages, limits)
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            m = {**m, "content": [_decoded(part, limits) for part in content]}
        out.append(m)
    return out


def _decoded(part: dict[str, Any], limits: ImageLimits) -> dict[str, Any]:
    if part.get("type") != "image" or "source" not in part:
        return part
    return {"type": "image", "image": decode_source(part["source"], limits)}


def _fetch(url: str, limits: ImageLimits, param: str | None, seconds: float = FETCH_SECONDS,
           clock: Callable[[], float] = time.monotonic) -> bytes:
    """An http(s) image's bytes, at most ``limits.max_bytes`` of them read (a
    Content-Length over it is refused unread), in ``seconds``: every wait is
    bounded by it, and the fetch is refused at the first response (a redirect's
    too, at most MAX_REDIRECTS of them) or chunk that comes after it (twice
    ``seconds`` at worst), so that no request holds a worker thread for long."""
    import httpx

    start, chunks, total = clock(), [], 0

    def in_time(_=None) -> None:
        if clock() - start > seconds:
            raise InvalidRequest(f"The image at {_short(url)} was not fetched within {seconds:g} s; "
                                 "send it inline as a data: URL.", param=param)

    try:
        with httpx.Client(timeout=seconds, follow_redirects=True, max_redirects=MAX_REDIRECTS,
                          event_hooks={"response": [in_time]}) as client, client.stream("GET", url) as response:
            response.raise_for_status()
            declared = response.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > limits.max_bytes:
                raise _too_big(int(declared), limits, param)
            for chunk in response.iter_bytes():
                total += len(chunk)
                if total > limits.max_bytes:
                    raise _too_big(total, limits, param)
                in_time()
                chunks.append(chunk)
    except httpx.HTTPError as e:
        raise InvalidRequest(f"The image at {_short(url)} could not be fetched ({e}).", param=param) from None
    return b"".join(chunks)


def _too_big(nbytes: int, limits: ImageLimits, param: str | None) -> InvalidRequest:
    return InvalidRequest(f"The image is {nbytes} bytes or more; at most {limits.max_bytes} are taken per "
                          "image (--max-image-bytes).", param=param)


def _short(url: str, keep: int = 60) -> str:
    """A URL cut short for an error message (a data URL can be megabytes)."""
    return repr(url if len(url) <= keep else url[:keep] + "...")
