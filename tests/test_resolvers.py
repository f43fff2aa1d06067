"""Resolvers for unknown model ids (mola/registry/resolvers.py, --adapter-resolver):
dir:PATH against a real directory, hf:ORG/* and hf:REPO,... against a local
hub cache laid out as a download leaves it, with HF_HUB_OFFLINE=1; a found
adapter is served (the slot of its answer holds its files) and checked like
any other, a miss is a 404. In process, over a scripted engine: resolution is
the subject, not the adapter's math (tests/test_request_paths.py checks that)."""

from __future__ import annotations

import os
import shutil

import httpx
import pytest

from mola.cli import build_parser, config_from_args
from mola.cli.config_file import load_config_file
from mola.registry.resolvers import ResolverSpec, parse_resolver

from helpers.scripted import InProcessServer, tokenizer_model

QUESTION = "Where do rivers go?"
MAX_TOKENS = 8
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(root, repos: dict) -> None:
    """repo id -> adapter directory, as snapshot_download leaves them."""
    for repo, src in repos.items():
        folder = root / f"models--{repo.replace('/', '--')}"
        shutil.copytree(src, folder / "snapshots" / COMMIT)
        (folder / "refs").mkdir()
        (folder / "refs" / "main").write_text(COMMIT)


@pytest.fixture(scope="module")
def lib(tmp_path_factory, adapters):
    """lib/org/name (nested id), lib/flat.gguf-less dir, lib/broken (junk),
    lib/evil -> outside (escapes); a hub cache with mola-test/lora,
    mola-test/other and elsewhere/lora."""
    root = tmp_path_factory.mktemp("resolve")
    lib = root / "lib"
    shutil.copytree(adapters["a"], lib / "org" / "name")
    shutil.copytree(adapters["b"], lib / "flat")
    (lib / "broken").mkdir()
    (lib / "broken" / "adapter_config.json").write_text("{not json")
    shutil.copytree(adapters["c"], root / "outside")
    os.symlink(root / "outside", lib / "evil")
    hub = root / "hub"
    hub_cache(hub, {"mola-test/lora": adapters["b"], "mola-test/other": adapters["c"],
                    "elsewhere/lora": adapters["a"]})
    return {"lib": lib, "hub": hub}


@pytest.fixture(scope="module")
def live(tiny_model, lib):
    import huggingface_hub.constants as hc

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setattr(hc, "HF_HUB_CACHE", str(lib["hub"]))
        mp.setattr(hc, "HF_HUB_OFFLINE", True)
        handle = InProcessServer(tokenizer_model(tiny_model), served_model_name="tiny", max_loras=2,
                                 max_lora_rank=16, adapter_resolvers=(f"dir:{lib['lib']}", "hf:mola-test/*"))
        yield handle
        handle.stop()


@pytest.fixture(scope="module")
def client(live):
    """A client of ``live`` (conftest's ``server``, without resolvers, is this module's other server)."""
    with live.client(timeout=60) as c:
        yield c


def post(client, model):
    return client.post("/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": MAX_TOKENS,
        "temperature": 0, "ignore_eos": True})


def served_files(live) -> str:
    """The adapter files in the slot of the last request's answer."""
    (part, _), = live.engine.slots[live.engine.submitted[-1].slot].parts
    return part


def model_ids(client) -> set[str]:
    return {m["id"] for m in client.get("/v1/models").json()["data"]}


def test_dir_resolver_finds_nested_and_flat_ids(live, client, lib):
    assert "org/name" not in model_ids(client)  # not scanned, not listed before it is asked for
    for model, folder in (("org/name", lib["lib"] / "org" / "name"), ("flat", lib["lib"] / "flat")):
        r = post(client, model)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model
        assert served_files(live) == str(folder.resolve())
    assert {"org/name", "flat"} <= model_ids(client)
    record = client.get("/v1/adapters/org/name").json()
    assert record["source"] == "resolver:dir" and record["path"] == str((lib["lib"] / "org" / "name").resolve())


def test_hf_resolver_uses_the_hub_cache_offline(live, client, lib):
    r = post(client, "mola-test/lora")
    assert r.status_code == 200, r.text
    assert served_files(live) == str(lib["hub"] / "models--mola-test--lora" / "snapshots" / COMMIT)
    assert client.get("/v1/adapters/mola-test/lora").json()["source"] == "resolver:hf"


def test_misses_and_refusals(client):
    for model in ("nothing-here", "mola-test/absent", "elsewhere/lora",  # another org: not asked
                  "../lib/flat", "org//name"):  # not valid ids: never looked up
        r = post(client, model)
        assert r.status_code == 404, (model, r.text)
        assert r.json()["error"]["code"] == "model_not_found"
    r = post(client, "evil")  # a symlink out of the resolver's directory
    assert r.status_code == 403 and r.json()["error"]["code"] == "adapter_path_not_allowed"
    r = post(client, "broken")  # found, then checked like any adapter
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_adapter"


def test_a_repo_list_resolves_only_its_repos(tiny_model, lib):
    import huggingface_hub.constants as hc

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hc, "HF_HUB_CACHE", str(lib["hub"]))
        mp.setattr(hc, "HF_HUB_OFFLINE", True)
        handle = InProcessServer(tokenizer_model(tiny_model), served_model_name="tiny", max_loras=1,
                                 max_lora_rank=16, adapter_resolvers=("hf:mola-test/other,elsewhere/lora",))
        try:
            with handle.client(timeout=60) as c:
                assert post(c, "mola-test/other").status_code == 200
                assert post(c, "elsewhere/lora").status_code == 200
                assert post(c, "mola-test/lora").status_code == 404
        finally:
            handle.stop()


def test_resolvers_are_off_by_default(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        assert post(c, "mola-test/lora").status_code == 404
    assert server.config.adapter_resolvers == ()


def test_parsing(tmp_path):
    assert parse_resolver(f"dir:{tmp_path}") == ResolverSpec("dir", root=str(tmp_path))
    assert parse_resolver("hf:my-org/*") == ResolverSpec("hf", org="my-org")
    assert parse_resolver("hf:a/b, c/d") == ResolverSpec("hf", repos=("a/b", "c/d"))
    for bad, problem in (("dir:" + str(tmp_path / "none"), "is not a directory"), ("hf:*", "not a hub"),
                         ("hf:*/*", "not a hub organization"), ("hf:a/b,c", "'c' is not a hub repo id"),
                         ("s3:bucket", "unknown adapter resolver"), ("dir:", "unknown adapter resolver")):
        with pytest.raises(ValueError, match=problem):
            parse_resolver(bad)
    (tmp_path / "adapters").mkdir()
    args = build_parser().parse_args(["serve", "--adapter-resolver", f"dir:{tmp_path}/adapters",
                                      "--adapter-resolver", "hf:org/*"])
    assert [str(r) for r in config_from_args(args).adapter_resolvers] == [f"dir:{tmp_path}/adapters", "hf:org/*"]
    config = tmp_path / "mola.toml"
    config.write_text('adapter_resolvers = ["dir:adapters", "hf:org/x"]\n')
    specs = load_config_file(config)["adapter_resolvers"]
    assert specs == (ResolverSpec("dir", root=str(tmp_path / "adapters")), ResolverSpec("hf", repos=("org/x",)))
