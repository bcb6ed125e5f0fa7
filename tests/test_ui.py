"""The chat page at / (server/ui.py, server/static/): its files and headers (quick), and the page
itself in a real browser (slow): Playwright driving Debian's Chromium, no browser download.

The browser tests run the server in this process, so the tiny random model's output can be
scripted (server_util.scripted_output): Markdown, code and reasoning to render, a long reply
to stop."""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import time
from pathlib import Path

import httpx
import pytest
from server_util import running_server, scripted_output

from mlxlocal.server import ServerConfig
from mlxlocal.server.ui import CSP, FILES

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--headless=new", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]
# Where the desktop and phone screenshots go (docs/images has the committed ones); else a temp dir.
SHOTS = os.environ.get("MLXLOCAL_UI_SHOTS")


def serve(models: list[Path], **kw):
    names = ["tiny-qwen3", "tiny-llama"][: len(models)]
    return running_server(ServerConfig(models=[str(m) for m in models],
                                       served_model_names=names if len(models) > 1 else [], **kw))


# --- the files (no browser) -----------------------------------------------------------------
@pytest.fixture(scope="module")
def plain(tiny_model):
    with serve([tiny_model], api_key="k3y") as (url, app):
        yield url


def test_the_page_and_its_files_are_served_under_a_strict_policy(plain):
    page = httpx.get(plain + "/")  # no key: a browser's navigation cannot send one
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert page.headers["content-security-policy"] == CSP and "'unsafe-inline'" not in CSP
    assert page.headers["x-content-type-options"] == "nosniff"
    assert httpx.get(plain + "/ui").text == page.text
    # No inline script or style: every script has a src, nothing has a style attribute.
    assert not re.search(r"<script(?![^>]*\bsrc=)", page.text) and " style=" not in page.text
    total = 0
    for name in FILES:
        r = httpx.get(f"{plain}/ui/{name}")
        assert r.status_code == 200, name
        total += len(r.content)
    assert total <= 300_000, total  # the budget for the page's assets
    for bad in ("/ui/ui.py", "/ui/%2e%2e/ui.py", "/ui/..%2fui.py", "/ui/vendor/LICENSES.md"):
        assert httpx.get(plain + bad).status_code == 404, bad
    # The API still wants the key; the page's files do not.
    assert httpx.get(plain + "/v1/models").status_code == 401
    keyed = httpx.get(plain + "/v1/models", headers={"Authorization": "Bearer k3y"})
    assert keyed.status_code == 200
    # A page's files are not a way around the Origin and Host checks.
    assert httpx.get(plain + "/", headers={"Origin": "http://evil.example"}).status_code == 403
    assert httpx.get(plain + "/", headers={"Host": "evil.example"}).status_code == 421


def test_no_ui_leaves_the_page_out(tiny_model):
    with serve([tiny_model], ui=False) as (url, _):
        assert httpx.get(url + "/").status_code == 404
        assert httpx.get(url + "/ui/app.js").status_code == 404
        assert httpx.get(url + "/v1/models").status_code == 200


# --- the page in a browser ------------------------------------------------------------------
@pytest.fixture(scope="module")
def playwright():
    sync_api = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.skip("Chromium is not installed (Debian's chromium package): no browser to test in")
    with sync_api.sync_playwright() as p:
        yield p


@pytest.fixture(scope="module")
def browser(playwright):
    b = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
    yield b
    b.close()


@pytest.fixture(scope="module")
def two_models(tiny_models):
    with serve([tiny_models["qwen3"], tiny_models["llama"]]) as (url, app):
        yield url, app


@pytest.fixture
def page(browser, two_models):
    context = browser.new_context(viewport={"width": 1280, "height": 800}, accept_downloads=True)
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    pg.goto(two_models[0] + "/")
    models_listed(pg)
    yield pg
    context.close()
    assert not errors, errors  # no script error and no CSP violation on the way


def models_listed(pg) -> None:
    # Functions, not expressions: polling an expression evals it, which the page's CSP forbids.
    pg.wait_for_function("() => document.querySelector('#model').options.length > 0",
                         timeout=30_000)


def send(pg, text: str) -> None:
    pg.fill("#input", text)
    pg.press("#input", "Enter")


