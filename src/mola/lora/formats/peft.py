"""Hugging Face PEFT LoRA adapters (what ``PeftModel.save_pretrained`` writes):

    adapter_config.json        {"peft_type": "LORA", "r", "lora_alpha", "target_modules",
                                "use_rslora", "rank_pattern", "alpha_pattern",
                                "layers_to_transform", "layers_pattern", ...}
    adapter_model.safetensors  base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight  [r, in]
                               base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight  [out, r]

PEFT computes delta(x) = scaling * lora_B(lora_A(x)) = scaling * x @ A.T @ B.T with
scaling = alpha / r (or alpha / sqrt(r) with use_rslora), r and alpha per module
after ``rank_pattern`` / ``alpha_pattern``. mola's ModuleLoRA wants a = A.T and
b = B.T. Which modules carry LoRA follows PEFT's own matching
(``peft.tuners.tuners_utils.check_target_module_exists``,
``peft.utils.other.get_pattern_key``); tensors for modules the config does not
target are ignored, as PEFT's non-strict ``load_state_dict`` ignores them.

LoRA on the experts of a mixture of experts (one linear per expert, or 3-D
expert parameters through ``target_parameters``) is gathered into mola's
expert modules by peft_experts.py.

Anything that would make the output differ from plain LoRA on the listed
linears is refused rather than dropped: DoRA, biases, ``modules_to_save``,
LoRA on embeddings or the output head, base-weight-modifying initialisations
(PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA) and other variants.
"""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path

import mlx.core as mx

from ...errors import InvalidAdapter
from . import peft_experts
from .common import CONFIG_FILE, read_config
from ..weights import LoRAWeights, ModuleLoRA

log = logging.getLogger("mola.adapters")

WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_WEIGHTS_FILE = "adapter_model.bin"
PREFIX = "base_model.model."

# PEFT's LoraConfig defaults, used when a config leaves a field out.
DEFAULT_R = 8
DEFAULT_ALPHA = 8

# Module names of token embeddings and output heads: PEFT puts an Embedding
# LoRA (or a LoRA on the head) there, which mola's slots do not cover.
EMBEDDING_NAMES = frozenset({"embed_tokens", "lm_head", "wte", "wpe", "embed_out", "word_embeddings"})

# Config fields that change the forward pass beyond plain LoRA when set
# (truthy), with the name of the feature for the message.
UNSUPPORTED_FEATURES = {
    "use_dora": "DoRA (use_dora: true)",
    "lora_bias": "LoRA biases (lora_bias: true)",
    "layer_replication": "layer replication (layer_replication)",
    "trainable_token_indices": "trainable token embeddings (trainable_token_indices)",
    "alora_invocation_tokens": "Activated LoRA (alora_invocation_tokens)",
    "arrow_config": "Arrow routing (arrow_config)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "kasa_config": "KaSA (kasa_config)",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
    "use_qalora": "QA-LoRA (use_qalora: true)",
}

# init_lora_weights values with which PEFT also rewrites the base weights (an
# adapter saved that way only fits the rewritten base; PEFT's
# save_pretrained(path_initial_model_for_weight_conversion=...) turns it into
# a plain LoRA and resets init_lora_weights to true).
BASE_MODIFYING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")

# The weight keys PEFT writes: <module>.lora_A.weight, or
# <module>.lora_A.<adapter name>.weight from a raw model.state_dict().
FACTOR_KEY = re.compile(r"^(?P<module>.+)\.(?P<factor>lora_A|lora_B)(?:\.(?P<name>[^.]+))?\.weight$")


# ---- detection ------------------------------------------------------------------


def _load_json(path: Path):
    try:
        return json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return None


def looks_like_peft_config(path: Path) -> bool:
    """adapter_config.json parses as a JSON object with a ``peft_type``."""
    config = _load_json(path)
    return isinstance(config, dict) and "peft_type" in config


def is_peft_adapter(path: Path) -> bool:
    """A directory with a PEFT LoRA config and adapter_model.safetensors."""
    if not (path / WEIGHTS_FILE).is_file():
        return False
    config = _load_json(path)
    return (
        isinstance(config, dict)
        and isinstance(config.get("peft_type"), str)
        and config["peft_type"].upper() == "LORA"
    )


# ---- config -----------------------------------------------------------------------


def _positive_number(value, what: str, where: Path, *, integer: bool) -> float | int:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if ok and integer:
        ok = float(value).is_integer()
    if not ok or value <= 0:
        kind = "a positive integer" if integer else "a positive number"
        raise InvalidAdapter(f"{where / CONFIG_FILE}: {what} must be {kind}, got {value!r}.")
    return int(value) if integer else float(value)


