"""POST /v1/images/generations (mola/images, mola/server/routes/images.py) on a
tiny random FLUX.2-klein (mola.testing.images): one resident base, each request's
LoRA applied unmerged per row; requests of different LoRAs that arrive together
run as one batch, and every image is, pixel for pixel, what mflux itself makes
for that request alone with bake_lora=False (on MLX's reference BLAS; within a
grey level on OpenBLAS, whose kernels depend on the batch) (and within a grey level of its
default, merged LoRA); LoKr, DoRA and .diff files, sizes, steps and n out of
bounds, url responses, unknown models and paths outside the adapter directories
are 4xx in OpenAI's envelope naming the field.

Needs mflux (pip install --no-deps mflux==0.24.0, docs/images.md): skipped
without it, failed with MOLA_REQUIRE_IMAGES=1 (CI)."""

from __future__ import annotations

import base64
import io
import os
import threading

import httpx
import mlx.core as mx
import numpy as np
import pytest

from mola import blas
from mola.errors import InvalidRequest
from mola.images.request import pair_paths, parse_size

if os.environ.get("MOLA_REQUIRE_IMAGES") == "1":
    import mflux  # noqa: F401 (CI: a missing mflux fails here)
else:
    pytest.importorskip("mflux", reason="images need mflux: pip install --no-deps mflux==0.24.0 (docs/images.md)")

from helpers.schemas import validate_schema
from helpers.servers import start_server, wait_until

from mola.testing.images import (
    build_tiny_image_model,
    load_reference,
    write_bfl_qkv_lora,
    write_lora,
    write_not_lora,
)

SIZE, STEPS = 64, 2
S1, S2 = 0.8, 1.3  # not powers of two: a scale applied anywhere else than mflux's place would show
# Pixels equal mflux's exactly on MLX's bundled reference BLAS, whose products do not depend on the
# batch's shape; OpenBLAS (which tests/conftest.py preloads when it can) picks its kernels by shape,
# so a row of a batch may round apart from the same image alone: a grey level at most.
EXACT = blas.blas_in_use() == "reference"
TOLERANCE = 0 if EXACT else 1


def same(got, want) -> bool:
    """Equal (up to TOLERANCE grey levels), in at least 99% of the values exactly."""
    diff = np.abs(got - want)
    return diff.max() <= TOLERANCE and (diff == 0).mean() >= (1.0 if EXACT else 0.99)



