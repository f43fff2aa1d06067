"""Hugging Face PEFT LoRA adapters (what ``PeftModel.save_pretrained`` writes):

    adapter_config.json        {"peft_type": "LORA", "r", "lora_alpha", "target_modules",
                                "use_rslora", "rank_pattern", "alpha_pattern",
                                "layers_to_transform", "layers_pattern", ...}
    adapter_model.safetensors  base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight  [r, in]
                               base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight  [out, r]

PEFT computes delta(x) = scaling * lora_B(lora_A(x)) = scaling * x @ A.T @ B.T with
scaling = alpha / r (or alpha / sqrt(r) with use_rslora), r and alpha per module
after ``rank_pattern`` / ``alpha_pattern``. mola's ModuleLoRA wants a = A.T and
b = B.T. Which modules carry LoRA follows PEFT's own matching (peft_config.py,
which also checks the config); tensors for modules the config does not
target are ignored, as PEFT's non-strict ``load_state_dict`` ignores them.

LoRA on the experts of a mixture of experts (one linear per expert, or 3-D
expert parameters through ``target_parameters``) is gathered into mola's
expert modules by peft_experts.py.

DoRA (``use_dora: true``) adds ``<module>.lora_magnitude_vector`` [out] per
module (mola.adapters.dora). Anything else that would make the output differ
from LoRA or DoRA on the listed linears is refused rather than dropped:
biases, ``modules_to_save``, LoRA on embeddings or the output head,
base-weight-modifying initialisations (PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA)
and other variants.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import mlx.core as mx

from ...errors import InvalidAdapter
from ..dora import PEFT_KEY as MAGNITUDE_KEY, take_magnitudes
from ..host_safetensors import read_safetensors_file
from ..weights import LoRAWeights, ModuleLoRA, alora_tokens, with_invocation
from .common import CONFIG_FILE, language_path, read_config
from .peft_config import EMBEDDING_NAMES, SERVED_VOCAB_NAMES, check_config, module_scale, targets_module
from .peft_expert_paths import to_mlx_lm
from .peft_experts import expert_param_lora, take_param_wrappers
from .peft_vocab import read_vocab_parts

log = logging.getLogger("mola.adapters")

WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_WEIGHTS_FILE = "adapter_model.bin"
PREFIX = "base_model.model."


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
        match = FACTOR_KEY.match(key)
        if match is None:
            hint = ""
            if "lora_magnitude_vector" in key:
                hint = " It is a DoRA magnitude vector, but the config's use_dora is not true."
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
    :func:`mola.adapters.weights.validate`."""
    path = Path(path)
    config = read_config(path)
    weights_file = _weights_file(path)
    return peft_weights(config, _load_tensors(weights_file), path, weights_file, dtype, model_type, model_config)


def peft_weights(config: dict, tensors: dict[str, mx.array], path: Path, weights_file: Path,
                 dtype: mx.Dtype | None = None, model_type: str | None = None,
                 model_config: dict | None = None) -> LoRAWeights:
    """PEFT's factors (``tensors``, by PEFT's names) under its adapter_config
    ``config`` as LoRAWeights; ``path`` and ``weights_file`` name where they
    came from in messages (a directory, or a pushed body)."""
    check_config(config, path)
    magnitudes = None
    if config.get("use_dora"):
        tensors, magnitudes = take_magnitudes(tensors, MAGNITUDE_KEY, PREFIX)
    tensors, embeddings, vocab = read_vocab_parts(config, tensors, path, weights_file, model_config)
    pairs = _pair_factors(tensors, weights_file)
    _check_pairs(pairs, path, weights_file)
    modules = _targeted_modules(config, pairs, path, weights_file, model_type, model_config)
    modules = {language_path(key, weights_file): m for key, m in modules.items()}  # a vision model's decoder
    modules = to_mlx_lm(modules, model_type, model_config, path) | embeddings
    if dtype is not None:
        modules = {p: ModuleLoRA(a=m.a.astype(dtype), b=m.b.astype(dtype), scale=m.scale)
                   for p, m in modules.items()}
    try:
        mx.eval([(m.a, m.b) for m in modules.values()])
    except Exception as e:
        raise InvalidAdapter(f"{weights_file} could not be read: {e}") from None
    if magnitudes is not None:
        magnitudes = _dora_magnitudes(config, magnitudes, modules, path, weights_file)
    return with_invocation(LoRAWeights(source=str(path), format="peft", modules=modules, magnitudes=magnitudes,
                                       vocab=vocab),
                           alora_tokens(config, f"Adapter at {path}"))


def _dora_magnitudes(config: dict, magnitudes: dict, modules: dict, path: Path, weights_file: Path) -> dict:
    """A use_dora adapter's magnitudes of the modules its config targets
    (evaluated); each must be on a dense linear whose name mola keeps."""
    magnitudes = {k: m for k, m in magnitudes.items() if targets_module(config, k)}
    if not magnitudes:
        raise InvalidAdapter(f"Adapter at {path} is a DoRA adapter (use_dora: true), but {weights_file} holds "
                             "no lora_magnitude_vector of a module its config targets.")
    moved = sorted(k for k in magnitudes if k not in modules)
    if moved:
        raise InvalidAdapter(f"Adapter at {path} puts DoRA on {moved[0]}, which is not a dense linear mola "
                             "serves it on (the experts of a mixture of experts, or no LoRA factors there); "
                             "mola serves DoRA on dense linear layers only.")
    mx.eval(magnitudes)
    return magnitudes


def _load_tensors(weights_file: Path) -> dict[str, mx.array]:
    tensors = read_safetensors_file(str(weights_file))  # on the host (mola.adapters.host_safetensors)
    try:
        tensors = mx.load(str(weights_file)) if tensors is None else tensors
    except Exception as e:  # mlx raises RuntimeError/ValueError for bad files
        raise InvalidAdapter(f"{weights_file} is not a readable safetensors file: {e}") from None
    if not isinstance(tensors, dict):
        raise InvalidAdapter(f"{weights_file} is not a safetensors file.")
    return tensors


def _check_pairs(pairs: dict[str, dict], path: Path, weights_file: Path) -> None:
    """Every module has both factors, and none is an embedding or the head."""
    for key, factors in sorted(pairs.items()):
        if key.rpartition(".")[2] in EMBEDDING_NAMES - SERVED_VOCAB_NAMES:
            raise InvalidAdapter(
                f"Adapter at {path} puts LoRA on {key} (embeddings or the output head); "
                "mola applies LoRA to the blocks' linear layers, embed_tokens and lm_head only."
            )
        missing = {"lora_A", "lora_B"} - set(factors)
        if missing:
            raise InvalidAdapter(f"{weights_file}: {key} has no {missing.pop()}.")


def _targeted_modules(config: dict, pairs: dict[str, dict], path: Path, weights_file: Path,
                      model_type: str | None, model_config: dict | None) -> dict[str, ModuleLoRA]:
    """The ModuleLoRA of every module (and ParamWrapper) the config targets,
    by PEFT name (3-D ones by their parameter); the others are ignored, as
    PEFT ignores them, with a warning."""
    wrapped = take_param_wrappers(config, pairs, weights_file)
    modules: dict[str, ModuleLoRA] = {}
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
            modules[key] = expert_param_lora(key, factors, r, scale, model_type, model_config, weights_file)
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
    return modules
