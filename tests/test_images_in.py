"""mola.frontend.images_in: images in chat requests decoded and bounded, on
real PNG/JPEG bytes made by PIL and on hand-crafted bad ones (a PNG whose
header claims more pixels than its data could hold, with a valid CRC); with
--allow-remote-images, fetched from a local HTTP server, bounded in bytes and
in time (a clock passed in)."""

from __future__ import annotations

import base64
import hashlib
import http.server
import itertools
import struct
import threading
import tracemalloc
import zlib

import pytest

from helpers.vision import crafted_png, data_url, image_bytes, require_pillow

Image = require_pillow()


from mola.errors import InvalidRequest  # noqa: E402
from mola.frontend.images_in import (ImageLimits, ImageSource, _fetch, check_count, decode_base64_source,  # noqa: E402
                                     decode_data_url, decode_messages, decode_source)

LIMITS = ImageLimits()


def test_a_png_decodes_to_its_own_pixels_with_the_hash_of_its_bytes():
    raw = image_bytes("PNG", (5, 3), color=(200, 10, 30))
    got = decode_data_url(data_url(raw), LIMITS)
    assert (got.width, got.height, got.nbytes) == (5, 3, len(raw))
    assert got.sha256 == hashlib.sha256(raw).hexdigest()
    assert got.image.mode == "RGB" and got.image.getpixel((4, 2)) == (200, 10, 30)
    assert got.media_type == "image/png"


def test_a_jpeg_decodes_and_an_rgba_png_becomes_rgb():
    jpeg = image_bytes("JPEG", (16, 8), color=(0, 128, 255))
    got = decode_base64_source("image/jpeg", base64.b64encode(jpeg).decode(), LIMITS)
    assert (got.width, got.height, got.media_type) == (16, 8, "image/jpeg")
    r, g, b = got.image.getpixel((8, 4))  # lossy: near the colour, not at it
    assert abs(r - 0) < 8 and abs(g - 128) < 8 and abs(b - 255) < 8
    rgba = image_bytes("PNG", (2, 2), color=(1, 2, 3, 4), mode="RGBA")
    assert decode_data_url(data_url(rgba), LIMITS).image.mode == "RGB"


@pytest.mark.parametrize("fmt, media_type", [("WEBP", "image/webp"), ("GIF", "image/gif")])
def test_webp_and_gif_decode(fmt, media_type):
    raw = image_bytes(fmt, (5, 7), color=(0, 0, 255))
    got = decode_data_url(data_url(raw, media_type), LIMITS)
    assert (got.width, got.height, got.media_type) == (5, 7, media_type)
    assert max(abs(a - b) for a, b in zip(got.image.getpixel((2, 3)), (0, 0, 255))) < 8  # WebP is lossy


def test_the_same_bytes_are_equal_inputs_and_different_bytes_are_not():
    a, b = image_bytes("PNG", (4, 4), color=(1, 1, 1)), image_bytes("PNG", (4, 4), color=(2, 2, 2))
    assert decode_data_url(data_url(a), LIMITS) == decode_data_url(data_url(a), LIMITS)
    assert decode_data_url(data_url(a), LIMITS) != decode_data_url(data_url(b), LIMITS)


def test_line_breaks_in_base64_are_taken():
    raw = image_bytes("PNG", (3, 3))
    text = base64.encodebytes(raw).decode()  # 76-character lines
    assert "\n" in text
    assert decode_base64_source("image/png", text, LIMITS).nbytes == len(raw)


@pytest.mark.parametrize("data, words", [
    ("not base64 at all!", "not valid base64"),
    ("QUJD=QUJD", "not valid base64"),  # padding in the middle
    ("", "missing or empty"),
])
def test_malformed_base64_is_refused_naming_it(data, words):
    with pytest.raises(InvalidRequest, match=words) as e:
        decode_base64_source("image/png", data, LIMITS, param="messages[0].content[1]")
    assert e.value.param == "messages[0].content[1]"


def test_an_unsupported_media_type_is_refused_naming_it():
    with pytest.raises(InvalidRequest, match="'image/tiff'"):
        decode_base64_source("image/tiff", base64.b64encode(image_bytes("PNG", (2, 2))).decode(), LIMITS)
    with pytest.raises(InvalidRequest, match="'text/plain'"):
        decode_data_url("data:text/plain;base64,aGVsbG8=", LIMITS)


