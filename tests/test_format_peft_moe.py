"""PEFT LoRA on mixtures of experts (mola/adapters/formats/peft_experts.py): twins of
mlx-lm MoE adapters in PEFT's two layouts (mola/testing/peft.py) read back
equal, the files follow PEFT's own layout (checked against the raw mlx-lm file
with PEFT's and transformers' formulas, not with mola's reader), and what
cannot be applied exactly is refused."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx
import numpy as np
import pytest

from mola.errors import InvalidAdapter
from mola.adapters.formats import read_adapter
from mola.adapters.weights import LoRAWeights, ModuleLoRA
from mola.models.metadata import read_model_config
from mola.testing.adapter import make_mlx_lm_lora
from mola.testing.model import TinyModelSpec, make_tiny_model
from mola.testing.peft import (save_peft_adapter, save_peft_expert_params_adapter,
                                 save_peft_per_expert_adapter)

RANK = 4
PREFIX = "base_model.model."
PER_EXPERT_TYPES = ["mixtral", "qwen3_moe", "qwen2_moe"]
ALL_TYPES = [*PER_EXPERT_TYPES, "gpt_oss"]
# transformers 4's per-expert linears (mlx-lm's sanitize, models/mixtral.py, qwen3_moe.py)
PER_EXPERT = {
    "mixtral": ("block_sparse_moe", {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}),
    "qwen3_moe": ("mlp", {p: p for p in ("gate_proj", "up_proj", "down_proj")}),
    "qwen2_moe": ("mlp", {p: p for p in ("gate_proj", "up_proj", "down_proj")}),
}
MLX_EXPERTS = {"mixtral": "block_sparse_moe.switch_mlp", "qwen3_moe": "mlp.switch_mlp",
               "qwen2_moe": "mlp.switch_mlp", "gpt_oss": "mlp.experts"}
MLX_ROUTER = {"mixtral": "block_sparse_moe.gate", "qwen3_moe": "mlp.gate", "qwen2_moe": "mlp.gate",
              "gpt_oss": "mlp.router"}
WIDTH = {"mixtral": "intermediate_size", "qwen3_moe": "moe_intermediate_size",
         "qwen2_moe": "moe_intermediate_size", "gpt_oss": "intermediate_size"}


class Base(NamedTuple):
    adapter: Path  # mlx-lm's own MoE adapter
    config: dict  # the base's config.json
    weights: LoRAWeights  # the adapter as mola reads it

    @property
    def num_experts(self) -> int:
        return self.config.get("num_local_experts") or self.config["num_experts"]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    root, bases = tmp_path_factory.mktemp("moe"), {}

    def get(model_type: str) -> Base:
        if model_type not in bases:
            model = make_tiny_model(root / model_type, TinyModelSpec(model_type=model_type))
            adapter = make_mlx_lm_lora(root / f"{model_type}-lora", model, rank=RANK, seed=1)
            config = read_model_config(model)
            bases[model_type] = Base(adapter, config, read_adapter(adapter, model_type=model_type,
                                                                   model_config=config))
        return bases[model_type]
    return get


def read(path: Path, base: Base, model_type: str | None = None, **config) -> LoRAWeights:
    return read_adapter(path, model_type=model_type or base.config["model_type"],
                        model_config={**base.config, **config})


def products(m: ModuleLoRA) -> np.ndarray:
    """scale * a @ b: [in, out], or [E, in, out] per expert."""
    return np.array((m.a.astype(mx.float32) @ m.b.astype(mx.float32)) * m.scale)


def assert_same(got: LoRAWeights, want: LoRAWeights, arrays: bool):
    assert sorted(got.modules) == sorted(want.modules)
    for p, w in want.modules.items():
        g = got.modules[p]
        np.testing.assert_allclose(products(g), products(w), rtol=1e-5, atol=1e-6, err_msg=p)
        if arrays:
            assert g.scale == w.scale, p
            np.testing.assert_allclose(np.array(g.a), np.array(w.a), rtol=1e-6, err_msg=p)
            np.testing.assert_allclose(np.array(g.b), np.array(w.b), rtol=1e-6, err_msg=p)


def load(path: Path) -> dict[str, np.ndarray]:
    file = path / ("adapters.safetensors" if (path / "adapters.safetensors").exists()
                   else "adapter_model.safetensors")
    return {k: np.array(v) for k, v in mx.load(str(file)).items()}


def rewrite(src: Path, dst: Path, tensors=None, config=None) -> Path:
    """A copy of the PEFT adapter ``src`` with its tensors / config changed."""
    shutil.copytree(src, dst)
    if tensors is not None:
        mx.save_safetensors(str(dst / "adapter_model.safetensors"),
                            {k: mx.array(v) for k, v in tensors(load(src)).items()})
    if config is not None:
        conf = json.loads((src / "adapter_config.json").read_text())
        (dst / "adapter_config.json").write_text(json.dumps(config(conf)))
    return dst


def pattern(patterns: dict, key: str, default):
    """PEFT's get_pattern_key (src/peft/utils/other.py) and the value it picks."""
    return next((v for p, v in patterns.items() if re.match(rf"(.*\.)?({p})$", key)), default)


