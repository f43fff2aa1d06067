"""Where mola keeps what it builds or fetches once (the demos, the real model)."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """$MOLA_CACHE, else $XDG_CACHE_HOME/mola, else ~/.cache/mola."""
    if os.environ.get("MOLA_CACHE"):
        return Path(os.environ["MOLA_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "mola"
