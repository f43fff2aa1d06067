"""`mola train` on a quantized base as it is, and to a llama.cpp GGUF LoRA
(mola/train/export.py, mola/adapters/formats/gguf_writer.py): the base's linears
stay QuantizedLinear and no full-precision copy of it is ever made (MLX's peak
memory), and the GGUF file served by mola gives the same greedy outputs as the
mlx-lm directory written from the same weights."""

from __future__ import annotations

import re

import pytest

from mola.adapters.formats import read_adapter
from mola.adapters.formats.gguf_writer import OUTTYPES
from mola.models.metadata import read_model_config
from mola.testing.adapter import linear_shapes
from mola.testing.model import TinyModelSpec, make_tiny_model
from mola.train import GGUF_OUTTYPES, OutputPathError, TrainConfig, TrainError, train_adapter

from test_train import PROMPTS, TARGET, mola_cli, served_answers, write

CHATS = [{"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": TARGET}]} for p in PROMPTS]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write(tmp_path_factory.mktemp("yes"), "train.jsonl", CHATS)


def test_a_quantized_base_is_trained_as_it_is(tmp_path, data):
    """A 4-bit base whose float32 linears would take 25 MB, trained in a
    process of its own (MLX's peak memory is the process's): every linear
    stays quantized and the peak stays well below that (measured: 11.6 MB at
    batch 1, against 34.5 MB for the same model in float32; a single layer
    dequantized would add 12.6 MB)."""
    spec = TinyModelSpec(hidden_size=512, intermediate_size=1536, quantize_bits=4, quantize_group_size=64)
    model = make_tiny_model(tmp_path / "wide-q4", spec)
    config = read_model_config(model)
    full_precision = 4 * config["num_hidden_layers"] * sum(i * o for i, o in linear_shapes(config).values())
    assert full_precision > 24e6
    r = mola_cli("train", "--model", str(model), "--data", str(data), "--out", str(tmp_path / "a"), "--iters", "3",
                 "--batch-size", "1", "--learning-rate", "1e-3", "--steps-per-report", "3")
    assert r.returncode == 0, r.stderr
    m = re.search(r"the base stayed quantized: (\d+) of (\d+) linear layers are QuantizedLinear; "
                  r"peak memory ([\d.]+) MiB", r.stderr)
    assert m, r.stderr
    quantized, linears, peak = int(m.group(1)), int(m.group(2)), float(m.group(3)) * 2**20
    assert linears >= 14 and quantized == linears
    assert 0 < peak < 0.6 * full_precision, (peak, full_precision)


@pytest.fixture(scope="module")
def trained(quantized_model, data, tmp_path_factory):
    """`mola train --out DIR --out FILE.gguf` on the 4-bit tiny model, as a user runs it."""
    root = tmp_path_factory.mktemp("q-trained")
    out, gguf = root / "yes", root / "yes.gguf"
    r = mola_cli("train", "--model", str(quantized_model), "--data", str(data), "--out", str(out),
                 "--out", str(gguf), "--iters", "40", "--batch-size", "4", "--learning-rate", "1e-2",
                 "--scale", "2", "--steps-per-report", "20")
    assert r.returncode == 0, r.stderr
    return out, gguf, r.stderr


def test_both_outputs_hold_the_same_weights(trained, quantized_model):
    out, gguf, log = trained
    assert "the base stayed quantized" in log and f"written to {out} and {gguf}" in log
    config = read_model_config(quantized_model)
    twin = read_adapter(gguf, model_config=config)  # llama's q/k rows put back by the reader
    mine = read_adapter(out)
    assert twin.format == "gguf" and set(twin.modules) == set(mine.modules)
    for path, m in mine.modules.items():
        t = twin.modules[path]
        assert t.rank == m.rank and abs(t.scale - m.scale) < 1e-6
        assert (abs(t.a - m.a).max().item(), abs(t.b - m.b).max().item()) == (0.0, 0.0), path
    from mola.adapters.formats.gguf import read_metadata

    fields, types = read_metadata(gguf)
    assert fields["general.architecture"] == "llama" and fields["adapter.lora.alpha"] == 2.0 * 8
    assert fields["general.base_model.0.name"] == str(quantized_model) and set(types.values()) == {"F32"}
    assert any(name == "blk.0.attn_q.weight.lora_a" for name in types)


