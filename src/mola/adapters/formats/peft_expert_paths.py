"""Where PEFT's LoRA on the experts of a mixture of experts goes in the mlx-lm
model: mola's expert modules (``ModuleLoRA`` with a [E, in, r], b [E, r, out])
at the SwitchLinear paths, from either layout PEFT saves:

1. One ``nn.Linear`` per expert (transformers 4 Mixtral, Qwen2-MoE, Qwen3-MoE),
   LoRA'd through ``target_modules`` like any linear (peft.py reads them):

       model.layers.N.block_sparse_moe.experts.K.{w1,w3,w2}.lora_A.weight  [r, in]   mixtral
       model.layers.N.mlp.experts.K.{gate,up,down}_proj.lora_B.weight     [out, r]  qwen2_moe, qwen3_moe

   mlx-lm stacks expert K's weight into slice K of one SwitchLinear per
   projection (``sanitize`` in mlx_lm/models/mixtral.py: w1 -> switch_mlp.gate_proj,
   w3 -> up_proj, w2 -> down_proj; qwen3_moe.py / qwen2_moe.py: experts.K.X ->
   switch_mlp.X); mola stacks their factors the same way. An expert missing from
   the file gets zeros; ranks that differ between experts are zero-padded to the
   largest (exact), and scales that differ are folded into B (exact up to rounding).

2. 3-D expert parameters (transformers 5 for all four; gpt-oss always), read by
   peft_experts.py. transformers 5.24 stores (models/*/modeling_*.py):

       qwen3_moe, qwen2_moe, mixtral   gate_up_proj [E, 2I, H], down_proj [E, H, I], used as
                                       F.linear(x, W[e]); gate, up = (...).chunk(2, dim=-1)
                                       (modeling_qwen3_moe.py:219-220, 241; modeling_mixtral.py:65-66, 87;
                                       modeling_qwen2_moe.py:280-281, 302): gate = out[:I], up = out[I:]
                                       (conversion_mapping.py "mixtral", "qwen2_moe": w1/gate_proj and
                                       w3/up_proj Concatenate(dim=1))
       gpt_oss                         gate_up_proj [E, H, 2I], down_proj [E, I, H], is_transposed=True,
                                       used as x @ W[e]; gate, up = gate_up[..., ::2], gate_up[..., 1::2]
                                       (modeling_gpt_oss.py:68, 75-77, 83): interleaved

   so a gate_up LoRA becomes two mlx-lm experts, gate and up, sharing A and
   splitting B's output columns. The module is ``model.layers.N.mlp.experts``
   for all four (transformers 5 renamed Mixtral's block_sparse_moe to mlp:
   conversion_mapping.py "mixtral"), and its router ``mlp.gate`` (``mlp.router``
   for gpt-oss) is a plain [E, H] weight, targeted as ``gate.weight``: a 2-D
   ParamWrapper, whose factors and delta are a Linear's (``get_delta_weight``
   with num_experts 1).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from ...errors import InvalidAdapter
from ..weights import ModuleLoRA

QWEN_EXPERTS = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}
MIXTRAL_EXPERTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


@dataclass(frozen=True)
class MoELayout:
    """Where one mlx-lm architecture keeps its experts, and how transformers named them."""

    mlx_block: str  # the MoE block: model.layers.N.<mlx_block>
    mlx_experts: str  # its SwitchGLU: <mlx_block>.<mlx_experts>.{gate,up,down}_proj
    per_expert_block: str | None  # transformers 4's block of per-expert linears (None: never had them)
    per_expert: dict[str, str]  # their names -> the mlx-lm projection
    interleaved: bool  # gate_up_proj's output columns: gate/up alternate, else [gate; up]
    expert_width: str  # config key of one expert's intermediate size


LAYOUTS = {
    "mixtral": MoELayout("block_sparse_moe", "switch_mlp", "block_sparse_moe", MIXTRAL_EXPERTS, False,
                         "intermediate_size"),
    "qwen3_moe": MoELayout("mlp", "switch_mlp", "mlp", QWEN_EXPERTS, False, "moe_intermediate_size"),
    "qwen2_moe": MoELayout("mlp", "switch_mlp", "mlp", QWEN_EXPERTS, False, "moe_intermediate_size"),
    "gpt_oss": MoELayout("mlp", "experts", None, {}, True, "intermediate_size"),
}
PER_EXPERT_NAMES = {  # what a per-expert layout looks like, for messages
    "block_sparse_moe": "Mixtral's block_sparse_moe.experts.K.w1/w3/w2",
    "mlp": "Qwen-MoE's mlp.experts.K.gate_proj/up_proj/down_proj",
}

PER_EXPERT = re.compile(
    r"^(?P<layer>model\.layers\.\d+)\.(?P<block>[^.]+)\.experts\.(?P<k>\d+)\.(?P<proj>[^.]+)$")
FUSED = re.compile(r"^(?P<layer>model\.layers\.\d+)\.mlp\.experts$")
T5_MIXTRAL_ROUTER = re.compile(r"^(model\.layers\.\d+)\.mlp\.gate$")  # mixtral's mlp.gate in transformers 5


# ---- PEFT names -> mlx-lm paths ----------------------------------------------------------


def check_expert_module(key: str, model_type: str, where: Path) -> None:
    if model_type not in LAYOUTS:
        raise _not_moe(key, model_type, where, "LoRA on 3-D expert parameters (target_parameters)")
    if FUSED.match(key.rpartition(".")[0]) is None:
        raise InvalidAdapter(
            f"Adapter at {where} has LoRA on the expert parameter {key}, but transformers keeps the "
            f"experts of {model_type} at model.layers.N.mlp.experts: the adapter is for another layout."
        )


def expert_count(model_config: dict | None) -> int | None:
    """The base's experts per MoE layer (mixtral, gpt_oss: num_local_experts; qwen: num_experts)."""
    config = model_config or {}
    n = config.get("num_local_experts") or config.get("num_experts")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def to_mlx_lm(modules: dict[str, ModuleLoRA], model_type: str | None, model_config: dict | None,
              where: Path) -> dict[str, ModuleLoRA]:
    """mlx-lm module path -> ModuleLoRA from PEFT names -> ModuleLoRA (3-D ones
    keyed by their parameter, ``...mlp.experts.gate_up_proj``)."""
    layout = LAYOUTS.get(model_type or "")
    out: dict[str, ModuleLoRA] = {}
    origin: dict[str, str] = {}
    per_expert: dict[str, dict[int, ModuleLoRA]] = {}

    def put(path: str, m: ModuleLoRA, source: str) -> None:
        if path in out:
            raise InvalidAdapter(
                f"Adapter at {where} holds two LoRAs for {path}: {origin[path]} and {source}."
            )
        out[path], origin[path] = m, source

    for key, m in sorted(modules.items()):
        if m.a.ndim == 3 and model_type is None:
            put(key, m, key)  # no base to say how gate_up_proj splits: described as it is
        elif m.a.ndim == 3:
            for path, lora in _split_expert_param(key, m, layout, model_type, model_config, where):
                put(path, lora, key)
        elif match := PER_EXPERT.match(key):
            path = _per_expert_path(key, match, layout, model_type, where)
            per_expert.setdefault(path, {})[int(match["k"])] = m
        elif model_type == "mixtral" and (router := T5_MIXTRAL_ROUTER.match(key)):
            put(f"{router[1]}.block_sparse_moe.gate", m, key)
        else:
            put(key, m, key)
    for path, experts in sorted(per_expert.items()):
        gathered = _gather(path, experts, expert_count(model_config), where)
        put(path, gathered, f"the per-expert LoRAs of {path}")
    return out