def reply_done(pg, n: int = 1):
    """The n-th assistant reply, once its stats line is there (the stream ended)."""
    sel = f".msg.assistant >> nth={n - 1}"
    pg.wait_for_selector(f"{sel} >> .stats:not(:empty)", timeout=60_000)
    return pg.locator(sel)


REPLY_IS = "text => document.querySelector('.msg.assistant .content')?.textContent.trim() === text"


def metric(url: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", httpx.get(url + "/metrics", timeout=30).text, re.M)
    return float(m[1]) if m else 0.0


def tokenizer(app, i: int = 0):
    entry = app.state.registry.models[i]
    if entry.engine is None:  # loaded on its first request
        httpx.post(f"http://127.0.0.1:{app.state.config.port}/v1/chat/completions", timeout=120,
                   json={"model": entry.name, "max_tokens": 1,
                         "messages": [{"role": "user", "content": "hi"}]})
    return entry.engine.tokenizer


ANSWER = ("<think>plan the answer</think>Here is **bold** text and code:\n\n"
          "```python\nprint('hi')\n```\n")


@pytest.mark.slow
def test_first_paint_and_a_streamed_reply_rendered(page, two_models, tmp_path):
    url, app = two_models
    paints = []
    for _ in range(3):
        page.reload()
        paints.append(page.evaluate("""() => new Promise(done => {
            const look = () => {
                const e = performance.getEntriesByName('first-contentful-paint')[0];
                e ? done(e.startTime) : setTimeout(look, 10);
            };
            look();
        })"""))
    models_listed(page)
    assert statistics.median(paints) <= 200, paints  # from localhost, the bound
    page.evaluate("""() => {
        window.lengths = [];
        new MutationObserver(() => {
            const c = document.querySelector('.msg.assistant .content');
            if (c) window.lengths.push(c.textContent.length);
        }).observe(document.getElementById('messages'), {subtree: true, childList: true});
    }""")
    with scripted_output(tokenizer(app), ANSWER + "More text follows here. " * 12):
        send(page, "Show me some code")
        reply = reply_done(page)
    grew = sorted(set(page.evaluate("window.lengths")))
    assert len(grew) >= 3, grew  # rendered as it streamed, not at the end
    assert reply.locator(".reasoning summary").inner_text() == "Reasoning"
    assert "plan the answer" in reply.locator(".reasoning").text_content()
    assert reply.locator(".content strong").inner_text() == "bold"
    code = reply.locator("pre code.hljs.language-python")
    assert code.count() == 1 and code.locator(".hljs-built_in").count() >= 1  # highlighted
    assert reply.locator("pre .copy-code").count() == 1
    stats = reply.locator(".stats").inner_text()
    assert re.search(r"TTFT \d+ ms · [\d.]+ tok/s · \d+ tokens · \d+ of \d+ prompt tokens cached"
                     r" · stop", stats), stats
    assert re.search(r"Session KV ≈ \d+ tokens", page.inner_text("#kv-line"))
    # The server's own MCP tools, listed from its /mcp endpoint.
    assert [t.inner_text() for t in page.locator("#mcp-tools code").all()] == \
        ["generate", "chat", "count_tokens"]
    shots = Path(SHOTS) if SHOTS else tmp_path
    shots.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(shots / "chat-desktop.png"))
    page.set_viewport_size({"width": 390, "height": 844})
    page.wait_for_timeout(400)  # the sidebar's slide out of view
    assert page.locator("#sidebar").bounding_box()["x"] < -200  # off screen
    page.screenshot(path=str(shots / "chat-phone.png"))


@pytest.mark.slow
def test_stop_cancels_the_reply_on_the_server(page, two_models):
    url, app = two_models
    cancelled = metric(url, "mlxlocal_requests_cancelled_total")
    page.click("#toggle-settings")
    page.fill("#max_tokens", "6000")
    page.dispatch_event("#max_tokens", "change")
    with scripted_output(tokenizer(app), "and on " * 3000):
        send(page, "Go on forever")
        page.wait_for_function(
            "() => document.querySelector('.msg.assistant .content')?.textContent.length > 40",
            timeout=60_000)
        assert metric(url, "mlxlocal_requests_running") == 1
        page.click("#stop")
        reply = reply_done(page)
        deadline = time.monotonic() + 10
        while metric(url, "mlxlocal_requests_running") and time.monotonic() < deadline:
            time.sleep(0.1)
    assert metric(url, "mlxlocal_requests_running") == 0
    assert metric(url, "mlxlocal_requests_cancelled_total") == cancelled + 1
    assert reply.locator(".stats").inner_text().endswith("stopped")
    assert page.is_visible("#send") and not page.is_visible("#stop")


