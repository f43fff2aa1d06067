"""Hugging Face PEFT LoRA adapters: reading them (mola/adapters/formats/peft.py),
writing twins of mlx-lm adapters (mola/testing/peft.py,
devtools/convert_mlx_lm_to_peft.py), serving them beside their mlx-lm
originals, and refusing what cannot be applied exactly."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mola.errors import InvalidAdapter
from mola.adapters.formats import detect_format, read_adapter
from mola.adapters.formats.peft import is_peft_adapter, looks_like_peft_config, read_peft_adapter
from mola.adapters.weights import LoRAWeights, ModuleLoRA, validate
from mola.models.metadata import read_model_config
from mola.testing.adapter import linear_shapes
from mola.testing.peft import save_peft_adapter

from helpers.engines import EngineRunner as Runner
from helpers.references import greedy_tokens, merged_model

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "base_model.model."
VARIANTS = {  # name -> save_peft_adapter keywords
    "plain": {},
    "rslora": {"use_rslora": True},
    "bf16": {"dtype": mx.bfloat16},
}


# ---- fixtures and helpers -------------------------------------------------------


@pytest.fixture(scope="module")
def model_config(tiny_model):
    return read_model_config(tiny_model)


@pytest.fixture(scope="module")
def targets(model_config):
    shapes = linear_shapes(model_config)
    return {
        f"model.layers.{i}.{k}": v
        for i in range(model_config["num_hidden_layers"])
        for k, v in shapes.items()
    }


@pytest.fixture(scope="module")
def twins(adapters, tmp_path_factory):
    """PEFT twins of the mlx-lm adapters: (adapter name, variant) -> dir."""
    root = tmp_path_factory.mktemp("peft-twins")
    out = {}
    for name, path in adapters.items():
        weights = read_adapter(path)
        for variant, kwargs in VARIANTS.items():
            out[name, variant] = save_peft_adapter(root / f"{name}-{variant}", weights, **kwargs)
    return out


def deltas(weights: LoRAWeights) -> dict[str, np.ndarray]:
    """Module path -> scale * a @ b in float32, the delta each module adds."""
    return {
        p: np.array((m.a.astype(mx.float32) @ m.b.astype(mx.float32)) * m.scale)
        for p, m in weights.modules.items()
    }


def assert_same_deltas(got: LoRAWeights, want: LoRAWeights, rtol=1e-5, atol=1e-6):
    assert sorted(got.modules) == sorted(want.modules)
    g, w = deltas(got), deltas(want)
    for p in w:
        np.testing.assert_allclose(g[p], w[p], rtol=rtol, atol=atol, err_msg=p)


def write_peft(path: Path, config: dict, tensors: dict[str, np.ndarray]) -> Path:
    """A PEFT adapter directory written by hand (numpy arrays, PEFT's layout)."""
    path.mkdir(parents=True, exist_ok=True)
    full = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8,
            "bias": "none", "modules_to_save": None, "use_rslora": False, **config}
    (path / "adapter_config.json").write_text(json.dumps(full))
    mx.save_safetensors(str(path / "adapter_model.safetensors"),
                        {k: mx.array(v) for k, v in tensors.items()})
    return path


def factors(shapes, layer: int, key: str, r: int, seed: int, name: str = "") -> dict:
    """PEFT's lora_A [r, in] and lora_B [out, r] of one module, random."""
    rng = np.random.default_rng(seed)
    in_dims, out_dims = shapes[key]
    base = f"{PREFIX}model.layers.{layer}.{key}"
    suffix = f".{name}" if name else ""
    return {
        f"{base}.lora_A{suffix}.weight": rng.normal(0, 0.3, (r, in_dims)).astype(np.float32),
        f"{base}.lora_B{suffix}.weight": rng.normal(0, 0.3, (out_dims, r)).astype(np.float32),
    }


# ---- 1. twins at the weights level ------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("name", ["a", "b", "c"])
def test_twin_has_the_same_modules_and_deltas(adapters, twins, targets, name, variant):
    original = read_adapter(adapters[name])
    twin = read_adapter(twins[name, variant])
    validate(twin, targets, 16)
    assert twin.format == "peft" and original.format == "mlx-lm"
    assert twin.rank == original.rank
    if variant == "bf16":
        # The factors were rounded to bfloat16 (8 bits of mantissa).
        assert all(m.a.dtype == mx.bfloat16 for m in twin.modules.values())
        assert_same_deltas(twin, original, rtol=0.05, atol=0.02)
    else:
        assert_same_deltas(twin, original)
        for p, m in twin.modules.items():
            assert math.isclose(m.scale, original.modules[p].scale, rel_tol=1e-9)


