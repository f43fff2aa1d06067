"""What this process holds resident of a mapped file (Linux's /proc/self/smaps)."""

from __future__ import annotations

import os

HAS_SMAPS = os.path.exists("/proc/self/smaps")


def mapped_rss_kib(path) -> int:
    """This process's resident KiB in its mappings of ``path``."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split(maxsplit=1)[0]
            if not first.endswith(":"):  # a mapping's header line: its range, ..., its file
                inside = line.rstrip().endswith(str(path))
            elif inside and first == "Rss:":
                total += int(line.split()[1])
    return total
