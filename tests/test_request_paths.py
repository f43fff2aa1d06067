"""Adapters named by path in a request's ``adapters`` (mola/registry/paths.py,
sources.resolve_request_path, registry._by_path): the path policy before any
file is opened, one cached record per resolved path and content version,
stacks with named adapters; outputs checked against plain mlx-lm on merged
weights."""

from __future__ import annotations

import itertools

import os
import shutil

import pytest

from mola.config import AdapterSpec
from mola.errors import AdapterPathNotAllowed, AdapterPathNotFound
from mola.registry.sources import AdapterSources, content_version

from helpers.references import merged_answer
from helpers.servers import start_server

QUESTION = "Where do rivers go?"
MAX_TOKENS = 10


UIDS = itertools.count(1)  # records' uids, as a registry's counter gives them


@pytest.fixture(scope="module")
def tree(tmp_path_factory, adapters):
    """allowed/b (a copy of adapter b), allowed/evil -> outside/c (escapes),
    outside/a; allowed/junk (no adapter in it)."""
    root = tmp_path_factory.mktemp("paths")
    allowed, outside = root / "allowed", root / "outside"
    shutil.copytree(adapters["b"], allowed / "b")
    shutil.copytree(adapters["c"], outside / "c")
    shutil.copytree(adapters["a"], outside / "a")
    (allowed / "junk").mkdir()
    (allowed / "junk" / "notes.txt").write_text("not an adapter")
    os.symlink(outside / "c", allowed / "evil")
    return {"allowed": allowed, "outside": outside}


@pytest.fixture(scope="module")
def server(tiny_model, adapters, tree):
    """Adapters may come from allowed/ only; 'a' is named at start."""
    handle = start_server(model=str(tiny_model), served_model_name="tiny", max_loras=2, max_lora_rank=16,
                          adapters=(AdapterSpec("a", str(adapters["a"])),), adapter_dirs=(str(tree["allowed"]),))
    yield handle
    handle.stop()


def post(client, model="tiny", **extra):
    return client.post("/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": MAX_TOKENS,
        "temperature": 0, "ignore_eos": True, **extra})


def answer(client, model="tiny", **extra) -> tuple[str, str]:
    r = post(client, model, **extra)
    assert r.status_code == 200, r.text
    return r.json()["model"], r.json()["choices"][0]["message"]["content"]


def expected(server, tiny_model, adapter_dirs=(), scales=None) -> str:
    return merged_answer(server.state.tokenizer, tiny_model, QUESTION, MAX_TOKENS, adapter_dirs, scales)


def path_records(client) -> list[dict]:
    return client.get("/v1/adapters").json()["path_adapters"]


def test_a_path_inside_the_adapter_directories_is_served(server, client, tiny_model, adapters, tree):
    path = str(tree["allowed"] / "b")
    model, text = answer(client, adapters=[{"path": path}])
    assert model == f"tiny+path:{path}"  # the response names it
    assert text == expected(server, tiny_model, [adapters["b"]])
    assert text != expected(server, tiny_model)
    (record,) = [r for r in path_records(client) if r["path"] == str((tree["allowed"] / "b").resolve())]
    assert record["id"] == f"path:{record['path']}" and record["version"] == 1 and record["source"] == "request"
    loads = record["loads"]
    assert answer(client, adapters=[{"path": path, "scale": 1.0}])[1] == text
    again = [r for r in path_records(client) if r["path"] == record["path"]]
    assert again[0]["version"] == 1 and again[0]["loads"] == loads  # cached: not read again
    ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert not any(i.startswith("path:") for i in ids)  # not a model id


def test_paths_outside_are_403_before_anything_is_opened(client, tree):
    outside = tree["outside"]
    for given in (outside / "a", outside / "does-not-exist", tree["allowed"] / ".." / "outside" / "a",
                  tree["allowed"] / "evil"):  # a symlink out of the adapter directory
        r = post(client, adapters=[{"path": str(given)}])
        assert r.status_code == 403, (given, r.text)
        error = r.json()["error"]
        assert error["code"] == "adapter_path_not_allowed" and error["type"] == "permission_error"
        assert str(outside.resolve()) not in error["message"].replace(str(given), "")  # no paths it was not given
    r = post(client, adapters=[{"path": str(tree["allowed"] / "missing")}])
    assert r.status_code == 404 and "does not exist" in r.json()["error"]["message"]
    r = post(client, adapters=[{"path": str(tree["allowed"] / "junk")}])
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_adapter"