def test_twin_files_are_in_peft_layout(adapters, twins):
    original = read_adapter(adapters["c"])
    config = json.loads((twins["c", "rslora"] / "adapter_config.json").read_text())
    r = original.rank
    assert config["peft_type"] == "LORA" and config["use_rslora"] is True
    assert config["r"] == r and config["bias"] == "none" and config["modules_to_save"] is None
    assert math.isclose(config["lora_alpha"] / math.sqrt(r), original.scale)
    assert not config["rank_pattern"] and not config["alpha_pattern"]
    plain = json.loads((twins["c", "plain"] / "adapter_config.json").read_text())
    assert plain["lora_alpha"] == original.scale * r
    tensors = mx.load(str(twins["c", "plain"] / "adapter_model.safetensors"))
    assert len(tensors) == 2 * len(original.modules)
    for p, m in original.modules.items():
        lora_a = tensors[f"{PREFIX}{p}.lora_A.weight"]
        lora_b = tensors[f"{PREFIX}{p}.lora_B.weight"]
        assert lora_a.shape == (r, m.a.shape[0]) and lora_b.shape == (m.b.shape[1], r)
        assert mx.array_equal(lora_a, m.a.T).item() and mx.array_equal(lora_b, m.b.T).item()


def test_writer_keeps_per_module_ranks_and_scales(tmp_path, targets):
    """Mixed ranks and scales become rank_pattern / alpha_pattern entries."""
    rng = np.random.default_rng(7)

    def module(in_dims, out_dims, r, scale):
        return ModuleLoRA(a=mx.array(rng.normal(0, 0.2, (in_dims, r)).astype(np.float32)),
                          b=mx.array(rng.normal(0, 0.2, (r, out_dims)).astype(np.float32)),
                          scale=scale)

    weights = LoRAWeights("hand", "mlx-lm", {
        "model.layers.0.self_attn.q_proj": module(*targets["model.layers.0.self_attn.q_proj"], 4, 2.0),
        "model.layers.1.self_attn.q_proj": module(*targets["model.layers.1.self_attn.q_proj"], 4, 0.5),
        "model.layers.1.mlp.down_proj": module(*targets["model.layers.1.mlp.down_proj"], 8, 2.0),
    })
    for rslora in (False, True):
        path = save_peft_adapter(tmp_path / f"mixed-{rslora}", weights, use_rslora=rslora)
        config = json.loads((path / "adapter_config.json").read_text())
        assert config["r"] == 4
        assert config["rank_pattern"] == {"model.layers.1.mlp.down_proj": 8}
        # q_proj of layer 1 has its own scale; down_proj the common scale at
        # another rank, which needs another alpha.
        assert set(config["alpha_pattern"]) == {
            "model.layers.1.self_attn.q_proj", "model.layers.1.mlp.down_proj"
        }
        back = read_adapter(path)
        validate(back, targets, 16)
        assert back.scale is None  # no single scale
        assert_same_deltas(back, weights)
    # An explicit, inconsistent lora_alpha is compensated per module.
    path = save_peft_adapter(tmp_path / "alpha", weights, r=4, lora_alpha=1)
    assert json.loads((path / "adapter_config.json").read_text())["lora_alpha"] == 1
    assert_same_deltas(read_adapter(path), weights)
    with pytest.raises(ValueError, match="do not target"):
        save_peft_adapter(tmp_path / "bad", weights, target_modules=["q_proj"])


def test_devtools_converter(adapters, tmp_path):
    out = tmp_path / "converted"
    r = subprocess.run(
        [sys.executable, str(ROOT / "devtools" / "convert_mlx_lm_to_peft.py"),
         str(adapters["b"]), str(out), "--rslora"],
        capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "adapter_config.json").read_text())["use_rslora"] is True
    assert detect_format(out) == "peft"
    assert_same_deltas(read_adapter(out), read_adapter(adapters["b"]))


# ---- 2. twins at the output level, on the real engine --------------------------------


QUESTIONS = ["Hello there", "What is the capital of France? Please answer in one word."]
MAX_TOKENS = 8


