"""GGUFFileReader (mola/adapters/formats/gguf_reader.py) reads what gguf-py's
GGUFReader reads, part for part: every metadata field (offsets, parts, types,
values) and every tensor, on a file with every kind of array and on the real
model's; a file cut short is refused by name. GGUFTensorTable reads the same tensors
and scalars, its arrays' items stepped over. ``release`` drops a range's pages from
the process's resident memory, its bytes unchanged."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from helpers.mappings import HAS_SMAPS, mapped_rss_kib
from mola.adapters.formats.gguf_reader import GGUFFileReader, GGUFTensorTable
from mola.errors import ModelLoadError
from mola.models.gguf_file import open_gguf


@pytest.fixture(scope="module")
def real_theirs(smollm_gguf):
    """gguf-py's reading of the real model, made once for the module: its
    49,152-token vocabulary takes it seconds."""
    return GGUFReader(str(smollm_gguf))


def assert_same_reading(path, theirs=None) -> None:
    ours, theirs = GGUFFileReader(str(path)), theirs or GGUFReader(str(path))
    assert list(ours.fields) == list(theirs.fields)
    for key, want in theirs.fields.items():
        got = ours.fields[key]
        assert (got.offset, got.name, got.data, got.types) == (want.offset, want.name, want.data, want.types), key
        assert len(got.parts) == len(want.parts), key
        for a, b in zip(got.parts, want.parts):
            assert a.dtype == b.dtype and np.array_equal(a, b), key
        assert got.contents() == want.contents(), key
    assert (ours.alignment, ours.data_offset) == (theirs.alignment, theirs.data_offset)
    assert len(ours.tensors) == len(theirs.tensors)
    for got, want in zip(ours.tensors, theirs.tensors):
        assert (got.name, got.tensor_type, list(got.shape), got.n_bytes, got.data_offset) == \
            (want.name, want.tensor_type, list(want.shape), want.n_bytes, want.data_offset)
        assert np.array_equal(got.data, want.data), got.name


def write_gguf(path) -> None:
    w = GGUFWriter(str(path), "llama")
    w.add_array("test.strings", ["a", "", "héllo wörld", "x" * 300, "<|im_end|>"])
    w.add_array("test.ints", [1, -2, 3, 2**31 - 1])
    w.add_array("test.floats", [0.5, -1.25, 3e-7])
    w.add_array("test.bools", [True, False, True])
    w.add_array("test.nested", [[1, 2], [3, 4]])
    w.add_string("test.string", "value")
    w.add_uint32("test.uint", 7)
    w.add_float32("test.float", 1e-5)
    w.add_tensor("one", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("two", np.ones((5,), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_every_kind_of_array_reads_as_gguf_py_reads_it(tmp_path):
    path = tmp_path / "kinds.gguf"
    write_gguf(path)
    assert_same_reading(path)
    fields = GGUFFileReader(str(path)).fields
    assert fields["test.strings"].contents() == ["a", "", "héllo wörld", "x" * 300, "<|im_end|>"]
    assert fields["test.ints"].contents() == [1, -2, 3, 2**31 - 1]


def test_the_real_models_vocabulary_reads_as_gguf_py_reads_it(smollm_gguf, real_theirs):
    assert_same_reading(smollm_gguf, real_theirs)


def test_a_file_cut_inside_an_array_is_refused_by_name(tmp_path):
    path = tmp_path / "kinds.gguf"
    write_gguf(path)
    data = path.read_bytes()
    # inside a string; between two ints (the slice still holds whole ints); inside an int
    for marker, extra in ((b"x" * 300, 5), (b"\xff\xff\xff\x7f", 0), (b"\xff\xff\xff\x7f", 2)):
        cut = tmp_path / "cut.gguf"
        cut.write_bytes(data[:data.index(marker) + extra])
        with pytest.raises(ModelLoadError, match="is not a readable GGUF file"):
            open_gguf(cut)


def assert_same_table(path, theirs=None) -> None:
    table, theirs = GGUFTensorTable(str(path)), theirs or GGUFReader(str(path))
    assert list(table.fields) == list(theirs.fields)
    for key, want in theirs.fields.items():
        got = table.fields[key]
        assert got.offset == want.offset, key  # every value before it stepped over by its size
        if want.types[0] == GGUFValueType.ARRAY:  # its item count alone
            assert int(got.parts[4][0]) == int(want.parts[4][0]) and got.contents() == [], key
        else:
            assert got.contents() == want.contents(), key
    assert (table.alignment, table.data_offset) == (theirs.alignment, theirs.data_offset)
    assert len(table.tensors) == len(theirs.tensors)
    for got, want in zip(table.tensors, theirs.tensors):
        assert (got.name, got.tensor_type, list(got.shape), got.n_elements, got.n_bytes, got.data_offset) == \
            (want.name, want.tensor_type, list(want.shape), want.n_elements, want.n_bytes, want.data_offset)
        assert np.array_equal(got.data, want.data), got.name


def test_the_tensor_table_reads_the_tensors_and_scalars_as_gguf_py_reads_them(tmp_path):
    path = tmp_path / "kinds.gguf"
    write_gguf(path)
    assert_same_table(path)


def test_the_real_models_tensor_table_reads_as_gguf_py_reads_it(smollm_gguf, real_theirs):
    assert_same_table(smollm_gguf, real_theirs)


def test_the_tensor_table_refuses_a_file_cut_inside_an_array(tmp_path):
    path = tmp_path / "kinds.gguf"
    write_gguf(path)
    data = path.read_bytes()
    for marker, extra in ((b"x" * 300, 5), (b"\xff\xff\xff\x7f", 2)):  # inside a string; inside an int
        cut = tmp_path / "cut.gguf"
        cut.write_bytes(data[:data.index(marker) + extra])
        with pytest.raises(ValueError):
            GGUFTensorTable(str(cut))


def test_the_tensor_tables_arrays_read_in_one_pass_as_gguf_py_reads_them(tmp_path, smollm_gguf, real_theirs):
    path = tmp_path / "kinds.gguf"
    write_gguf(path)
    for file, theirs in ((path, GGUFReader(str(path))), (smollm_gguf, real_theirs)):
        table = GGUFTensorTable(str(file))
        arrays = [k for k, f in theirs.fields.items() if f.types[:1] == [GGUFValueType.ARRAY]
                  and f.types[1:2] != [GGUFValueType.ARRAY]]  # arrays of arrays: open_gguf reads them in full
        assert len(arrays) >= (4 if file == path else 3)
        for key in arrays:
            got, want = table.array_contents(table.fields[key]), theirs.fields[key].contents()
            assert got == want and [type(x) for x in got] == [type(x) for x in want], key


def test_open_gguf_reads_the_metadata_gguf_py_reads(smollm_gguf, tmp_path, real_theirs):
    path = tmp_path / "kinds.gguf"
    write_gguf(path)  # with an array of arrays: read in full
    for file, theirs in ((path, GGUFReader(str(path))), (smollm_gguf, real_theirs)):
        want = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
        assert open_gguf(file).metadata == want


@pytest.mark.skipif(not HAS_SMAPS, reason="reads the mapping's Rss from /proc/self/smaps")
def test_release_drops_a_tensors_pages_and_keeps_its_bytes(tmp_path):
    path = tmp_path / "big.gguf"
    big = np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32)  # 4 MiB
    w = GGUFWriter(str(path), "llama")
    w.add_tensor("small", np.arange(12, dtype=np.float32))
    w.add_tensor("big", big)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader = GGUFFileReader(str(path))
    tensor = next(t for t in reader.tensors if t.name == "big")
    assert float(np.asarray(tensor.data, dtype=np.float64).sum()) == pytest.approx(float(big.astype(np.float64).sum()))
    touched = mapped_rss_kib(path)
    assert touched >= 4096  # every page of it read in
    reader.release(int(tensor.data_offset), int(tensor.n_bytes))
    assert mapped_rss_kib(path) <= touched - 4096 + 8  # all but the two pages at its ends, at most
    assert np.array_equal(tensor.data.reshape(big.shape), big)  # read again from the page cache
    assert mapped_rss_kib(path) >= 4096
