"""Adapters pushed from memory (issue 37, part 4): PUT /v1/adapters/{name}/weights
with an mlx-lm training model's LoRA factors (mola.client.push_adapter) serves
what the same adapter serves from its files; a new push is a new version that
requests already running never see; bad bodies get 4xx naming the problem."""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
from pathlib import Path

import httpx
import pytest
from mlx_lm.tuner.utils import load_adapters
from mlx_lm.utils import load

from helpers.servers import start_server, wait_until

from mola.client import adapter_body, push_adapter
from mola.config import AdapterSpec

KEY = "admin-key-123456"
PROMPT = [{"role": "user", "content": "tell me about the sea"}]


def chat(url, model, max_tokens=24, **extra):
    r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": model, "messages": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra})
    assert r.status_code == 200, r.text
    return r


@pytest.fixture(scope="module")
def trained(tiny_model, adapters):
    """What a training loop holds: the tiny model with LoRALinear layers, adapter a's factors in them."""
    model, _ = load(str(tiny_model))
    return load_adapters(model, str(adapters["a"]))


@pytest.fixture(scope="module")
def server(tiny_model, adapters, tmp_path_factory):
    handle = start_server(model=str(tiny_model), adapters=[AdapterSpec("a", str(adapters["a"]))], admin_key=KEY,
                          max_lora_rank=16, max_adapter_push_bytes=1 << 20,
                          adapter_dirs=(str(tmp_path_factory.mktemp("pushed")),))
    yield handle
    handle.stop()


def zeroed_b(model) -> bytes:
    """The push body of ``model``'s factors with every B zeroed: the base model's answers."""
    import safetensors.numpy

    body = adapter_body(model)
    header = json.loads(body[8 : 8 + int.from_bytes(body[:8], "little")])
    factors = {k: v * 0 if k.endswith(".lora_b") else v for k, v in safetensors.numpy.load(body).items()}
    return safetensors.numpy.save(factors, metadata=header["__metadata__"])