@pytest.mark.slow
def test_switching_models_and_finding_the_conversation_after_a_reload(page, two_models):
    url, app = two_models
    assert page.eval_on_selector_all("#model option", "os => os.map(o => o.value)") == \
        ["tiny-qwen3", "tiny-llama"]
    page.select_option("#model", "tiny-llama")
    with scripted_output(tokenizer(app, 1), "from llama"):
        send(page, "Which model?")
        reply = reply_done(page)
    assert "tiny-llama" in reply.locator(".role").inner_text()
    assert reply.locator(".content").inner_text().strip() == "from llama"
    page.reload()
    models_listed(page)
    assert page.input_value("#model") == "tiny-llama"
    assert page.locator(".msg.user .content").inner_text() == "Which model?"
    assert page.locator("#conversations li.active").inner_text().startswith("Which model?")


@pytest.mark.slow
def test_edit_regenerate_export_and_import(page, two_models, tmp_path):
    url, app = two_models
    tok = tokenizer(app)
    page.click("#new-chat")
    page.click("#toggle-settings")
    for field, value in (("#system", "Answer briefly."), ("#temperature", "0"), ("#top_p", "0.5")):
        page.fill(field, value)
        page.dispatch_event(field, "change")
    with scripted_output(tok, "first"), page.expect_request("**/v1/chat/completions") as request:
        send(page, "Hello")
        reply_done(page)
    body = request.value.post_data_json  # the settings, as the request carries them
    assert body["messages"] == [{"role": "system", "content": "Answer briefly."},
                                {"role": "user", "content": "Hello"}]
    assert (body["temperature"], body["top_p"], body["stream"]) == (0, 0.5, True)
    assert request.value.headers["x-session-id"]  # the conversation's session
    page.click(".msg.user .edit")
    page.fill(".edit-box", "Hello again")
    with scripted_output(tok, "second"):
        page.click(".save-edit")
        page.wait_for_function(REPLY_IS, arg="second", timeout=60_000)
        reply_done(page)
    assert page.locator(".msg").count() == 2
    assert page.locator(".msg.user .content").inner_text() == "Hello again"
    with scripted_output(tok, "third"):
        page.click(".msg.assistant .regenerate")
        page.wait_for_function(REPLY_IS, arg="third", timeout=60_000)
    with page.expect_download() as download:
        page.click("#export")
    saved = json.loads(Path(download.value.path()).read_text())
    convs = saved["conversations"]
    mine = next(c for c in convs if c["messages"] and c["messages"][0]["content"] == "Hello again")
    assert [m["content"] for m in mine["messages"]] == ["Hello again", "third"]
    # A new browser profile (nothing in localStorage) imports the file and has it back.
    page.evaluate("localStorage.clear()")
    page.reload()
    models_listed(page)
    assert page.locator(".msg").count() == 0
    path = tmp_path / "chats.json"
    path.write_text(json.dumps(saved))
    page.set_input_files("#import-file", str(path))
    page.wait_for_selector("#status:has-text('Imported')")
    assert page.locator("#conversations li").count() == len(convs) + 1  # and the empty new one
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    page.set_input_files("#import-file", str(bad))
    page.wait_for_selector("#status.error:has-text('bad.json: not JSON')")


@pytest.mark.slow
def test_a_full_browser_storage_is_said_and_the_chat_goes_on(page, two_models):
    page.evaluate("""() => { Storage.prototype.setItem = () => {
        throw new DOMException('over the quota', 'QuotaExceededError'); }; }""")
    with scripted_output(tokenizer(two_models[1]), "still here"):
        send(page, "hi")
        reply = reply_done(page)
    assert reply.locator(".content").inner_text().strip() == "still here"
    assert "storage is full (QuotaExceededError)" in page.inner_text("#status.error")


