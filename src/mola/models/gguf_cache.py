"""The conversion cache: a GGUF file's converted tensors (kept or dequantized), written
after its first load in MLX's own safetensors and read back with ``mx.load``, as mlx-lm
reads a model directory; beside them, in ``entry.json``, what rebuilding the model
needs (the mlx-lm config, the quantization map) and the tokenizer files.

Where: ``$MOLA_GGUF_CACHE``, else the folder ``gguf`` in mola's cache directory
(``$MOLA_CACHE``, else ``~/.cache/mola``); ``MOLA_GGUF_CACHE=off`` turns it off. Bound:
``$MOLA_GGUF_CACHE_BYTES`` (default 20GiB), least recently used entries evicted first;
an entry larger than the bound is never written. ``mola cache list`` shows it, ``mola
cache clear`` empties it; deleting the folder is as safe.

The key. An entry is found by a hash of: the versions (CONVERSION_VERSION, bumped whenever
read_weights' output for a file changes, and mola's and gguf-py's), the dtype, and the file's
identity: its resolved path, device and inode, size, mtime_ns and ctime_ns, and a
hash of its header (every byte before the tensor data: metadata, tokenizer, tensor
table) and of 64 KiB at 16 places spread over its tensor data, and its last 64 KiB.
Why a file replaced in place is never served stale:
  - replaced by a new file (downloaded then renamed, ``cp`` to a new name and ``mv``):
    another inode, and another ctime;
  - rewritten in place (same inode): every write sets mtime and ctime to the current
    time, and ctime cannot be set back (``touch -d``/``os.utime`` set mtime, and set
    ctime to now); truncated or grown: another size too;
  - what timestamps alone could miss (a write in the same clock tick as the previous
    one, a few ms; a filesystem with coarse times) is caught where it touches the
    header or a sampled block; and an entry is not written if the file's identity
    changed while it converted.
A full content hash would cost seconds at every start (2.6 s for a 1.06 GB file here,
blake2b), against a few ms for the above; ``mola cache clear`` (or
``MOLA_GGUF_CACHE=off``) covers a file rewritten within the same clock tick, at the
same size, outside the header and the sampled blocks.

Writes are atomic: an entry is built in a hidden ``.tmp-*`` folder and renamed into
place, so a crash never leaves a half entry that is read later
(stale temporary folders are removed at the next write). A cache folder that cannot
be written (a read-only filesystem, no write permission, or a folder whose mode
grants no write bit, which is honoured even for root) is skipped with a log line.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

log = logging.getLogger("mola.loader")

CONVERSION_VERSION = 1  # bump when read_weights' output (or this layout) changes for any file
DEFAULT_MAX_BYTES = 20 * 2**30
OFF = ("off", "0", "none", "false", "no")
ENTRY = "entry.json"
WEIGHTS = "model.safetensors"
TOKENIZER = "tokenizer"
SAMPLES, SAMPLE_BYTES = 16, 1 << 16  # 1 MiB read at 16 places: a few ms, or ~0.25 s from a cold disk
STALE_TMP_S = 3600.0  # a temporary folder older than this is a crashed write


@dataclass(frozen=True)
class Entry:
    path: Path  # the entry's folder
    meta: dict  # entry.json

    @property
    def nbytes(self) -> int:
        return int(self.meta.get("bytes", 0))

    @property
    def used_at(self) -> int:
        """When it was last written or read (ns): its entry.json's mtime, set by
        ConversionCache.mark_used."""
        try:
            return (self.path / ENTRY).stat().st_mtime_ns
        except OSError:
            return 0

    def read(self) -> tuple[dict, dict[str, mx.array], dict[str, dict]]:
        """(config, weights, quantization) as read_weights returns them; the weights
        are mx.load's (read from disk when evaluated)."""
        file = self.path / WEIGHTS
        if file.stat().st_size != self.meta["weights_bytes"]:
            raise OSError(f"{file} has {file.stat().st_size} bytes, not the {self.meta['weights_bytes']} written")
        return dict(self.meta["config"]), mx.load(str(file)), dict(self.meta["quantization"])

    @property
    def tokenizer_dir(self) -> Path | None:
        d = self.path / TOKENIZER
        return d if (d / "tokenizer.json").is_file() else None


