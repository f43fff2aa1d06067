"""`mola cache list|clear`: the conversion cache of GGUF files (models/gguf_cache.py):
where it is, its bound, its entries; emptied whole, or of the entries whose file is
gone or changed (--stale)."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time


def add_cache_parser(commands) -> argparse.ArgumentParser:
    cache = commands.add_parser(
        "cache", help="show or clear the conversion cache of GGUF models",
        description="GGUF models are converted to MLX arrays at their first load and kept in the "
        "conversion cache, in MLX safetensors, so that later loads read them as they are. It lives in "
        "$MOLA_GGUF_CACHE (default: the folder gguf in $MOLA_CACHE or ~/.cache/mola), bounded by "
        "$MOLA_GGUF_CACHE_BYTES (default 20GiB, least recently used entries go first); "
        "MOLA_GGUF_CACHE=off turns it off.")
    actions = cache.add_subparsers(dest="cache_action", required=True)
    listing = actions.add_parser("list", help="the cache's folder, bound and entries")
    listing.add_argument("--json", action="store_true", help="print it as JSON")
    clear = actions.add_parser("clear", help="remove every entry")
    clear.add_argument("--stale", action="store_true",
                       help="remove only the entries whose GGUF file is gone or has changed, or that "
                       "another version of mola wrote")
    return cache


def _is_stale(entry) -> bool:
    """The entry's file is gone or changed, or another mola or gguf-py wrote it."""
    from ..models.gguf_cache import identity_now, versions

    source = entry.meta.get("source", {})
    now = identity_now(source)
    return now is None or any(now[k] != source.get(k) for k in now) or entry.meta.get("versions") != versions()


def run_cache(args: argparse.Namespace, env=None) -> int:
    from ..models.gguf_cache import ConversionCache

    try:
        cache = ConversionCache.from_env(env)
    except ValueError as e:
        print(f"[mola] error: {e}", file=sys.stderr)
        return 1
    if cache.root is None:
        print("[mola] the conversion cache is off (MOLA_GGUF_CACHE=off)", file=sys.stderr)
        return 0
    if args.cache_action == "clear":
        if args.stale:
            gone = [e for e in cache.entries() if _is_stale(e)]
            for e in gone:
                shutil.rmtree(e.path, ignore_errors=True)
            freed = sum(e.nbytes for e in gone)
            print(f"[mola] removed {len(gone)} stale entries ({freed / 2**20:,.1f} MiB) from {cache.root}")
        else:
            freed = cache.clear()
            print(f"[mola] cleared {cache.root} ({freed / 2**20:,.1f} MiB)")
        return 0
    entries = cache.entries()[::-1]  # most recently used first
    rows = [{"key": e.path.name, "file": e.meta["source"]["path"], "dtype": e.meta["dtype"], "bytes": e.nbytes,
             "used": e.used_at / 1e9, "stale": _is_stale(e)} for e in entries]
    total = sum(r["bytes"] for r in rows)
    if args.json:
        print(json.dumps({"folder": str(cache.root), "max_bytes": cache.max_bytes, "bytes": total,
                          "entries": rows}, indent=2))
        return 0
    print(f"{cache.root}: {len(rows)} entries, {total / 2**20:,.1f} MiB of {cache.max_bytes / 2**20:,.0f} MiB")
    for r in rows:
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(r["used"]))
        print(f"  {r['key']}  {r['bytes'] / 2**20:10,.1f} MiB  {r['dtype']:8s}  used {used}  {r['file']}"
              + ("  (stale: the file is gone or changed, or another mola wrote it)" if r["stale"] else ""))
    return 0
