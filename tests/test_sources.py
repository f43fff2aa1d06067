"""Where adapters may come from (mola/registry/sources.py): one policy for every
way an adapter is reached (REST, vLLM's route, an --adapter-dir entry by
name, the config file, --adapter), each tried with a symlink that escapes the
adapter directory and one that stays inside it."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import pytest

from mola.cli import build_parser, config_from_args
from mola.cli.config_file import load_config_file
from mola.errors import AdapterPathNotAllowed, AdapterPathNotFound
from mola.registry.sources import AdapterSources

from helpers.scripted import InProcessServer, ScriptedEngine, by_recipe, tokenizer_model


@pytest.fixture
def tree(tmp_path, adapters):
    """allowed/real (a directory), allowed/inner -> allowed/.store/b (stays
    inside), allowed/evil -> outside/target (escapes); outside/other."""
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    shutil.copytree(adapters["a"], allowed / "real")
    shutil.copytree(adapters["b"], allowed / ".store" / "b")
    shutil.copytree(adapters["c"], outside / "target")
    shutil.copytree(adapters["a"], outside / "other")
    os.symlink(allowed / ".store" / "b", allowed / "inner")
    os.symlink(outside / "target", allowed / "evil")
    return {"allowed": allowed, "outside": outside, "tmp": tmp_path}


def test_policy(tree):
    allowed, outside = tree["allowed"], tree["outside"]
    s = AdapterSources(adapter_dirs=[allowed])
    assert s.resolve(str(allowed / "real")) == str((allowed / "real").resolve())
    assert s.resolve(str(allowed / "inner")) == str((allowed / ".store" / "b").resolve())
    with pytest.raises(AdapterPathNotAllowed, match="a symlink leads out of it.*--allow-adapter-symlinks"):
        s.resolve(str(allowed / "evil"))
    with pytest.raises(AdapterPathNotAllowed, match="--allow-any-adapter-path"):
        s.resolve(str(outside / "other"))
    with pytest.raises(AdapterPathNotAllowed):
        s.resolve(str(allowed / ".." / "outside" / "other"))
    with pytest.raises(AdapterPathNotFound):
        s.resolve(str(tree["tmp"] / "nothing" / "here"))
    assert AdapterSources(allow_any_path=True).resolve(str(allowed / "evil")) == str((outside / "target").resolve())


def test_paths_named_at_start_are_allowed_exactly(tree):
    allowed, outside = tree["allowed"], tree["outside"]
    s = AdapterSources(adapter_dirs=[allowed], named_paths=[allowed / "evil"])
    assert s.resolve(str(allowed / "evil")) == str((outside / "target").resolve())
    assert s.resolve(str(outside / "target")) == str((outside / "target").resolve())
    assert s.discover("evil") == str((outside / "target").resolve())
    with pytest.raises(AdapterPathNotAllowed):  # naming one does not open its neighbours
        s.resolve(str(outside / "other"))


def test_allow_adapter_symlinks(tree):
    allowed, outside = tree["allowed"], tree["outside"]
    s = AdapterSources(adapter_dirs=[allowed], allow_symlinks=True)
    assert s.resolve(str(allowed / "evil")) == str((outside / "target").resolve())
    assert s.discover("evil") == str((outside / "target").resolve())
    assert set(s.scan()) == {"real", "inner", "evil"}
    with pytest.raises(AdapterPathNotAllowed):  # '..' out of a symlink's target: still checked
        s.resolve(str(allowed / "evil" / ".." / "other"))
    with pytest.raises(AdapterPathNotAllowed):
        s.resolve(str(outside / "other"))


def test_scan_and_discover(tree):
    allowed, outside = tree["allowed"], tree["outside"]
    (allowed / "beta.gguf").write_bytes(b"GGUF")
    (allowed / "notes.txt").write_text("x")
    (allowed / "bad name").mkdir()
    s = AdapterSources(adapter_dirs=[allowed])
    assert s.scan() == {"real": str((allowed / "real").resolve()), "inner": str((allowed / ".store" / "b").resolve()),
                        "beta": str((allowed / "beta.gguf").resolve())}
    assert s.discover("real") == str((allowed / "real").resolve())
    assert s.discover("beta") == str((allowed / "beta.gguf").resolve())
    assert s.discover("inner") == str((allowed / ".store" / "b").resolve())
    with pytest.raises(AdapterPathNotAllowed, match="--allow-adapter-symlinks") as e:
        s.discover("evil")
    assert str(outside) not in e.value.message and str(allowed) not in e.value.message
    for name in ("../allowed/real", "gamma", "bad name", ".store/b", "..", ".store"):
        assert s.discover(name) is None, name


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


# ---- every way, through the app in process ------------------------------------------------


def chat(model):
    return {"model": model, "messages": [{"role": "user", "content": "Tell me"}], "max_tokens": 6,
            "temperature": 0, "ignore_eos": True}


def answer(c, model):
    r = c.post("/v1/chat/completions", json=chat(model))
    return r.status_code, (r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else r.json())


def serve(model, **config):
    """The app in process over a scripted engine whose answer names the adapter
    files its slot holds (the policy is the subject, not the model's output)."""
    loaded = tokenizer_model(Path(model))
    engine = ScriptedEngine()
    engine.script = by_recipe(engine, loaded.tokenizer)
    return InProcessServer(loaded, engine, served_model_name="tiny", max_loras=2, max_lora_rank=16, **config)


def test_rest_vllm_and_names_under_the_default_policy(tiny_model, tree):
    allowed, outside = tree["allowed"], tree["outside"]
    handle = serve(model=str(tiny_model), adapter_dirs=(str(allowed),))
    try:
        c = handle.client(timeout=60)
        # REST and vLLM: the escaping symlink is a 403, the inside one loads.
        r = c.post("/v1/adapters", json={"name": "x", "path": str(allowed / "evil")})
        assert r.status_code == 403 and r.json()["error"]["code"] == "adapter_path_not_allowed"
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(allowed / "evil")})
        assert r.status_code == 403 and "--allow-adapter-symlinks" in r.json()["error"]["message"]
        assert c.post("/v1/adapters", json={"name": "rest-in", "path": str(allowed / "inner")}).status_code == 200
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "vllm-in", "lora_path": str(allowed / "inner")})
        assert r.status_code == 200
        # By name: the escaping entry is refused the same way, and not listed.
        assert {m["id"] for m in c.get("/v1/models").json()["data"]} == {"tiny", "real", "inner", "rest-in", "vllm-in"}
        status, error = answer(c, "evil")
        assert status == 403 and error["error"]["code"] == "adapter_path_not_allowed"
        assert "--allow-adapter-symlinks" in error["error"]["message"] and str(outside) not in str(error)
        assert c.get("/v1/adapters/evil").status_code == 403
        os.symlink(outside / "other", allowed / "late-evil")  # found on first use, not at start
        assert answer(c, "late-evil")[0] == 403
        # The inside symlink serves adapter b, whichever way it was reached.
        b = answer(c, "inner")
        assert b[0] == 200 and answer(c, "rest-in") == b and answer(c, "vllm-in") == b
        assert answer(c, "real")[0] == 200 and answer(c, "real") != b
        assert c.get("/health").status_code == 200
    finally:
        handle.stop()


