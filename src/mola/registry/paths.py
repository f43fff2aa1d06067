"""Adapters named by path in a request: ``{"path": ..., "scale"?: x}`` in its
``adapters`` list (as mlx-lm's server takes ``adapters`` and LoRAX
``adapter_id``).

The path is checked by the one policy (sources.py) before anything at it is
opened; then it is one record per resolved path and content version, served
like any adapter loaded just in time (a slot while used, evicted least
recently used, stacked with named adapters). An edited adapter (other sizes,
times or inodes of its files: sources.content_version) is a new version under
the same id: requests running on the old one finish on its weights, nothing of
the old one (slot, stacks, cached prompts) serves the new one.

The id of such a record is ``path:<resolved path>``; it is not a model id
(requests cannot name it as their ``model``), only what ``/v1/adapters`` lists.
"""

from __future__ import annotations

from collections.abc import Iterator

from .records import AdapterRecord, AdapterState

# Records of paths kept known (not resident) before the least recently used go.
MAX_PATH_RECORDS = 256
SOURCE = "request"


def path_id(real: str) -> str:
    return f"path:{real}"


class PathAdapters:
    def __init__(self, uids: Iterator[int], max_records: int = MAX_PATH_RECORDS):
        self.max_records = max_records
        self.uids = uids  # the catalog's counter
        self._current: dict[str, AdapterRecord] = {}  # resolved path -> its current version
        self._content: dict[str, tuple] = {}  # resolved path -> content_version of that record
        self._versions: dict[str, int] = {}  # resolved path -> last version number

    def __iter__(self):
        return iter(list(self._current.values()))

    def __len__(self) -> int:
        return len(self._current)

    def get_or_make(self, real: str, content: tuple) -> tuple[AdapterRecord, AdapterRecord | None]:
        """The record for the adapter files at ``real`` as they are now
        (``content``), and the record it replaces (an older version) if any."""
        current = self._current.get(real)
        if current is not None and self._content[real] == content:
            return current, None
        version = self._versions.get(real, 0) + 1
        self._versions[real] = version
        record = AdapterRecord(name=path_id(real), path=real, source=SOURCE, version=version, uid=next(self.uids))
        self._current[real] = record
        self._content[real] = content
        return record, current

    def is_current(self, record: AdapterRecord) -> bool:
        return self._current.get(record.path) is record

    def surplus(self, keep: AdapterRecord) -> list[AdapterRecord]:
        """Records beyond ``max_records`` that can go: known, not resident, no
        request waiting, least recently used first; never ``keep``."""
        extra = len(self._current) - self.max_records
        if extra <= 0:
            return []
        idle = [r for r in self._current.values()
                if r.state is AdapterState.KNOWN and r.waiting == 0 and r is not keep]
        idle.sort(key=lambda r: (r.last_used or 0.0, r.uid))
        return idle[:extra]

    def drop(self, record: AdapterRecord) -> None:
        if self.is_current(record):
            del self._current[record.path]
            del self._content[record.path]
