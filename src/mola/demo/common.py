"""What both demos share: where their adapters live, and builds that are
renamed into place only when complete."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable

BASE_HASH_FILE = "base.sha256"  # beside committed adapters: the SHA-256 of the base they were trained on


def stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def checkout_adapters_dir() -> Path:
    """Where a source checkout keeps the committed demo adapters: <repo>/adapters."""
    import mola

    return Path(mola.__file__).resolve().parents[2] / "adapters"


def adapters_are_built(path: Path, adapters: tuple[str, ...]) -> bool:
    path = Path(path)
    return all((path / a / "adapter_config.json").is_file() and (path / a / "adapters.safetensors").is_file()
               for a in adapters)


def read_base_hash(path: Path) -> str | None:
    """The base hash recorded beside the adapters in ``path``, if any."""
    hash_file = Path(path) / BASE_HASH_FILE
    return hash_file.read_text().strip() if hash_file.is_file() else None


def build_into(target: Path, build: Callable[[Path], object]) -> None:
    """Run ``build(tmp)`` on a temporary directory beside ``target`` and rename
    it into place (replacing a stale or partial ``target``), so that an
    interrupted build never leaves half a demo."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-build-", dir=target.parent))
    try:
        build(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