def mlx_deltas(base: Base) -> dict[str, np.ndarray]:
    """What mlx-lm's LoRASwitchLinear.fuse adds to each SwitchLinear weight
    [E, out, in]: scale * lora_b @ lora_a, from the raw file."""
    raw, scale = load(base.adapter), json.loads((base.adapter / "adapter_config.json").read_text())
    scale = scale["lora_parameters"]["scale"]
    return {k[: -len(".lora_a")]: scale * raw[k.replace("lora_a", "lora_b")] @ v
            for k, v in raw.items() if k.endswith(".lora_a") and v.ndim == 3}


# ---- twins read back equal -------------------------------------------------------------


@pytest.mark.parametrize("model_type", PER_EXPERT_TYPES)
def test_per_expert_twin_reads_back_equal(moe, tmp_path, model_type):
    base = moe(model_type)
    twin = save_peft_per_expert_adapter(tmp_path / "peft", base.weights, model_type)
    assert_same(read(twin, base), base.weights, arrays=True)


@pytest.mark.parametrize("model_type", ALL_TYPES)
def test_expert_params_twin_reads_back_equal(moe, tmp_path, model_type):
    base = moe(model_type)
    twin = save_peft_expert_params_adapter(tmp_path / "peft", base.weights, model_type)
    # gate and up have their own A in mlx-lm, so gate_up_proj's LoRA has them side by side
    # (rank 2r): equal products; every other module equal arrays.
    back = read(twin, base)
    assert_same(back, base.weights, arrays=False)
    for p, m in base.weights.modules.items():
        if not p.endswith(("gate_proj", "up_proj")) or m.num_experts is None:
            assert_same(LoRAWeights("", "", {p: back.modules[p]}), LoRAWeights("", "", {p: m}), arrays=True)


def test_rslora_twins(moe, tmp_path):
    base = moe("qwen2_moe")
    per_expert = save_peft_per_expert_adapter(tmp_path / "a", base.weights, "qwen2_moe", use_rslora=True)
    params = save_peft_expert_params_adapter(tmp_path / "b", base.weights, "qwen2_moe", use_rslora=True)
    assert json.loads((params / "adapter_config.json").read_text())["use_rslora"] is True
    assert_same(read(per_expert, base), base.weights, arrays=True)
    assert_same(read(params, base), base.weights, arrays=False)


def test_plain_writer_refuses_experts(moe, tmp_path):
    with pytest.raises(ValueError, match=r"switch_mlp\.down_proj holds experts"):
        save_peft_adapter(tmp_path / "peft", moe("qwen3_moe").weights)


