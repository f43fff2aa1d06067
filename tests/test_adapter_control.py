"""Per-request adapter scale and stacking (mola/registry/registry.py acquire,
mola/adapters/weights.py stack_weights), against plain mlx-lm on merged weights."""

from __future__ import annotations

import asyncio

import httpx
import mlx.core as mx

from mola.adapters.formats import read_adapter
from mola.adapters.weights import stack_weights

from helpers.engines import runner_stats
from helpers.references import detokenize, merged_model, reference_decode

QUESTION = "Where do rivers go?"
MAX_TOKENS = 10


def ask(client, model="tiny", **extra):
    body = {"model": model, "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **extra}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def expected(server, tiny_model, adapter_dirs=(), scales=None):
    model, _ = merged_model(tiny_model, list(adapter_dirs), scales)
    tok = server.state.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True)
    tokens, _ = reference_decode(model, prompt, MAX_TOKENS)
    return detokenize(tok, tokens, stop_at_eos=False)


def test_stacked_weights_are_the_sum_of_deltas(adapters):
    a, b = read_adapter(adapters["a"]), read_adapter(adapters["b"])
    both = stack_weights([(a, 0.7), (b, -0.3)], max_rank=64)
    for path, m in both.modules.items():
        x = mx.random.normal((3, m.a.shape[0]))
        want = mx.zeros((3, m.b.shape[1]))
        for w, s in ((a, 0.7), (b, -0.3)):
            if path in w.modules:
                p = w.modules[path]
                want = want + s * p.scale * ((x @ p.a) @ p.b)
        assert mx.allclose(m.scale * ((x @ m.a) @ m.b), want, atol=1e-5).item(), path
    assert both.rank == a.rank + b.rank


def test_scale_zero_is_the_base_and_one_is_the_adapter(server, client, tiny_model, adapters):
    base = expected(server, tiny_model)
    assert ask(client, "a", lora_scale=0.0) == base == ask(client)
    assert ask(client, "a", lora_scale=1.0) == expected(server, tiny_model, [adapters["a"]]) == ask(client, "a")
    assert ask(client, "a", lora_scale=0.5) == expected(server, tiny_model, [adapters["a"]], [0.5])


def test_two_scales_of_one_adapter_share_the_batch(server, tiny_model, adapters):
    scales = [0.25, 1.5, 0.5, 1.0]
    want = {s: expected(server, tiny_model, [adapters["c"]], [s]) for s in scales}
    assert len(set(want.values())) == len(scales)
    before = runner_stats(server.engine).max_batch

    async def go():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            bodies = [{"model": "c", "lora_scale": s, "max_tokens": MAX_TOKENS, "temperature": 0,
                       "ignore_eos": True, "messages": [{"role": "user", "content": QUESTION}]}
                      for s in scales * 2]
            return await asyncio.gather(*(c.post("/v1/chat/completions", json=b) for b in bodies))

    for s, r in zip(scales * 2, asyncio.run(go())):
        assert r.json()["choices"][0]["message"]["content"] == want[s], s
    assert runner_stats(server.engine).max_batch >= max(before, 2)


def test_stacked_adapters_equal_both_merged(server, client, tiny_model, adapters):
    stack = [{"name": "a", "scale": 0.7}, {"name": "b", "scale": 0.3}]
    want = expected(server, tiny_model, [adapters["a"], adapters["b"]], [0.7, 0.3])
    assert ask(client, "tiny", adapters=stack) == want
    assert want not in (expected(server, tiny_model, [adapters["a"]]), expected(server, tiny_model))
    # The adapter `model` names joins the stack with its lora_scale.
    assert ask(client, "a", lora_scale=0.7, adapters=[{"name": "b", "scale": 0.3}]) == want
    comps = [c for c in client.get("/v1/adapters").json()["stacks"]]
    assert any({p["name"] for p in c["parts"]} == {"a", "b"} and c["rank"] == 12 for c in comps)
    assert "a@" not in " ".join(m["id"] for m in client.get("/v1/models").json()["data"])


def test_stacks_above_the_max_rank_are_refused(client):
    r = client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": QUESTION}],
        "adapters": [{"name": "a"}, {"name": "c"}]})  # 4 + 16 > 16
    assert r.status_code == 400
    assert "--max-lora-rank 16" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": QUESTION}], "adapters": [{"name": "zz"}]})
    assert r.status_code == 404 and r.json()["error"]["param"] == "adapters"


def test_unloading_a_part_retires_its_stacks(server, client, tiny_model, adapters):
    assert client.post("/v1/adapters", json={"name": "part", "path": str(adapters["b"])}).status_code == 200
    ask(client, "tiny", adapters=[{"name": "a"}, {"name": "part", "scale": 2.0}])
    assert any("part" in c["name"] for c in client.get("/v1/adapters").json()["stacks"])
    assert client.delete("/v1/adapters/part").status_code == 200
    assert not any("part" in c["name"] for c in client.get("/v1/adapters").json()["stacks"])
    r = client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": QUESTION}],
        "adapters": [{"name": "a"}, {"name": "part"}]})
    assert r.status_code == 404
