"""How much memory the device has free, and the check that adapter slots fit
in it before they are allocated (a server refuses at start, with the numbers,
rather than at its first request)."""

from __future__ import annotations

import os

import mlx.core as mx

from ..errors import SlotsDoNotFit
from ..lora.pack import SlotGeometry


def free_bytes() -> int | None:
    """Bytes the packs may still take: on a GPU what MLX recommends for its
    working set less what it holds; on a CPU the system's available memory.
    None when it cannot be told."""
    if mx.default_device() == mx.gpu:
        info = mx.device_info()
        limit = info.get("max_recommended_working_set_size") or info.get("memory_size")
        if limit:
            return int(limit) - mx.get_active_memory()
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


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