def test_bytes_that_are_no_image_are_refused():
    with pytest.raises(InvalidRequest, match="could not be read"):
        decode_data_url(data_url(b"hello, this is text"), LIMITS)
    tiff = image_bytes("TIFF", (2, 2))  # a real image, of a format not taken
    with pytest.raises(InvalidRequest, match="could not be read"):
        decode_data_url(data_url(tiff, "image/png"), LIMITS)


def test_a_data_url_that_is_not_base64_or_not_a_data_url_is_refused():
    with pytest.raises(InvalidRequest, match="not base64"):
        decode_data_url("data:image/png,rawbytes", LIMITS)
    with pytest.raises(InvalidRequest, match="Unsupported image URL"):
        decode_data_url("file:///etc/passwd", LIMITS)
    with pytest.raises(InvalidRequest, match="Unsupported image URL"):
        decode_data_url("data:image/png;base64", LIMITS)  # no comma


@pytest.mark.parametrize("url", ["http://example.com/cat.png", "HTTPS://example.com/cat.png"])
def test_a_remote_url_is_refused_naming_the_flag_that_allows_it(url):
    with pytest.raises(InvalidRequest, match="--allow-remote-images") as e:
        decode_source(ImageSource(param="messages[0].content[0].image_url.url", url=url), LIMITS)
    assert e.value.param == "messages[0].content[0].image_url.url"


REMOTE_PNG = image_bytes("PNG", (6, 4), color=(10, 200, 30))


class _Images(http.server.BaseHTTPRequestHandler):
    """/dot.png: a PNG; /moved: a redirect to it; /loopN: a redirect to
    /loopN+1; /big: a Content-Length past any bound; /missing: a 404;
    /endless: 1 KiB chunks until the client leaves (a thousand at most)."""

    def do_GET(self):
        if self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "/dot.png")
            self.end_headers()
        elif self.path.startswith("/loop"):  # /loop1 -> /loop2 -> ...: more redirects than are followed
            self.send_response(302)
            self.send_header("Location", f"/loop{int(self.path[5:]) + 1}")
            self.end_headers()
        elif self.path in ("/dot.png", "/big"):
            self.send_response(200)
            self.send_header("Content-Length", str(len(REMOTE_PNG) if self.path == "/dot.png" else 10 ** 12))
            self.end_headers()
            self.wfile.write(REMOTE_PNG)
        elif self.path == "/endless":
            self.send_response(200)
            self.end_headers()
            try:
                for _ in range(1000):
                    self.wfile.write(b"x" * 1024)
            except OSError:  # the client gave up
                pass
        else:
            self.send_error(404)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def image_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join(timeout=10)


def test_with_the_flag_a_remote_image_is_fetched_as_its_inline_twin(image_server):
    limits = ImageLimits(allow_remote=True)
    inline = decode_data_url(data_url(REMOTE_PNG), limits)
    for path in ("/dot.png", "/moved"):  # redirects are followed
        got = decode_source(ImageSource(param="p", url=image_server + path), limits)
        assert got == inline and got.sha256 == hashlib.sha256(REMOTE_PNG).hexdigest()
        assert got.image.getpixel((5, 3)) == (10, 200, 30)


@pytest.mark.parametrize("path, words", [("/big", "--max-image-bytes"), ("/missing", "could not be fetched"),
                                         ("/loop1", "could not be fetched")])
def test_a_remote_image_too_big_or_missing_is_a_400_naming_why(image_server, path, words):
    with pytest.raises(InvalidRequest, match=words) as e:
        decode_source(ImageSource(param="messages[0].content[0].image_url.url", url=image_server + path),
                      ImageLimits(allow_remote=True))
    assert e.value.param == "messages[0].content[0].image_url.url"


@pytest.mark.parametrize("path", ["/endless", "/moved"])
def test_a_remote_image_is_refused_when_its_time_is_up(image_server, path):
    """The time counts over the whole fetch: the chunks of an endless body, a redirect and its target."""
    ticks = itertools.count(0.0, 6.0)  # each look at the clock: 6 s later
    with pytest.raises(InvalidRequest, match="not fetched within 10 s") as e:
        _fetch(image_server + path, ImageLimits(allow_remote=True), "p", seconds=10.0, clock=lambda: next(ticks))
    assert e.value.param == "p"