TOOLS_CHAT = {"conversations": [{
    "id": "with-tools", "title": "Tools", "model": "tiny-qwen3", "system": "", "drops": [],
    "params": {"temperature": 0, "max_tokens": 4},
    "messages": [
        {"role": "user", "content": "List the files"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "ls", "arguments": "{\"path\": \".\"}"}}]},
        {"role": "tool", "tool_call_id": "c1",
         "content": "a.txt\nb.txt\n" + "big listing line\n" * 20},
        {"role": "assistant", "content": "Two files."}]}]}


@pytest.mark.slow
def test_tool_cards_and_compact_drop_old_tool_outputs(page, two_models, tmp_path):
    path = tmp_path / "tools.json"
    path.write_text(json.dumps(TOOLS_CHAT))
    page.set_input_files("#import-file", str(path))
    page.wait_for_selector(".tool-card.call")
    assert page.locator(".tool-card.call .tool-name").inner_text() == "Tool call: ls"
    assert "a.txt" in page.locator(".msg.tool .tool-card").inner_text()
    send(page, "Thanks")
    first = reply_done(page, 3)
    assert first.locator(".stats").count() == 1
    page.click("#compact")
    assert "1 tool output" in page.inner_text("#status")
    assert "1 tool outputs leave with the next message" in page.inner_text("#kv-line")
    send(page, "And now?")
    reply_done(page, 4)
    # The tool output left the session's cache: the server says how many tokens it dropped.
    kv = page.inner_text("#kv-line")
    dropped = re.search(r"· (\d+) tokens dropped", kv)
    assert dropped and int(dropped[1]) > 40, kv


@pytest.mark.slow
def test_a_foreign_origin_is_refused(playwright, two_models):
    """A page on another site calls the API: the server refuses it (403). Chromium's own
    local-network checks would block the call before it left the browser, so they are off
    here: what is tested is the server's refusal, which older and other browsers rely on."""
    url, _ = two_models
    refused = refusals(url)
    off = ("LocalNetworkAccessChecks,PrivateNetworkAccessRestrictions,"
           "PrivateNetworkAccessSendPreflights")
    browser = playwright.chromium.launch(executable_path=CHROMIUM,
                                         args=[*ARGS, f"--disable-features={off}"])
    outcome = _call_from_elsewhere(browser, url)
    browser.close()
    assert outcome.startswith("blocked")
    # The browser's preflight reached the server and was refused there.
    assert refusals(url) == refused + 1


def refusals(url: str) -> float:
    """403s the server answered (a refusal before routing is counted under "other")."""
    text = httpx.get(url + "/metrics", timeout=30).text
    found = re.findall(r'^mlxlocal_requests_total\{[^}]*status="403"\} (\S+)$', text, re.M)
    return sum(float(v) for v in found)


def _call_from_elsewhere(browser, url: str) -> str:
    context = browser.new_context()
    pg = context.new_page()
    # A page on another site (served by the browser's router: no network) calls our API.
    pg.route("http://evil.example/**", lambda route: route.fulfill(
        status=200, content_type="text/html", body="<html><body>evil</body></html>"))
    pg.goto("http://evil.example/")
    outcome = pg.evaluate("""url => fetch(url + '/v1/chat/completions', {method: 'POST',
        headers: {'Content-Type': 'application/json'},
        body: JSON.stringify({model: 'tiny-qwen3', messages: [{role: 'user', content: 'hi'}]})})
        .then(r => 'answered ' + r.status, e => 'blocked: ' + e.name)""", url)
    context.close()
    return outcome


@pytest.mark.slow
def test_the_page_with_an_api_key(browser, tiny_model):
    with serve([tiny_model], api_key="s3cret") as (url, app):
        context = browser.new_context()
        pg = context.new_page()
        pg.goto(url + "/")
        pg.wait_for_selector("#key-dialog[open]")
        pg.fill("#key-input", "wrong")
        pg.click("#key-save")
        pg.wait_for_selector("#key-dialog[open]")  # refused again: asked again
        pg.fill("#key-input", "s3cret")
        pg.click("#key-save")
        models_listed(pg)
        with scripted_output(tokenizer(app), "keyed"):
            send(pg, "hi")
            reply = reply_done(pg)
        assert reply.locator(".content").inner_text().strip() == "keyed"
        assert pg.evaluate("sessionStorage.getItem('mlxlocal.key')") == "s3cret"
        # Never kept past the tab.
        assert pg.evaluate("localStorage.getItem('mlxlocal.key')") is None
        context.close()
