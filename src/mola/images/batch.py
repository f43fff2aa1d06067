"""Which waiting images run together: plain Python, no arrays.

Images batch when they share size and steps (one denoising loop has one latent
shape and one schedule); their LoRAs may all differ. The oldest waiting image
always goes first, so nothing waits behind a stream of other sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .request import ImageJob, LoRAUse


@dataclass(frozen=True)
class Pending:
    """One waiting image: the ``index``-th job of its request's ticket."""

    job: ImageJob
    ticket: Any  # worker.Ticket
    index: int


def next_batch(pending: list[Pending], max_rows: int) -> list[Pending]:
    """Take from ``pending`` (in place) the oldest image and the next ones of its
    size and steps, up to ``max_rows``, in their order of arrival."""
    key = pending[0].job.shape_key
    batch = [p for p in pending if p.job.shape_key == key][:max_rows]
    taken = {id(p) for p in batch}
    pending[:] = [p for p in pending if id(p) not in taken]
    return batch


def slot_key(loras: tuple[LoRAUse, ...]) -> tuple:
    """What a slot holds for a LoRA set. One LoRA: its file alone (the scale is the
    row's, so one slot serves it at every scale); a stack: each file at its scale
    (folded into the slot: rows scale by 1)."""
    if len(loras) == 1:
        return (loras[0].path,)
    return tuple((u.path, u.scale) for u in loras)


def row_scale(loras: tuple[LoRAUse, ...]) -> float:
    return loras[0].scale if len(loras) == 1 else 1.0
