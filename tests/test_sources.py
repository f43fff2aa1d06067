"""Where adapters may come from (mola/lora/sources.py)."""

from __future__ import annotations

import os
import shutil

import pytest

from mola.errors import AdapterPathNotAllowed, AdapterPathNotFound
from mola.lora.sources import AdapterSources


def test_policy(tmp_path, adapters):
    root = tmp_path / "root"
    shutil.copytree(adapters["a"], root / "a")
    named = tmp_path / "named"
    shutil.copytree(adapters["b"], named)
    s = AdapterSources(adapter_dirs=[root], named_paths=[named])
    assert s.resolve(str(root / "a")) == str((root / "a").resolve())
    assert s.resolve(str(named)) == str(named.resolve())
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(adapters["c"], elsewhere)
    with pytest.raises(AdapterPathNotAllowed, match="--allow-any-adapter-path"):
        s.resolve(str(elsewhere))
    os.symlink(elsewhere, root / "link")
    with pytest.raises(AdapterPathNotAllowed):
        s.resolve(str(root / "link"))
    with pytest.raises(AdapterPathNotAllowed):
        s.resolve(str(root / ".." / "elsewhere"))
    assert AdapterSources(allow_any_path=True).resolve(str(elsewhere)) == str(elsewhere.resolve())
    with pytest.raises(AdapterPathNotFound):
        s.resolve(str(tmp_path / "nothing" / "here"))


def test_scan_and_discover(tmp_path, adapters):
    root = tmp_path / "root"
    shutil.copytree(adapters["a"], root / "alpha")
    (root / "beta.gguf").write_bytes(b"GGUF")
    (root / ".hidden").mkdir()
    (root / "notes.txt").write_text("x")
    s = AdapterSources(adapter_dirs=[root])
    assert s.scan() == {"alpha": root / "alpha", "beta": root / "beta.gguf"}
    assert s.discover("alpha") == root / "alpha"
    assert s.discover("beta") == root / "beta.gguf"
    assert s.discover("../root/alpha") is None and s.discover("gamma") is None


def test_hub_id_goes_through_the_hub_cache(tmp_path, adapters, monkeypatch):
    import huggingface_hub.constants as hc

    commit = "fedcba9876543210fedcba9876543210fedcba98"
    repo = tmp_path / "hub" / "models--someone--my-lora"
    shutil.copytree(adapters["a"], repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    s = AdapterSources()
    assert s.resolve("someone/my-lora") == str(repo / "snapshots" / commit)
    with pytest.raises(AdapterPathNotFound, match="someone/absent"):
        s.resolve("someone/absent")


@pytest.mark.parametrize("given", ["~no-such-user-xyz/adapter", "bad\x00path", "x" * 5000])
def test_unusable_paths_are_not_found_errors(given):
    with pytest.raises(AdapterPathNotFound):
        AdapterSources(allow_any_path=True).resolve(given)
    assert AdapterSources(adapter_dirs=["/tmp"]).discover(given.replace("/", "")) is None
