"""PEFT LoRA on 3-D expert parameters (``target_parameters``), read into
mola's expert modules (``ModuleLoRA`` with a [E, in, r], b [E, r, out]). PEFT
saves expert LoRA in two layouts: one ``nn.Linear`` per expert (transformers
4), LoRA'd through ``target_modules`` like any linear (peft.py reads them),
and this one; where either goes in the mlx-lm model is peft_expert_paths.py.

3-D expert parameters (transformers 5 for all four; gpt-oss always), LoRA'd
through ``target_parameters`` by PEFT's ``ParamWrapper``. Sources: PEFT 0.20
(commit 5d602fdb), src/peft/tuners/lora/layer.py. A parameter [E, d1, d2]
has in, out = d2, d1 unless its module sets ``is_transposed`` (then d1, d2):
``_get_in_out_features`` (layer.py:2301) and ``update_layer``'s
``swap_in_out_features`` (layer.py:2348). Then (layer.py:2366-2367, 2436-2452)

    lora_A.weight  [r*E, in]   nn.Linear(in, r*E), expert-major:  A_e = A.reshape(E, r, in)[e]
    lora_B.weight  [out, r*E]  nn.Linear(r*E, out), expert-minor: B_e = B.reshape(out, r, E)[:, :, e]

and ``get_delta_weight`` forms einsum("o r e, e r i -> e o i") * scaling (or
"-> e i o" when transposed), so expert e's delta is x @ A_e.T @ B_e.T * scaling:
a[e] = A_e.T, b[e] = B_e.T. (PEFT before 0.19.1 could save these the other
way round, PEFT #3165; such a file is refused by its shapes where they
differ.)

Several parameters of one module are nested ParamWrappers: PEFT wraps them
in the order the module registers them (tuners_utils.py:1204,
``_inject_parameters`` walks ``module.named_parameters(recurse=False)``),
each new wrapper around the last, so the last-registered is outermost and
each one inside it gains a ``.base_layer``: with gate_up_proj and down_proj
both targeted, ``mlp.experts.base_layer.lora_A.weight`` is gate_up_proj and
``mlp.experts.lora_A.weight`` is down_proj -- as PEFT's own conversion of
per-expert adapters writes them (src/peft/utils/transformers_weight_conversion.py:267
"the gate_up_proj is the innner PEFT ParamWrapper", :309 "the down_proj is
the outer PEFT ParamWrapper"). Rank and alpha patterns match the parameter's
key, ``model.layers.N.mlp.experts.gate_up_proj`` (lora/model.py:234).
"""

from __future__ import annotations

from pathlib import Path

from ...errors import InvalidAdapter
from ..weights import ModuleLoRA
from .peft_expert_paths import check_expert_module, expert_count

# The 3-D parameters of a transformers *Experts module that take LoRA, in the
# order the classes register them (modeling_qwen3_moe.py:219-220, ...).
EXPERT_PARAMS = ("gate_up_proj", "down_proj")
# What target_parameters may name: those, and a 2-D weight (e.g. a router's).
TARGETABLE_PARAMS = (*EXPERT_PARAMS, "weight")


# ---- which factors belong to target_parameters -------------------------------------


def check_target_parameters(config: dict, config_file: Path) -> None:
    targets = config.get("target_parameters")
    if targets is None:
        return
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise InvalidAdapter(f"{config_file}: target_parameters must be a list of names, got {targets!r}.")
    for t in targets:
        if t.rpartition(".")[2] not in TARGETABLE_PARAMS:
            raise InvalidAdapter(
                f"{config_file}: target_parameters names {t!r}; mola applies LoRA on parameters only to "
                "experts' gate_up_proj / down_proj and to 2-D weights, not to biases or other parameters."
            )


def _targeted(module: str, targets: list[str]) -> list[str]:
    """The parameters of ``module`` that PEFT wraps, innermost first."""
    candidates = EXPERT_PARAMS if module.rpartition(".")[2] == "experts" else ("weight",)
    return [p for p in candidates
            if any(f"{module}.{p}" == t or f"{module}.{p}".endswith(f".{t}") for t in targets)]


def take_param_wrappers(config: dict, pairs: dict[str, dict], weights_file: Path) -> dict[str, dict]:
    """Move the factors of ParamWrappers out of ``pairs`` (PEFT module name ->
    factors), keyed by the parameter they adapt (``model.layers.0.mlp.experts.down_proj``)."""
    targets = config.get("target_parameters") or []
    wrapped = {}
    for name in sorted(pairs):
        module, depth = name, 0
        while module.endswith(".base_layer"):
            module, depth = module[: -len(".base_layer")], depth + 1
        params = _targeted(module, targets)
        if not params and not depth:
            continue  # a module of target_modules
        if depth >= len(params):
            raise InvalidAdapter(
                f"{weights_file} holds LoRA factors for {name}, a ParamWrapper {depth} level(s) inside "
                f"others, but the config's target_parameters {targets!r} target {len(params)} "
                f"parameter(s) of {module}."
            )
        wrapped[f"{module}.{params[len(params) - 1 - depth]}"] = pairs.pop(name)  # last wrapped is outermost
    return wrapped


def expert_param_lora(key: str, factors: dict, r: int, scale: float, model_type: str | None,
                      model_config: dict | None, weights_file: Path) -> ModuleLoRA:
    """The expert ModuleLoRA of a 3-D ParamWrapper's factors (see the module's
    doc), once the parameter is known to be the base's experts'."""
    where = weights_file.parent
    if model_type is not None:  # without a base, described as it is
        check_expert_module(key, model_type, where)
    num_experts = expert_count(model_config)
    lora_a, lora_b = factors["lora_A"], factors["lora_B"]  # [r*E, in], [out, r*E]
    shapes = f"lora_A {tuple(lora_a.shape)}, lora_B {tuple(lora_b.shape)}"
    if lora_a.ndim != 2 or lora_b.ndim != 2 or lora_b.shape[1] != lora_a.shape[0]:
        raise InvalidAdapter(f"{weights_file}: {key} has {shapes}; PEFT stores [r*E, in] and [out, r*E].")
    rows = lora_a.shape[0]
    if rows % r:
        raise InvalidAdapter(
            f"{weights_file}: {key} has {shapes}: {rows} rows are not r * experts for r={r} "
            "(after rank_pattern)."
        )
    experts = rows // r
    if num_experts is not None and experts != num_experts:
        raise InvalidAdapter(
            f"Adapter at {where}: {key} holds LoRA for {experts} experts ({shapes} at r={r}) "
            f"but the base model has {num_experts} experts."
        )
    in_dims, out_dims = lora_a.shape[1], lora_b.shape[0]
    a = lora_a.reshape(experts, r, in_dims).transpose(0, 2, 1)  # [E, in, r]
    b = lora_b.reshape(out_dims, r, experts).transpose(2, 1, 0)  # [E, r, out]
    return ModuleLoRA(a=a, b=b, scale=scale)