@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The tiny image model and LoRA files: two in an adapter directory, in two key styles."""
    root = tmp_path_factory.mktemp("images")
    model_dir = build_tiny_image_model(root / "tiny-flux")
    transformer = load_reference(model_dir).transformer
    loras = root / "loras"
    loras.mkdir()
    out = {"model": model_dir, "loras": loras,
           "l1": write_lora(loras / "l1.safetensors", transformer, rank=4, seed=11, alpha=2.0),
           "l2": write_lora(loras / "l2.safetensors", transformer, rank=8, seed=22),
           "kohya": write_lora(loras / "kohya.safetensors", transformer, rank=4, seed=33, style="kohya"),
           "bfl": write_bfl_qkv_lora(loras / "bfl.safetensors", transformer, rank=4, seed=44, strength=2.0),
           "outside": write_lora(root / "outside.safetensors", transformer, rank=4, seed=55),
           "garbage": loras / "garbage.safetensors"}
    out["garbage"].write_bytes(b"not a safetensors file")
    out["not-a-table"] = loras / "not-a-table.safetensors"  # a header that parses, as the number 1
    out["not-a-table"].write_bytes((1).to_bytes(8, "little") + b"1")
    out["wrong-shape"] = loras / "wrong-shape.safetensors"  # to_q's factors of a model twice as wide
    width = load_reference(model_dir).transformer.transformer_blocks[0].attn.to_q.weight.shape[1]
    stem = "transformer.transformer_blocks.0.attn.to_q"
    mx.save_safetensors(str(out["wrong-shape"]), {f"{stem}.lora_A.weight": mx.ones((4, 2 * width)),
                                                  f"{stem}.lora_B.weight": mx.ones((2 * width, 4))})
    for kind in ("lokr", "dora", "diff"):
        out[kind] = write_not_lora(loras / f"{kind}.safetensors", kind)
    for bad, value in (("nan", float("nan")), ("inf", float("inf"))):  # l1 with one value not finite
        factors = mx.load(str(out["l1"]))
        key = sorted(factors)[0]
        factors[key] = mx.where(mx.arange(factors[key].size).reshape(factors[key].shape) == 0, value, factors[key])
        out[bad] = loras / f"{bad}.safetensors"
        mx.save_safetensors(str(out[bad]), factors)
    return out


@pytest.fixture(scope="module")
def server(tiny_model, files):
    handle = start_server(model=str(tiny_model), adapter_dirs=[str(files["loras"])], image_dtype="float32",
                          image_model={"name": "tiny-flux", "path": str(files["model"])},
                          image_adapters=[{"name": "style-a", "path": str(files["l1"]), "scale": S1}])
    yield handle
    handle.stop()


def post(server, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/images/generations", json=body, timeout=120)


def pixels(b64: str) -> np.ndarray:
    from PIL import Image

    return np.array(Image.open(io.BytesIO(base64.b64decode(b64)))).astype(int)


def mflux_image(files, seed: int, prompt: str, loras=(), bake_lora=False, steps=STEPS) -> np.ndarray:
    """What mflux itself makes for one request: its own model, its own LoRA loading."""
    model = load_reference(files["model"], [(str(p), s) for p, s in loras], bake_lora=bake_lora)
    image = model.generate_image(seed=seed, prompt=prompt, num_inference_steps=steps, height=SIZE, width=SIZE)
    return np.array(image.image).astype(int)


def test_sizes_and_lora_fields_are_checked_before_any_work():
    assert parse_size("64x128") == (64, 128) and parse_size(None) == (1024, 1024)
    for bad in ("64", "65x64", "2048x64", "48x64", "axb"):
        with pytest.raises(InvalidRequest) as e:
            parse_size(bad)
        assert e.value.param == "size"
    assert pair_paths(["a", "b"], None) == [("a", 1.0), ("b", 1.0)]
    with pytest.raises(InvalidRequest) as e:
        pair_paths(["a", "b"], [1.0])
    assert e.value.param == "lora-scales"


@pytest.mark.slow
def test_a_mixed_batch_is_mflux_image_for_image(server, files):
    """Three requests arriving together (LoRA 1 at S1, LoRA 2 at S2, no LoRA) run as
    one batch; each image equals mflux's for that request alone, pixel for pixel."""
    worker = server.app.state.images.worker
    asks = [dict(prompt="a photo of a cat", seed=1, model="style-a"),  # the named adapter: l1 at S1
            dict(prompt="a red fox in the snow", seed=2, **{"lora-paths": [str(files["l2"])], "lora-scales": [S2]}),
            dict(prompt="a watercolor city at night", seed=3, model="tiny-flux")]
    answers = [None] * len(asks)
    batches = worker.batches

    def ask(i):
        answers[i] = post(server, size=f"{SIZE}x{SIZE}", steps=STEPS, **asks[i])

    # The worker waits on a gate while the three queue up behind it, then takes them at once.
    gate = threading.Event()
    held = worker.call(gate.wait)
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(asks))]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: worker.waiting == len(asks), timeout=60, what="the three requests to queue")
    finally:
        gate.set()
    held.result(timeout=60)
    for t in threads:
        t.join()
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    assert worker.batches - batches == 1 and worker.batch_rows[-1] == 3, worker.batch_rows
    validate_schema("ImagesResponse", answers[0].json())
    got = [pixels(a.json()["data"][0]["b64_json"]) for a in answers]
    assert got[0].shape == (SIZE, SIZE, 3)
    want = [mflux_image(files, 1, asks[0]["prompt"], [(files["l1"], S1)]),
            mflux_image(files, 2, asks[1]["prompt"], [(files["l2"], S2)]),
            mflux_image(files, 3, asks[2]["prompt"])]
    for g, w in zip(got, want):
        assert same(g, w), (np.abs(g - w).max(), (g != w).mean())
    # The LoRAs change the images (else equality would say little).
    assert np.abs(mflux_image(files, 1, asks[0]["prompt"]) - got[0]).max() > 20


