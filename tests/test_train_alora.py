"""`mola train --alora-invocation` (mola/train/alora.py): the loss it trains
on is the one of a naive per-position loop (the base model before each row's
invocation, the adapter merged into it from there), and the adapter it
writes is an activated LoRA that mola serves from its invocation on, reusing
the base model's cached prompt up to there."""

from __future__ import annotations

import json
import random

import httpx
import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.tuner.trainer import default_loss
from mlx_lm.tuner.utils import load_adapters
from mlx_lm.utils import load

from helpers.references import merged_model
from test_train import PROMPTS, RECIPE, TARGET, chat, mola_cli, write

INVOCATION = "<|im_start|>assistant\n"  # the tiny model's (ChatML) assistant header, as a user would pick


def per_position_logits(base, merged, row: list[int], start: int) -> mx.array:
    """Logits of each position of ``row`` fed alone into one cache, to
    ``merged`` from ``start`` on and to ``base`` before it."""
    cache = make_prompt_cache(base)
    return mx.concatenate([(merged if p >= start else base)(mx.array([[t]]), cache=cache)[0]
                           for p, t in enumerate(row)])


def test_the_activated_loss_is_the_per_position_loop(tiny_model, adapters):
    from mola.adapters.weights import invocation_start
    from mola.train import alora

    model, tokenizer = load(str(tiny_model))
    model = load_adapters(model, str(adapters["a"]))
    invocation = alora.invocation_tokens(tokenizer, INVOCATION)
    rng = random.Random(3)
    rows = [[rng.randrange(300, 500) for _ in range(n)] for n in (9, 21, 14)]
    rows = [r[:k] + list(invocation) + r[k:] for r, k in zip(rows, (2, 15, 0))]
    width = max(map(len, rows)) + 3
    batch = mx.array([r + [0] * (width - len(r)) for r in rows])
    lengths = mx.array([[1, len(r)] for r in rows])
    starts = [invocation_start(invocation, r) for r in rows]
    assert starts == [2, 15, 0]

    activated = alora.loss(alora.activate(model))(model, batch, lengths, mx.array(starts))
    base, merged = merged_model(tiny_model)[0], merged_model(tiny_model, [adapters["a"]])[0]
    reference = mx.stack([per_position_logits(base, merged, row, s)
                          for row, s in zip(batch[:, :-1].tolist(), starts)])
    expected = default_loss(lambda _: reference, batch, lengths)
    assert abs(activated[0].item() - expected[0].item()) < 1e-4 * expected[0].item()
    assert activated[1].item() == expected[1].item()
    # and it is neither the plain LoRA's loss nor the base model's
    plain = default_loss(model, batch, lengths)[0].item()
    bare = default_loss(lambda x: base(x), batch, lengths)[0].item()
    assert min(abs(activated[0].item() - plain), abs(activated[0].item() - bare)) > 1e-3
    # the batches mlx-lm's loop draws carry the same starts, found in the rows again
    drawn, drawn_lengths, drawn_starts = next(alora.batches(invocation)([(r, 1) for r in rows], 3, 64))
    for row, (_, n), s in zip(drawn.tolist(), drawn_lengths.tolist(), drawn_starts.tolist()):
        assert s == starts[rows.index(row[:n])]


@pytest.fixture(scope="module")
def invoked(tiny_model, tmp_path_factory):
    """`mola train --alora-invocation` run as a user runs it (no server yet)."""
    data = tmp_path_factory.mktemp("alora-data")
    lines = [{"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": TARGET}]}
             for p in PROMPTS]
    write(data, "train.jsonl", lines)
    out = tmp_path_factory.mktemp("alora") / "yes-alora"
    r = mola_cli("train", "--model", str(tiny_model), "--data", str(data), "--out", str(out),
                 "--out", str(out.with_suffix(".gguf")), *RECIPE,
                 "--mask-prompt", "--steps-per-report", "100", "--alora-invocation", INVOCATION)
    assert r.returncode == 0, r.stderr
    return out, r.stderr


def test_an_activated_lora_trains_and_serves_from_its_invocation(invoked, tiny_model, server):
    """The adapter learns the data from its invocation on; served, the base
    model's turn leaves its prompt in the cache, and the adapter's turn on
    the same conversation reuses it up to the invocation and answers as
    trained; the base alone answers otherwise. (On the module's server,
    conftest's, which loads it over REST.)"""
    out, log = invoked
    config = json.loads((out / "adapter_config.json").read_text())
    tokenizer = load(str(tiny_model))[1]
    assert config["alora_invocation_tokens"] == tokenizer.encode(INVOCATION, add_special_tokens=False)
    from mola.adapters.formats import read_adapter  # llama.cpp's file carries it as adapter.alora.invocation_tokens

    gguf = read_adapter(out.with_suffix(".gguf"), model_config=json.loads((tiny_model / "config.json").read_text()))
    assert gguf.invocation_tokens == tuple(config["alora_invocation_tokens"])
    assert "an activated LoRA" in log
    r = httpx.post(server.url + "/v1/adapters", json={"name": "yes", "path": str(out)}, timeout=60)
    assert r.status_code == 200, r.text
    for prompt in PROMPTS[:3]:
        assert chat(server.url, "tiny", prompt, max_tokens=12) != TARGET
        r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "model": "yes", "messages": [{"role": "user", "content": prompt}], "max_tokens": 12,
            "temperature": 0})
        answer = r.json()
        head = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        start = len(head) - len(config["alora_invocation_tokens"])
        assert answer["choices"][0]["message"]["content"] == TARGET
        assert answer["choices"][0]["alora_invoked"] is True
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == start


def test_data_without_the_invocation_is_refused(tiny_model, tmp_path):
    data = write(tmp_path / "data", "train.jsonl", [{"text": f"plain text number {i}"} for i in range(4)])
    r = mola_cli("train", "--model", str(tiny_model), "--data", str(data), "--out", str(tmp_path / "out"),
                 "--iters", "2", "--alora-invocation", "<|im_start|>assistant\n")
    assert r.returncode == 1
    assert "is not in 4 of the 4 training examples (the first: example 1)" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()