def test_shared_a_makes_gate_up_rank_r(moe, tmp_path):
    base = moe("qwen3_moe")
    gate, up = (f"model.layers.0.mlp.switch_mlp.{p}" for p in ("gate_proj", "up_proj"))
    shared = LoRAWeights("", "", {gate: base.weights.modules[gate], up: ModuleLoRA(
        a=base.weights.modules[gate].a, b=base.weights.modules[up].b, scale=base.weights.modules[up].scale)})
    twin = save_peft_expert_params_adapter(tmp_path / "peft", shared, "qwen3_moe")
    assert load(twin)[f"{PREFIX}model.layers.0.mlp.experts.lora_A.weight"].shape == (
        RANK * base.num_experts, base.config["hidden_size"])  # only gate_up_proj: the outer wrapper
    assert_same(read(twin, base), shared, arrays=True)


def test_nesting_follows_what_each_module_has_targeted(moe, tmp_path):
    """target_parameters naming down_proj in layer 1 only (as PEFT's docs target
    "7.mlp.experts.gate_up_proj"): layer 0's experts have one wrapper, gate_up_proj
    with no .base_layer; layer 1's two."""
    base = moe("gpt_oss")
    twin = save_peft_expert_params_adapter(tmp_path / "peft", base.weights, "gpt_oss")
    layer0 = f"{PREFIX}model.layers.0.mlp.experts"
    one = rewrite(twin, tmp_path / "one", tensors=lambda t: {
        k.replace(f"{layer0}.base_layer.", f"{layer0}."): v for k, v in t.items()
        if not k.startswith(f"{layer0}.lora_")}, config=lambda c: {
        **c, "target_parameters": ["mlp.experts.gate_up_proj", "1.mlp.experts.down_proj", "mlp.router.weight"]})
    want = {p: m for p, m in base.weights.modules.items() if p != "model.layers.0.mlp.experts.down_proj"}
    assert_same(read(one, base), LoRAWeights("", "", want), arrays=False)


def test_without_a_base_names_say_the_layout(moe, tmp_path):
    base = moe("mixtral")
    per_expert = read_adapter(save_peft_per_expert_adapter(tmp_path / "a", base.weights, "mixtral"))
    assert_same(per_expert, base.weights, arrays=True)
    fused = read_adapter(save_peft_expert_params_adapter(tmp_path / "b", base.weights, "mixtral"))
    assert fused.modules["model.layers.0.mlp.experts.gate_up_proj"].a.ndim == 3  # not split without a base


# ---- the files follow PEFT's layout -----------------------------------------------------


@pytest.mark.parametrize("model_type", PER_EXPERT_TYPES)
def test_per_expert_files_are_peft_layout(moe, tmp_path, model_type):
    base = moe(model_type)
    twin = save_peft_per_expert_adapter(tmp_path / "peft", base.weights, model_type)
    raw, peft = load(base.adapter), load(twin)
    config = json.loads((twin / "adapter_config.json").read_text())
    block, names = PER_EXPERT[model_type]
    expected = {}
    for key, v in raw.items():  # mlx-lm: lora_a [in, r] / [E, r, in], lora_b [r, out] / [E, out, r]
        module, _, factor = key.rpartition(".")
        peft_factor = "lora_A" if factor == "lora_a" else "lora_B"
        if v.ndim == 2:  # nn.Linear(in, r).weight [r, in], nn.Linear(r, out).weight [out, r]
            expected[f"{PREFIX}{module}.{peft_factor}.weight"] = v.T
            continue
        layer = module.split(".")[2]
        name = names[module.rpartition(".")[2]]
        for k in range(base.num_experts):
            expected[f"{PREFIX}model.layers.{layer}.{block}.experts.{k}.{name}.{peft_factor}.weight"] = v[k]
    assert sorted(peft) == sorted(expected)
    for key, want in expected.items():
        np.testing.assert_array_equal(peft[key], want, err_msg=key)
    assert set(names.values()) <= set(config["target_modules"]) and "gate" in config["target_modules"]
    assert config["lora_alpha"] / config["r"] == base.weights.scale and config["r"] == RANK