def test_the_openai_client_gets_mflux_image(server, files):
    """OpenAI's client reads the answer; a named adapter at its start scale times
    lora_scale makes mflux's image for that LoRA at that scale."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key="none")
    out = client.images.generate(model="style-a", prompt="a cat", n=2, size=f"{SIZE}x{SIZE}",
                                 extra_body={"seed": 5, "steps": 1, "lora_scale": 0.5})
    assert len(out.data) == 2 and out.data[0].b64_json != out.data[1].b64_json  # seeds 5 and 6
    want = mflux_image(files, 6, "a cat", [(files["l1"], S1 * 0.5)], steps=1)
    assert same(pixels(out.data[1].b64_json), want)
    # /v1/models lists the image base and its adapter after the text models
    listed = httpx.get(f"{server.url}/v1/models").json()
    validate_schema("ListModelsResponse", listed)
    images = {m["id"]: m for m in listed["data"] if m.get("kind") == "image"}
    assert images.keys() == {"tiny-flux", "style-a"} and images["style-a"]["parent"] == "tiny-flux"
    assert images["tiny-flux"]["status"] == "loaded" and listed["data"][-2]["id"] == "tiny-flux"
    assert client.models.retrieve("style-a").id == "style-a"
    chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                      json={"model": "tiny-flux", "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 404 and chat.json()["error"]["param"] == "model", chat.text


@pytest.mark.parametrize("body, status, param, says", [
    ({"size": "65x64"}, 400, "size", "multiple of 16"),
    ({"size": "2048x2048"}, 400, "size", "1024"),
    ({"n": 5}, 400, "n", "from 1 to 4"),
    ({"steps": 51}, 400, "steps", "from 1 to 50"),
    ({"response_format": "url"}, 400, "response_format", "'url'"),
    ({"stream": True}, 400, "stream", "stream"),
    ({"model": "nope"}, 404, "model", "'nope' does not exist"),
    ({"model": "tiny-flux", "lora_scale": 0.5}, 400, "lora_scale", "base"),
    ({"lora-paths": ["a", "b"], "lora-scales": [1.0]}, 400, "lora-scales", "one number per"),
])
def test_bad_fields_are_4xx_naming_the_field(server, body, status, param, says):
    r = post(server, prompt="a cat", **body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], error


@pytest.mark.parametrize("name, status, says", [
    ("outside", 403, "outside the directories"),
    ("garbage", 400, "not a readable .safetensors"),
    ("not-a-table", 400, "not a readable .safetensors"),
    ("wrong-shape", 400, "does not fit this image model"),
    ("lokr", 400, "LoKr"),
    ("dora", 400, "DoRA"),
    ("diff", 400, ".diff"),
    ("nan", 400, "non-finite values (NaN or Inf)"),
    ("inf", 400, "non-finite values (NaN or Inf)"),
])
def test_lora_files_that_cannot_be_served_are_refused(server, files, name, status, says):
    r = post(server, prompt="a cat", size="64x64", steps=1, **{"lora-paths": [str(files[name])]})
    assert r.status_code == status, r.text
    assert says in r.json()["error"]["message"], r.json()
    assert post(server, prompt="a cat", size="64x64", steps=1).status_code == 200  # the worker lives on


@pytest.mark.slow
@pytest.mark.parametrize("style", ["kohya", "bfl"])
def test_each_key_style_mflux_reads_is_served_as_mflux_applies_it(server, files, style):
    r = post(server, prompt="a red fox", seed=7, size=f"{SIZE}x{SIZE}", steps=STEPS,
             **{"lora-paths": [str(files[style])], "lora-scales": [S2]})
    assert r.status_code == 200, r.text
    got = pixels(r.json()["data"][0]["b64_json"])
    assert same(got, mflux_image(files, 7, "a red fox", [(files[style], S2)]))
    assert np.abs(got - mflux_image(files, 7, "a red fox")).max() > 0


@pytest.mark.slow
def test_merged_lora_and_stacks_agree_within_rounding(server, files):
    """mflux's default merges the LoRA into the weights (bake_lora=True), and sums a
    stack layer by layer; mola's unmerged rows and concatenated stacks agree to within
    float rounding: a grey level at most."""
    r = post(server, prompt="a photo of a cat", seed=1, size=f"{SIZE}x{SIZE}", steps=STEPS, model="style-a")
    got = pixels(r.json()["data"][0]["b64_json"])
    assert np.abs(got - mflux_image(files, 1, "a photo of a cat", [(files["l1"], S1)], bake_lora=True)).max() <= 1
    stack = [(files["l1"], S1), (files["l2"], S2)]
    r = post(server, prompt="a cat", seed=4, size=f"{SIZE}x{SIZE}", steps=STEPS,
             **{"lora-paths": [str(p) for p, _ in stack], "lora-scales": [s for _, s in stack]})
    got = pixels(r.json()["data"][0]["b64_json"])
    assert np.abs(got - mflux_image(files, 4, "a cat", stack)).max() <= 1
