"""Will a GGUF model fit (mola/models/fit.py): the plan of its memory by tensor group,
made from codecs and shapes before a byte is read, equals what the loaded model
holds (kept and dequantized, a Q4_K_M-like file); a model that does not fit the free
memory is refused with the numbers; --dtype auto on a CPU keeps the codecs where
float32 would not fit; codecs mola cannot read are refused before loading; the load
log and mola validate tell the plan."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import mlx.core as mx
import pytest
from gguf import GGMLQuantizationType as T
from mlx.utils import tree_flatten

from mola.errors import ModelLoadError
from mola.models import fit
from mola.models.gguf_file import open_gguf
from mola.models.loader import check_gguf, load_base_model, resolve_dtype
from mola.testing.gguf_model import save_gguf_model
from mola.testing.model import TinyModelSpec, make_tiny_model

# what llama.cpp's Q4_K_M gives the tensors of a small model: Q4_K, with Q6_K for
# attn_v and ffn_down in some layers and for the output (llama-quant.cpp's use_more_bits)
Q4_K_M = {"blk.0.attn_v.weight": "Q6_K", "blk.0.ffn_down.weight": "Q6_K", "output.weight": "Q6_K"}


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory):
    root = tmp_path_factory.mktemp("fit")
    model_dir = make_tiny_model(root / "model", TinyModelSpec(hidden_size=256, intermediate_size=512))
    return save_gguf_model(root / "q4_k_m.gguf", model_dir, "Q4_K", codecs=Q4_K_M)


def resident_bytes(model) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


@pytest.mark.parametrize("dtype", ["keep", "float32", "float16"])
def test_the_plan_is_what_the_loaded_model_holds(q4_k_m, dtype):
    planned = fit.plan(open_gguf(q4_k_m).reader.tensors, dtype)
    loaded = load_base_model(str(q4_k_m), dtype=dtype)
    assert planned.total == resident_bytes(loaded.model)
    if dtype == "keep":
        assert planned.compute == "float32"  # Q4_K's scales are float32
        assert set(planned.groups["attention"]) == {"Q4_K kept", "Q6_K kept"}
        # Q6_K as two halves of 6 bits and two float32 numbers per 32 weights: 2 bytes a weight
        assert planned.groups["output"] == {"Q6_K kept": 2 * 256 * loaded.config["vocab_size"]}


def test_kept_is_several_times_smaller_than_float32(q4_k_m):
    tensors = open_gguf(q4_k_m).reader.tensors
    kept, full = fit.plan(tensors, "keep"), fit.plan(tensors, "float32")
    # Q4_K: 4 bits and two float32 numbers per 32 weights (6 bits), against 32
    assert fit.plan(tensors, "keep").groups["feed-forward"]["Q4_K kept"] * 32 == \
        full.groups["feed-forward"]["Q4_K -> float32"] * 6
    assert kept.total < full.total / 2


def test_a_model_that_does_not_fit_is_refused_with_the_numbers(q4_k_m):
    f = open_gguf(q4_k_m)
    full = fit.plan(f.reader.tensors, "float32").total
    kept = fit.plan(f.reader.tensors, "keep").total
    with pytest.raises(ModelLoadError, match=r"needs .* GiB as --dtype float32 \(.*Q4_K -> float32.*\), but only "
                                             r".* is free; --dtype keep holds it in .*Nothing was loaded"):
        check_gguf(f, "float32", free=(full + kept) // 2)
    with pytest.raises(ModelLoadError, match=r"as --dtype keep .*is free\. Nothing"):
        check_gguf(f, "keep", free=kept - 1)
    assert check_gguf(f, "keep", free=kept)[0] == "keep"
    assert check_gguf(f, "float32", free=None)[0] == "float32"  # nothing known: no refusal


def test_auto_keeps_the_codecs_on_a_cpu_where_float32_would_not_fit(q4_k_m):
    tensors = open_gguf(q4_k_m).reader.tensors
    full = fit.plan(tensors, "float32").total
    assert fit.auto_dtype(tensors, free=int(full / fit.AUTO_FLOAT32_SHARE) + 1) == "float32"
    assert fit.auto_dtype(tensors, free=full) == "keep"
    if mx.default_device() == mx.cpu:
        assert resolve_dtype("auto", True, tensors, free=full) == "keep"


def test_codecs_mola_cannot_read_are_named():
    tensors = [SimpleNamespace(name="blk.0.attn_q.weight", tensor_type=T.Q4_K, shape=(256, 256)),
               SimpleNamespace(name="blk.0.attn_k.weight", tensor_type=T.Q8_K, shape=(256, 256)),
               SimpleNamespace(name="blk.0.ffn_down.weight", tensor_type=T.Q6_K, shape=(256, 256)),
               SimpleNamespace(name="blk.0.attn_v.weight", tensor_type=T.I32, shape=(256, 256))]
    assert fit.unreadable_codecs(tensors) == {"Q8_K": "blk.0.attn_k.weight", "I32": "blk.0.attn_v.weight"}


def test_the_load_log_tells_each_groups_memory(q4_k_m, caplog):
    with caplog.at_level(logging.INFO, logger="mola.loader"):
        load_base_model(str(q4_k_m), dtype="keep")
    text = caplog.text
    assert "dtype keep, computing in float32" in text
    for group in ("embedding", "attention", "feed-forward", "output", "norms, biases"):
        assert f"  {group}" in text, group
    assert "Q4_K kept" in text and "Q6_K kept" in text


@pytest.mark.parametrize("name, group", [
    ("token_embd.weight", "embedding"), ("output.weight", "output"), ("output_norm.weight", "norms, biases"),
    ("blk.3.attn_q.weight", "attention"), ("blk.3.attn_q.bias", "norms, biases"),
    ("blk.3.attn_q_norm.weight", "norms, biases"), ("blk.3.ffn_up.weight", "feed-forward"),
    ("blk.3.ffn_up_exps.weight", "experts"), ("blk.3.ffn_gate_inp.weight", "experts"),
    ("blk.3.ffn_gate_inp_shexp.weight", "experts"), ("blk.3.ffn_up_shexp.weight", "feed-forward"),
    ("blk.3.attn_sinks.weight", "norms, biases"), ("rope_freqs.weight", "other"),
])
def test_tensor_groups(name, group):
    assert fit.tensor_group(name) == group


def test_mola_validate_prints_the_plan_and_refuses_an_unreadable_codec(q4_k_m, tmp_path):
    from mola.adapters.formats.gguf_writer import save_gguf_adapter
    from mola.testing.adapter import random_lora
    from mola.validate.command import text, validate

    lora = save_gguf_adapter(tmp_path / "lora.gguf", random_lora(q4_k_m, rank=2), n_head=4, n_kv_head=2)
    report = validate(str(lora), str(q4_k_m), max_rank=8, dtype="keep")
    assert report.ok, report.error
    lines = text(report)
    memory = next(line for line in lines if line.startswith("memory"))
    assert memory.startswith("memory   ") and "as --dtype keep" in memory
    assert any("Q4_K kept" in line for line in lines)
    assert report.to_json()["model"]["memory"]["bytes"] == fit.plan(open_gguf(q4_k_m).reader.tensors, "keep").total


def test_a_q4_k_m_base_served_kept_with_gguf_loras_in_a_mixed_batch(q4_k_m, tmp_path):
    """The kept Q4_K_M twin in mola's engine: two GGUF LoRAs and base rows in one batch
    answer as alone, and as the same file dequantized to float32 (whose weights the
    kept ones equal bit for bit: tests/test_models_codecs.py) wherever its margins allow."""
    from helpers.engines import EngineRunner
    from mola.adapters.formats.gguf_writer import save_gguf_adapter
    from mola.testing.adapter import linear_shapes, random_lora

    keys = tuple(linear_shapes(load_base_model(str(q4_k_m), dtype="keep").config))
    loras = []
    for name, seed in (("a", 1), ("b", 2)):
        # random K-quant blocks make weights of ~2 and logits of ~1000: a LoRA must be as large to move them
        weights = random_lora(q4_k_m, rank=4, keys=keys, seed=seed, scale=20.0, std=30.0)
        loras.append((name, save_gguf_adapter(tmp_path / f"{name}.gguf", weights, n_head=4, n_kv_head=2)))
    prompt = [1, 17, 300, 45, 2, 99, 7, 256, 12]
    answers = {}
    for dtype in ("keep", "float32"):
        runner = EngineRunner(q4_k_m, adapters=loras, max_tokens=6, max_lora_rank=4, dtype=dtype)
        try:
            layer = runner.loaded.model.model.layers[1].self_attn.q_proj.base  # inside its MultiLoRALinear
            assert (getattr(layer, "bits", None) == 4) == (dtype == "keep")
            alone = {name: runner.run(prompt, name) for name in (None, "a", "b")}
            names = [None, "a", "b", "a", None, "b"]
            assert runner.wait([runner.submit(prompt, n) for n in names]) == [alone[n] for n in names]
            answers[dtype] = alone
        finally:
            runner.stop()
    assert answers["keep"]["a"] != answers["keep"][None] or answers["keep"]["b"] != answers["keep"][None]
    assert answers["keep"] == answers["float32"]