@pytest.mark.parametrize("model_type", ALL_TYPES)
def test_expert_params_files_are_peft_layout(moe, tmp_path, model_type):
    """PEFT's ParamWrapper.get_delta_weight (PEFT 0.20 src/peft/tuners/lora/layer.py:
    lora_A [r*E, in] read as [E, r, in], lora_B [out, r*E] as [out, r, E]) on the
    file gives transformers 5's parameter deltas, which split into gate and up
    as transformers does and equal what mlx-lm fuses into its SwitchLinears. Key
    names: nested ParamWrappers, gate_up_proj inner (peft/utils/
    transformers_weight_conversion.py:267, 309); gate_up's rank doubled, as
    PEFT's PeftConcatenate and rank_pattern (:474) do for gate and up."""
    base = moe(model_type)
    twin = save_peft_expert_params_adapter(tmp_path / "peft", base.weights, model_type)
    raw, peft, want = load(base.adapter), load(twin), mlx_deltas(base)
    config = json.loads((twin / "adapter_config.json").read_text())
    E, H, I = base.num_experts, base.config["hidden_size"], base.config[WIDTH[model_type]]
    router = MLX_ROUTER[model_type].rpartition(".")[2]
    assert sorted(config["target_parameters"]) == sorted(
        ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", f"mlp.{router}.weight"])
    transposed = model_type == "gpt_oss"  # GptOssExperts is_transposed: [E, in, out], x @ W
    for layer in range(base.config["num_hidden_layers"]):
        experts = f"model.layers.{layer}.mlp.experts"
        mlx = f"model.layers.{layer}.{MLX_EXPERTS[model_type]}"
        # gate_up_proj is registered first, so it is the inner wrapper: .base_layer
        for param, module, (in_dims, out_dims) in (("gate_up_proj", f"{experts}.base_layer", (H, 2 * I)),
                                                   ("down_proj", experts, (I, H))):
            A, B = peft[f"{PREFIX}{module}.lora_A.weight"], peft[f"{PREFIX}{module}.lora_B.weight"]
            r = pattern(config["rank_pattern"], f"{experts}.{param}", config["r"])
            alpha = pattern(config["alpha_pattern"], f"{experts}.{param}", config["lora_alpha"])
            assert r == (2 * RANK if param == "gate_up_proj" else RANK)  # PeftConcatenate doubles r
            assert A.shape == (r * E, in_dims) and B.shape == (out_dims, r * E)
            A3, B3 = A.reshape(E, r, in_dims), B.reshape(out_dims, r, E)
            delta = np.einsum("ore,eri->" + ("eio" if transposed else "eoi"), B3, A3) * alpha / r
            if param == "down_proj":
                parts = {"down_proj": delta}
            elif transposed:  # gate_up[..., ::2], gate_up[..., 1::2] (modeling_gpt_oss.py)
                parts = {"gate_proj": delta[..., ::2], "up_proj": delta[..., 1::2]}
            else:  # F.linear(x, W).chunk(2, dim=-1): the output rows [gate; up]
                parts = {"gate_proj": delta[:, :I], "up_proj": delta[:, I:]}
            for proj, got in parts.items():
                w = want[f"{mlx}.{proj}"]  # [E, out, in]
                np.testing.assert_allclose(got, w.transpose(0, 2, 1) if transposed else w,
                                           rtol=1e-5, atol=1e-6, err_msg=f"{layer} {proj}")
        # the router: a 2-D ParamWrapper, saved as a Linear's factors
        mlx_router = f"model.layers.{layer}.{MLX_ROUTER[model_type]}"
        np.testing.assert_array_equal(peft[f"{PREFIX}model.layers.{layer}.mlp.{router}.lora_A.weight"],
                                      raw[f"{mlx_router}.lora_a"].T)


# ---- what the reader makes of experts the file lacks or ranks that differ -----------------


def test_missing_experts_are_zero(moe, tmp_path):
    base = moe("mixtral")
    twin = save_peft_per_expert_adapter(tmp_path / "peft", base.weights, "mixtral")
    cut = rewrite(twin, tmp_path / "cut", tensors=lambda t: {
        k: v for k, v in t.items() if ".experts.5.w1." not in k})
    back = read(cut, base)
    for p, m in base.weights.modules.items():
        g, w = products(back.modules[p]), products(m)
        if p.endswith("switch_mlp.gate_proj"):
            assert not g[5].any() and w[5].any()
            g, w = np.delete(g, 5, axis=0), np.delete(w, 5, axis=0)
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=p)


