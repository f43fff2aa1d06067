"""gguf-py's ``GGUFReader``, made fast on files with large vocabularies: what
GGUF adapters (formats/gguf.py) and GGUF bases (mola/models) are read with.

``GGUFReader`` slices its ``np.memmap`` once or twice per metadata value, and
every slice of a memmap runs Python-level ``__array_finalize__``; the 49,152
tokens and 48,900 merges of SmolLM2's GGUF made that most of the model's load.
:class:`GGUFFileReader` reads the same file into the same fields and tensors
(tests/test_gguf_reader.py compares the two), but slices a plain ndarray view
of the same mapping, and reads each array in one loop. :class:`GGUFTensorTable` reads
the tensor table alone, stepping over the arrays' items (what sizing a model needs).
"""

from __future__ import annotations

import mmap

import numpy as np
from gguf import GGUFReader, GGUFValueType


class GGUFFileReader(GGUFReader):
    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        # GGUFReader.__init__ assigns its np.memmap here first thing: keep a
        # plain view of it (the mapping stays open through the view's base).
        self._data = value.view(np.ndarray) if isinstance(value, np.memmap) else value
        self._mapping = getattr(value, "_mmap", None)  # the mmap.mmap under it, to release pages of

    def release(self, offset: int, length: int) -> None:
        """Drop the whole pages of bytes [offset, offset + length) of the file
        from this process's resident memory (``madvise(MADV_DONTNEED)`` on the
        read-only mapping): the bytes are unchanged, and a later read maps them
        again from the page cache. A base's load calls it once a tensor is
        converted, so that the file's pages do not add up beside the result."""
        if self._mapping is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages only: a neighbour's stay
        end = (offset + length) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start:
            self._mapping.madvise(mmap.MADV_DONTNEED, start, end - start)

    def _array_head(self, orig_offs: int):
        """(item type part, count part, item type, count, the first item's offset,
        numpy type of a numeric item or None) of the array at ``orig_offs``."""
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        itype = int(raw_itype[0])
        nptype = self.gguf_scalar_to_np.get(GGUFValueType(itype)) if itype != _STRING else None
        return raw_itype, alen, itype, int(alen[0]), orig_offs + 12, nptype

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if raw_type != _ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        # An array, as GGUFReader lays one out: its item type and count, then
        # one data part per item (a string's length part before its bytes).
        raw_itype, alen, itype, count, offs, nptype = self._array_head(orig_offs)
        parts: list[np.ndarray] = [raw_itype, alen]
        if nptype is not None:
            items = self._get(offs, nptype, count)
            if len(items) != count:
                raise ValueError(f"an array at byte {orig_offs} runs past the end of the file")
            parts += [items[i:i + 1] for i in range(count)]
            idxs = list(range(2, 2 + count))
            offs += int(items.nbytes)
        elif itype == _STRING:
            data = self.data
            raw = memoryview(data)
            for _ in range(count):
                n = int.from_bytes(raw[offs:offs + 8], "little")
                if offs + 8 + n > len(data):
                    raise ValueError(f"a string at byte {offs} runs past the end of the file")
                parts += (data[offs:offs + 8].view(np.uint64), data[offs + 8:offs + 8 + n])
                offs += 8 + n
            idxs = list(range(3, len(parts), 2))
        else:  # arrays of arrays: as GGUFReader reads them
            return super()._get_field_parts(orig_offs, raw_type)
        types = [GGUFValueType.ARRAY] + ([GGUFValueType(itype)] if count else [])
        return offs - orig_offs, parts, idxs, types


class GGUFTensorTable(GGUFFileReader):
    """A GGUF file's tensors (names, types, shapes, data) and its scalar metadata, its
    arrays' items (at any depth) stepped over unread: an array field holds its item
    type and count, its ``contents()`` is empty, and :meth:`array_contents` reads its
    values in one pass. About a fifth of :class:`GGUFFileReader`'s time on SmolLM2-1.7B's
    49,152-token vocabulary: what bases/host_memory.py sizes a base by, and what a
    base's load reads its metadata with (models/gguf_file.py)."""

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if raw_type != _ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype, alen, itype, count, offs, nptype = self._array_head(orig_offs)
        end = len(self.data)
        if nptype is not None:
            offs += count * np.dtype(nptype).itemsize
        elif itype == _STRING:
            raw = memoryview(self.data)
            for _ in range(count):  # [u64 length, bytes] per item
                offs += 8 + int.from_bytes(raw[offs:offs + 8], "little")
                if offs > end:
                    break
        else:  # arrays of arrays: gguf-py's walk, which steps over each inner array here
            return super()._get_field_parts(orig_offs, raw_type)
        if offs > end:
            raise ValueError(f"an array at byte {orig_offs} runs past the end of the file")
        return offs - orig_offs, [raw_itype, alen], [], [GGUFValueType.ARRAY]

    def array_contents(self, field) -> list:
        """What ``contents()`` of the full reading gives for the array ``field`` of
        numbers, booleans or strings (strings decoded as gguf-py decodes them, strict
        UTF-8), read from the file now in one pass."""
        head, (raw_itype, alen) = field.parts[:3], field.parts[3:5]
        itype, count = int(raw_itype[0]), int(alen[0])
        offs = field.offset + sum(int(p.nbytes) for p in head) + 12  # after the item type and count
        if itype == _STRING:
            raw, out = memoryview(self.data), []
            for _ in range(count):
                n = int.from_bytes(raw[offs:offs + 8], "little")
                out.append(str(raw[offs + 8:offs + 8 + n], encoding="utf-8"))
                offs += 8 + n
            return out
        nptype = self.gguf_scalar_to_np[GGUFValueType(itype)]
        return self.data[offs:offs + count * np.dtype(nptype).itemsize].view(nptype).tolist()


_ARRAY, _STRING = int(GGUFValueType.ARRAY), int(GGUFValueType.STRING)