def test_config_file(tiny_model, tree):
    allowed, outside = tree["allowed"], tree["outside"]
    config = tree["tmp"] / "mola.toml"
    config.write_text(f'model = "{tiny_model}"\nadapter_dirs = ["allowed"]\n'
                      '[[adapters]]\nname = "cfg-in"\npath = "allowed/inner"\n'
                      '[[adapters]]\nname = "cfg-evil"\npath = "allowed/evil"\n')
    handle = serve(**load_config_file(config))
    try:
        c = handle.client(timeout=60)
        # Named in the file: trusted as the operator wrote them, symlink or not.
        assert answer(c, "cfg-in")[0] == 200 and answer(c, "cfg-in") == answer(c, "inner")
        assert answer(c, "cfg-evil")[0] == 200
        # ... exactly: the escaping target's neighbours stay out.
        r = c.post("/v1/adapters", json={"name": "x", "path": str(outside / "other")})
        assert r.status_code == 403
        os.symlink(outside / "other", allowed / "evil-other")
        assert answer(c, "evil-other")[0] == 403
    finally:
        handle.stop()
    config.write_text(f'model = "{tiny_model}"\nadapter_dirs = ["allowed"]\nallow_adapter_symlinks = true\n')
    handle = serve(**load_config_file(config))
    try:
        c = handle.client(timeout=60)
        assert answer(c, "evil")[0] == 200 and answer(c, "evil-other")[0] == 200
    finally:
        handle.stop()


def test_adapter_flags(tiny_model, tree):
    allowed, outside = tree["allowed"], tree["outside"]
    args = ["serve", "--model", str(tiny_model), "--adapter-dir", str(allowed), "--allow-adapter-symlinks",
            "--adapter", f"cli-in={allowed / 'inner'}", "--adapter", f"cli-evil={allowed / 'evil'}"]
    config = config_from_args(build_parser().parse_args(args))
    assert config.allow_adapter_symlinks
    nested = {f.name for f in dataclasses.fields(config) if dataclasses.is_dataclass(getattr(config, f.name))}
    handle = serve(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)
                      if f.name not in {"log_level", "served_model_name"} | nested})
    try:
        c = handle.client(timeout=60)
        assert answer(c, "cli-in")[0] == 200 and answer(c, "cli-in") == answer(c, "inner")
        assert answer(c, "cli-evil")[0] == 200 and answer(c, "cli-evil") == answer(c, "evil")
        r = c.post("/v1/adapters", json={"name": "x", "path": str(allowed / "evil" / ".." / "other")})
        assert r.status_code == 403  # a '..' out of the link's target is still checked
        assert c.post("/v1/adapters", json={"name": "y", "path": str(outside / "other")}).status_code == 403
    finally:
        handle.stop()
