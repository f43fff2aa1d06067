"""The conversion cache of GGUF models (mola/models/gguf_cache.py, gguf_load.py): a
load from the cache holds, to the bit, what a fresh conversion (the cache off) holds,
weights and logits, kept and float, on random blocks of each codec and on every
family's twin; a file replaced, rewritten or truncated is never served from a stale
entry; a read-only folder is skipped with a message; the bound holds, least recently
used first; `mola cache list|clear`; and the progress of a long conversion."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import threading

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mola.cli import main
from mola.errors import ModelLoadError
from mola.models.gguf_cache import ConversionCache
from mola.models.gguf_load import WRITER_THREAD
from mola.models.loader import load_base_model
from mola.models.progress import Progress
from mola.testing.gguf_model import save_gguf_model
from mola.testing.gguf_twins import TWINS
from mola.testing.model import TinyModelSpec, make_tiny_model

# 256 wide so that every K-quant's 256-value blocks fit the rows (as tests/test_models_codecs.py)
SPEC = TinyModelSpec(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                     vocab_size=400, norm_noise=0.2)
TOKENS = mx.array([[1, 17, 300, 45, 2, 99, 7, 256, 12, 5]])
FROM_CACHE = "read from the conversion cache"


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("models") / "wide", SPEC)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("MOLA_GGUF_CACHE", str(folder))
    monkeypatch.delenv("MOLA_GGUF_CACHE_BYTES", raising=False)
    return folder


def params(model) -> dict[str, bytes]:
    """Every parameter's dtype, shape and bytes."""
    return {k: (str(v.dtype), v.shape, np.array(v.view(mx.uint8)).tobytes())
            for k, v in tree_flatten(model.parameters())}


def fresh(path, dtype, monkeypatch):
    """The model converted now, the cache off."""
    with monkeypatch.context() as m:
        m.setenv("MOLA_GGUF_CACHE", "off")
        loaded = load_base_model(str(path), dtype=dtype)
    assert not any(t.name == WRITER_THREAD for t in threading.enumerate())
    return loaded


def wait_for_writes() -> None:
    """Until the entries being written after a load are written."""
    for thread in threading.enumerate():
        if thread.name == WRITER_THREAD:
            thread.join()