def _check_config(config: dict, where: Path) -> None:
    """Refuse what mola cannot apply exactly, naming the feature."""
    config_file = where / CONFIG_FILE
    peft_type = config.get("peft_type")
    if not isinstance(peft_type, str) or peft_type.upper() != "LORA":
        raise InvalidAdapter(
            f"Adapter at {where} is a PEFT adapter of type {peft_type!r}; mola serves "
            "LoRA adapters only (peft_type 'LORA')."
        )
    for field, feature in UNSUPPORTED_FEATURES.items():
        if config.get(field):
            raise InvalidAdapter(
                f"Adapter at {where} uses {feature}, which mola cannot apply exactly; "
                "only plain LoRA on linear layers is served."
            )
    modules_to_save = config.get("modules_to_save")
    if modules_to_save:
        raise InvalidAdapter(
            f"Adapter at {where} has modules_to_save {modules_to_save!r}: it carries full "
            "copies of those modules, which mola does not load. Merge them into the base "
            "model or train without modules_to_save."
        )
    bias = config.get("bias", "none")
    if bias not in (None, "none"):
        raise InvalidAdapter(
            f"Adapter at {where} has bias {bias!r}: it trains bias terms, which mola does "
            "not apply; only bias 'none' is supported."
        )
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(BASE_MODIFYING_INITS):
        raise InvalidAdapter(
            f"Adapter at {where} has init_lora_weights {init!r}: this initialisation also "
            "rewrites the base model's weights, so the adapter does not fit the unmodified "
            "base. Save it with PEFT's save_pretrained(..., "
            "path_initial_model_for_weight_conversion=...) to get a plain LoRA."
        )
    target_modules = config.get("target_modules")
    if target_modules is not None and not isinstance(target_modules, (str, list)):
        raise InvalidAdapter(
            f"{config_file}: target_modules must be a list of names or a regex string, "
            f"got {target_modules!r}."
        )
    if isinstance(target_modules, list):
        if not all(isinstance(t, str) for t in target_modules):
            raise InvalidAdapter(f"{config_file}: target_modules must hold strings.")
        embeddings = sorted(t for t in target_modules if t.rpartition(".")[2] in EMBEDDING_NAMES)
        if embeddings:
            raise InvalidAdapter(
                f"Adapter at {where} puts LoRA on embeddings or the output head "
                f"(target_modules {embeddings}); mola applies LoRA to the blocks' linear "
                "layers only."
            )
    exclude = config.get("exclude_modules")
    if exclude is not None and not (
        isinstance(exclude, str) or (isinstance(exclude, list) and all(isinstance(e, str) for e in exclude))
    ):
        raise InvalidAdapter(f"{config_file}: exclude_modules must be a list of names or a regex string.")
    layers = config.get("layers_to_transform")
    if layers is not None:
        if not (
            (isinstance(layers, int) and not isinstance(layers, bool))
            or (isinstance(layers, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in layers))
        ):
            raise InvalidAdapter(
                f"{config_file}: layers_to_transform must be a layer index or a list of them, "
                f"got {layers!r}."
            )
        if isinstance(target_modules, str):
            # PEFT's LoraConfig refuses this combination too.
            raise InvalidAdapter(
                f"{config_file}: layers_to_transform cannot be used when target_modules is a "
                "regex string."
            )
    pattern = config.get("layers_pattern")
    if pattern is not None and not (
        isinstance(pattern, str) or (isinstance(pattern, list) and all(isinstance(p, str) for p in pattern))
    ):
        raise InvalidAdapter(f"{config_file}: layers_pattern must be a name or a list of names.")
    for p in [pattern] if isinstance(pattern, str) else pattern or []:
        _check_regex(p, "layers_pattern", config_file)
    _positive_number(config.get("r", DEFAULT_R), "r", where, integer=True)
    _positive_number(config.get("lora_alpha", DEFAULT_ALPHA), "lora_alpha", where, integer=False)
    for name in ("rank_pattern", "alpha_pattern"):
        value = config.get(name)
        if value is not None and not isinstance(value, dict):
            raise InvalidAdapter(f"{config_file}: {name} must be an object, got {value!r}.")
        for key, v in (value or {}).items():
            _positive_number(v, f"{name}[{key!r}]", where, integer=name == "rank_pattern")
            _check_regex(key, f"{name} key", config_file)
    for name in ("target_modules", "exclude_modules"):
        if isinstance(config.get(name), str):
            _check_regex(config[name], name, config_file)
    peft_experts.check_target_parameters(config, config_file)


def _check_regex(pattern: str, what: str, config_file: Path) -> None:
    try:
        re.compile(pattern)
    except re.error as e:
        raise InvalidAdapter(f"{config_file}: {what} {pattern!r} is not a valid regex: {e}") from None