def file_identity(path: Path, mapped, data_offset: int) -> dict:
    """What the key says of the file at ``path`` whose bytes are ``mapped`` (the
    reader's mapping, a uint8 array) with tensor data from ``data_offset``."""
    st = os.stat(path)
    h = hashlib.blake2b(digest_size=16)
    h.update(memoryview(mapped[:data_offset]))
    size = len(mapped)
    starts = {min(data_offset + i * (size - data_offset) // SAMPLES, max(size - SAMPLE_BYTES, 0))
              for i in range(SAMPLES)} | {max(size - SAMPLE_BYTES, 0)}
    for start in sorted(starts):
        h.update(memoryview(mapped[start:start + SAMPLE_BYTES]))
    return {"path": str(Path(path).resolve()), "dev": st.st_dev, "ino": st.st_ino, "size": st.st_size,
            "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "mapped_size": size,
            "fingerprint": h.hexdigest()}


def _stat_part(identity: dict) -> tuple:
    return tuple(identity[k] for k in ("dev", "ino", "size", "mtime_ns", "ctime_ns"))


def versions() -> dict:
    """The versions an entry was written by: the conversion's, mola's and gguf-py's
    (whose dequantization a float dtype holds); another of any is another key."""
    from importlib.metadata import PackageNotFoundError, version

    from .. import __version__

    try:
        gguf_version = version("gguf")
    except PackageNotFoundError:
        gguf_version = None
    return {"conversion": CONVERSION_VERSION, "mola": __version__, "gguf": gguf_version}


def entry_key(identity: dict, dtype: str) -> str:
    text = json.dumps({"versions": versions(), "dtype": dtype, **identity}, sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


def why_unwritable(folder: Path) -> str | None:
    """None if ``folder`` (or, where it does not exist yet, its nearest existing
    parent) can be written, else why not."""
    probe = Path(folder)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is not a folder"
    if os.statvfs(probe).f_flag & os.ST_RDONLY:
        return f"{probe} is on a read-only filesystem"
    if not os.access(probe, os.W_OK | os.X_OK) or not probe.stat().st_mode & 0o222:
        return f"{probe} is not writable (mode {stat.filemode(probe.stat().st_mode)})"
    return None


@dataclass(frozen=True)
class ConversionCache:
    root: Path | None  # None: caching off
    max_bytes: int = DEFAULT_MAX_BYTES

    @classmethod
    def from_env(cls, env=None) -> ConversionCache:
        """$MOLA_GGUF_CACHE (a folder, or off) and $MOLA_GGUF_CACHE_BYTES (a size)."""
        from ..cache import default_cache_dir, parse_bytes

        env = os.environ if env is None else env
        where = env.get("MOLA_GGUF_CACHE", "").strip()
        if where.lower() in OFF:
            return cls(None)
        limit = env.get("MOLA_GGUF_CACHE_BYTES", "").strip()
        try:
            max_bytes = parse_bytes(limit) if limit else DEFAULT_MAX_BYTES
        except ValueError as e:
            raise ValueError(f"MOLA_GGUF_CACHE_BYTES: {e}") from None
        return cls(Path(where).expanduser() if where else default_cache_dir() / "gguf", max_bytes)

    @property
    def enabled(self) -> bool:
        return self.root is not None and self.max_bytes > 0

    def entries(self) -> list[Entry]:
        """Every complete entry, least recently used first."""
        if self.root is None or not self.root.is_dir():
            return []
        found = []
        for d in self.root.iterdir():
            if d.name.startswith(".") or not (d / ENTRY).is_file():
                continue
            try:
                found.append(Entry(d, json.loads((d / ENTRY).read_text())))
            except (OSError, ValueError):
                continue
        return sorted(found, key=lambda e: e.used_at)

    def lookup(self, identity: dict, dtype: str, touch: bool = True) -> Entry | None:
        """The entry for the file of ``identity`` at ``dtype``, marked used (``touch``)."""
        if not self.enabled:
            return None
        folder = self.root / entry_key(identity, dtype)
        try:
            meta = json.loads((folder / ENTRY).read_text())
        except (OSError, ValueError):
            return None
        if meta.get("versions") != versions() or meta.get("source") != identity or meta.get("dtype") != dtype:
            return None
        if touch and why_unwritable(folder) is None:
            self.mark_used(folder)
        return Entry(folder, meta)

    def mark_used(self, folder: Path) -> None:
        """Make ``folder`` the most recently used entry, the eviction order. The stamp
        is strictly after every other entry's: the kernel's file clock ticks coarsely
        (milliseconds), so two uses in one tick would otherwise tie."""
        stamp = max([time.time_ns()] + [e.used_at + 1 for e in self.entries() if e.path != folder])
        try:
            os.utime(folder / ENTRY, ns=(stamp, stamp))
        except OSError:
            pass

    def store(self, identity: dict, dtype: str, config: dict, weights: dict[str, mx.array],
              quantization: dict, tokenizer_dir: Path | None = None, stops=None) -> Entry | None:
        """Write the entry (atomically) and evict least recently used ones past the
        bound; None, with a log line saying why, where it is not written."""
        if not self.enabled:
            return None
        size = sum(int(v.nbytes) for v in weights.values())
        if size > self.max_bytes:
            log.info("conversion cache skipped: %.1f MiB of tensors exceed its bound of %.1f MiB "
                     "(MOLA_GGUF_CACHE_BYTES)", size / 2**20, self.max_bytes / 2**20)
            return None
        why = why_unwritable(self.root)
        if why is not None:
            log.info("conversion cache skipped: %s (set MOLA_GGUF_CACHE to a writable folder, or off)", why)
            return None
        now = identity_now(identity)
        if now is not None and _stat_part(now) != _stat_part(identity):
            log.info("conversion cache skipped: %s changed while it was converted", identity["path"])
            return None
        key = entry_key(identity, dtype)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._remove_stale_tmp()
            tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=self.root))
        except OSError as e:
            log.info("conversion cache skipped: cannot write in %s: %s", self.root, e)
            return None
        try:
            mx.save_safetensors(str(tmp / WEIGHTS), weights)
            if tokenizer_dir is not None:
                shutil.copytree(tokenizer_dir, tmp / TOKENIZER)
            meta = {"versions": versions(), "key": key, "dtype": dtype, "source": identity,
                    "config": config, "quantization": quantization, "stops": stops,
                    "bytes": sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file()),
                    "weights_bytes": (tmp / WEIGHTS).stat().st_size, "created": time.time()}
            (tmp / ENTRY).write_text(json.dumps(meta, indent=1))
            os.chmod(tmp, 0o755)
            folder = self.root / key
            if folder.exists():  # written meanwhile by another process: keep theirs
                shutil.rmtree(tmp, ignore_errors=True)
                return self.lookup(identity, dtype)
            os.rename(tmp, folder)
            self.mark_used(folder)
        except (OSError, TypeError, ValueError) as e:
            shutil.rmtree(tmp, ignore_errors=True)
            log.info("conversion cache skipped: writing the entry failed: %s", e)
            return None
        self.evict(keep=key)
        return Entry(folder, meta)

    def evict(self, keep: str | None = None) -> list[Entry]:
        """Remove least recently used entries until the cache is within its bound."""
        entries = self.entries()
        total = sum(e.nbytes for e in entries)
        removed = []
        for e in entries:
            if total <= self.max_bytes:
                break
            if e.path.name == keep:
                continue
            shutil.rmtree(e.path, ignore_errors=True)
            total -= e.nbytes
            removed.append(e)
            log.info("conversion cache: evicted %s (%s, %.1f MiB)", e.path.name, e.meta["source"]["path"],
                     e.nbytes / 2**20)
        return removed

    def clear(self) -> int:
        """Remove every entry (and crashed writes); the bytes freed."""
        if self.root is None or not self.root.is_dir():
            return 0
        freed = 0
        for d in self.root.iterdir():
            if d.is_dir() and ((d / ENTRY).is_file() or d.name.startswith(".tmp-")):
                freed += sum(p.stat().st_size for p in d.rglob("*") if p.is_file())
                shutil.rmtree(d, ignore_errors=True)
        return freed

    def _remove_stale_tmp(self) -> None:
        for d in self.root.glob(".tmp-*"):
            try:
                if time.time() - d.stat().st_mtime > STALE_TMP_S:
                    shutil.rmtree(d, ignore_errors=True)
            except OSError:
                pass


def describe(f, dtype: str, cache: ConversionCache | None = None) -> str:
    """What mola serve will do for the opened GGUF file ``f`` at the resolved
    ``dtype``: read the cache's entry, or convert it (and where it will cache it)."""
    cache = cache or ConversionCache.from_env()
    if not cache.enabled:
        return "converted at every load (the conversion cache is off)"
    entry = cache.lookup(file_identity(f.path, f.reader.data, int(f.reader.data_offset)), dtype, touch=False)
    if entry is not None:
        return f"cached ({entry.nbytes / 2**20:,.1f} MiB in {entry.path}): read as it is at load"
    return f"not cached: converted at the first load (with progress), then cached in {cache.root}"


def identity_now(identity: dict) -> dict | None:
    """The stat part of the identity of the file at ``identity['path']`` now."""
    try:
        st = os.stat(identity["path"])
    except OSError:
        return None
    return {"dev": st.st_dev, "ino": st.st_ino, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "ctime_ns": st.st_ctime_ns}
