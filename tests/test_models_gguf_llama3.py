"""Llama 3.x rope scaling in GGUF bases (models/gguf_arch/llama.py): llama.cpp's
converter writes no metadata for it, only rope_freqs.weight (LlamaModel.
generate_extra_tensors); mola recovers factor, low/high_freq_factor and
original_max_position_embeddings from those factors and serves mlx-lm's Llama3RoPE.

The tiny model has Llama 3.2 1B's head (64, rope_theta 500000), so that the
high-frequency pairs (factor 1), the smoothing band and the low-frequency pairs
(factor 8) are all there; its twin computes exactly what mlx-lm computes on the
directory, GGUF LoRAs answer as the LoRA merged in plain mlx-lm, and factors that
the converter cannot have written are refused by name."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType
from mlx_lm.models.rope_utils import Llama3RoPE

from mola.errors import ModelLoadError
from mola.models.gguf_arch.llama import _powers, converter_factors, llama3_scaling
from mola.models.loader import load_base_model
from mola.testing.gguf_model import save_gguf_model
from mola.testing.gguf_twins import TWINS
from mola.testing.model import TinyModelSpec, make_tiny_model
from twin_checks import TOKENS, assert_loras_answer_as_merged

LLAMA_31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
HEAD_DIM, THETA = 64, 500000.0


def edit_config(model_dir, **changes) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    config.update(changes)
    (model_dir / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    """(mlx-lm directory with Llama 3.1's rope_scaling, its GGUF twin)."""
    root = tmp_path_factory.mktemp("llama3")
    spec = TinyModelSpec(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, norm_noise=0.3)
    model_dir = make_tiny_model(root / "model", spec)
    edit_config(model_dir, rope_theta=THETA, rope_scaling=LLAMA_31, max_position_embeddings=131072)
    return model_dir, save_gguf_model(root / "twin.gguf", model_dir)


def rope_freqs(path) -> np.ndarray:
    tensor = next(t for t in GGUFReader(str(path)).tensors if t.name == "rope_freqs.weight")
    return np.array(tensor.data, dtype=np.float32)


def test_the_twin_holds_the_converters_factors_in_all_three_regions(llama3):
    factors = rope_freqs(llama3[1])
    assert factors.shape == (HEAD_DIM // 2,)
    inner = factors[(factors != 1) & (factors != 8)]
    assert factors[0] == 1 and factors[-1] == 8 and inner.size >= 2
    assert np.all(np.diff(factors) >= 0)
    metadata = {f.name for f in GGUFReader(str(llama3[1])).fields.values()}
    assert not any(".rope.scaling." in key for key in metadata)  # "llama3": no metadata
    # plain llama gets no rope_freqs (the twin of every other llama test is unchanged)
    assert TWINS["llama"].extra_tensors({"rope_theta": THETA, "hidden_size": 128, "num_attention_heads": 2}) == {}


def test_the_scaling_is_recovered_and_computes_exactly_what_mlx_lm_computes(llama3):
    from mlx_lm import load

    model_dir, twin = llama3
    ref, _ = load(str(model_dir))
    got = load_base_model(str(twin), dtype="float32")
    assert got.config["rope_scaling"] == LLAMA_31
    rope, ref_rope = got.model.model.layers[0].self_attn.rope, ref.model.layers[0].self_attn.rope
    assert isinstance(rope, Llama3RoPE)
    np.testing.assert_array_equal(np.array(rope._freqs), np.array(ref_rope._freqs))
    tokens = mx.array([TOKENS])
    logits = np.array(got.model(tokens))
    np.testing.assert_array_equal(logits, np.array(ref(tokens)))
    plain = model_dir.parent / "plain"  # the scaling shows in the logits
    shutil.copytree(model_dir, plain, dirs_exist_ok=True)
    edit_config(plain, rope_scaling=None)
    assert not np.array_equal(logits, np.array(load(str(plain))[0](tokens)))


@pytest.mark.parametrize("scaling, recovered", [
    ({"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
     None),  # Llama 3.2's
    ({"factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 2.5, "original_max_position_embeddings": 4096},
     None),
    # only the ratios matter: twice the three numbers is the same scaling, bit for bit
    ({"factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0, "original_max_position_embeddings": 16384},
     {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
])
@pytest.mark.parametrize("head_dim, theta", [(64, 500000.0), (128, 500000.0), (128, 10000.0)])
def test_other_scalings_are_recovered_to_the_same_rope(scaling, recovered, head_dim, theta):
    config = {"rope_theta": theta, "head_dim": head_dim, "rope_scaling": {"rope_type": "llama3", **scaling}}
    factors = TWINS["llama"].extra_tensors(config)["rope_freqs.weight"]
    got = llama3_scaling("twin.gguf", factors, head_dim, theta)
    assert got == {"rope_type": "llama3", **(recovered or scaling)}
    mine = Llama3RoPE(head_dim, base=theta, scaling_config=got)
    theirs = Llama3RoPE(head_dim, base=theta, scaling_config=config["rope_scaling"])
    np.testing.assert_array_equal(np.array(mine._freqs), np.array(theirs._freqs))
    # torch's powf may round a power the other way (Sleef, within an ulp): the same answer
    for direction in (0, np.inf):
        powers = np.nextafter(_powers(head_dim, theta), np.float32(direction))
        other = converter_factors(powers, *(config["rope_scaling"][k] for k in (
            "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")))
        assert llama3_scaling("twin.gguf", other, head_dim, theta) == got


def test_factors_the_converter_cannot_have_written_are_refused(llama3, tmp_path):
    model_dir, twin = llama3
    factors = rope_freqs(twin)
    band = np.flatnonzero((factors != 1) & (factors != 8))
    nudged = factors.copy()
    nudged[band[1]] *= np.float32(1.0001)
    for name, bad in (("nudged", nudged), ("short", factors[:-2]), ("flat", np.ones_like(factors)),
                      ("step", np.where(factors < 8, np.float32(1), factors))):
        path = save_gguf_model(tmp_path / f"{name}.gguf", model_dir, extra_tensors={"rope_freqs.weight": bad})
        with pytest.raises(ModelLoadError, match=r"rope_freqs\.weight"):
            load_base_model(str(path), dtype="float32")
    both = save_gguf_model(tmp_path / "both.gguf", model_dir, metadata={
        "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": (2.0, GGUFValueType.FLOAT32)})
    with pytest.raises(ModelLoadError, match=r"rope_freqs\.weight and rope scaling.*linear"):
        load_base_model(str(both), dtype="float32")


def test_gguf_loras_in_a_mixed_batch_answer_as_merged_mlx_lm(llama3, tmp_path):
    assert_loras_answer_as_merged(*llama3, tmp_path, "llama")