def targets_module(config: dict, key: str) -> bool:
    """Whether PEFT would put a LoRA layer on the module named ``key``
    (``model.layers.3.self_attn.q_proj``), as
    ``peft.tuners.tuners_utils.check_target_module_exists`` decides it."""
    exclude = config.get("exclude_modules")
    if exclude:
        if isinstance(exclude, str):
            if re.fullmatch(exclude, key):
                return False
        elif key in exclude or any(key.endswith(f".{e}") for e in exclude):
            return False
    target = config.get("target_modules")
    if target is None:
        return True  # no restriction written down: every module in the file
    if isinstance(target, str):
        if target.lower() == "all-linear":
            return True
        return re.fullmatch(target, key) is not None
    if key in target:
        return True
    if not any(key.endswith(f".{t}") for t in target):
        return False
    layers = config.get("layers_to_transform")
    if layers is None or (isinstance(layers, list) and not layers):
        return True
    pattern = config.get("layers_pattern")
    index = None
    if not pattern:
        index = re.match(r".*?\.[^.]*\.(\d+)\.", key)
    else:
        for p in [pattern] if isinstance(pattern, str) else pattern:
            index = re.match(rf".*?\.{p}\.(\d+)\.", key)
            if index is not None:
                break
    if index is None:
        return False
    i = int(index.group(1))
    return i == layers if isinstance(layers, int) else i in layers


