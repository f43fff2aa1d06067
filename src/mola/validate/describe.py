"""What an adapter is, read by the readers mola serves it with: format,
ranks, scales (and the alpha it declares), target modules and layers, dtypes,
size and the base model it declares."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path

from ..adapters.formats import detect_format, read_adapter
from ..adapters.formats.common import read_config
from ..adapters.formats.gguf import KEY_ARCHITECTURE, KEY_LORA_ALPHA, read_metadata
from ..registry.sources import ADAPTER_FILES
from ..adapters.vocab import file_parts
from ..adapters.weights import LoRAWeights

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


@dataclass
class AdapterInfo:
    path: str  # resolved
    format: str  # "mlx-lm", "peft" or "gguf"
    modules: int  # linears it adapts
    ranks: list[int]  # distinct ranks over its modules
    scales: list[float]  # distinct scales applied (alpha / r, or mlx-lm's scale)
    alpha: float | None  # what the file declares (PEFT lora_alpha, GGUF adapter.lora.alpha)
    targets: list[str]  # block-relative module names: self_attn.q_proj, ...
    layers: list[int]  # block indices
    dtypes: list[str]  # as stored: float32, bfloat16, or a GGUF tensor type
    size_bytes: int  # the adapter files on disk
    parameters: int  # numbers in its factors
    base: str | None  # the base model it declares, if any
    architecture: str | None  # GGUF general.architecture
    # LoRA on the experts of a mixture of experts (per-expert factors):
    expert_modules: int = 0  # expert projections it adapts (of ``modules``)
    expert_targets: list[str] | None = None  # their block-relative names
    num_experts: int | None = None  # experts per projection
    kind: str = "lora"  # "lora", "alora" (an activated LoRA) or "dora" (LoRAWeights.kind)
    # What it changes of the token embedding and the output head (mola.adapters.vocab.file_parts): LoRA ranks,
    # replaced token rows, and whether they are tied to a tied head; None: nothing.
    vocab: dict | None = None

    @property
    def rank(self) -> int:
        return max(self.ranks, default=0)

    def to_json(self) -> dict:
        return {**asdict(self), "rank": self.rank}


def adapter_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted({f for pattern in ADAPTER_FILES for f in path.glob(pattern) if f.is_file()})


def describe(path: str | Path) -> AdapterInfo:
    """Describe the adapter at ``path`` (a resolved local path); raises
    InvalidAdapter (or AdapterPathNotFound) as mola serve would."""
    path = Path(path)
    weights = read_adapter(path, rows_as_stored=True)  # names what is wrong, as serve does
    kind = detect_format(path)
    base, alpha, arch, stored = _declared(path, kind)
    return _info(path, kind, weights, base, alpha, arch, stored)


def _declared(path: Path, kind: str) -> tuple[str | None, float | None, str | None, list[str]]:
    """(declared base, declared alpha, architecture, stored dtypes) from the
    files' own metadata."""
    if kind == "gguf":
        file = path if path.is_file() else sorted(path.glob("*.gguf"))[0]
        fields, types = read_metadata(file)
        base = fields.get("general.base_model.0.repo_url") or fields.get("general.base_model.0.name")
        return base, fields.get(KEY_LORA_ALPHA), fields.get(KEY_ARCHITECTURE), sorted(set(types.values()))
    config = read_config(path)
    if kind == "peft":
        alpha = config.get("lora_alpha")
        return config.get("base_model_name_or_path"), alpha, None, []
    return config.get("model") or config.get("base_model"), None, None, []


def _info(path: Path, kind: str, weights: LoRAWeights, base, alpha, arch, stored) -> AdapterInfo:
    targets, layers, expert_targets = set(), set(), set()
    for module, lora in weights.modules.items():
        m = _LAYER.fullmatch(module)
        if m:
            layers.add(int(m.group(1)))
            targets.add(m.group(2))
        else:
            targets.add(module)
        if lora.num_experts is not None:
            expert_targets.add(m.group(2) if m else module)
    experts = sorted({lora.num_experts for lora in weights.modules.values() if lora.num_experts})
    dtypes = stored or sorted({str(x.dtype).removeprefix("mlx.core.")
                               for m in weights.modules.values() for x in (m.a, m.b)})
    return AdapterInfo(
        path=str(path), format=kind, modules=len(weights.modules),
        ranks=sorted({m.rank for m in weights.modules.values()}),
        scales=sorted({round(m.scale, 6) for m in weights.modules.values()}),
        alpha=alpha if isinstance(alpha, (int, float)) and not isinstance(alpha, bool) else None,
        targets=sorted(targets), layers=sorted(layers), dtypes=dtypes,
        size_bytes=sum(f.stat().st_size for f in adapter_files(path)),
        parameters=sum(m.a.size + m.b.size for m in weights.modules.values())
        + sum(m.size for m in (weights.magnitudes or {}).values()),
        base=base if isinstance(base, str) else None, architecture=arch,
        expert_modules=len(weights.expert_modules), expert_targets=sorted(expert_targets) or None,
        num_experts=experts[-1] if experts else None, kind=weights.kind, vocab=file_parts(weights),
    )
