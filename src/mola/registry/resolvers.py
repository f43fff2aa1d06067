"""Resolvers: where an unknown model id may still be found, as vLLM's resolver
plugins find adapters. Off by default; each is an operator's explicit choice
(``--adapter-resolver``, repeatable, tried in order):

    dir:PATH         the id ``name`` (or ``org/name``) is PATH/name (or PATH/org/name),
                     a directory or a ``.gguf`` file; PATH is an allowed root of the
                     path policy (sources.py), not scanned, not listed
    hf:ORG/*         an id ``ORG/name`` is that Hugging Face hub repo, through
                     huggingface-hub's cache (downloaded when the hub is reachable)
    hf:ORG/A,ORG/B   only these repos

An id is tried only once it is a valid adapter id (names.py) that no adapter
has. What a resolver finds is registered under the id and loaded just in time,
so it is read and checked like any other adapter (a bad one is a 400); a miss
is the usual 404. With ``hf:``, any client that may send requests can make the
server fetch any adapter of that org (only adapter files: config, safetensors,
gguf): a list of repos, or an org whose repos are trusted, bounds that.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from .sources import HUB_PATTERNS, AdapterSources, looks_like_hub_id

log = logging.getLogger("mola.adapters")

HUB_MISS_SECONDS = 30.0  # a hub id that was not found is not asked for again this long


@dataclass(frozen=True)
class ResolverSpec:
    """One --adapter-resolver, parsed: ``dir`` with ``root``, or ``hf`` with
    ``org`` (every repo of it) or ``repos``."""

    kind: str
    root: str | None = None
    org: str | None = None
    repos: tuple[str, ...] = ()

    def __str__(self) -> str:
        if self.kind == "dir":
            return f"dir:{self.root}"
        return f"hf:{self.org}/*" if self.org else "hf:" + ",".join(self.repos)


def parse_resolver(spec: str, base: Path | None = None) -> ResolverSpec:
    """``dir:PATH`` or ``hf:ORG/*`` or ``hf:ORG/A,ORG/B``; ValueError naming what
    is wrong. A relative PATH is taken from ``base`` (default: the working directory)."""
    if not isinstance(spec, str):
        raise ValueError(f"an adapter resolver is a string such as dir:PATH or hf:ORG/*, got {spec!r}")
    kind, sep, rest = spec.partition(":")
    rest = rest.strip()
    if not sep or kind not in ("dir", "hf") or not rest:
        raise ValueError(f"unknown adapter resolver {spec!r}: expected dir:PATH, hf:ORG/* or hf:ORG/NAME,...")
    if kind == "dir":
        root = Path(rest).expanduser()
        root = root if root.is_absolute() else (base or Path.cwd()) / root
        if not root.is_dir():
            raise ValueError(f"adapter resolver {spec!r}: {root} is not a directory")
        return ResolverSpec("dir", root=str(root))
    items = [item.strip() for item in rest.split(",")]
    if len(items) == 1 and items[0].endswith("/*"):
        org = items[0][:-2]
        if not looks_like_hub_id(f"{org}/x") or "*" in org:
            raise ValueError(f"adapter resolver {spec!r}: {org!r} is not a hub organization")
        return ResolverSpec("hf", org=org)
    bad = [item for item in items if not looks_like_hub_id(item) or "*" in item]
    if bad:
        raise ValueError(f"adapter resolver {spec!r}: {bad[0]!r} is not a hub repo id (ORG/NAME); "
                         "use hf:ORG/* for every repo of an organization")
    return ResolverSpec("hf", repos=tuple(items))


class DirResolver:
    kind = "dir"

    def __init__(self, root: str | Path, sources: AdapterSources):
        self.root = Path(root).resolve()
        self.sources = sources  # must count root as an allowed root (resolver_dirs)

    async def find(self, name: str) -> str | None:
        return self.sources.find_in(self.root, name)


class HubResolver:
    kind = "hf"

    def __init__(self, org: str | None = None, repos: tuple[str, ...] = ()):
        self.org = org
        self.repos = frozenset(repos)
        self._misses: dict[str, float] = {}  # id -> when it was last not found

    def matches(self, name: str) -> bool:
        return looks_like_hub_id(name) and (name in self.repos or name.split("/")[0] == self.org)

    async def find(self, name: str) -> str | None:
        if not self.matches(name):
            return None
        missed = self._misses.get(name)
        if missed is not None and time.monotonic() - missed < HUB_MISS_SECONDS:
            return None
        path = await asyncio.to_thread(self._snapshot, name)
        if path is None:
            self._misses[name] = time.monotonic()
        else:
            self._misses.pop(name, None)
        return path

    @staticmethod
    def _snapshot(repo: str) -> str | None:
        from huggingface_hub import snapshot_download

        try:
            return snapshot_download(repo, allow_patterns=HUB_PATTERNS)
        except Exception as e:  # offline and not cached, unknown repo, gated, ...
            log.info("adapter resolver hf: %s not found (%s: %s)", repo, type(e).__name__, e)
            return None


def make_resolvers(specs, sources: AdapterSources) -> list:
    """The resolvers of parsed ``specs``, in order."""
    out = []
    for spec in specs:
        if spec.kind == "dir":
            out.append(DirResolver(spec.root, sources))
        else:
            out.append(HubResolver(spec.org, spec.repos))
    return out