def load(path, dtype, caplog) -> tuple[object, bool]:
    """(the loaded model, whether it came from the cache), its entry written."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mola.loader"):
        loaded = load_base_model(str(path), dtype=dtype)
        wait_for_writes()
    return loaded, FROM_CACHE in caplog.text


def assert_same(got, expected) -> None:
    assert got.config == expected.config
    a, b = params(got.model), params(expected.model)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k] == b[k], k
    logits = np.array(got.model(TOKENS).view(mx.uint8))  # the bits (bfloat16 has no numpy dtype)
    np.testing.assert_array_equal(logits, np.array(expected.model(TOKENS).view(mx.uint8)))
    assert got.tokenizer.encode("hello 123 world") == expected.tokenizer.encode("hello 123 world")
    assert got.tokenizer.eos_token_ids == expected.tokenizer.eos_token_ids


@pytest.mark.parametrize("codec", ["Q4_K", "Q6_K", "Q5_K", "Q3_K", "Q4_1", "Q8_0", "IQ4_XS", "IQ3_S", "Q2_K", "BF16"])
@pytest.mark.parametrize("dtype", ["keep", "float32", "bfloat16"])
def test_a_cached_load_is_the_fresh_conversion_to_the_bit(codec, dtype, wide_model, cache_dir, tmp_path,
                                                          monkeypatch, caplog):
    path = save_gguf_model(tmp_path / f"{codec}.gguf", wide_model, codec)
    reference = fresh(path, dtype, monkeypatch)
    first, hit = load(path, dtype, caplog)
    assert not hit and "written to the conversion cache" in caplog.text
    second, hit = load(path, dtype, caplog)
    assert hit
    assert_same(first, reference)
    assert_same(second, reference)


@pytest.mark.parametrize("model_type", tuple(dict.fromkeys(("llama", "qwen3", *TWINS))))
def test_every_twin_loads_from_the_cache_as_converted(model_type, cache_dir, tmp_path, monkeypatch, caplog):
    model_dir = make_tiny_model(tmp_path / "model", TinyModelSpec(model_type=model_type, norm_noise=0.3))
    path = save_gguf_model(tmp_path / "twin.gguf", model_dir, "Q8_0")
    for dtype in ("keep", "float32"):
        reference = fresh(path, dtype, monkeypatch)
        assert not load(path, dtype, caplog)[1]
        got, hit = load(path, dtype, caplog)
        assert hit
        assert_same(got, reference)
    assert len(ConversionCache.from_env().entries()) == 2  # one per dtype


def _two_files(tmp_path, wide_model):
    a = save_gguf_model(tmp_path / "a.gguf", wide_model, "Q8_0", seed=0)
    other = make_tiny_model(tmp_path / "other", dataclasses.replace(SPEC, seed=7))
    b = save_gguf_model(tmp_path / "b.gguf", other, "Q8_0", seed=1)
    assert a.stat().st_size == b.stat().st_size
    return a, b


def test_a_file_replaced_by_another_is_not_served_stale(wide_model, cache_dir, tmp_path, monkeypatch, caplog):
    a, b = _two_files(tmp_path, wide_model)
    old, _ = load(a, "keep", caplog)
    assert load(a, "keep", caplog)[1]
    stat = a.stat()
    os.replace(b, a)  # a download renamed into place
    os.utime(a, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # even with the old mtime
    got, hit = load(a, "keep", caplog)
    assert not hit
    assert_same(got, fresh(a, "keep", monkeypatch))
    assert params(got.model) != params(old.model)


def test_a_file_rewritten_in_place_is_not_served_stale(wide_model, cache_dir, tmp_path, monkeypatch, caplog):
    """The same inode, size and mtime (set back), other bytes: not the entry."""
    a, b = _two_files(tmp_path, wide_model)
    old, _ = load(a, "keep", caplog)
    stat = a.stat()
    with open(a, "r+b") as f:  # cp b a: the same inode, rewritten
        f.write(b.read_bytes())
    os.utime(a, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (a.stat().st_ino, a.stat().st_size, a.stat().st_mtime_ns) == (stat.st_ino, stat.st_size, stat.st_mtime_ns)
    got, hit = load(a, "keep", caplog)
    assert not hit
    assert_same(got, fresh(a, "keep", monkeypatch))
    assert params(got.model) != params(old.model)


def test_an_entry_another_version_wrote_is_not_served(wide_model, cache_dir, tmp_path, monkeypatch, caplog, capsys):
    import mola.models.gguf_cache as gguf_cache

    path = save_gguf_model(tmp_path / "a.gguf", wide_model, "Q8_0")
    load(path, "keep", caplog)
    written = gguf_cache.versions()
    monkeypatch.setattr(gguf_cache, "versions", lambda: {**written, "conversion": written["conversion"] + 1})
    assert not load(path, "keep", caplog)[1]
    assert load(path, "keep", caplog)[1]
    capsys.readouterr()
    assert main(["cache", "clear", "--stale"]) == 0
    assert "removed 1 stale" in capsys.readouterr().out  # the older one


def test_a_truncated_file_is_refused_not_served(wide_model, cache_dir, tmp_path, caplog):
    path = save_gguf_model(tmp_path / "a.gguf", wide_model, "Q8_0")
    load(path, "keep", caplog)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 4096)
    with pytest.raises(ModelLoadError):
        load_base_model(str(path), dtype="keep")


def test_a_damaged_entry_is_converted_again(wide_model, cache_dir, tmp_path, monkeypatch, caplog):
    path = save_gguf_model(tmp_path / "a.gguf", wide_model, "Q4_K")
    load(path, "keep", caplog)
    (entry,) = ConversionCache.from_env().entries()
    weights = entry.path / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    got, hit = load(path, "keep", caplog)
    assert not hit and "unreadable" in caplog.text
    assert_same(got, fresh(path, "keep", monkeypatch))
    assert load(path, "keep", caplog)[1]  # written again


def test_a_crashed_write_is_never_read(wide_model, cache_dir, tmp_path, caplog):
    path = save_gguf_model(tmp_path / "a.gguf", wide_model, "Q8_0")
    (cache_dir / ".tmp-half-written").mkdir(parents=True)
    (cache_dir / ".tmp-half-written" / "model.safetensors").write_bytes(b"\0" * 100)
    assert ConversionCache.from_env().entries() == []
    assert not load(path, "keep", caplog)[1]
    assert [e.meta["source"]["path"] for e in ConversionCache.from_env().entries()] == [str(path.resolve())]


def test_a_read_only_cache_folder_is_skipped_with_a_message(wide_model, cache_dir, tmp_path, monkeypatch, caplog):
    path = save_gguf_model(tmp_path / "a.gguf", wide_model, "Q8_0")
    cache_dir.mkdir()
    cache_dir.chmod(0o555)
    try:
        got, hit = load(path, "keep", caplog)
        assert not hit
        assert "conversion cache skipped" in caplog.text and "not writable" in caplog.text
        assert list(cache_dir.iterdir()) == []
        assert_same(got, fresh(path, "keep", monkeypatch))
    finally:
        cache_dir.chmod(0o755)


def test_the_bound_evicts_the_least_recently_used(wide_model, cache_dir, tmp_path, monkeypatch, caplog):
    paths = [save_gguf_model(tmp_path / f"{i}.gguf", wide_model, "Q8_0", seed=i) for i in range(3)]
    load(paths[0], "keep", caplog)
    size = ConversionCache.from_env().entries()[0].nbytes
    monkeypatch.setenv("MOLA_GGUF_CACHE_BYTES", str(2 * size + size // 2))  # two entries fit, not three
    load(paths[1], "keep", caplog)
    assert load(paths[0], "keep", caplog)[1]  # 0 is now the most recently used
    load(paths[2], "keep", caplog)
    cache = ConversionCache.from_env()
    kept = {e.meta["source"]["path"] for e in cache.entries()}
    assert kept == {str(paths[0].resolve()), str(paths[2].resolve())}
    assert sum(e.nbytes for e in cache.entries()) <= cache.max_bytes
    monkeypatch.setenv("MOLA_GGUF_CACHE_BYTES", str(size // 2))  # smaller than one entry: none written
    assert not load(paths[1], "float32", caplog)[1]
    assert "exceed its bound" in caplog.text
    assert len(ConversionCache.from_env().entries()) <= 2


def test_caching_off_writes_nothing(wide_model, tmp_path, monkeypatch, caplog):
    path = save_gguf_model(tmp_path / "a.gguf", wide_model, "Q8_0")
    monkeypatch.setenv("MOLA_GGUF_CACHE", "off")
    monkeypatch.setenv("MOLA_CACHE", str(tmp_path / "mola-cache"))
    assert not load(path, "keep", caplog)[1] and not load(path, "keep", caplog)[1]
    assert "conversion cache off" in caplog.text
    assert not (tmp_path / "mola-cache").exists()


def test_a_bad_bound_is_named(monkeypatch):
    with pytest.raises(ValueError, match="MOLA_GGUF_CACHE_BYTES.*'lots'"):
        ConversionCache.from_env({"MOLA_GGUF_CACHE": "/tmp/x", "MOLA_GGUF_CACHE_BYTES": "lots"})


def test_mola_cache_lists_and_clears(wide_model, cache_dir, tmp_path, caplog, capsys):
    a = save_gguf_model(tmp_path / "a.gguf", wide_model, "Q8_0")
    b = save_gguf_model(tmp_path / "b.gguf", wide_model, "Q4_0")
    load(a, "keep", caplog)
    load(b, "float32", caplog)
    capsys.readouterr()
    assert main(["cache", "list", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert listing["folder"] == str(cache_dir)
    assert {(e["file"], e["dtype"], e["stale"]) for e in listing["entries"]} == {
        (str(a.resolve()), "keep", False), (str(b.resolve()), "float32", False)}
    assert listing["bytes"] == sum(e["bytes"] for e in listing["entries"]) > 0
    assert main(["cache", "list"]) == 0
    assert str(a.resolve()) in capsys.readouterr().out
    b.unlink()
    assert main(["cache", "clear", "--stale"]) == 0
    assert "removed 1 stale" in capsys.readouterr().out
    assert [e.meta["source"]["path"] for e in ConversionCache.from_env().entries()] == [str(a.resolve())]
    assert main(["cache", "clear"]) == 0
    assert ConversionCache.from_env().entries() == []


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_shows_a_bar_on_a_terminal_after_a_while():
    out = Terminal()
    p = Progress("m.gguf", total_tensors=4, total_bytes=4 * 2**20, start=100.0, stream=out, after_s=3.0)
    p.advance(2**20, now=101.0)
    assert out.getvalue() == ""  # a short conversion shows nothing
    p.advance(2**20, now=104.0)
    assert "[mola] converting m.gguf: [############------------] 2/4 tensors, 2 MiB/4 MiB, 4 s left" in out.getvalue()
    p.advance(2**20, now=104.1)  # redrawn at most every redraw_s
    assert "3/4" not in out.getvalue()
    p.advance(2**20, now=105.0)
    p.close(now=105.0)
    assert out.getvalue().endswith("4/4 tensors, 4 MiB/4 MiB, 0 s left\n")


def test_progress_logs_lines_elsewhere(caplog):
    p = Progress("m.gguf", total_tensors=10, total_bytes=10, start=0.0, stream=io.StringIO(), after_s=3.0,
                 every_s=5.0)
    with caplog.at_level(logging.INFO, logger="mola.loader"):
        for i in range(10):
            p.advance(1, now=float(2 * i))
        p.close(now=20.0)
    lines = [r.message for r in caplog.records]
    assert [line.split(": ", 1)[1][27:].split(",")[0] for line in lines] == ["3/10 tensors", "6/10 tensors",
                                                                              "9/10 tensors"]
