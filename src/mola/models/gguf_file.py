"""A GGUF model file opened for its metadata, its architecture (gguf_arch/) found,
and the typed reads of ``{arch}.key`` values that metadata.py
(the dense config) and moe_config.py (the experts' keys) both make."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelLoadError
from .gguf_arch import BASE_ARCHITECTURES, MIXTRAL, BaseArchitecture, float32_decimal


@dataclass
class GGUFFile:
    path: Path
    reader: object  # a gguf.GGUFReader (GGUFTensorTable: the arrays' values are in metadata)
    metadata: dict  # key -> value (strings, numbers, lists)
    arch: BaseArchitecture

    def get(self, key: str, default=None):
        """``{arch}.key`` when it starts with '.', else ``key``."""
        return self.metadata.get(self.arch.name + key if key.startswith(".") else key, default)

    def get_int(self, key: str, default=None) -> int:
        """:meth:`get` as one int: refused by name when missing (and no
        ``default``) or given per layer, which mlx-lm's models cannot hold."""
        value = self.get(key, default)
        if isinstance(value, list):
            raise ModelLoadError(
                f"{self.path}: {self.arch.name}{key} differs per layer ({value[:4]}...), which mlx-lm's "
                f"{self.arch.model_type} model does not support.")
        if value is None:
            raise ModelLoadError(f"{self.path} has no {self.arch.name}{key}, which a {self.arch.name} model needs.")
        return int(value)

    def get_float(self, key: str, default=None) -> float:
        """:meth:`get` as a float (see :func:`float32_decimal`)."""
        return float32_decimal(self.get(key, default))


def open_gguf(path: Path) -> GGUFFile:
    try:
        reader, metadata = _read(path)
    except Exception as e:  # truncated, corrupt, unknown tensor types
        raise ModelLoadError(f"{path} is not a readable GGUF file: {type(e).__name__}: {e}") from None
    if getattr(reader, "byte_order", "I") != "I":
        raise ModelLoadError(f"{path} is a big-endian GGUF file; mola reads little-endian ones.")
    kind = metadata.get("general.type", "model")
    if kind != "model":
        raise ModelLoadError(
            f"{path} has general.type '{kind}', not 'model'"
            + (" (a LoRA adapter: serve it with --adapter NAME=PATH)" if kind == "adapter" else ""))
    name = metadata.get("general.architecture")
    if name not in BASE_ARCHITECTURES:
        raise ModelLoadError(
            f"{path} is a GGUF model of architecture '{name}', which mola cannot map onto an "
            f"mlx-lm model (supported: {', '.join(BASE_ARCHITECTURES)}; llama with experts as "
            "Mixtral).")
    arch = BASE_ARCHITECTURES[name]
    if name == "llama" and (metadata.get("llama.expert_count") or has_expert_tensors(reader)):
        arch = MIXTRAL
    return GGUFFile(path, reader, metadata, arch)


def has_expert_tensors(reader) -> bool:
    """Whether the file holds a router or expert tensors (blk.N.ffn_gate_inp / ffn_*_exps)."""
    return any(".ffn_gate_inp." in t.name or "_exps." in t.name for t in reader.tensors)


def _read(path: Path) -> tuple[object, dict]:
    """(reader, metadata): the tensor table with the scalars, and the arrays' values
    read in one pass each (0.1 s against 0.3 s for gguf-py's part-by-part reading of
    SmolLM2's 49,152-token vocabulary); an array of arrays, read as gguf-py reads it."""
    from gguf import GGUFValueType

    from ..adapters.formats.gguf_reader import GGUFFileReader, GGUFTensorTable

    reader = GGUFTensorTable(str(path))
    if reader.byte_order != "I":
        return reader, {}
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    if any(f.types[:2] == [GGUFValueType.ARRAY] * 2 for f in fields.values()):
        reader = GGUFFileReader(str(path))
        return reader, {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    return reader, {k: reader.array_contents(f) if f.types[0] == GGUFValueType.ARRAY else f.contents()
                    for k, f in fields.items()}
