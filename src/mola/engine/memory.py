"""How much memory the device has free, and the checks that adapter packs fit
in it. The packs are sized to the adapters loaded (mola.lora.pack), so nothing
is reserved for them at start: a server refuses at start only ceilings under
which even one adapter could never fit (with the numbers, rather than at its
first load), and each slot write that would grow the packs is checked
against the memory then free, less what the KV budget may still take."""

from __future__ import annotations

from ..errors import PacksDoNotFit, SlotsDoNotFit
from ..lora.geometry import bucket
from ..lora.pack import PackStats, SlotGeometry, SlotRows
from ..models.fit import free_bytes, gib

__all__ = ["check_growth", "check_slots_fit", "free_bytes", "gib", "growth_bytes"]


def check_slots_fit(geometry: SlotGeometry, free: int | None) -> None:
    """SlotsDoNotFit, naming each part's size, unless one adapter at the
    ceilings (one dense slot beside the empty one at --max-lora-rank on every
    linear, and one expert slot at --max-expert-lora-rank) fits ``free``."""
    need = 2 * geometry.dense_slot_bytes + (geometry.expert_slot_bytes if geometry.expert_slots else 0)
    if free is None or need <= free:
        return
    parts = [f"a dense slot and the base's of {gib(geometry.dense_slot_bytes)} each at rank {geometry.max_rank}"]
    if geometry.expert_slots:
        parts.append(f"an expert slot (--max-expert-loras) of {gib(geometry.expert_slot_bytes)} at rank "
                     f"{geometry.max_expert_rank} over {geometry.num_experts} experts")
    raise SlotsDoNotFit(
        f"One adapter at the ceilings needs {gib(need)} of slot packs ({' + '.join(parts)}), but only "
        f"{gib(max(free, 0))} is free beside the base model. Lower --max-lora-rank, --max-expert-loras or "
        f"--max-expert-lora-rank.")


def growth_bytes(packs: PackStats, geometry: SlotGeometry, slot: int, rows: SlotRows) -> int:
    """Bytes the packs (``packs``, as published) grow by when ``rows`` are
    written into ``slot``: more slots for every dense pack, a higher rank or
    a new pack for the modules the rows target (sized as AdapterPacks does)."""
    size = geometry.dtype.size
    had = packs.slot_capacity
    slots = max(had, bucket(slot + 1, geometry.num_slots))
    grow = 0
    for path, rank in packs.shape.items():  # existing dense packs take the new slots
        t = geometry.targets[path]
        if t.num_experts is None:
            grow += (slots - had) * rank * (t.input_dims + t.output_dims) * size
    for path, row in rows.modules.items():
        t = geometry.targets[path]
        old = packs.shape.get(path, 0)
        new = bucket(row.rank, geometry.max_expert_rank if t.num_experts else geometry.max_rank)
        if new > old:
            n = t.num_experts * geometry.expert_slots if t.num_experts else slots
            grow += n * (new - old) * (t.input_dims + t.output_dims) * size
    return grow


def check_growth(packs: PackStats, geometry: SlotGeometry, slot: int, rows: SlotRows, free: int | None,
                 kv_headroom: int = 0) -> None:
    """PacksDoNotFit unless the growth of writing ``rows`` into ``slot`` fits
    ``free`` less ``kv_headroom`` (what the KV budget may still take)."""
    need = growth_bytes(packs, geometry, slot, rows)
    if not need or free is None or need <= free - kv_headroom:
        return
    raise PacksDoNotFit(
        f"Loading this adapter grows the slot packs by {gib(need)} (to {packs.nbytes / 2**30 + need / 2**30:.2f} "
        f"GiB), but only {gib(max(0, free - kv_headroom))} is free beside the base model and the KV budget "
        f"(--kv-cache-bytes). Unload adapters of higher rank, or lower --kv-cache-bytes.")
