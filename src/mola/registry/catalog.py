"""What a model id (or a path in a request) names: the adapter records the
registry may serve, and where they come from. Plain Python; nothing here
reads an adapter or touches a slot (registry.py does). A request names
adapters by :class:`AdapterRef`.

A name is known when it was named at start, loaded over REST, found in an
adapter directory (``sources.discover``) or, for an id nothing else knows,
found by a resolver (resolvers.py). Each registration of a name is a new
version. A path named in a request is one record per resolved path and
content version (paths.py). Unloaded names are not found again in adapter
directories or by resolvers until they are loaded again.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Iterator
from dataclasses import dataclass

from ..errors import AdapterExists, AdapterNotFound, InvalidAdapterName
from .names import check_adapter_id
from .paths import SOURCE as PATH_SOURCE, PathAdapters
from .records import AdapterRecord
from .sources import AdapterSources, content_version

log = logging.getLogger("mola.adapters")


@dataclass(frozen=True)
class AdapterRef:
    """One entry of a request's ``adapters``: a known adapter by ``name``, or
    the adapter files at ``path``, applied with ``scale`` (this request's, as
    the API's field has it)."""

    name: str | None = None
    path: str | None = None
    scale: float = 1.0


class Catalog:
    def __init__(self, base_id: str, sources: AdapterSources, resolvers: list | None = None,
                 uids: Iterator[int] | None = None):
        self.base_id = base_id
        self.uids = uids if uids is not None else itertools.count(1)  # every record's uid, one counter
        self.sources = sources
        self.resolvers = list(resolvers or ())  # asked, in order, for an id nothing else knows
        self.paths = PathAdapters(self.uids)  # adapters named by path in requests
        self._known: dict[str, AdapterRecord] = {}
        self._unloaded: set[str] = set()  # names not to find again until loaded again
        self._versions: dict[str, int] = {}
        self._resolving: dict[str, asyncio.Task] = {}  # id -> the resolver lookup under way

    def adapters(self) -> list[AdapterRecord]:
        """Every adapter that can be requested by name, resident or not."""
        return list(self._known.values())

    def check_name(self, name: str) -> None:
        """A new name: a valid id (names.py) that nothing is served as."""
        check_adapter_id(name)
        if name == self.base_id or name in self._known:
            raise AdapterExists(name)

    def register(self, name: str, path: str, source: str, slot_scale: float = 1.0) -> AdapterRecord:
        """Know ``name`` as the adapter at (already resolved) ``path``."""
        self.check_name(name)
        version = self._versions.get(name, 0) + 1
        self._versions[name] = version
        record = AdapterRecord(name=name, path=str(path), source=source, version=version, uid=next(self.uids),
                               slot_scale=slot_scale)
        self._known[name] = record
        self._unloaded.discard(name)
        return record

    def remove(self, name: str) -> AdapterRecord:
        """Stop knowing ``name`` (unloaded); AdapterNotFound if it is not known."""
        record = self._known.pop(name, None)
        if record is None:
            raise AdapterNotFound(name)
        self._unloaded.add(name)
        return record

    def is_current(self, record: AdapterRecord) -> bool:
        """Whether ``record`` is what its name (or path) names now."""
        if record.source == PATH_SOURCE:
            return self.paths.is_current(record)
        return self._known.get(record.name) is record

    def get(self, name: str) -> AdapterRecord | None:
        """A known name, or an adapter-directory entry of that name (raises
        AdapterPathNotAllowed for one the path policy refuses)."""
        record = self._known.get(name)
        if record is not None or name in self._unloaded or name == self.base_id:
            return record
        path = self.sources.discover(name)
        if path is None:
            return None
        log.info("adapter discovered: name=%s path=%s", name, path)
        return self.register(name, path, "dir")

    async def find(self, name: str) -> AdapterRecord | None:
        """``get``, then the resolvers: one lookup per id at a time, shared by
        the requests that ask meanwhile."""
        record = self.get(name)
        if record is not None or not self.resolvers or name in self._unloaded or name == self.base_id:
            return record
        try:
            check_adapter_id(name)
        except InvalidAdapterName:
            return None
        task = self._resolving.get(name)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._ask_resolvers(name))
            self._resolving[name] = task
            task.add_done_callback(lambda _: self._resolving.pop(name, None))
        return await asyncio.shield(task)  # a request that goes away does not stop it

    async def _ask_resolvers(self, name: str) -> AdapterRecord | None:
        for resolver in self.resolvers:
            path = await resolver.find(name)  # may raise AdapterPathNotAllowed
            if path is None:
                continue
            if name in self._known or name in self._unloaded:  # loaded or unloaded meanwhile
                return self._known.get(name)
            log.info("adapter resolved: name=%s resolver=%s path=%s", name, resolver.kind, path)
            return self.register(name, path, f"resolver:{resolver.kind}")
        return None

    def by_path(self, given: str) -> tuple[AdapterRecord, list[AdapterRecord]]:
        """The record of the adapter files at ``given`` as they are now, and
        the records that are no longer current (an older version of it; the
        least recently used beyond the paths kept), for the caller to retire.
        The path policy comes first: AdapterPathNotAllowed outside it."""
        real = self.sources.resolve_request_path(given)
        record, stale = self.paths.get_or_make(real, content_version(real))
        gone = [] if stale is None else [stale]
        if stale is not None:
            log.info("adapter changed on disk: name=%s version=%d -> %d", record.name, stale.version,
                     record.version)
        for old in self.paths.surplus(keep=record):
            self.paths.drop(old)
            gone.append(old)
        return record, gone
