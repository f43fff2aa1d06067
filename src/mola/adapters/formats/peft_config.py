"""What a PEFT LoRA's adapter_config.json declares, as PEFT reads it: the
checks that refuse what mola cannot apply exactly (naming the feature), and
PEFT's own matching of modules (``peft.tuners.tuners_utils.check_target_module_exists``)
and of per-module rank and alpha (``peft.utils.other.get_pattern_key``).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from ...errors import InvalidAdapter
from ..weights import alora_tokens
from .common import CONFIG_FILE
from .peft_experts import check_target_parameters

# PEFT's LoraConfig defaults, used when a config leaves a field out.
DEFAULT_R = 8
DEFAULT_ALPHA = 8

# Module names of token embeddings and output heads: PEFT puts an Embedding
# LoRA (or a LoRA on the head) there, which mola's slots do not cover.
EMBEDDING_NAMES = frozenset({"embed_tokens", "lm_head", "wte", "wpe", "embed_out", "word_embeddings"})
# Of those, the ones mola's slots cover (mola.lora.embedding; PEFT's names are mlx-lm's).
SERVED_VOCAB_NAMES = frozenset({"embed_tokens", "lm_head"})

# Config fields that change the forward pass beyond plain LoRA when set
# (truthy), with the name of the feature for the message.
UNSUPPORTED_FEATURES = {
    "lora_bias": "LoRA biases (lora_bias: true)",
    "layer_replication": "layer replication (layer_replication)",
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


# ---- checks -----------------------------------------------------------------------


def check_config(config: dict, where: Path) -> None:
    """Refuse what mola cannot apply exactly, naming the feature, and a config
    whose fields PEFT itself would not take."""
    config_file = where / CONFIG_FILE
    _check_plain_lora(config, where)
    alora_tokens(config, f"Adapter at {where}")
    _check_targets(config, where, config_file)
    _check_ranks(config, where, config_file)
    for name in ("target_modules", "exclude_modules"):
        if isinstance(config.get(name), str):
            _check_regex(config[name], name, config_file)
    check_target_parameters(config, config_file)


def _check_plain_lora(config: dict, where: Path) -> None:
    """A LoRA whose output is plain LoRA on the base's linears: no other PEFT
    type, no variant, no trained copies or biases, an unmodified base."""
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


def _check_targets(config: dict, where: Path, config_file: Path) -> None:
    """target_modules, exclude_modules, layers_to_transform and layers_pattern
    of the types PEFT takes (regexes that compile), and no LoRA on embeddings
    or the head."""
    target_modules = config.get("target_modules")
    if target_modules is not None and not isinstance(target_modules, (str, list)):
        raise InvalidAdapter(
            f"{config_file}: target_modules must be a list of names or a regex string, "
            f"got {target_modules!r}."
        )
    if isinstance(target_modules, list):
        if not all(isinstance(t, str) for t in target_modules):
            raise InvalidAdapter(f"{config_file}: target_modules must hold strings.")
        embeddings = sorted(t for t in target_modules
                            if t.rpartition(".")[2] in EMBEDDING_NAMES - SERVED_VOCAB_NAMES)
        if embeddings:
            raise InvalidAdapter(
                f"Adapter at {where} puts LoRA on embeddings or the output head "
                f"(target_modules {embeddings}); mola applies LoRA to the blocks' linear "
                "layers, embed_tokens and lm_head only."
            )
    exclude = config.get("exclude_modules")
    if exclude is not None and not _is_names(exclude):
        raise InvalidAdapter(f"{config_file}: exclude_modules must be a list of names or a regex string.")
    layers = config.get("layers_to_transform")
    if layers is not None:
        if not (_is_int(layers) or (isinstance(layers, list) and all(_is_int(i) for i in layers))):
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
    if pattern is not None and not _is_names(pattern):
        raise InvalidAdapter(f"{config_file}: layers_pattern must be a name or a list of names.")
    for p in [pattern] if isinstance(pattern, str) else pattern or []:
        _check_regex(p, "layers_pattern", config_file)


def _check_ranks(config: dict, where: Path, config_file: Path) -> None:
    """r and lora_alpha, and their per-module patterns, positive numbers."""
    _positive_number(config.get("r", DEFAULT_R), "r", where, integer=True)
    _positive_number(config.get("lora_alpha", DEFAULT_ALPHA), "lora_alpha", where, integer=False)
    for name in ("rank_pattern", "alpha_pattern"):
        value = config.get(name)
        if value is not None and not isinstance(value, dict):
            raise InvalidAdapter(f"{config_file}: {name} must be an object, got {value!r}.")
        for key, v in (value or {}).items():
            _positive_number(v, f"{name}[{key!r}]", where, integer=name == "rank_pattern")
            _check_regex(key, f"{name} key", config_file)


def _is_names(value) -> bool:
    """A regex string or a list of names."""
    return isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_number(value, what: str, where: Path, *, integer: bool) -> float | int:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if ok and integer:
        ok = float(value).is_integer()
    if not ok or value <= 0:
        kind = "a positive integer" if integer else "a positive number"
        raise InvalidAdapter(f"{where / CONFIG_FILE}: {what} must be {kind}, got {value!r}.")
    return int(value) if integer else float(value)


def _check_regex(pattern: str, what: str, config_file: Path) -> None:
    try:
        re.compile(pattern)
    except re.error as e:
        raise InvalidAdapter(f"{config_file}: {what} {pattern!r} is not a valid regex: {e}") from None


# ---- PEFT's matching ----------------------------------------------------------------


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
