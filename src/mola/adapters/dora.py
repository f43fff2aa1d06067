"""DoRA adapters: what their files hold beside LoRA's factors, and what mola
refuses of them.

A DoRA adapter is a LoRA plus one magnitude m [out] per module: mlx-lm's
DoRALinear saves it as ``<module>.m`` (``fine_tune_type: dora``), PEFT as
``<module>.lora_magnitude_vector`` (``use_dora: true``). Both compute

    y = m / ||W + s B A|| * (W x + s B A x) + bias   (the norm row-wise, one per output)

which the slot packs apply unmerged (mola.lora.dora). The magnitudes travel on
LoRAWeights.magnitudes, by module path.

Refused, each with a message naming the problem: DoRA on the experts of a
mixture of experts (neither trainer writes it for mlx-lm's SwitchLinear), on a
tensor-parallel base, as an activated LoRA, in a stack, a module with factors
but no magnitude (or the other way round), and a request's ``lora_scale`` other
than 1 (g is computed for the adapter's own scale at load: see docs/adapters.md).
"""

from __future__ import annotations

import re
from typing import Mapping

import mlx.core as mx
import numpy as np

from ..errors import InvalidAdapter, InvalidRequest

KIND = "dora"
# PEFT's magnitude keys: <module>.lora_magnitude_vector as saved, or
# <module>.lora_magnitude_vector.<adapter name>.weight from a raw state_dict().
PEFT_KEY = re.compile(r"^(?P<module>.+)\.lora_magnitude_vector(?:\.(?P<name>[^.]+)\.weight)?$")


def take_magnitudes(tensors: Mapping[str, mx.array], pattern: re.Pattern, prefix: str = "",
                    ) -> tuple[dict[str, mx.array], dict[str, mx.array]]:
    """(the tensors but the magnitudes, module -> m as float32) of a file whose
    magnitude keys match ``pattern`` (group "module"); ``prefix`` is cut from
    module names."""
    rest, magnitudes = {}, {}
    for key, value in tensors.items():
        match = pattern.match(key)
        if match is None:
            rest[key] = value
            continue
        module = match["module"]
        magnitudes[module[len(prefix):] if module.startswith(prefix) else module] = value.astype(mx.float32)
    return rest, magnitudes


def check_dora(weights, targets: Mapping) -> None:
    """InvalidAdapter unless ``weights``' magnitudes (LoRAWeights.magnitudes)
    fit: one m [out] per module with LoRA, on a plain linear of a base that is
    not split across a tensor-parallel group, not an activated LoRA."""
    where, magnitudes = weights.source, weights.magnitudes
    if weights.invocation_tokens is not None:
        raise InvalidAdapter(f"Adapter at {where} is a DoRA adapter with alora_invocation_tokens; mola does not "
                             "serve DoRA as an activated LoRA (PEFT does not train that combination either).")
    lonely = sorted(set(magnitudes) - set(weights.modules))
    if lonely:
        raise InvalidAdapter(f"Adapter at {where} has a DoRA magnitude for {lonely[0]} but no LoRA factors there.")
    missing = sorted(set(weights.modules) - set(magnitudes))
    if missing:
        raise InvalidAdapter(f"Adapter at {where} is a DoRA adapter, but {missing[0]} has LoRA factors and no "
                             "magnitude vector; DoRA needs one per module.")
    for path, m in sorted(magnitudes.items()):
        target = targets[path]
        if getattr(target, "num_experts", None) is not None:
            raise InvalidAdapter(f"Adapter at {where} puts DoRA on the experts of a mixture of experts ({path}); "
                                 "mola serves DoRA on dense linear layers only.")
        sharding = getattr(target, "sharding", None)
        if sharding is not None and sharding.kind != "none":
            raise InvalidAdapter(f"Adapter at {where} is a DoRA adapter, and this server's base is split across a "
                                 f"tensor-parallel group ({path} is {sharding.kind}-sharded); mola does not serve "
                                 "DoRA on a tensor-parallel base.")
        if tuple(m.shape) != (target.output_dims,):
            raise InvalidAdapter(f"Adapter at {where}: the DoRA magnitude of {path} has shape {tuple(m.shape)}; "
                                 f"expected ({target.output_dims},), one per output of that linear.")
        if not bool(np.isfinite(np.asarray(m)).all()):
            raise InvalidAdapter(f"Adapter at {where}: the DoRA magnitude of {path} contains non-finite values.")


def refuse_in_stack(weights) -> None:
    """InvalidAdapter when ``weights``, a part of a stack, is a DoRA adapter."""
    if weights.magnitudes:
        raise InvalidAdapter(
            f"The adapter at {weights.source} is a DoRA adapter: it is not stacked with others (its magnitude "
            "normalises its own LoRA on the base, and a sum of DoRA and LoRA deltas has no such normalisation); "
            "serve it alone.")


def check_row_scale(kind: str | None, row_scale: float, name: str) -> None:
    """InvalidRequest (400) for a ``lora_scale`` other than 1 on a DoRA adapter."""
    if kind == KIND and row_scale != 1.0:
        raise InvalidRequest(
            f"lora_scale {row_scale:g} asks to scale '{name}', a DoRA adapter; its magnitude scale is computed "
            "for the scale it was loaded with, so mola serves it at lora_scale 1 only. Load it again with "
            "POST /v1/adapters' \"scale\" to serve it at another scale.", param="lora_scale")
