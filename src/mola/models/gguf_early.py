"""A GGUF base's conversion begun with `mola serve` itself, on a thread of its own,
while the main thread still imports the server (mlx-lm and transformers: about 1.8 s
of a first start that converted only after them). The load takes the converted
tensors (once) instead of converting (models/gguf_load.py); where it cannot (another
file or dtype, the file changed, the early conversion failed), it converts as always,
and so reports whatever made the early one fail.

Only what the load would convert is converted early: a local GGUF file, at the dtype
the load resolves (memory checked first, models/fit.py), not in the conversion cache."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from .gguf_cache import ConversionCache, file_identity

log = logging.getLogger("mola.loader")
THREAD = "mola-gguf-early"


@dataclass(frozen=True)
class Converted:
    path: Path  # resolved
    dtype: str  # resolved ("keep" or a float dtype)
    identity: dict  # gguf_cache.file_identity's, when it converted
    config: dict
    weights: dict
    quantization: dict
    nbytes: int  # the file's tensor bytes
    seconds: float  # the conversion's own time


class EarlyConversion:
    """The conversion of ``path`` at ``dtype`` ("auto" or a --dtype), running from
    construction on a thread of its own."""

    def __init__(self, path: Path, dtype: str):
        self.path, self.requested = Path(path).resolve(), dtype
        self._lock = threading.Lock()
        self._planned: Future = Future()  # (resolved dtype, fit.MemoryPlan) or None
        self._future: Future | None = Future()
        self._ended = threading.Event()
        threading.Thread(target=self._run, args=(self._planned, self._future), name=THREAD, daemon=True).start()

    def _run(self, planned: Future, future: Future) -> None:
        try:
            future.set_result(_convert(self.path, self.requested, planned))
        except BaseException as e:  # the load converts again, and reports it
            log.debug("the early conversion of %s stopped: %s", self.path, e)
            future.set_result(None)
        finally:
            if not planned.done():
                planned.set_result(None)
            self._ended.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the conversion has ended (converted or not), waiting up to ``timeout``."""
        return self._ended.wait(timeout)

    def plan(self, path: Path, dtype: str):
        """(the resolved dtype, its memory plan) the early conversion checked ``path``
        at --dtype ``dtype`` with, before it held anything; None if it did not. The
        load resolves it so too: free memory, measured now, is less by what it holds."""
        if Path(path).resolve() != self.path or dtype != self.requested:
            return None
        return self._planned.result()

    def take(self, f, dtype: str) -> Converted | None:
        """The converted tensors of the opened file ``f`` at the resolved ``dtype``,
        once (waiting for them); None where they are not that file's as it is now."""
        with self._lock:
            future, self._future = self._future, None
        done = future.result() if future is not None else None
        if done is None or done.path != Path(f.path).resolve() or done.dtype != dtype:
            return None
        if file_identity(f.path, f.reader.data, int(f.reader.data_offset)) != done.identity:
            return None
        return done

    def close(self) -> None:
        """Drop what was not taken (waiting for the thread, so nothing is held after)."""
        with self._lock:
            future, self._future = self._future, None
        if future is not None:
            future.result()


def start(model: str | None, dtype: str) -> EarlyConversion | None:
    """An early conversion of ``model`` if it names a local GGUF file, else None."""
    from .metadata import find_gguf

    if model is None:
        return None
    try:
        path = find_gguf(Path(model).expanduser())
    except Exception:  # the load says what is wrong with it
        return None
    return EarlyConversion(path, dtype) if path is not None else None


def _convert(path: Path, dtype: str, planned: Future) -> Converted | None:
    from .fit import free_bytes
    from .gguf import conversion_progress, gguf_config, read_weights
    from .gguf_file import open_gguf
    from .loader import check_gguf

    cache = ConversionCache.from_env()
    f = open_gguf(path)
    dtype, need = check_gguf(f, dtype, free_bytes())
    planned.set_result((dtype, need))
    identity = file_identity(f.path, f.reader.data, int(f.reader.data_offset))
    if cache.enabled and cache.lookup(identity, dtype, touch=False) is not None:
        return None  # the load reads the cache
    t0 = time.perf_counter()
    progress = conversion_progress(f)
    config, weights, quantization = read_weights(f, dtype, progress, gguf_config(f))
    progress.close(time.monotonic())
    return Converted(Path(path).resolve(), dtype, identity, config, weights, quantization,
                     progress.total_bytes, time.perf_counter() - t0)
