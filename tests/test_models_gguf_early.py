"""A GGUF base's conversion begun with `mola serve` (mola/models/gguf_early.py): the
load takes its tensors, once, and holds to the bit what a load that converts holds;
it is not taken for another file or dtype, nor after the file changed, and where it
cannot convert the load converts (and reports) as always; what is not taken is
dropped."""

from __future__ import annotations

import logging
import os
import time

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mola.models import gguf_early
from mola.models.gguf import read_weights
from mola.models.gguf_file import open_gguf
from mola.models.loader import load_base_model
from mola.testing.gguf_model import save_gguf_model
from mola.testing.model import TinyModelSpec, make_tiny_model

SPEC = TinyModelSpec(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                     vocab_size=400, norm_noise=0.2)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("early")
    return save_gguf_model(folder / "m.Q4_K.gguf", make_tiny_model(folder / "m", SPEC), codec="Q4_K")


@pytest.fixture(autouse=True)
def no_cache(monkeypatch):
    monkeypatch.setenv("MOLA_GGUF_CACHE", "off")


def bits(arrays: dict) -> dict:
    return {k: (str(v.dtype), v.shape, np.array(v.view(mx.uint8)).tobytes()) for k, v in arrays.items()}


def test_the_tensors_taken_are_a_conversion_now_to_the_bit(gguf_file):
    early = gguf_early.start(str(gguf_file), "keep")
    f = open_gguf(gguf_file)
    assert early.plan(gguf_file, "float32") is None and early.plan(gguf_file, "keep")[0] == "keep"
    done = early.take(f, "keep")
    assert done is not None and done.dtype == "keep" and done.quantization
    _, weights, quantization = read_weights(open_gguf(gguf_file), "keep")
    assert bits(done.weights) == bits(weights) and done.quantization == quantization
    assert early.take(f, "keep") is None  # once


def test_another_dtype_or_a_changed_file_is_converted_again(gguf_file, tmp_path):
    early = gguf_early.start(str(gguf_file), "keep")
    assert early.take(open_gguf(gguf_file), "float32") is None  # the load resolved another dtype
    copy = tmp_path / "c.gguf"
    copy.write_bytes(gguf_file.read_bytes())
    early = gguf_early.start(str(copy), "keep")
    assert early.wait(60)  # converted from the file as it was
    time.sleep(0.01)
    os.utime(copy, ns=(time.time_ns(), time.time_ns()))  # rewritten in place, say: its ctime moves
    f = open_gguf(copy)
    assert early.take(f, "keep") is None


def test_a_load_that_takes_them_holds_what_one_that_converts_holds(gguf_file, caplog):
    converted = load_base_model(str(gguf_file), dtype="keep")
    early = gguf_early.start(str(gguf_file), "keep")
    with caplog.at_level(logging.INFO, logger="mola.loader"):
        taken = load_base_model(str(gguf_file), dtype="keep", early=early)
    assert "converted beside the start's imports" in caplog.text
    assert bits(dict(tree_flatten(taken.model.parameters()))) == bits(dict(tree_flatten(converted.model.parameters())))
    tokens = mx.array([[1, 17, 300, 45, 2]])
    assert mx.array_equal(taken.model(tokens), converted.model(tokens))


def test_what_cannot_be_converted_early_is_loaded_and_reported_as_always(tmp_path):
    assert gguf_early.start(None, "keep") is None and gguf_early.start(str(tmp_path / "nothing"), "keep") is None
    broken = tmp_path / "b.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)
    early = gguf_early.start(str(broken), "keep")
    assert early is not None and early.plan(broken, "keep") is None
    with pytest.raises(Exception, match="not a readable GGUF file"):
        load_base_model(str(broken), dtype="keep", early=early)


def test_close_drops_what_was_not_taken(gguf_file):
    early = gguf_early.start(str(gguf_file), "keep")
    early.close()
    assert early.take(open_gguf(gguf_file), "keep") is None