def pattern_value(patterns: dict, key: str, default):
    """``peft.utils.other.get_pattern_key``: the first pattern (in the file's
    order) that matches the end of ``key`` after a dot, or the whole of it, as
    a regex."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


def module_scale(config: dict, key: str) -> tuple[int, float]:
    """(r, scaling) of module ``key`` as PEFT's LoraLayer.update_layer sets them
    (the config already checked)."""
    r = config.get("r", DEFAULT_R)
    alpha = config.get("lora_alpha", DEFAULT_ALPHA)
    r = pattern_value(config.get("rank_pattern") or {}, key, r)
    alpha = pattern_value(config.get("alpha_pattern") or {}, key, alpha)
    r, alpha = int(r), float(alpha)
    scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    return r, scale


# ---- reading ----------------------------------------------------------------------


def _weights_file(path: Path) -> Path:
    weights_file = path / WEIGHTS_FILE
    if weights_file.is_file():
        return weights_file
    if (path / PICKLE_WEIGHTS_FILE).is_file():
        raise InvalidAdapter(
            f"Adapter at {path} has {CONFIG_FILE} (PEFT) but its weights are in "
            f"{PICKLE_WEIGHTS_FILE}, a pickle .bin file, which mola does not load (pickles "
            f"can run code). Convert it to {WEIGHTS_FILE}, e.g. with safetensors: "
            "save_file(torch.load('adapter_model.bin'), 'adapter_model.safetensors')."
        )
    raise InvalidAdapter(f"Adapter at {path} has {CONFIG_FILE} (PEFT) but no {WEIGHTS_FILE}.")


def _pair_factors(tensors: dict[str, mx.array], weights_file: Path) -> dict[str, dict[str, mx.array]]:
    """PEFT module name -> {"lora_A": ..., "lora_B": ...}."""
    pairs: dict[str, dict[str, mx.array]] = {}
    adapter_names = set()
    for key in sorted(tensors):
        if "lora_embedding_A" in key or "lora_embedding_B" in key:
            raise InvalidAdapter(
                f"{weights_file} holds '{key}': LoRA on embeddings, which mola does not "
                "apply (it serves LoRA on the blocks' linear layers only)."
            )
        match = FACTOR_KEY.match(key)
        if match is None:
            hint = ""
            if "lora_magnitude_vector" in key:
                hint = " It is a DoRA magnitude vector; mola serves LoRA only."
            elif key.endswith(".bias"):
                hint = " It is a bias, which mola does not apply."
            elif "modules_to_save" in key:
                hint = " It is part of a modules_to_save copy, which mola does not load."
            raise InvalidAdapter(
                f"{weights_file} holds '{key}', which is not a LoRA factor (expected keys "
                f"ending in .lora_A.weight / .lora_B.weight).{hint}"
            )
        module = match["module"]
        if module.startswith(PREFIX):
            module = module[len(PREFIX):]
        adapter_names.add(match["name"])
        pairs.setdefault(module, {})[match["factor"]] = tensors[key]
    if len(adapter_names) > 1:
        names = sorted(n or "(none)" for n in adapter_names)
        raise InvalidAdapter(
            f"{weights_file} holds the weights of several adapters ({', '.join(names)}); "
            "save each adapter on its own."
        )
    return pairs


def _linear_lora(key: str, factors: dict, config: dict, scale_key: str, path: Path,
                 weights_file: Path) -> ModuleLoRA:
    """The ModuleLoRA of one linear's factors (lora_A [r, in], lora_B [out, r]);
    ``scale_key`` is what rank_pattern / alpha_pattern match (the module, or
    for a ParamWrapper the parameter)."""
    lora_a, lora_b = factors["lora_A"], factors["lora_B"]
    if lora_a.ndim != 2 or lora_b.ndim != 2:
        raise InvalidAdapter(
            f"{weights_file}: {key} has lora_A of shape {tuple(lora_a.shape)} and "
            f"lora_B of shape {tuple(lora_b.shape)}; both must be matrices."
        )
    rank = lora_a.shape[0]
    if lora_b.shape[1] != rank:
        raise InvalidAdapter(
            f"{weights_file}: rank mismatch in {key}: lora_A {tuple(lora_a.shape)} has "
            f"rank {rank} but lora_B {tuple(lora_b.shape)} has rank {lora_b.shape[1]}."
        )
    r, scale = module_scale(config, scale_key)
    if r != rank:
        raise InvalidAdapter(
            f"Adapter at {path}: rank mismatch in {key}: its factors have rank {rank} "
            f"but {CONFIG_FILE} gives r={r} (after rank_pattern); the scale "
            "lora_alpha / r would be wrong."
        )
    return ModuleLoRA(a=lora_a.T, b=lora_b.T, scale=scale)  # [in, r], [r, out]


def read_peft_adapter(
    path: Path, dtype: mx.Dtype | None = None, model_type: str | None = None,
    model_config: dict | None = None,
) -> LoRAWeights:
    """Read (and evaluate) a PEFT LoRA adapter directory. ``model_type`` and
    ``model_config`` (the base's) say where its experts go in the mlx-lm model
    and how many it has. Shapes are checked against the model later, by
    :func:`mola.lora.weights.validate`."""
    path = Path(path)
    config = read_config(path)
    _check_config(config, path)
    weights_file = _weights_file(path)
    try:
        tensors = mx.load(str(weights_file))
    except Exception as e:  # mlx raises RuntimeError/ValueError for bad files
        raise InvalidAdapter(f"{weights_file} is not a readable safetensors file: {e}") from None
    if not isinstance(tensors, dict):
        raise InvalidAdapter(f"{weights_file} is not a safetensors file.")

    pairs = _pair_factors(tensors, weights_file)
    for key, factors in sorted(pairs.items()):
        if key.rpartition(".")[2] in EMBEDDING_NAMES:
            raise InvalidAdapter(
                f"Adapter at {path} puts LoRA on {key} (embeddings or the output head); "
                "mola applies LoRA to the blocks' linear layers only."
            )
        missing = {"lora_A", "lora_B"} - set(factors)
        if missing:
            raise InvalidAdapter(f"{weights_file}: {key} has no {missing.pop()}.")
    wrapped = peft_experts.take_param_wrappers(config, pairs, weights_file)
    modules: dict[str, ModuleLoRA] = {}  # PEFT names (3-D ones by their parameter)
    ignored = []
    for key, factors in sorted(pairs.items()):
        if not targets_module(config, key):
            ignored.append(key)
            continue
        modules[key] = _linear_lora(key, factors, config, key, path, weights_file)
    for key, factors in sorted(wrapped.items()):
        module, _, param = key.rpartition(".")
        if param == "weight":  # a 2-D ParamWrapper: a Linear's LoRA (ParamWrapper.get_delta_weight)
            modules[module] = _linear_lora(module, factors, config, key, path, weights_file)
        else:
            r, scale = module_scale(config, key)
            modules[key] = peft_experts.expert_param_lora(
                key, factors, r, scale, model_type, model_config, weights_file)
    if ignored:
        shown = ", ".join(ignored[:5]) + (" ..." if len(ignored) > 5 else "")
        log.warning(
            "Adapter at %s: ignoring weights of %d module(s) that its %s does not target "
            "(as PEFT does): %s", path, len(ignored), CONFIG_FILE, shown,
        )
        if not modules:
            raise InvalidAdapter(
                f"Adapter at {path}: none of the modules in {WEIGHTS_FILE} is targeted by "
                f"its {CONFIG_FILE} (target_modules / layers_to_transform): {shown}"
            )
    modules = peft_experts.to_mlx_lm(modules, model_type, model_config, path)
    if dtype is not None:
        modules = {p: ModuleLoRA(a=m.a.astype(dtype), b=m.b.astype(dtype), scale=m.scale)
                   for p, m in modules.items()}
    try:
        mx.eval([(m.a, m.b) for m in modules.values()])
    except Exception as e:
        raise InvalidAdapter(f"{weights_file} could not be read: {e}") from None
    return LoRAWeights(source=str(path), format="peft", modules=modules)