def test_the_policy_comes_before_existence(tree):
    """No oracle: a path outside is refused the same whether it exists or not."""
    s = AdapterSources(adapter_dirs=[tree["allowed"]])
    with pytest.raises(AdapterPathNotAllowed):
        s.resolve_request_path(str(tree["outside"] / "a"))
    with pytest.raises(AdapterPathNotAllowed):
        s.resolve_request_path(str(tree["outside"] / "nothing"))
    with pytest.raises(AdapterPathNotFound):
        s.resolve_request_path(str(tree["allowed"] / "nothing"))
    with pytest.raises(AdapterPathNotAllowed):  # a hub-like id is never fetched
        s.resolve_request_path("org/name")


def test_an_edited_adapter_is_a_new_version(server, client, tiny_model, adapters, tree):
    path = tree["allowed"] / "edited"
    shutil.copytree(adapters["b"], path)
    before = content_version(path)
    assert answer(client, adapters=[{"path": str(path)}])[1] == expected(server, tiny_model, [adapters["b"]])
    for f in adapters["c"].iterdir():  # retrained in place: other weights, same files
        shutil.copyfile(f, path / f.name)
    assert content_version(path) != before
    model, text = answer(client, adapters=[{"path": str(path)}])
    assert text == expected(server, tiny_model, [adapters["c"]])
    (record,) = [r for r in path_records(client) if r["path"] == str(path.resolve())]
    assert record["version"] == 2 and record["rank"] == 16


def test_a_stack_of_a_named_adapter_and_a_path(server, client, tiny_model, adapters, tree):
    path = str(tree["allowed"] / "b")
    want = expected(server, tiny_model, [adapters["a"], adapters["b"]], [0.7, 0.5])
    model, text = answer(client, "a", lora_scale=0.7, adapters=[{"path": path, "scale": 0.5}])
    assert text == want and model == f"a+path:{path}"
    assert answer(client, adapters=[{"name": "a", "scale": 0.7}, {"path": path, "scale": 0.5}])[1] == want
    comps = client.get("/v1/adapters").json()["stacks"]
    assert any({p["name"] for p in c["parts"]} == {"a", f"path:{(tree['allowed'] / 'b').resolve()}"}
               for c in comps)
    r = post(client, adapters=[{"path": path}, {"path": str(tree["allowed"] / "." / "b")}])
    assert r.status_code == 400 and "more than once" in r.json()["error"]["message"]


def test_entries_name_or_path_one_of_the_two(client, tree):
    for entry in ({"name": "a", "path": str(tree["allowed"] / "b")}, {"scale": 0.5}, {"path": ""}):
        r = post(client, adapters=[entry])
        assert r.status_code == 400, entry
        assert "adapters" in r.json()["error"]["message"] or r.json()["error"]["param"]


def test_streamed_chunks_name_it(client, tree):
    path = str(tree["allowed"] / "b")
    with client.stream("POST", "/v1/chat/completions", json={
            "model": "tiny", "stream": True, "max_tokens": 3, "adapters": [{"path": path}],
            "messages": [{"role": "user", "content": QUESTION}]}) as r:
        body = r.read().decode()
    assert r.status_code == 200
    assert f'"model":"tiny+path:{path}"' in body.replace(" ", "")


def test_path_records_are_bounded():
    """Beyond max_records, known (not resident, not awaited) path records go,
    least recently used first, never the one just asked for."""
    from mola.registry.paths import PathAdapters
    from mola.registry.records import AdapterState

    paths = PathAdapters(UIDS, max_records=2)
    first, _ = paths.get_or_make("/a", (("x", 1, 1, 1),))
    second, _ = paths.get_or_make("/b", (("x", 1, 1, 2),))
    first.last_used, second.last_used = 2.0, 1.0
    assert paths.surplus(keep=second) == []
    third, _ = paths.get_or_make("/c", (("x", 1, 1, 3),))
    assert paths.surplus(keep=third) == [second]  # least recently used
    second.move_to(AdapterState.LOADING)
    assert paths.surplus(keep=third) == [first]  # a record being loaded stays
    again, stale = paths.get_or_make("/a", (("x", 2, 2, 1),))  # edited
    assert stale is first and again.version == 2 and not paths.is_current(first)