def test_peft_twins_serve_like_their_mlx_lm_originals(tiny_model, adapters, twins):
    """The mlx-lm adapters and their PEFT twins in four slots plus the base,
    all in one batch: each twin's greedy output equals its original's, and
    both equal plain mlx-lm on merged weights."""
    slots = [("a", adapters["a"]), ("a-peft", twins["a", "plain"]),
             ("c", adapters["c"]), ("c-peft", twins["c", "rslora"])]
    runner = Runner(tiny_model, adapters=slots, max_tokens=MAX_TOKENS)
    try:
        prompts = {q: runner.prompt(q) for q in QUESTIONS}
        refs = {}
        for name in (None, "a", "c"):
            model, _ = merged_model(tiny_model, [adapters[name]] if name else [])
            for q in QUESTIONS:
                refs[name, q] = greedy_tokens(model, prompts[q], MAX_TOKENS)
        jobs = [(n, q) for q in QUESTIONS for n in (None, "a", "a-peft", "c", "c-peft")]
        seqs = [runner.submit(prompts[q], n) for n, q in jobs]
        outputs = dict(zip(jobs, runner.wait(seqs)))
    finally:
        runner.stop()
    for q in QUESTIONS:
        assert outputs[None, q] == refs[None, q]
        for name in ("a", "c"):
            assert outputs[f"{name}-peft", q] == outputs[name, q] == refs[name, q], (name, q)
    # The adapters really change the output, so equality means something.
    assert len({tuple(refs[n, QUESTIONS[1]]) for n in (None, "a", "c")}) == 3


# ---- 3. rank_pattern, alpha_pattern, layers_to_transform, regex targets ---------------


@pytest.mark.parametrize("rslora", [False, True])
def test_patterns_and_layers_to_transform(tmp_path, model_config, targets, rslora):
    shapes = linear_shapes(model_config)
    ranks = {"self_attn.q_proj": 4, "self_attn.v_proj": 2, "mlp.down_proj": 6, "self_attn.k_proj": 4}
    tensors = {}
    for layer in (0, 1):
        for i, (key, r) in enumerate(ranks.items()):
            if key == "mlp.down_proj" and layer == 0:
                r = 4  # rank_pattern below names layer 1's down_proj only
            tensors.update(factors(shapes, layer, key, r, seed=10 * layer + i))
    config = {
        "r": 4, "lora_alpha": 8, "use_rslora": rslora,
        "target_modules": ["q_proj", "v_proj", "down_proj"],  # not k_proj
        "layers_to_transform": [1],
        "rank_pattern": {"v_proj": 2, "model.layers.1.mlp.down_proj": 6},
        "alpha_pattern": {"layers.1.self_attn.q_proj": 3, "^model.layers.\\d+.self_attn.v_proj": 5},
    }
    path = write_peft(tmp_path / "patterns", config, tensors)
    weights = read_adapter(path)
    validate(weights, targets, 16)
    assert sorted(weights.modules) == [
        "model.layers.1.mlp.down_proj", "model.layers.1.self_attn.q_proj",
        "model.layers.1.self_attn.v_proj",
    ]
    norm = math.sqrt if rslora else (lambda r: r)
    want = {  # (rank, scale) as PEFT's LoraLayer computes them
        "model.layers.1.self_attn.q_proj": (4, 3 / norm(4)),
        "model.layers.1.self_attn.v_proj": (2, 5 / norm(2)),
        "model.layers.1.mlp.down_proj": (6, 8 / norm(6)),
    }
    for p, (r, scale) in want.items():
        m = weights.modules[p]
        assert m.rank == r and math.isclose(m.scale, scale, rel_tol=1e-12), p
        lora_a = tensors[f"{PREFIX}{p}.lora_A.weight"]
        lora_b = tensors[f"{PREFIX}{p}.lora_B.weight"]
        assert np.array_equal(np.array(m.a), lora_a.T) and np.array_equal(np.array(m.b), lora_b.T)
        # PEFT's merged delta: W' = W + scaling * B @ A ([out, in]).
        np.testing.assert_allclose(
            (np.array(m.a) @ np.array(m.b) * m.scale).T, scale * lora_b @ lora_a, rtol=1e-5, atol=1e-6
        )
    assert weights.scale is None