def test_per_expert_ranks_and_scales_that_differ(moe, tmp_path):
    """Expert 2 at rank 2, expert 3 with its own alpha: zero-padded to the
    largest rank and the scale folded into B, each expert's delta PEFT's."""
    base = moe("qwen3_moe")
    twin = save_peft_per_expert_adapter(tmp_path / "peft", base.weights, "qwen3_moe")
    e2, e3 = (f"model.layers.0.mlp.experts.{k}.gate_proj" for k in (2, 3))
    odd = rewrite(twin, tmp_path / "odd", tensors=lambda t: {
        **t, f"{PREFIX}{e2}.lora_A.weight": t[f"{PREFIX}{e2}.lora_A.weight"][:2],
        f"{PREFIX}{e2}.lora_B.weight": t[f"{PREFIX}{e2}.lora_B.weight"][:, :2]},
        config=lambda c: {**c, "rank_pattern": {e2: 2}, "alpha_pattern": {e3: 3 * c["lora_alpha"]}})
    peft, config = load(odd), json.loads((odd / "adapter_config.json").read_text())
    m = read(odd, base).modules["model.layers.0.mlp.switch_mlp.gate_proj"]
    assert m.rank == RANK and not np.array(m.a[2, :, 2:]).any() and not np.array(m.b[2, 2:]).any()
    got = products(m)
    for k in range(base.num_experts):
        key = f"model.layers.0.mlp.experts.{k}.gate_proj"
        r = pattern(config["rank_pattern"], key, config["r"])
        alpha = pattern(config["alpha_pattern"], key, config["lora_alpha"])
        want = (peft[f"{PREFIX}{key}.lora_B.weight"] @ peft[f"{PREFIX}{key}.lora_A.weight"]).T * alpha / r
        np.testing.assert_allclose(got[k], want, rtol=1e-5, atol=1e-6, err_msg=key)


# ---- refusals ------------------------------------------------------------------------------

GU = f"{PREFIX}model.layers.0.mlp.experts.base_layer"
DOWN = f"{PREFIX}model.layers.0.mlp.experts"


def _reversed_down(t):
    """down_proj's factors the other way round (PEFT before 0.19.1 on [E, out, in] parameters)."""
    A, B = t[f"{DOWN}.lora_A.weight"], t[f"{DOWN}.lora_B.weight"]  # [r*E, I], [H, r*E]
    E = A.shape[0] // RANK
    a, b = A.reshape(E, RANK, -1), B.reshape(B.shape[0], RANK, E)  # [E, r, I], [H, r, E]
    return {**t, f"{DOWN}.lora_A.weight": b.transpose(2, 1, 0).reshape(E * RANK, -1),  # [r*E, H]
            f"{DOWN}.lora_B.weight": a.transpose(2, 1, 0).reshape(a.shape[2], RANK * E)}  # [I, r*E]


