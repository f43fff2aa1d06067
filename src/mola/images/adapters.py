"""Reading an image LoRA file into factors, by mflux's own loader.

mflux 0.24.0's LoRALoader knows every key style its FLUX.2 mapping accepts
(diffusers/PEFT ``transformer.*.lora_A``, kohya ``lora_unet_*.lora_down``, BFL
``diffusion_model.*``, fused-projection splits, ``alpha`` and PEFT metadata).
Rather than copy that, :func:`read_lora` lets it apply one file at scale 1 with
``bake_lora=False`` to the plain transformer (each wrapped linear's base put
back for the while), takes the factors from the LoRALinear layers it made
(lora_B already times alpha / rank, exactly as mflux computes with it), and
puts mola's layers back, whatever happened.

Refused with InvalidAdapter, naming the kind: LoKr and LoHa (Kronecker and
Hadamard products, not two factors), DoRA (a magnitude that rescales the merged
weight), and ``.diff`` direct weight patches: none of them is a plain LoRA a
slot can hold as x @ A @ B. Runs on the image worker thread (it touches the model).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import struct
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..errors import InvalidAdapter

log = logging.getLogger("mola.images")

# Key parts that mark an adapter that is not plain LoRA -> what to call it.
NOT_LORA = {"lokr_w1": "LoKr", "lokr_w2": "LoKr", "lokr_w1_a": "LoKr", "lokr_w2_a": "LoKr", "hada_w1_a": "LoHa",
            "dora_scale": "DoRA", "lora_magnitude_vector": "DoRA", "diff": "a .diff weight patch",
            "diff_b": "a .diff_b bias patch"}
MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class ImageLoRA:
    """One LoRA file as factors: delta(x) = (x @ a) @ b per module path, before any scale."""

    path: str
    modules: dict[str, tuple[mx.array, mx.array]]  # module path -> (a [in, r], b [r, out])

    @property
    def rank(self) -> int:
        return max(a.shape[1] for a, _ in self.modules.values())


def safetensors_keys(path: str) -> list[str]:
    """The tensor names of a .safetensors file, read from its header alone."""
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > MAX_HEADER_BYTES:
                raise ValueError(f"a header of {size} bytes")
            header = json.loads(f.read(size))
        if not isinstance(header, dict):
            raise ValueError("its header is not a JSON object")
    except (OSError, ValueError, struct.error) as e:
        raise InvalidAdapter(f"{Path(path).name} is not a readable .safetensors file: {e}") from None
    return [k for k in header if k != "__metadata__"]


def refuse_non_lora(path: str) -> None:
    """Raise InvalidAdapter naming the kind when the file is not plain LoRA."""
    for key in safetensors_keys(path):
        parts = key.split(".")
        for part in parts[-2:]:
            if part in NOT_LORA:
                raise InvalidAdapter(
                    f"{Path(path).name} is {NOT_LORA[part]} (key {key!r}), not a plain LoRA: images apply "
                    "LoRA per request unmerged, as x @ A @ B, which LoKr, LoHa, DoRA and .diff patches are not.")


def read_lora(path: str, transformer: nn.Module, layers: dict[str, nn.Module], mapping: list) -> ImageLoRA:
    """The factors of the LoRA file at ``path`` for ``transformer``, whose target
    linears ``layers`` (module path -> DiffusionLoRALinear) wrap."""
    from mflux.models.common.lora.layer.linear_lora_layer import LoRALinear
    from mflux.models.common.lora.mapping.lora_loader import LoRALoader

    refuse_non_lora(path)
    printed = io.StringIO()  # mflux prints its progress; kept for the log and the error
    modules: dict[str, tuple[mx.array, mx.array]] = {}
    try:
        for name, layer in layers.items():
            _put(transformer, name, layer.base)
        with contextlib.redirect_stdout(printed):
            LoRALoader.load_and_apply_lora(lora_mapping=mapping, transformer=transformer, lora_paths=[path],
                                           lora_scales=[1.0], bake_lora=False)
        for name, module in transformer.named_modules():
            if isinstance(module, LoRALinear):
                modules[name] = (module.lora_A, module.lora_B)  # [in, r], [r, out] (times alpha / r)
            elif name in layers and module is not layers[name].base:
                raise InvalidAdapter(f"{Path(path).name} puts a {type(module).__name__} on {name} (one layer "
                                     "named twice, or not a plain LoRA); images take one plain LoRA per layer.")
    except (ValueError, TypeError, AttributeError, IndexError, FileNotFoundError, KeyError) as e:
        said = " ".join(line.strip() for line in printed.getvalue().splitlines() if "❌" in line)
        raise InvalidAdapter(f"{Path(path).name} cannot be applied to this image model: {e} {said}".strip()) from None
    finally:
        for name, layer in layers.items():
            _put(transformer, name, layer)
        log.debug("mflux on %s: %s", path, printed.getvalue())
    if not modules:
        raise InvalidAdapter(f"{Path(path).name} holds no LoRA for this image model.")
    for name, (a, b) in modules.items():  # mflux does not check: a LoRA of another model must not reach a slot
        want = layers[name].full_dims
        if a.ndim != 2 or b.ndim != 2 or (a.shape[0], b.shape[1]) != want or a.shape[1] != b.shape[0]:
            raise InvalidAdapter(f"{Path(path).name} does not fit this image model: {name} takes factors of "
                                 f"[{want[0]}, r] and [r, {want[1]}], the file has {list(a.shape)} and "
                                 f"{list(b.shape)} (a LoRA for another model?).")
    mx.eval([f for pair in modules.values() for f in pair])
    names = sorted(modules)  # NaN or Inf would make a black image, not an error: one reduction for all
    finite = mx.stack([mx.isfinite(f).all() for name in names for f in modules[name]]).tolist()  # [2 * modules]
    if not all(finite):
        name = names[finite.index(False) // 2]
        raise InvalidAdapter(f"{Path(path).name}: its LoRA on {name} contains non-finite values (NaN or Inf).")
    return ImageLoRA(path, modules)


def _put(root: nn.Module, path: str, module: nn.Module) -> None:
    """Set the module at dotted ``path`` (list items by index)."""
    *parents, last = path.split(".")
    node = root
    for part in parents:
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    if last.isdigit():
        node[int(last)] = module
    else:
        setattr(node, last, module)