@pytest.mark.parametrize(
    "config, expected",
    [
        ({"target_modules": r".*\.layers\.0\.self_attn\.(q|k)_proj"},
         ["model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.q_proj"]),
        # fullmatch: a regex that matches only part of the name targets nothing there.
        ({"target_modules": r"q_proj|.*layers\.1\.self_attn\.v_proj"},
         ["model.layers.1.self_attn.v_proj"]),
        ({"target_modules": ["q_proj", "k_proj"], "layers_to_transform": 0},
         ["model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.q_proj"]),
        ({"target_modules": ["v_proj"], "layers_to_transform": [1], "layers_pattern": "layers"},
         ["model.layers.1.self_attn.v_proj"]),
        ({"target_modules": ["v_proj"], "layers_to_transform": [1], "layers_pattern": "h"}, []),
        # A full module name in target_modules matches it exactly, whatever the layers.
        ({"target_modules": ["model.layers.0.self_attn.v_proj", "q_proj"], "layers_to_transform": [1]},
         ["model.layers.0.self_attn.v_proj", "model.layers.1.self_attn.q_proj"]),
        ({"target_modules": ["q_proj", "k_proj", "v_proj"], "exclude_modules": ["k_proj"],
          "layers_to_transform": []},
         ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj",
          "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.v_proj"]),
    ],
)
def test_which_modules_are_targeted(tmp_path, model_config, targets, config, expected):
    shapes = linear_shapes(model_config)
    tensors = {}
    for layer in (0, 1):
        for i, key in enumerate(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")):
            tensors.update(factors(shapes, layer, key, 4, seed=10 * layer + i))
    path = write_peft(tmp_path / "targets", config, tensors)
    if not expected:
        with pytest.raises(InvalidAdapter, match="none of the modules"):
            read_adapter(path)
        return
    weights = read_adapter(path)
    validate(weights, targets, 16)
    assert sorted(weights.modules) == expected
    assert weights.scale == 2.0


def test_default_adapter_name_in_keys_and_dtype_cast(tmp_path, model_config, targets):
    shapes = linear_shapes(model_config)
    tensors = factors(shapes, 0, "self_attn.q_proj", 4, seed=1, name="default")
    tensors = {k: v.astype(np.float16) for k, v in tensors.items()}
    path = write_peft(tmp_path / "default", {"target_modules": ["q_proj"]}, tensors)
    assert is_peft_adapter(path)
    weights = read_adapter(path, dtype=mx.float32)
    validate(weights, targets, 16)
    (p, m), = weights.modules.items()
    assert p == "model.layers.0.self_attn.q_proj" and m.a.dtype == mx.float32
    assert np.array_equal(np.array(m.a), tensors[f"{PREFIX}{p}.lora_A.default.weight"].T.astype(np.float32))
    assert read_adapter(path).modules[p].a.dtype == mx.float16  # stored dtype when none asked


def test_module_the_model_lacks_is_left_to_validate(tmp_path, model_config, targets):
    shapes = linear_shapes(model_config)
    tensors = factors(shapes, 5, "self_attn.q_proj", 4, seed=1)
    path = write_peft(tmp_path / "lacks", {"target_modules": ["q_proj"]}, tensors)
    weights = read_adapter(path)
    assert list(weights.modules) == ["model.layers.5.self_attn.q_proj"]
    with pytest.raises(InvalidAdapter, match=r"does not have .*model\.layers\.5\.self_attn\.q_proj"):
        validate(weights, targets, 16)


# ---- 4. refusals ---------------------------------------------------------------------


def _drop(key):
    return lambda t: {k: v for k, v in t.items() if key not in k}


def _add(key, shape):
    return lambda t: {**t, key: np.zeros(shape, np.float32)}


def _retype(key, shape):
    return lambda t: {**t, **{k: np.zeros(shape, np.float32) for k in t if k.endswith(key)}}


Q = f"{PREFIX}model.layers.0.self_attn.q_proj"
REFUSALS = {
    # name: (config changes, tensor changes, what the message must name)
    "modules_to_save": ({"modules_to_save": ["lm_head"]}, None, "modules_to_save"),
    "bias all": ({"bias": "all"}, None, "bias 'all'"),
    "bias lora_only": ({"bias": "lora_only"}, None, "bias 'lora_only'"),
    "dora without magnitudes": ({"use_dora": True}, None, "DoRA adapter \\(use_dora: true\\).*no lora_magnitude_vector"),
    "lora_bias": ({"lora_bias": True}, None, "lora_bias"),
    "magnitude vector": (None, _add(f"{Q}.lora_magnitude_vector", (64,)), "lora_magnitude_vector.*DoRA"),
    "bias tensor": (None, _add(f"{Q}.lora_B.bias", (64,)), "lora_B.bias"),
    "wte target": ({"target_modules": ["q_proj", "transformer.wte"]}, None, "wte"),
    "other tensor": (None, _add(f"{PREFIX}model.norm.weight", (64,)), "model.norm.weight.*not a LoRA factor"),
    "no lora_B": (None, _drop("q_proj.lora_B"), "q_proj has no lora_B"),
    "no lora_A": (None, _drop("q_proj.lora_A"), "q_proj has no lora_A"),
    "r zero": ({"r": 0}, None, "r must be a positive integer"),
    "r string": ({"r": "4"}, None, "r must be a positive integer"),
    "r fraction": ({"r": 2.5}, None, "r must be a positive integer"),
    "alpha negative": ({"lora_alpha": -8}, None, "lora_alpha must be a positive number"),
    "alpha null": ({"lora_alpha": None}, None, "lora_alpha must be a positive number"),
    "alpha bool": ({"lora_alpha": True}, None, "lora_alpha must be a positive number"),
    "rank_pattern value": ({"rank_pattern": {"q_proj": 0}}, None, "rank_pattern"),
    "A/B rank mismatch": (None, _retype("q_proj.lora_B.weight", (64, 3)), "rank mismatch.*q_proj"),
    "config/tensor rank mismatch": ({"r": 8}, None, "rank mismatch.*r=8"),
    "adalora": ({"peft_type": "ADALORA"}, None, "ADALORA"),
    "pissa": ({"init_lora_weights": "pissa_niter_4"}, None, "pissa"),
    "layer_replication": ({"layer_replication": [[0, 2], [1, 2]]}, None, "layer_replication"),
    "trainable tokens, no rows": ({"trainable_token_indices": [1, 2]}, None,
                                  "trainable_token_indices names.*no trainable_tokens_delta"),
    "regex and layers": ({"target_modules": ".*q_proj", "layers_to_transform": [0]}, None,
                         "layers_to_transform"),
    "bad regex": ({"target_modules": "(q_proj"}, None, "not a valid regex"),
    "two adapters": (None, lambda t: {**t, **{k.replace(".weight", ".other.weight"): v
                                               for k, v in t.items()}}, "several adapters"),
}


@pytest.fixture()
def good_peft(tmp_path, model_config):
    shapes = linear_shapes(model_config)
    tensors = {**factors(shapes, 0, "self_attn.q_proj", 4, seed=1),
               **factors(shapes, 0, "self_attn.v_proj", 4, seed=2)}
    return tmp_path / "peft", {"target_modules": ["q_proj", "v_proj"]}, tensors


def test_the_unbroken_adapter_reads(good_peft, targets):
    path, config, tensors = good_peft
    validate(read_adapter(write_peft(path, config, tensors)), targets, 16)


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals_name_the_feature(good_peft, case):
    path, config, tensors = good_peft
    config_change, tensor_change, match = REFUSALS[case]
    write_peft(path, {**config, **(config_change or {})},
               tensor_change(tensors) if tensor_change else tensors)
    with pytest.raises(InvalidAdapter, match=match):
        read_adapter(path)


def test_config_not_json(good_peft):
    path, config, tensors = good_peft
    write_peft(path, config, tensors)
    (path / "adapter_config.json").write_text("{not json")
    for read in (read_adapter, read_peft_adapter):
        with pytest.raises(InvalidAdapter, match="not valid JSON"):
            read(path)


def test_truncated_safetensors(good_peft):
    path, config, tensors = good_peft
    write_peft(path, config, tensors)
    data = (path / "adapter_model.safetensors").read_bytes()
    (path / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(InvalidAdapter, match="adapter_model.safetensors"):
        read_adapter(path)


# ---- 5. the dispatch -----------------------------------------------------------------


def test_dispatch_detects_peft(adapters, twins, good_peft):
    twin = twins["a", "plain"]
    assert is_peft_adapter(twin) and looks_like_peft_config(twin)
    assert detect_format(twin) == "peft" and read_adapter(twin).format == "peft"
    assert not is_peft_adapter(adapters["a"]) and not looks_like_peft_config(adapters["a"])
    assert detect_format(adapters["a"]) == "mlx-lm"
    # peft_type is matched without regard to case.
    path, config, tensors = good_peft
    write_peft(path, {**config, "peft_type": "lora"}, tensors)
    assert detect_format(path) == "peft" and read_adapter(path).format == "peft"


def test_peft_dir_without_safetensors_weights(good_peft):
    path, config, tensors = good_peft
    write_peft(path, config, tensors)
    (path / "adapter_model.safetensors").unlink()
    assert not is_peft_adapter(path) and looks_like_peft_config(path)
    with pytest.raises(InvalidAdapter, match=r"adapter_config.json \(PEFT\) but no adapter_model.safetensors"):
        read_adapter(path)
    (path / "adapter_model.bin").write_bytes(b"\x80\x02}q\x00.")  # a pickled empty dict
    with pytest.raises(InvalidAdapter, match=r"pickle \.bin .*[Cc]onvert it to adapter_model.safetensors"):
        read_adapter(path)
