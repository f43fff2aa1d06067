"""The image base's LoRA slots: which LoRA set each slot holds, the LoRA files
read so far, and one batch's run. Worker thread only.

A slot holds one LoRA set: one file's factors (its rows scale them by their
request's scale), or a stack's, concatenated along the rank with each file's
scale folded into its B rows:

    A = [A1 | A2]    [in, r1 + r2]        B = [s1 * B1 ; s2 * B2]    [r1 + r2, out]

so that x @ A @ B = s1 x A1 B1 + s2 x A2 B2, what mflux's FusedLoRALinear sums.
Slots keep their set after a batch; a later batch with the same set writes nothing.
"""

from __future__ import annotations

import io
from collections import OrderedDict

import mlx.core as mx

from ..errors import AdapterRankTooHigh, MolaError
from ..registry.sources import content_version
from .adapters import ImageLoRA, read_lora
from .base import ImageBase, load_image_base
from .batch import Pending, row_scale, slot_key
from .generate import Row, generate

MAX_READ_FILES = 16  # LoRA files kept read (factors in memory), least recently used dropped first


class ImageSlots:
    def __init__(self, base: ImageBase):
        self.base = base
        self._holds: OrderedDict[tuple, int] = OrderedDict()  # slot key -> slot, least recently used first
        self._read: OrderedDict[tuple, ImageLoRA] = OrderedDict()  # (path, content version) -> factors

    @classmethod
    def load(cls, path: str, dtype: str, max_batch: int, max_rank: int) -> ImageSlots:
        return cls(load_image_base(path, dtype, num_slots=max_batch + 1, max_rank=max_rank))

    def place(self, batch: list[Pending]) -> tuple[list[tuple[Pending, Row]], list[tuple[Pending, MolaError]]]:
        """Each image of ``batch`` as a row on a slot holding its LoRA set (written
        now when no slot holds it); images whose LoRA files fail come back with why."""
        sets: dict[tuple, tuple] = {}  # slot key -> the LoRA set, for the sets of this batch
        for item in batch:
            if item.job.loras:
                sets.setdefault(slot_key(item.job.loras), item.job.loras)
        slot_of, errors = {}, {}
        for key, loras in sets.items():
            try:
                slot_of[key] = self._slot_for(key, loras, keep=set(sets))
            except MolaError as e:
                errors[key] = e
        rows, failed = [], []
        for item in batch:
            loras = item.job.loras
            key = slot_key(loras) if loras else None
            if key in errors:
                failed.append((item, errors[key]))
                continue
            slot = slot_of[key] if loras else 0
            rows.append((item, Row(item.job.prompt, item.job.seed, slot, row_scale(loras) if loras else 1.0)))
        return rows, failed

    def run(self, rows: list[Row], width: int, height: int, steps: int) -> list[bytes]:
        """One denoising loop for ``rows``: their images as PNG bytes."""
        images = generate(self.base, rows, width, height, steps)
        out = []
        for image in images:
            buffer = io.BytesIO()
            image.save(buffer, format="PNG")
            out.append(buffer.getvalue())
        return out

    def _slot_for(self, key: tuple, loras: tuple, keep: set) -> int:
        """The slot holding ``key``'s LoRA set, written into the least recently used
        slot that no other set of this batch (``keep``) holds."""
        if key in self._holds:
            self._holds.move_to_end(key)
            return self._holds[key]
        modules = self._factors(loras)
        used = set(self._holds.values())
        free = [s for s in range(1, self.base.num_slots) if s not in used]
        if not free:
            old = next(k for k in self._holds if k not in keep)
            free = [self._holds.pop(old)]
        slot = free[0]
        self._write(slot, modules)
        self._holds[key] = slot
        return slot

    def _factors(self, loras: tuple) -> dict[str, tuple[mx.array, mx.array]]:
        """Module path -> (A [in, r], B [r, out]) of a LoRA set (one file: its own B;
        a stack: concatenated, each B times its scale)."""
        files = [self._file(u.path) for u in loras]
        if len(files) == 1:
            modules = files[0].modules
        else:
            modules = {}
            for name in sorted(set().union(*(f.modules for f in files))):
                parts = [(f.modules[name], u.scale) for f, u in zip(files, loras) if name in f.modules]
                a = mx.concatenate([a for (a, _), _ in parts], axis=1)  # [in, sum r]
                b = mx.concatenate([s * b for (_, b), s in parts], axis=0)  # [sum r, out]
                modules[name] = (a, b)
        rank = max(a.shape[1] for a, _ in modules.values())
        if rank > self.base.max_rank:
            names = ", ".join(u.path.rsplit("/", 1)[-1] for u in loras)
            raise AdapterRankTooHigh(f"the LoRA rank of {names} is {rank}; this server's --image-max-lora-rank "
                                     f"is {self.base.max_rank}.", param="model")
        return modules

    def _file(self, path: str) -> ImageLoRA:
        version = (path, content_version(path))
        if version in self._read:
            self._read.move_to_end(version)
            return self._read[version]
        lora = read_lora(path, self.base.model.transformer, self.base.layers, self.base.mapping)
        self._read[version] = lora
        if len(self._read) > MAX_READ_FILES:
            self._read.popitem(last=False)
        return lora

    def _write(self, slot: int, modules: dict[str, tuple[mx.array, mx.array]]) -> None:
        for name, layer in self.base.layers.items():
            if name in modules:
                a, b = modules[name]
                layer.set_factors(slot, a, b, 1.0)
            else:
                layer.zero_rows(slot)
        mx.eval([x for layer in self.base.layers.values() for x in (layer.lora_a, layer.lora_b)])