def _not_moe(key: str, model_type: str | None, where: Path, what: str) -> InvalidAdapter:
    return InvalidAdapter(
        f"Adapter at {where} has {what} ({key}), but the base model type {model_type!r} is not a "
        f"mixture of experts mola knows ({', '.join(sorted(LAYOUTS))})."
    )


def _split_expert_param(key, m, layout, model_type, model_config, where):
    """[(mlx-lm path, ModuleLoRA)] of one 3-D expert parameter's LoRA (its
    module already checked by :func:`expert_param_lora`)."""
    module, _, param = key.rpartition(".")
    match = FUSED.match(module)
    prefix = f"{match['layer']}.{layout.mlx_block}.{layout.mlx_experts}"
    config = model_config or {}
    hidden, width = config.get("hidden_size"), config.get(layout.expert_width)
    in_dims, out_dims = m.a.shape[1], m.b.shape[2]
    if param == "down_proj":
        expected, parts = (width, hidden), [(f"{prefix}.down_proj", m)]
    else:
        half = out_dims // 2
        gate, up = ((m.b[..., 0::2], m.b[..., 1::2]) if layout.interleaved  # [E, r, I] each
                    else (m.b[..., :half], m.b[..., half:]))
        expected = (hidden, None if width is None else 2 * width)
        parts = [(f"{prefix}.gate_proj", ModuleLoRA(a=m.a, b=gate, scale=m.scale)),
                 (f"{prefix}.up_proj", ModuleLoRA(a=m.a, b=up, scale=m.scale))]
        if out_dims % 2:
            raise InvalidAdapter(f"Adapter at {where}: {key} has an odd output width {out_dims}; "
                                 "gate_up_proj holds gate and up, each half of it.")
    if None not in expected and (in_dims, out_dims) != expected:
        hint = ""
        if (out_dims, in_dims) == expected:
            hint = (" Its lora_A and lora_B are the other way round, as PEFT before 0.19.1 could save "
                    "3-D expert parameters (PEFT #3165); re-save it with a current PEFT.")
        raise InvalidAdapter(
            f"Adapter at {where}: {key} has LoRA for a {in_dims}->{out_dims} parameter, but {param} of "
            f"the base ({model_type}, hidden_size {hidden}, {layout.expert_width} {width}) is "
            f"{expected[0]}->{expected[1]}.{hint}"
        )
    return parts


