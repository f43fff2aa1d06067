"""The playground (mola/server/ui/, routes/ui.py) in a real browser: the
system's Chromium driven by Playwright, against the echo demo served with an
API key and an admin key. Every answer the page shows is checked against the
same request over the HTTP API, and the echo demo's known transformations.

Skipped when no Chromium is installed, unless MOLA_REQUIRE_BROWSER=1 (CI
installs Debian's `chromium` and sets it). Screenshots of the compare and
adapter views go to $MOLA_PLAYGROUND_SCREENSHOTS (docs/cli.md's are made with
`MOLA_PLAYGROUND_SCREENSHOTS=docs`), else to a temporary directory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import httpx
import jsonschema
import pytest

from mola.config import AdapterSpec

from helpers.servers import start_server

pytestmark = pytest.mark.slow  # long end-to-end: CI's second tier (pytest -m slow)

API_KEY = "playground-api-key"
ADMIN_KEY = "playground-admin-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MESSAGE = "hello world, how are you?"
BASE = "mola-demo"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIMEOUT_MS = 20_000


def chromium() -> str | None:
    for name in (os.environ.get("MOLA_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        path = name and shutil.which(name)
        if path:
            return path
    return None


def unavailable(reason: str):
    if os.environ.get("MOLA_REQUIRE_BROWSER") == "1":
        pytest.fail(f"MOLA_REQUIRE_BROWSER=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def browser():
    path = chromium()
    if path is None:
        unavailable("no Chromium installed (apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        unavailable("playwright is not installed (pip install -e '.[dev]')")
    from playwright.sync_api import expect

    expect.set_options(timeout=TIMEOUT_MS)
    with sync_playwright() as p:
        # not under a preloaded BLAS (CI's slow tier preloads OpenBLAS; Chromium's sandbox dies of it)
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        browser = p.chromium.launch(executable_path=path, env=env)
        yield browser
        browser.close()


def echo_server(echo_demo, **settings):
    """The echo demo with upper and title resident, behind the playground's keys."""
    model_dir, adapters = echo_demo
    handle = start_server(
        model=str(model_dir), served_model_name=BASE,
        adapters=(AdapterSpec("upper", str(adapters["upper"])), AdapterSpec("title", str(adapters["title"]))),
        max_loras=4, max_lora_rank=16, api_key=API_KEY, admin_key=ADMIN_KEY, **settings,
    )
    handle.adapter_paths = adapters
    return handle


@pytest.fixture(scope="module")
def server(echo_demo):
    """The echo demo; count is left for the page to load by path."""
    handle = echo_server(echo_demo, allow_any_adapter_path=True)
    yield handle
    handle.stop()


@pytest.fixture
def open_page(browser, server):
    """A function opening the playground in a fresh browser context (viewport
    given), with the keys entered unless told not to; every request that
    leaves the server's origin is recorded and refused."""
    contexts = []

    def open_page(width=1280, height=900, keys=True, clock=False):
        # With the clock, wait_for_function evaluates its predicate with eval, which the page's
        # Content-Security-Policy forbids: that context bypasses it.
        context = browser.new_context(viewport={"width": width, "height": height}, bypass_csp=clock)
        contexts.append(context)
        page = context.new_page()
        if clock:  # the page's timers under the test's control (they run on until paused)
            page.clock.install()
        page.set_default_timeout(TIMEOUT_MS)
        page.elsewhere = []

        def guard(route):
            if route.request.url.startswith(server.url):
                return route.continue_()
            page.elsewhere.append(route.request.url)
            return route.abort()

        page.route("**/*", guard)
        page.goto(server.url + "/")
        if keys:
            enter_keys(page, API_KEY, ADMIN_KEY)
            expect(page.locator("#model-ids option")).to_have_count(3)
        return page

    yield open_page
    for context in contexts:
        context.close()


def expect(locator):
    from playwright.sync_api import expect

    return expect(locator)


def enter_keys(page, api_key, admin_key):
    page.get_by_label("API key").fill(api_key)
    page.get_by_label("Admin key").fill(admin_key)
    page.get_by_role("button", name="Use keys").click()