def test_the_gguf_adapter_serves_the_same_greedy_outputs(trained, quantized_model):
    out, gguf, _ = trained
    answers = served_answers(quantized_model, {"dir": out, "gguf": gguf}, PROMPTS[:4], max_tokens=8)
    assert answers["gguf"] == answers["dir"]
    assert answers["dir"] != answers["base"]  # the adapter does something


def test_gguf_outputs_are_checked_before_training(tmp_path, data, quantized_model):
    (tmp_path / "taken.gguf").write_bytes(b"x")
    with pytest.raises(OutputPathError, match="already exists.*--force"):
        train_adapter(TrainConfig(model=str(quantized_model), data=data, out=tmp_path / "taken.gguf"))
    (tmp_path / "dir.gguf").mkdir()
    with pytest.raises(OutputPathError, match="is a directory"):
        train_adapter(TrainConfig(model=str(quantized_model), data=data, out=tmp_path / "dir.gguf"))
    for outs in ((tmp_path / "a.gguf", tmp_path / "b.gguf"), (tmp_path / "a", tmp_path / "b"), ()):
        with pytest.raises(ValueError, match="one of each"):
            TrainConfig(model="m", data=data, out=outs)
    with pytest.raises(ValueError, match="gguf_outtype"):
        TrainConfig(model="m", data=data, out=tmp_path / "x.gguf", gguf_outtype="q4_0")
    assert GGUF_OUTTYPES == OUTTYPES


def test_what_llama_cpp_cannot_name_is_refused():
    from mola.train.export import check_gguf_export

    assert check_gguf_export({"model_type": "mistral"}, ["self_attn.q_proj"]) == "llama"
    assert check_gguf_export({"model_type": "qwen3"}, ["mlp.down_proj"]) == "qwen3"
    assert check_gguf_export({"model_type": "gemma2"}, ["self_attn.q_proj"]) == "gemma2"
    with pytest.raises(TrainError, match="this model's type is 'mamba'"):
        check_gguf_export({"model_type": "mamba"}, ["self_attn.q_proj"])
    with pytest.raises(TrainError, match="no tensor name for mlp.experts"):
        check_gguf_export({"model_type": "qwen2"}, ["mlp.experts"])


# ---- a GGUF base ----------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_q4_gguf(tiny_model, tmp_path_factory):
    """The tiny model's llama.cpp twin with Q4_1 matrices (kept quantized by mola)."""
    from mola.testing.gguf_model import save_gguf_model

    return save_gguf_model(tmp_path_factory.mktemp("gguf") / "tiny.Q4_1.gguf", tiny_model, codec="Q4_1")


def test_train_on_a_gguf_base_as_it_is(tiny_q4_gguf, data, tmp_path):
    """`mola train --model FILE.gguf`: the Q4_1 linears stay quantized; both
    outputs serve the same greedy tokens on the GGUF base, and mola validate
    takes them against it."""
    from mola.validate import validate

    out, gguf = tmp_path / "yes", tmp_path / "yes.gguf"
    r = mola_cli("train", "--model", str(tiny_q4_gguf), "--data", str(data), "--out", str(out), "--out", str(gguf),
                 "--iters", "30", "--batch-size", "4", "--learning-rate", "1e-2", "--scale", "2",
                 "--steps-per-report", "30")
    assert r.returncode == 0, r.stderr
    m = re.search(r"the base stayed quantized: (\d+) of (\d+) linear layers", r.stderr)
    assert m and m.group(1) == m.group(2) and int(m.group(1)) >= 14, r.stderr
    for adapter in (out, gguf):
        report = validate(str(adapter), str(tiny_q4_gguf), max_rank=8)
        assert report.ok, report.error
    answers = served_answers(tiny_q4_gguf, {"dir": out, "gguf": gguf}, PROMPTS[:4], max_tokens=8)
    assert answers["gguf"] == answers["dir"] != answers["base"]