def test_a_pushed_adapter_serves_like_its_files_and_a_new_push_is_a_new_version(server, trained):
    first = push_adapter(server.url, "live", trained, admin_key=KEY)
    assert first["version"] == 1 and first["source"] == "push" and first["rank"] == 4
    answer = chat(server.url, "live").json()["choices"][0]["message"]["content"]
    assert answer == chat(server.url, "a").json()["choices"][0]["message"]["content"]
    # A request on version 1 ends on it while version 2 (the base: B zeroed) comes in. The engine
    # waits on a gate meanwhile, so the request has its lease on version 1 but no token yet.
    gate = threading.Event()
    server.engine.call(gate.wait)
    try:
        with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60, json={
                "model": "live", "messages": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                "stream": True}) as stream:
            lines = stream.iter_lines()
            head = next(lines)  # the role chunk: the request holds its lease
            assert httpx.get(server.url + "/v1/adapters/live").json()["in_flight"] == 1
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                pushing = pool.submit(httpx.put, server.url + "/v1/adapters/live/weights", content=zeroed_b(trained),
                                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
                # version 2 is served once registered; the push then drops version 1's cached
                # prompts on the engine thread, which waits on the gate: open it then
                wait_until(lambda: pushing.done() or httpx.get(server.url + "/v1/adapters/live").json()["version"] == 2,
                           what="version 2 to be registered")
                gate.set()
                second = pushing.result(timeout=60).json()
            events = [json.loads(line[6:]) for line in [head, *lines] if line.startswith("data: {")]
    finally:
        gate.set()
    assert "".join(c["delta"].get("content") or "" for e in events for c in e["choices"]) == answer
    assert second["version"] == 2
    assert chat(server.url, "live").json()["choices"][0]["message"]["content"] == \
        chat(server.url, "tiny").json()["choices"][0]["message"]["content"]
    with httpx.Client() as client:  # a client the caller keeps: version 3, the trained factors again
        third = push_adapter(server.url, "live", trained, admin_key=KEY, client=client)
    assert third["version"] == 3
    assert chat(server.url, "live").json()["choices"][0]["message"]["content"] == answer


def test_bad_pushes_get_4xx_and_change_nothing(server, trained):
    url = server.url + "/v1/adapters/live2/weights"
    auth = {"Authorization": f"Bearer {KEY}"}
    body = adapter_body(trained)
    assert httpx.put(url, content=body).status_code == 401  # the admin key
    for content, status, words in [
        (b"not safetensors at all", 400, "not a readable safetensors body"),
        (body.replace(b"adapter_config", b"adapter_cfg_xx"), 400, "no 'adapter_config' metadata"),
        (body.replace(b"lora_a", b"lora_q"), 400, "not a LoRA factor"),
        (b"x" * ((1 << 20) + 1), 413, "--max-adapter-push-bytes"),
    ]:
        r = httpx.put(url, content=content, headers=auth, timeout=60)
        assert r.status_code == status and words in r.json()["error"]["message"], r.text
    wide = load(str(server.config.model))[0]  # a mismatched shape: factors of another width
    from mlx_lm.tuner.utils import linear_to_lora_layers

    linear_to_lora_layers(wide, 1, {"rank": 3, "scale": 2.0, "dropout": 0.0, "keys": ["self_attn.q_proj"]})
    import safetensors.numpy

    factors = safetensors.numpy.load(adapter_body(wide))
    factors = {k: (v[:-1] if k.endswith("lora_a") else v) for k, v in factors.items()}
    bad = safetensors.numpy.save(factors, metadata={"adapter_config": json.dumps({"lora_parameters": {"scale": 2.0}})})
    r = httpx.put(url, content=bad, headers=auth, timeout=60)
    assert r.status_code == 400 and "q_proj" in r.json()["error"]["message"], r.text
    assert httpx.get(server.url + "/v1/adapters/live2").status_code == 404


def with_header(body: bytes, change) -> bytes:
    """``body`` with its safetensors header changed in place by ``change(header)``."""
    n = int.from_bytes(body[:8], "little")
    header = json.loads(body[8 : 8 + n])
    change(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + body[8 + n :]


def with_config(body: bytes, **lora_parameters_and_extra) -> bytes:
    def change(header):
        config = json.loads(header["__metadata__"]["adapter_config"])
        config["lora_parameters"].update(lora_parameters_and_extra.pop("lora_parameters", {}))
        config.update(lora_parameters_and_extra)
        header["__metadata__"]["adapter_config"] = json.dumps(config)
    return with_header(body, change)


def test_push_configs_and_persisted_names_are_bounded(server, trained):
    """What a push's config says is bounded as ?scale= is (its own bound, named),
    invocation tokens are in the vocabulary, tensors do not share bytes, and a
    persisted name is one an --adapter-dir serves after a restart: each a 400
    naming the rule, with nothing served or written."""
    auth = {"Authorization": f"Bearer {KEY}"}
    body = adapter_body(trained)

    def overlap(header):
        a, b = sorted(k for k in header if k.endswith(".lora_a"))[:2]
        header[b]["data_offsets"] = header[a]["data_offsets"]

    def past_the_end(header):
        key = sorted(k for k in header if k.endswith(".lora_a"))[0]
        header[key]["data_offsets"] = [0, 10**9]

    def three_offsets(header):
        key = sorted(k for k in header if k.endswith(".lora_a"))[0]
        header[key]["data_offsets"] = [0, 1, 2]

    for name, content, params, words in [
        (".hid", body, {"persist": "true"}, "does not start with '.'"),
        ("org/one", body, {"persist": "true"}, "one segment (no '/')"),
        ("big", with_config(body, lora_parameters={"scale": 1e30}), {}, "scale 1e+30"),
        ("big", with_config(body, lora_parameters={"scale": -1001}), {}, "within [-1000, 1000]"),
        ("never", with_config(body, alora_invocation_tokens=[7, 100000]), {},
         "token id 100000, outside the base's vocabulary (size 512)"),
        ("shared", with_header(body, overlap), {}, "overlap"),
        ("far", with_header(body, past_the_end), {}, "outside the body's"),
        ("odd", with_header(body, three_offsets), {}, "not a readable safetensors body"),
    ]:
        r = httpx.put(f"{server.url}/v1/adapters/{name}/weights", content=content, headers=auth, params=params,
                      timeout=60)
        assert r.status_code == 400 and words in r.json()["error"]["message"], (name, r.text)
        assert httpx.get(f"{server.url}/v1/adapters/{name}").status_code == 404
    root = Path(server.config.adapter_dirs[0])
    assert not (root / ".hid").exists() and not (root / "org").exists()
    # the bounds' edges are served: mlx-lm's default scale 20, the last token of the vocabulary
    r = httpx.put(f"{server.url}/v1/adapters/edge/weights", headers=auth, timeout=60,
                  content=with_config(body, lora_parameters={"scale": 20.0}, alora_invocation_tokens=[511]))
    assert r.status_code == 200 and r.json()["alora_invocation_tokens"] == [511], r.text


def peft_body(adapter, tmp_path, dtype, **config_extra) -> bytes:
    """Adapter ``adapter`` as PEFT writes it (PEFT's names, ``dtype``), as one push body."""
    import mlx.core as mx

    from mola.adapters.formats import read_adapter
    from mola.testing.peft import save_peft_adapter

    path = save_peft_adapter(tmp_path / f"peft-{dtype}", read_adapter(adapter), dtype=dtype)
    config = {**json.loads((path / "adapter_config.json").read_text()), **config_extra}
    mx.save_safetensors(str(tmp_path / "body.safetensors"), mx.load(str(path / "adapter_model.safetensors")),
                        metadata={"adapter_config": json.dumps(config)})
    return (tmp_path / "body.safetensors").read_bytes()


def test_peft_named_pushes_and_persisted_ones(server, adapters, tmp_path):
    """PEFT's names push as mlx-lm's do (float32: adapter a's answer); bfloat16
    factors too. persist=true writes the adapter directory under the first
    --adapter-dir, which serves from disk what the push serves from memory; a
    later persisted push replaces it whole, and a directory no push wrote is
    never replaced (409, nothing served)."""
    import mlx.core as mx

    auth = {"Authorization": f"Bearer {KEY}"}

    def put(name, body, **params):
        return httpx.put(f"{server.url}/v1/adapters/{name}/weights", content=body, headers=auth, params=params,
                         timeout=60)

    def answer(model):
        return chat(server.url, model).json()["choices"][0]["message"]["content"]

    r = put("peft32", peft_body(adapters["a"], tmp_path, mx.float32, alora_invocation_tokens=[7, 11]))
    assert r.status_code == 200 and r.json()["alora_invocation_tokens"] == [7, 11], r.text
    assert put("peft32", peft_body(adapters["a"], tmp_path, mx.float32)).status_code == 200
    assert answer("peft32") == answer("a")
    body16 = peft_body(adapters["a"], tmp_path, mx.bfloat16)
    r = put("peft16", body16, persist="true")
    assert r.status_code == 200, r.text
    persisted, version = Path(r.json()["persisted"]), r.json()["version"]
    root = Path(server.config.adapter_dirs[0])
    assert persisted == root / "peft16" and (persisted / "adapter_model.safetensors").read_bytes() == body16
    r = httpx.post(server.url + "/v1/adapters", json={"name": "peft16-disk", "path": str(persisted)},
                   headers=auth, timeout=60)
    assert r.status_code == 200, r.text
    assert answer("peft16") == answer("peft16-disk")
    body32 = peft_body(adapters["a"], tmp_path, mx.float32)
    assert put("peft16", body32, persist="true").json()["version"] > version
    assert (persisted / "adapter_model.safetensors").read_bytes() == body32
    (root / "theirs").mkdir()
    (root / "theirs" / "notes.txt").write_text("not a push")
    r = put("theirs", body32, persist="true")
    assert r.status_code == 409 and "not written by a push" in r.json()["error"]["message"], r.text
    assert (root / "theirs" / "notes.txt").read_text() == "not a push"
    theirs = httpx.get(server.url + "/v1/adapters/theirs")  # known from the directory, not pushed
    assert theirs.status_code == 200 and theirs.json()["source"] != "push", theirs.text


def test_a_bfloat16_training_model_pushes_as_it_is(tiny_model):
    """adapter_body writes the factors in their own dtype (bfloat16 too) and the server reads them back."""
    import mlx.core as mx
    from mlx_lm.tuner.utils import linear_to_lora_layers

    from mola.adapters import pushed

    model = load(str(tiny_model))[0]
    linear_to_lora_layers(model, 1, {"rank": 2, "scale": 3.0, "dropout": 0.0, "keys": ["self_attn.q_proj"]})
    model.set_dtype(mx.bfloat16)
    read = pushed.parse("bf16", adapter_body(model, alora_invocation_tokens=[5, 6]))
    (path, module), = read.weights.modules.items()
    assert path.endswith("self_attn.q_proj") and module.a.dtype == mx.bfloat16 and module.scale == 3.0
    assert read.weights.invocation_tokens == (5, 6)


def test_pushed_factors_are_held_per_store_and_read_cast(tiny_model):
    """Each base's PushedAdapters holds its own factors (no module state): a
    name's versions get fresh source names, a read casts to the packs' dtype
    (the factors as sent stay as sent), and a dropped or cleared source, or
    one read with no store, is an InvalidAdapter naming it."""
    import mlx.core as mx
    from mlx_lm.tuner.utils import linear_to_lora_layers

    from mola.adapters import pushed
    from mola.adapters.recipe import read_checked
    from mola.errors import InvalidAdapter

    model = load(str(tiny_model))[0]
    linear_to_lora_layers(model, 1, {"rank": 2, "scale": 3.0, "dropout": 0.0, "keys": ["self_attn.q_proj"]})
    weights = pushed.parse("p", adapter_body(model)).weights
    one, two = pushed.PushedAdapters(), pushed.PushedAdapters()
    first, second = one.keep("p", weights), one.keep("p", weights)
    assert first != second and first.startswith(pushed.PREFIX) and pushed.is_pushed(second)
    assert first in one and first not in two and len(one) == 2 and len(two) == 0
    (sent,), (read,) = weights.modules.values(), one.read(first, mx.float16).modules.values()
    assert read.a.dtype == mx.float16 and sent.a.dtype == mx.float32
    assert mx.allclose(read.a.astype(mx.float32), sent.a, atol=1e-3).item()
    one.drop(first)
    with pytest.raises(InvalidAdapter, match=re.escape(first)):
        one.read(first, None)
    with pytest.raises(InvalidAdapter, match="held by a server"):
        read_checked(second, None, None)  # no store: the recipe's reader cannot find it
    one.clear()
    assert second not in one and len(one) == 0


def test_trainable_tokens_and_an_embedding_lora_push_as_peft(server, tmp_path):
    """A push of PEFT's trainable tokens and embedding LoRA alone (no lora_A
    key to tell PEFT's names by) is read as PEFT's, made into factors against
    the base, and answers what the same directory answers from disk."""
    import mlx.core as mx
    import numpy as np

    from mola.adapters.weights import ModuleLoRA
    from mola.testing.peft_vocab import save_peft_vocab_adapter

    auth = {"Authorization": f"Bearer {KEY}"}
    rng = np.random.default_rng(2)
    emb = ModuleLoRA(mx.array(rng.normal(0, 1, (512, 4)).astype(np.float32)),
                     mx.array(rng.normal(0, 0.5, (4, 64)).astype(np.float32)), 2.0)
    tokens = {"model.embed_tokens": ([3, 40, 97], mx.array(rng.normal(0, 1, (3, 64)).astype(np.float32)))}
    path = save_peft_vocab_adapter(Path(server.config.adapter_dirs[0]) / "vocab-disk", embedding=emb)
    tok_path = save_peft_vocab_adapter(tmp_path / "tok", tokens=tokens)
    for name, src in (("vocab-push", path), ("tok-push", tok_path)):
        config = json.loads((src / "adapter_config.json").read_text())
        mx.save_safetensors(str(tmp_path / "body.safetensors"), mx.load(str(src / "adapter_model.safetensors")),
                            metadata={"adapter_config": json.dumps(config)})
        r = httpx.put(f"{server.url}/v1/adapters/{name}/weights", headers=auth, timeout=60,
                      content=(tmp_path / "body.safetensors").read_bytes())
        assert r.status_code == 200, r.text
    adapters = {a["name"]: a for a in httpx.get(server.url + "/v1/adapters", headers=auth).json()["data"]}
    assert adapters["tok-push"]["vocab"]["embedding_tokens"] == 3
    r = httpx.post(server.url + "/v1/adapters", json={"name": "vocab-disk", "path": str(path)}, headers=auth,
                   timeout=60)
    assert r.status_code == 200, r.text

    def answer(model):
        return chat(server.url, model).json()["choices"][0]["message"]["content"]

    assert answer("vocab-push") == answer("vocab-disk") != answer("tiny")
