"""How much memory the device has free, and the check that adapter slots fit
in it before they are allocated (a server refuses at start, with the numbers,
rather than at its first request)."""

from __future__ import annotations

from ..errors import SlotsDoNotFit
from ..lora.pack import SlotGeometry
from ..models.fit import free_bytes, gib

__all__ = ["check_slots_fit", "free_bytes", "gib"]


def check_slots_fit(geometry: SlotGeometry, free: int | None) -> None:
    """SlotsDoNotFit, naming each part's size, unless the packs fit ``free``."""
    need = geometry.pack_bytes
    if free is None or need <= free:
        return
    dense = f"{geometry.num_slots} dense slots (--max-loras + the base's) of {gib(geometry.dense_slot_bytes)} " \
            f"at rank {geometry.max_rank}"
    parts = [dense]
    if geometry.expert_slots:
        parts.append(f"{geometry.expert_slots} expert slots (--max-expert-loras) of "
                     f"{gib(geometry.expert_slot_bytes)} at rank {geometry.max_expert_rank} over "
                     f"{geometry.num_experts} experts")
    raise SlotsDoNotFit(
        f"The adapter slots need {gib(need)} ({' + '.join(parts)}), but only {gib(max(free, 0))} is free "
        f"beside the base model. Lower --max-loras, --max-lora-rank, --max-expert-loras or "
        f"--max-expert-lora-rank.")