def _per_expert_path(key: str, match: re.Match, layout: MoELayout | None, model_type: str | None,
                     where: Path) -> str:
    if model_type is None:  # no base: the names say which layout
        layout = LAYOUTS["mixtral" if match["block"] == "block_sparse_moe" else "qwen3_moe"]
    if layout is None:
        raise _not_moe(key, model_type, where, "per-expert LoRA")
    if match["block"] == layout.per_expert_block and match["proj"] in layout.per_expert:
        return f"{match['layer']}.{layout.mlx_block}.{layout.mlx_experts}.{layout.per_expert[match['proj']]}"
    found = next((name for block, name in PER_EXPERT_NAMES.items() if match["block"] == block
                  and match["proj"] in (MIXTRAL_EXPERTS if block == "block_sparse_moe" else QWEN_EXPERTS)),
                 "an unknown per-expert")
    if model_type is None:
        raise InvalidAdapter(f"Adapter at {where} has per-expert LoRA in {found} layout ({key}).")
    base = (f"whose experts transformers 4 names {PER_EXPERT_NAMES[layout.per_expert_block]}"
            if layout.per_expert_block else
            "whose experts transformers only ever stored as 3-D parameters (mlp.experts.gate_up_proj)")
    raise InvalidAdapter(
        f"Adapter at {where} has per-expert LoRA in {found} layout ({key}), but the base is {model_type}, "
        f"{base}: the adapter is for another architecture."
    )


def _gather(path: str, experts: dict[int, ModuleLoRA], count: int | None, where: Path) -> ModuleLoRA:
    """One expert ModuleLoRA from per-expert ones (2-D): zeros for experts the
    file lacks, ranks zero-padded to the largest, scales folded into B."""
    count = count if count is not None else max(experts) + 1
    beyond = sorted(k for k in experts if k >= count)
    if beyond:
        raise InvalidAdapter(
            f"Adapter at {where} has LoRA on expert {beyond[-1]} of {path}, but the base model has "
            f"{count} experts (0-{count - 1})."
        )
    shapes = sorted({(m.a.shape[0], m.b.shape[1]) for m in experts.values()})
    if len(shapes) > 1:
        raise InvalidAdapter(f"Adapter at {where}: the experts of {path} have LoRA for linears of "
                             f"different shapes (in, out) {shapes}.")
    (in_dims, out_dims), = shapes
    rank = max(m.rank for m in experts.values())
    scales = Counter(m.scale for m in experts.values())
    scale = max(scales, key=lambda s: (scales[s], s))
    dtype = experts[min(experts)].a.dtype
    a_list, b_list = [], []
    for e in range(count):
        m = experts.get(e)
        if m is None:
            a_list.append(mx.zeros((in_dims, rank), dtype))
            b_list.append(mx.zeros((rank, out_dims), dtype))
            continue
        b = m.b if m.scale == scale else (m.b.astype(mx.float32) * (m.scale / scale)).astype(m.b.dtype)
        pad = rank - m.rank
        a_list.append(mx.pad(m.a.astype(dtype), [(0, 0), (0, pad)]))  # [in, rank]
        b_list.append(mx.pad(b.astype(dtype), [(0, pad), (0, 0)]))  # [rank, out]
    return ModuleLoRA(a=mx.stack(a_list), b=mx.stack(b_list), scale=scale)  # [E, in, r], [E, r, out]