def test_an_image_over_the_byte_bound_is_refused_before_and_after_decoding_base64():
    raw = image_bytes("PNG", (64, 64), noise=True)
    limits = ImageLimits(max_bytes=len(raw) - 1)
    with pytest.raises(InvalidRequest, match="--max-image-bytes"):
        decode_data_url(data_url(raw), limits)
    assert decode_data_url(data_url(raw), ImageLimits(max_bytes=len(raw))).nbytes == len(raw)  # the bound is inclusive
    huge = "A" * (4 * (LIMITS.max_bytes // 3 + 8))  # refused on its length: never decoded
    with pytest.raises(InvalidRequest, match="--max-image-bytes"):
        decode_base64_source("image/png", huge, LIMITS)


def test_an_image_over_the_pixel_bound_is_refused():
    raw = image_bytes("PNG", (20, 10))
    with pytest.raises(InvalidRequest, match="20 x 10 = 200 pixels.*at most 199"):
        decode_data_url(data_url(raw), ImageLimits(max_pixels=199))
    assert decode_data_url(data_url(raw), ImageLimits(max_pixels=200)).width == 20


def test_a_png_whose_header_claims_a_huge_size_is_refused_without_allocating_it():
    bomb = crafted_png(100_000, 100_000)  # 10^10 pixels claimed; 30 GB as RGB
    tracemalloc.start()
    try:
        with pytest.raises(InvalidRequest, match="claims .*pixels.*--max-image-pixels"):
            decode_data_url(data_url(bomb), LIMITS)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 10 * 1024 * 1024  # nothing near the claimed size was allocated


def test_mola_checks_the_claimed_size_below_pils_own_guard():
    bomb = crafted_png(8_000, 6_000)  # 4.8e7 pixels: under PIL's guard (~8.9e7), over mola's default bound
    with pytest.raises(InvalidRequest, match="8000 x 6000 = 48000000 pixels"):
        decode_data_url(data_url(bomb), LIMITS)


def test_pils_own_guard_is_also_mapped_to_a_400():
    bomb = crafted_png(20_000, 20_000)  # 4e8 pixels: past PIL's DecompressionBombError threshold
    with pytest.raises(InvalidRequest, match="claims more than .*--max-image-pixels"):
        decode_data_url(data_url(bomb), ImageLimits(max_pixels=10**9))


def test_a_header_that_lies_within_the_bound_is_a_truncated_image():
    bomb = crafted_png(512, 512)  # a valid header, and a few bytes of pixel data
    with pytest.raises(InvalidRequest, match="truncated or corrupt"):
        decode_data_url(data_url(bomb), LIMITS)
    raw = image_bytes("JPEG", (32, 32), noise=True)
    with pytest.raises(InvalidRequest, match="truncated or corrupt"):
        decode_data_url(data_url(raw[: len(raw) // 2], "image/jpeg"), LIMITS)


def test_the_count_is_checked_before_anything_is_decoded():
    bad = ImageSource(param="p", media_type="image/png", data="!!!")  # would fail if decoded
    messages = [{"role": "user", "content": [{"type": "image", "source": bad}] * 3}]
    with pytest.raises(InvalidRequest, match="3 images; at most 2.*--max-images-per-request"):
        decode_messages(messages, ImageLimits(max_images=2))
    assert check_count(messages, ImageLimits(max_images=3)) == 3


def test_decode_messages_replaces_sources_and_leaves_the_rest():
    raw = image_bytes("PNG", (2, 2))
    source = ImageSource(param="p", url=data_url(raw))
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "what is it?"},
                                             {"type": "image", "source": source}]}]
    out = decode_messages(messages, LIMITS)
    assert out[0] == messages[0] and out[1]["content"][0] == {"type": "text", "text": "what is it?"}
    assert out[1]["content"][1]["image"].sha256 == hashlib.sha256(raw).hexdigest()
    assert messages[1]["content"][1]["source"] is source  # the input is not changed


@pytest.mark.parametrize("field, value", [("max_bytes", 0), ("max_pixels", -1), ("max_images", True)])
def test_limits_are_checked(field, value):
    with pytest.raises(ValueError, match=field):
        ImageLimits(**{field: value})


def test_the_crafted_png_has_a_valid_crc():
    """The helper's bytes are a PNG a strict reader takes: its IHDR CRC recomputed independently."""
    png = crafted_png(7, 9)
    length, = struct.unpack(">I", png[8:12])
    chunk = png[12:16 + length]
    crc, = struct.unpack(">I", png[16 + length:20 + length])
    assert chunk[:4] == b"IHDR" and zlib.crc32(chunk) == crc
    assert struct.unpack(">II", chunk[4:12]) == (7, 9)