REFUSALS = {
    # name: (layout written from which model type, read as, base config changes, tensor change,
    #        config change, what the message must name)
    "Mixtral names on qwen3_moe": ("per-expert", "mixtral", "qwen3_moe", {}, None, None,
                                   r"Mixtral's block_sparse_moe.* qwen3_moe.*Qwen-MoE's"),
    "Qwen-MoE names on mixtral": ("per-expert", "qwen3_moe", "mixtral", {}, None, None,
                                  r"Qwen-MoE's .*mixtral.*Mixtral's"),
    "per-expert names on gpt_oss": ("per-expert", "qwen3_moe", "gpt_oss", {}, None, None,
                                    r"gpt_oss.*only ever stored as 3-D"),
    "per-expert names on a dense base": ("per-expert", "qwen3_moe", "llama", {}, None, None,
                                         r"'llama' is not a mixture of experts"),
    "expert index beyond the base": ("per-expert", "qwen3_moe", None, {"num_experts": 6}, None, None,
                                     r"expert 7 of .*switch_mlp.* 6 experts"),
    "expert shapes differ": ("per-expert", "mixtral", None, {}, lambda t: {
        **t, f"{PREFIX}model.layers.0.block_sparse_moe.experts.1.w1.lora_A.weight": np.zeros((RANK, 32))},
        None, r"different shapes"),
    "expert count differs": ("params", "qwen3_moe", None, {"num_experts": 4}, None, None,
                             r"LoRA for 8 experts .* base model has 4"),
    "expert params on a dense base": ("params", "qwen3_moe", "llama", {}, None, None,
                                      r"3-D expert parameters.*'llama' is not a mixture of experts"),
    "expert params at another path": ("params", "qwen3_moe", None, {}, lambda t: {
        k.replace(".mlp.experts", ".feed_forward.experts"): v for k, v in t.items()},
        lambda c: {**c, "target_parameters": [p.replace("mlp.experts", "feed_forward.experts")
                                              for p in c["target_parameters"]]}, r"another layout"),
    "expert params of another width": ("params", "qwen3_moe", None, {"moe_intermediate_size": 16}, None,
                                       None, r"down_proj has LoRA for a 32->64 parameter.* 16->64"),
    "expert params the other way round": ("params", "qwen3_moe", None, {}, _reversed_down, None,
                                          r"down_proj .* 64->32 .*other way round"),
    "a bias as target parameter": ("params", "qwen3_moe", None, {}, None, lambda c: {
        **c, "target_parameters": [*c["target_parameters"], "mlp.experts.gate_up_proj_bias"]}, r"biases"),
    "target_parameters not a list": ("params", "qwen3_moe", None, {}, None, lambda c: {
        **c, "target_parameters": "mlp.experts.down_proj"}, r"target_parameters must be a list"),
    "nested wrappers without target_parameters": ("params", "qwen3_moe", None, {}, None, lambda c: {
        **c, "target_parameters": ["mlp.gate.weight"]}, r"ParamWrapper 1 level"),
    "rows not r times experts": ("params", "qwen3_moe", None, {}, None, lambda c: {
        **c, "rank_pattern": {**c["rank_pattern"], "model.layers.0.mlp.experts.down_proj": 3}},
        r"not r \* experts for r=3"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals_name_what_differs(moe, tmp_path, case):
    layout, written, read_as, changes, tensors, config, match = REFUSALS[case]
    base = moe(written)
    writer = save_peft_per_expert_adapter if layout == "per-expert" else save_peft_expert_params_adapter
    twin = writer(tmp_path / "twin", base.weights, written)
    broken = rewrite(twin, tmp_path / "broken", tensors=tensors, config=config)
    read(twin, base)  # the unbroken twin reads
    with pytest.raises(InvalidAdapter, match=match):
        read(broken, base, read_as, **changes)


def test_two_loras_for_one_module(moe, tmp_path):
    base = moe("qwen3_moe")
    a = save_peft_per_expert_adapter(tmp_path / "a", base.weights, "qwen3_moe")
    b = save_peft_expert_params_adapter(tmp_path / "b", base.weights, "qwen3_moe")
    both = rewrite(a, tmp_path / "both", tensors=lambda t: {**t, **load(b)}, config=lambda c: {
        **c, "target_parameters": json.loads((b / "adapter_config.json").read_text())["target_parameters"],
        "rank_pattern": json.loads((b / "adapter_config.json").read_text())["rank_pattern"]})
    with pytest.raises(InvalidAdapter, match=r"two LoRAs for model\.layers\.0\.mlp\.switch_mlp\.down_proj"):
        read(both, base)