def ask(url: str, model: str, content: str, **extra) -> str:
    """The answer over the HTTP API, as a column with the defaults asks it."""
    body = {"model": model, "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": 128, **extra}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def columns(page, models: list[str], message: str = MESSAGE):
    """Set up one column per model id under ``message``; returns the columns' locator."""
    cols = page.locator(".column")
    while cols.count() < len(models):
        page.get_by_role("button", name="Add column").click()
    while cols.count() > len(models):
        cols.last.get_by_role("button", name=re.compile("^Remove column")).click()
    for i, model in enumerate(models):
        cols.nth(i).get_by_label("Model", exact=True).fill(model)
    page.get_by_label("User message").fill(message)
    return cols


def screenshot(page, tmp_path, name: str) -> Path:
    folder = Path(os.environ.get("MOLA_PLAYGROUND_SCREENSHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"playground-{name}.png"
    page.screenshot(path=str(path), full_page=True)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return path


def test_the_page_asks_for_the_key_and_keeps_it_in_memory_only(open_page, server):
    page = open_page(keys=False)
    expect(page.locator("#key-needed")).to_contain_text("needs an API key")
    expect(page.get_by_label("API key")).to_be_focused()
    enter_keys(page, API_KEY, ADMIN_KEY)
    expect(page.locator("#key-needed")).to_be_hidden()
    ids = page.locator("#model-ids option").evaluate_all("options => options.map(o => o.value)")
    served = httpx.get(server.url + "/v1/models", headers=AUTH).json()["data"]
    assert ids == [card["id"] for card in served] and ids[0] == BASE
    assert page.url == server.url + "/"
    assert page.evaluate("localStorage.length + sessionStorage.length") == 0
    assert page.context.cookies() == [] and page.evaluate("document.cookie") == ""
    assert page.get_by_label("API key").get_attribute("type") == "password"
    assert page.elsewhere == []  # nothing fetched from anywhere else: it works offline


def test_compare_streams_base_upper_and_title_in_one_mixed_batch(open_page, server, tmp_path):
    page = open_page()
    mixed = metric(server.url, "mola_mixed_decode_steps_total")
    cols = columns(page, [BASE, "upper", "title"])
    page.get_by_role("button", name="Send to all columns").click()
    expected = {model: ask(server.url, model, MESSAGE) for model in (BASE, "upper", "title")}
    assert expected[BASE] == MESSAGE and expected["upper"] == MESSAGE.upper()  # the echo and its capitals
    assert len(set(expected.values())) == 3
    for i, model in enumerate((BASE, "upper", "title")):
        expect(cols.nth(i).locator(".answer")).to_have_text(expected[model])
        expect(cols.nth(i)).to_have_attribute("aria-busy", "false")
        stats = cols.nth(i).locator(".stats").inner_text()
        assert re.search(r"TTFT \d+ ms · [\d.]+ tok/s · cached \d+", stats), stats
    assert metric(server.url, "mola_mixed_decode_steps_total") > mixed
    screenshot(page, tmp_path, "compare")


def test_the_upper_slider_at_zero_answers_as_the_base(open_page, server):
    page = open_page()
    cols = columns(page, [BASE, "upper"])
    expect(cols.nth(0).get_by_label("lora_scale", exact=True)).to_be_disabled()  # the base takes no lora_scale
    page.get_by_role("button", name="Send to all columns").click()
    expect(cols.nth(1).locator(".answer")).to_have_text(MESSAGE.upper())
    cols.nth(1).get_by_label("lora_scale", exact=True).fill("0")
    assert ask(server.url, "upper", MESSAGE, lora_scale=0) == MESSAGE
    expect(cols.nth(1).locator(".answer")).to_have_text(cols.nth(0).locator(".answer").inner_text())
    expect(cols.nth(1).locator(".answer")).to_have_text(MESSAGE)


def test_sweep_fills_a_column_per_scale(open_page, server):
    page = open_page()
    cols = columns(page, [BASE, "title"])
    cols.nth(1).get_by_role("button", name=re.compile("^Sweep")).click()
    expect(cols).to_have_count(4)
    for i, scale in enumerate((0, 0.5, 1, 1.5)):
        expect(cols.nth(i).get_by_label("Model", exact=True)).to_have_value("title")
        expect(cols.nth(i).get_by_label("lora_scale", exact=True)).to_have_value(f"{scale:g}")
        expect(cols.nth(i).locator(".answer")).to_have_text(ask(server.url, "title", MESSAGE, lora_scale=scale))


def test_same_seed_sends_one_seed_to_every_column(open_page, server):
    page = open_page()
    bodies = []
    page.on("request", lambda r: bodies.append(r.post_data_json) if r.url.endswith("/chat/completions") else None)
    cols = columns(page, ["upper", "upper"])
    for i in range(2):
        cols.nth(i).get_by_label("Temperature").fill("1")
    page.get_by_label("Same seed").check()
    page.get_by_label("Seed", exact=True).fill("7")
    page.get_by_role("button", name="Send to all columns").click()
    expected = ask(server.url, "upper", MESSAGE, temperature=1, seed=7)
    for i in range(2):
        expect(cols.nth(i).locator(".answer")).to_have_text(expected)
    assert [(b["seed"], b["temperature"]) for b in bodies] == [(7, 1), (7, 1)]


def test_a_stack_column_sends_adapters(open_page, server):
    page = open_page()
    cols = columns(page, [BASE, "title*0.5+upper*0.5"])
    page.get_by_role("button", name="Send to all columns").click()
    stacked = ask(server.url, BASE, MESSAGE, adapters=[{"name": "title", "scale": 0.5}, {"name": "upper", "scale": 0.5}])
    expect(cols.nth(1).locator(".answer")).to_have_text(stacked)
    page.get_by_role("button", name="Adapters").click()  # the stack is listed, as /v1/adapters lists it
    stack = httpx.get(server.url + "/v1/adapters", headers=AUTH).json()["stacks"][0]["name"]
    expect(page.locator(f'#adapter-rows tr[data-name="{stack}"] td').first).to_have_text(f"{stack} (stack)")


def test_a_json_schema_answer_parses(open_page, server):
    page = open_page()
    said = '{"city": "paris", "unit": "celsius"}'
    cols = columns(page, [BASE, "upper"], message=said)
    page.locator("#structured summary").click()
    page.get_by_label("JSON schema").fill(json.dumps(WEATHER))
    page.get_by_role("button", name="Send to all columns").click()
    fmt = {"type": "json_schema", "json_schema": {"name": "playground", "schema": WEATHER, "strict": True}}
    for i, model in enumerate((BASE, "upper")):
        expect(cols.nth(i).locator(".json")).to_have_text("· valid JSON")
        answer = json.loads(cols.nth(i).locator(".answer").inner_text())
        jsonschema.validate(answer, WEATHER)
        assert answer == json.loads(ask(server.url, model, said, response_format=fmt))
    assert answer == {"city": "PARIS", "unit": "celsius"}  # upper's capitals, the enum held


def test_the_live_panel_shows_tokens_per_second_while_a_comparison_runs(open_page, server):
    page = open_page(clock=True)
    long = "Sphinx of black quartz, judge my vow. Pack my box with five dozen liquor jugs."
    cols = columns(page, [BASE, "upper", "title"], message=long)
    expect(page.locator("[data-series=tps]")).to_have_attribute("data-value", re.compile(r"\d"))  # a first poll
    page.clock.pause_at(page.evaluate("Date.now()") + 1000)  # polls now wait for run_for
    page.get_by_role("button", name="Send to all columns").click()
    page.wait_for_function("""() => [...document.querySelectorAll('.column')].some(
        c => c.getAttribute('aria-busy') === 'true' && c.querySelector('.answer').textContent !== '')""", polling=20)
    page.clock.run_for(500)  # the next poll, while the columns stream
    page.wait_for_function("Number(document.querySelector('[data-series=tps]').dataset.value) > 0", polling=20)
    expect(page.locator("[data-series=tps] polyline")).to_have_attribute("points", re.compile(r"\d"))
    expect(cols.nth(1).locator(".answer")).to_have_text(ask(server.url, "upper", long))


def test_chat_keeps_the_conversation_when_the_model_changes(open_page, server):
    page = open_page()
    page.get_by_role("button", name="Chat").click()
    expect(page.locator("#chat-model")).to_have_value(BASE)
    box = page.locator("#chat-input")
    box.fill("first turn here")
    box.press("Enter")
    log = page.locator("#chat-log li")
    expect(log.nth(1).locator(".text")).to_have_text("first turn here")
    box.fill("/model upper")
    box.press("Enter")
    box.fill("second turn here")
    box.press("Enter")
    conversation = [{"role": "user", "content": "first turn here"}, {"role": "assistant", "content": "first turn here"},
                    {"role": "user", "content": "second turn here"}]
    r = httpx.post(server.url + "/v1/chat/completions", headers=AUTH, timeout=60, json={
        "model": "upper", "messages": conversation, "temperature": 0, "max_tokens": 256})
    expected = r.json()["choices"][0]["message"]["content"]
    # The echo base copies the conversation's first user message: an answer
    # that kept the conversation differs from one to the last message alone.
    assert expected == "FIRST TURN HERE" != ask(server.url, "upper", "second turn here")
    expect(log.nth(4).locator(".text")).to_have_text(expected)
    expect(log.nth(4).locator(".who")).to_have_text("upper")


def test_load_by_path_reload_and_unload(open_page, server, tmp_path):
    page = open_page()
    page.get_by_role("button", name="Adapters").click()
    expect(page.locator('#adapter-rows tr[data-name="upper"]')).to_contain_text("resident (slot")
    page.get_by_label("Name", exact=True).fill("count")
    page.get_by_label(re.compile("^Path")).fill(str(server.adapter_paths["count"]))
    page.get_by_role("button", name="Load", exact=True).click()
    row = page.locator('#adapter-rows tr[data-name="count"]')
    expect(row).to_contain_text("resident (slot")
    listed = httpx.get(server.url + "/v1/adapters/count", headers=AUTH).json()
    cells = row.locator("td").all_inner_texts()  # name, state, rank, targets, format, version, bytes
    assert listed["resident"] and cells[1] == f"resident (slot {listed['slot']})"
    assert cells[2] == str(listed["rank"]) and cells[4] == listed["format"] and cells[5] == str(listed["version"])
    expect(page.locator("#model-ids option[value=count]")).to_have_count(1)
    resident = httpx.get(server.url + "/v1/adapters", headers=AUTH).json()["resident"]
    expect(page.locator("[data-series=slots]")).to_have_attribute("data-value", str(resident))  # the live panel too
    screenshot(page, tmp_path, "adapters")
    page.get_by_role("button", name="Reload count").click()
    expect(page.locator("#adapters-status")).to_have_text("Reloaded count.")
    expect(row.locator("td").nth(5)).to_have_text(str(listed["version"] + 1))
    assert httpx.get(server.url + "/v1/adapters/count", headers=AUTH).json()["version"] == listed["version"] + 1
    page.get_by_role("button", name="Unload count").click()
    expect(row).to_have_count(0)
    assert "count" not in {a["name"] for a in httpx.get(server.url + "/v1/adapters", headers=AUTH).json()["data"]}


def test_wrong_keys_show_the_servers_message(open_page, server):
    page = open_page()
    enter_keys(page, API_KEY, "not-the-admin-key")
    page.get_by_role("button", name="Adapters").click()
    page.get_by_label("Name", exact=True).fill("count")
    page.get_by_label(re.compile("^Path")).fill(str(server.adapter_paths["count"]))
    page.get_by_role("button", name="Load", exact=True).click()
    r = httpx.post(server.url + "/v1/adapters", json={"name": "count", "path": "x"},
                   headers={"Authorization": "Bearer not-the-admin-key"})
    assert r.status_code == 401
    expect(page.locator("#adapters-error")).to_have_text(r.json()["error"]["message"])
    enter_keys(page, "not-the-api-key", ADMIN_KEY)
    expect(page.locator("#key-needed")).to_contain_text("is not valid")
    page.get_by_role("button", name="Compare").click()
    page.get_by_role("button", name="Send to all columns").click()
    expect(page.locator(".column .answer.error").first).to_contain_text("the one given is not valid")


# The first stops of Tab from the top of the page, by accessible name (its label).
TAB_ORDER = ["API key", "Admin key", "Use keys", "Compare", "Chat", "Adapters", "System message", "User message",
             "Same seed", "Seed", "Send to all columns", "Add column", "Structured output (JSON schema)",
             "Model", "Temperature", "Max tokens", "Sweep column 1's model over scales 0 to 1.5",
             "Remove column 1", "Model", "lora_scale"]
UNNAMED = re.compile(r"^\s*- (textbox|button|checkbox|slider|spinbutton|combobox)\s*(:.*)?$", re.M)


def test_keyboard_only_tab_order_and_labels(open_page, server):
    page = open_page()
    page.get_by_role("heading", name="mola playground").click()  # Tab goes on from the top
    for name in TAB_ORDER:
        page.keyboard.press("Tab")
        expect(page.locator(":focus")).to_have_accessible_name(name)
    for view in ("Compare", "Chat", "Adapters"):  # every control of every view has a name
        page.get_by_role("button", name=view).click()
        snapshot = page.locator("body").aria_snapshot()
        assert not UNNAMED.findall(snapshot), snapshot


def test_keyboard_only_keys_and_a_comparison(open_page, server):
    page = open_page(keys=False)
    expect(page.get_by_label("API key")).to_be_focused()  # the page asks for it
    page.keyboard.type(API_KEY)
    page.keyboard.press("Tab")
    page.keyboard.type(ADMIN_KEY)
    page.keyboard.press("Enter")
    expect(page.locator("#model-ids option")).to_have_count(3)
    for _ in ("Use keys", "Compare", "Chat", "Adapters", "System message", "User message"):
        page.keyboard.press("Tab")
    page.keyboard.press("ControlOrMeta+A")
    page.keyboard.type("typed by keyboard")
    for _ in ("Same seed", "Seed", "Send to all columns"):
        page.keyboard.press("Tab")
    expect(page.locator(":focus")).to_have_accessible_name("Send to all columns")
    page.keyboard.press("Enter")
    expect(page.locator(".column").nth(1).locator(".answer")).to_have_text("TYPED BY KEYBOARD")


def test_a_phone_sized_viewport(open_page, server):
    page = open_page(width=390, height=844)
    cols = columns(page, [BASE, "upper"])
    page.get_by_role("button", name="Send to all columns").click()
    expect(cols.nth(1).locator(".answer")).to_have_text(MESSAGE.upper())
    first, second = cols.nth(0).bounding_box(), cols.nth(1).bounding_box()
    assert second["y"] >= first["y"] + first["height"]  # one column under the other
    for view in ("Compare", "Chat", "Adapters"):
        page.get_by_role("button", name=view).click()
        assert page.evaluate("document.documentElement.scrollWidth") <= 390, view  # nothing runs off the side


def test_the_page_is_open_and_no_ui_leaves_it_out(server, echo_demo):
    """The page and its files need no key (what they call does); --no-ui makes / a 404."""
    from mola.cli import build_parser

    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    for asset in re.findall(r'(?:src|href)="(/ui/[^"]+)"', page.text):
        assert httpx.get(server.url + asset).status_code == 200, asset
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert build_parser().parse_args(["serve", "--no-ui"]).ui is False
    from helpers.scripted import InProcessServer, tokenizer_model

    handle = InProcessServer(tokenizer_model(echo_demo[0]), served_model_name=BASE, ui=False)  # no port
    try:
        with handle.client() as c:
            assert c.get("/").status_code == 404
            assert c.get("/ui/app.js").status_code == 404
            assert c.get("/health").status_code == 200
    finally:
        handle.stop()


def test_two_bases_side_by_side(browser, echo_demo, tiny_model, tmp_path):
    """A server of two bases: the echo demo's (the default) and a tiny
    random one with an adapter loaded onto it over REST. A column on the
    second base takes no lora_scale, its adapter's does, and every column
    answers as the HTTP API does (the second base loaded by its first request)."""
    from helpers.servers import start_mola_serve, stop_mola_serve
    from mola.testing.adapter import make_random_adapter

    model_dir, adapters = echo_demo
    o1 = make_random_adapter(tmp_path / "o1", tiny_model, seed=7)
    proc, url = start_mola_serve(["--model", str(model_dir), "--served-model-name", BASE,
                                  "--adapter", f"upper={adapters['upper']}", "--model", f"other={tiny_model}",
                                  "--allow-any-adapter-path", "--max-lora-rank", "16"])
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    try:
        r = httpx.post(url + "/v1/adapters", json={"name": "o1", "path": str(o1), "base": "other"}, timeout=60)
        assert r.status_code == 200, r.text
        page = context.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        page.goto(url + "/")
        expect(page.locator("#model-ids option")).to_have_count(4)
        cols = columns(page, ["other", "o1", "upper"])
        expect(cols.nth(0).get_by_label("lora_scale", exact=True)).to_be_disabled()  # a base, not the default
        expect(cols.nth(1).get_by_label("lora_scale", exact=True)).to_be_enabled()
        page.get_by_role("button", name="Send to all columns").click()
        for i, model in enumerate(("other", "o1", "upper")):
            expect(cols.nth(i)).to_have_attribute("aria-busy", "false")
            expect(cols.nth(i).locator(".answer")).to_have_text(ask(url, model, MESSAGE))
        assert ask(url, "upper", MESSAGE) == MESSAGE.upper()
    finally:
        context.close()
        stop_mola_serve(proc)
