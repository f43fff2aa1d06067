"""Where mola keeps what it builds or fetches once (the demos, the real model, converted
GGUF models), and the sizes its caches and budgets are given in."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """$MOLA_CACHE, else $XDG_CACHE_HOME/mola, else ~/.cache/mola."""
    if os.environ.get("MOLA_CACHE"):
        return Path(os.environ["MOLA_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "mola"


SIZE_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_bytes(value: str) -> int:
    """A size in bytes: "1073741824", "512MB", "1.5G", "2GiB" (K, M, G are
    powers of 10, as mlx_lm.server reads them; KiB, MiB, GiB powers of 2)."""
    text = str(value).strip()
    number = text.rstrip("BbKkMmGgIi ")
    unit = text[len(number):].strip().upper()
    try:
        amount = float(number)
    except ValueError:
        amount = -1.0
    if unit not in SIZE_UNITS or not amount >= 0 or amount == float("inf"):
        raise ValueError(f"expected a size in bytes such as 1000000, 512MB or 2GiB, got {value!r}")
    return int(amount * SIZE_UNITS[unit])
