"""A GGUF model and its tokenizer for mola serve: read from the conversion cache
(gguf_cache.py) where it holds the file at this dtype, else converted now (gguf.py,
with progress) and then written to it. The load log says which path ran and how long
each part took. A new entry is written on a thread of its own after the load, so that
the model serves while it is written (the process waits for it at exit)."""

from __future__ import annotations

import copy
import importlib
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.nn as nn

from ..errors import ModelLoadError
from .gguf import assemble, conversion_progress, gguf_config, read_weights
from .gguf_cache import ConversionCache, Entry, file_identity
from .gguf_file import GGUFFile
from .tokenizer import load_tokenizer_dir, tokenizer_files

log = logging.getLogger("mola.loader")
WRITER_THREAD = "mola-gguf-cache-write"  # the thread that writes a new entry after the load


def load_gguf(f: GGUFFile, dtype: str, cache: ConversionCache) -> tuple[nn.Module, dict, object]:
    """(model, config, mlx-lm TokenizerWrapper) for the opened file ``f`` at the
    resolved ``dtype`` ("keep" or a float dtype)."""
    t0 = time.perf_counter()
    identity = None
    if cache.enabled:
        identity = file_identity(f.path, f.reader.data, int(f.reader.data_offset))
        entry = cache.lookup(identity, dtype)
        t_key = time.perf_counter() - t0
        loaded = entry and _from_entry(f, entry)
        if loaded:
            log.info("model read from the conversion cache (entry %s, %.1f MiB) in %.2f s: key %.3f s, "
                     "tensors and model %.2f s, tokenizer %.2f s (beside them)", entry.path, entry.nbytes / 2**20,
                     time.perf_counter() - t0, t_key, *loaded[3:])
            return loaded[:3]
    t_key = time.perf_counter() - t0
    config = gguf_config(f)
    tmp = Path(tempfile.mkdtemp(prefix="mola-gguf-tokenizer-"))
    try:
        # the tokenizer (and mlx-lm's import) built on a thread of its own while the tensors convert
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="mola-gguf-tokenizer") as pool:
            imported = pool.submit(importlib.import_module, "mlx_lm")
            building = pool.submit(_tokenizer, f, tmp, config)
            progress = conversion_progress(f)
            t1 = time.perf_counter()
            config, weights, quantization = read_weights(f, dtype, progress, config)
            progress.close(time.monotonic())
            t_convert = time.perf_counter() - t1
            stored_config = copy.deepcopy(config)  # as read_weights gave it: assemble adds to config
            t2 = time.perf_counter()
            imported.result()  # two threads importing transformers at once can break its lazy imports
            model = assemble(f, config, weights, quantization)
            t_build = time.perf_counter() - t2
            tokenizer, stops, t_tok = building.result()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if not cache.enabled:
        shutil.rmtree(tmp, ignore_errors=True)
        where = "conversion cache off (MOLA_GGUF_CACHE=off)"
    else:
        args = (cache, identity, dtype, stored_config, weights, quantization, tmp, stops)
        # Not a daemon: a process that ends right after the load waits for the write at exit.
        threading.Thread(target=_store, args=args, name=WRITER_THREAD).start()
        where = "writing it to the conversion cache in the background"
    log.info("model converted now in %.2f s: tensors read and converted %.2f s (%.0f MiB/s), key %.3f s, model "
             "built %.2f s, tokenizer %.2f s (beside the tensors); %s", time.perf_counter() - t0, t_convert,
             progress.total_bytes / 2**20 / max(t_convert, 1e-9), t_key, t_build, t_tok, where)
    return model, config, tokenizer


def _store(cache: ConversionCache, identity: dict, dtype: str, config: dict, weights: dict, quantization: dict,
           tokenizer_dir: Path, stops) -> None:
    """Write the entry (on the writer thread: the model is served meanwhile; its
    arrays are evaluated and never changed, so reading them here is safe). The
    thread runs at the lowest priority, so that the server's start after the load
    (its engine, its first requests) is not slowed by the write."""
    _lowest_priority()
    t0 = time.perf_counter()
    try:
        entry = cache.store(identity, dtype, config, weights, quantization, tokenizer_dir, stops)
    finally:
        shutil.rmtree(tokenizer_dir, ignore_errors=True)
    if entry is not None:
        log.info("written to the conversion cache in %.2f s: entry %s (%.1f MiB)", time.perf_counter() - t0,
                 entry.path, entry.nbytes / 2**20)


def _lowest_priority() -> None:
    """This thread at nice 19 (Linux: a thread's own priority; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:
            pass


def _tokenizer(f: GGUFFile, out: Path, config: dict):
    """(mlx-lm's tokenizer, the ids that end a generation, seconds) from files written into ``out``."""
    t0 = time.perf_counter()
    stops = _tokenizer_files(f, out, config)
    return load_tokenizer_dir(out, stops), stops, time.perf_counter() - t0


def _tokenizer_files(f: GGUFFile, out: Path, config: dict) -> list[int]:
    try:
        return tokenizer_files(f.metadata, f.arch.name, out, config.get("max_position_embeddings"))
    except ModelLoadError as e:
        raise ModelLoadError(f"{f.path}: {e.message}") from None


def _from_entry(f: GGUFFile, entry: Entry):
    """(model, config, tokenizer, seconds for the model, for the tokenizer) from ``entry``, or
    None (logged) where it cannot be read: the caller converts instead. The tokenizer
    loads on a thread of its own while the tensors are read."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="mola-gguf-tokenizer") as pool:
        imported = pool.submit(importlib.import_module, "mlx_lm")
        loading = pool.submit(_entry_tokenizer, f, entry)
        t0 = time.perf_counter()
        try:
            config, weights, quantization = entry.read()
            imported.result()  # as in load_gguf
            model = assemble(f, config, weights, quantization)
        except (OSError, ValueError, RuntimeError, KeyError, ModelLoadError) as e:
            log.warning("conversion cache entry %s unreadable (%s); converting the file instead", entry.path, e)
            loading.cancel()
            shutil.rmtree(entry.path, ignore_errors=True)
            return None
        t_model = time.perf_counter() - t0
        tokenizer, t_tok = loading.result()
    return model, config, tokenizer, t_model, t_tok


def _entry_tokenizer(f: GGUFFile, entry: Entry):
    """(mlx-lm's tokenizer, seconds) from the entry's files (built again if it has none)."""
    t0 = time.perf_counter()
    folder = entry.tokenizer_dir
    if folder is not None:
        return load_tokenizer_dir(folder, entry.meta.get("stops")), time.perf_counter() - t0
    with tempfile.TemporaryDirectory(prefix="mola-gguf-tokenizer-") as tmp:
        stops = _tokenizer_files(f, Path(tmp), entry.meta["config"])
        return load_tokenizer_dir(Path(tmp), stops), time.perf_counter() - t0
