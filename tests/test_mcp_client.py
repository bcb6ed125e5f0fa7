"""The MCP client: config files -> ServerConfig, and McpHub against real MCP servers written
with the official SDK (tests/mcp_servers), over stdio and Streamable HTTP: listing, calling,
argument validation, timeouts, crashes, never-answering servers, big and binary results,
cancellation, tools/list_changed, and a close that never hangs."""

from __future__ import annotations

import _thread
import json
import os
import threading
import time
from pathlib import Path

import pytest
from mcp_util import http_server, stdio_server

from mlxlocal.agents.client import McpHub
from mlxlocal.agents.config import McpConfigError, load_configs
from mlxlocal.agents.types import ServerConfig

# ----------------------------------------------------------------------------- config


def write(tmp_path: Path, name: str, data) -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_config_shapes_and_our_keys(tmp_path):
    path = write(tmp_path, "mcp.json", {
        "globalShortcut": "Ctrl+Space",  # Claude Desktop app settings sit next to mcpServers
        "mcpServers": {
            "files": {"command": "npx", "args": ["-y", "server-fs"], "env": {"A": "1"}, "cwd": "sub",
                      "sensitive": True, "tools": {"deny": ["delete_file"]},
                      "policy": {"read_file": {"sensitive": True}}},
            "web": {"type": "http", "url": "https://example.com/mcp", "headers": {"Authorization": "Bearer x"},
                    "trust": "untrusted", "tools": {"allow": ["fetch_url"]}},
            "code": {"type": "stdio", "command": "code-mcp"},
            "remote": {"type": "streamable-http", "url": "http://127.0.0.1:9/mcp"},
        }})
    servers, problems = load_configs([path])
    assert problems == []
    by = {s.name: s for s in servers}
    assert list(by) == ["files", "web", "code", "remote"]
    files = by["files"]
    assert (files.command, files.args, files.env) == ("npx", ("-y", "server-fs"), {"A": "1"})
    assert files.cwd == str(tmp_path / "sub")  # relative to the config file
    assert files.sensitive and files.trust == "trusted" and files.allow is None and files.deny == ("delete_file",)
    assert files.tool_policy == {"read_file": {"sensitive": True}} and files.source == str(path)
    web = by["web"]
    assert (web.url, web.headers, web.trust, web.allow) == (
        "https://example.com/mcp", {"Authorization": "Bearer x"}, "untrusted", ("fetch_url",))
    assert web.command is None and not web.sensitive
    assert by["code"].command == "code-mcp" and by["remote"].url == "http://127.0.0.1:9/mcp"


def test_config_variable_expansion(tmp_path):
    path = write(tmp_path, "mcp.json", {"mcpServers": {
        "a": {"command": "${TOOL_BIN}/srv", "args": ["--root", "${ROOT:-/tmp/default}", "${EMPTY:-fallback}"],
              "env": {"TOKEN": "${SECRET}"}, "cwd": "${ROOT:-/tmp}"},
        "b": {"url": "http://${HOST}:8080/mcp", "headers": {"Authorization": "Bearer ${KEY:-none}"}},
        "c": {"command": "srv", "args": ["${NOT_SET_ANYWHERE}"]},
        "d": {"url": "http://x/mcp", "headers": {"X": "${MISSING_HEADER_VAR}"}},
    }})
    env = {"TOOL_BIN": "/opt/bin", "SECRET": "s3", "HOST": "127.0.0.1", "EMPTY": ""}
    servers, problems = load_configs([path], environ=env)
    a, b = servers
    assert a.command == "/opt/bin/srv" and a.args == ("--root", "/tmp/default", "fallback")
    assert a.env == {"TOKEN": "s3"} and a.cwd == "/tmp"
    assert b.url == "http://127.0.0.1:8080/mcp" and b.headers == {"Authorization": "Bearer none"}
    assert len(problems) == 2
    assert "server 'c'" in problems[0] and "NOT_SET_ANYWHERE" in problems[0] and "args[0]" in problems[0]
    assert "server 'd'" in problems[1] and "MISSING_HEADER_VAR" in problems[1] and str(path) in problems[1]
    # The process environment is the default source.
    os.environ["MLXLOCAL_TEST_MCP_VAR"] = "from-env"
    try:
        path2 = write(tmp_path, "env.json", {"mcpServers": {"e": {"command": "${MLXLOCAL_TEST_MCP_VAR}"}}})
        assert load_configs([path2])[0][0].command == "from-env"
    finally:
        del os.environ["MLXLOCAL_TEST_MCP_VAR"]


@pytest.mark.parametrize("entry, words", [
    ({"command": "x", "autoApprove": []}, ["unknown key", "autoApprove"]),
    ({"command": 3}, ["\"command\" must be a string"]),
    ({"command": "x", "args": "a b"}, ["\"args\" must be a list of strings"]),
    ({"command": "x", "env": {"A": 1}}, ["\"env\""]),
    ({"command": "x", "url": "http://h/mcp"}, ["not both"]),
    ({}, ["needs \"command\""]),
    ({"type": "sse", "url": "http://h/sse"}, ["sse", "not supported", "Streamable HTTP"]),
    ({"type": "websocket", "url": "ws://h"}, ["unknown \"type\""]),
    ({"type": "http", "command": "x"}, ["needs \"url\""]),
    ({"url": "ftp://h/x"}, ["http:// or https://"]),
    ({"command": "x", "headers": {}}, ["'headers'", "stdio"]),
    ({"command": "x", "trust": "maybe"}, ["\"trust\""]),
    ({"command": "x", "sensitive": "yes"}, ["\"sensitive\" must be true or false"]),
    ({"command": "x", "tools": {"allow": "read_file"}}, ["tools.allow"]),
    ({"command": "x", "tools": {"only": []}}, ["unknown key 'only'"]),
    ({"command": "x", "policy": {"send": {"outbound": True}}}, ["unknown flag 'outbound'", "policy.send"]),
    ({"command": "x", "policy": {"send": {"state_change": 1}}}, ["policy.send.state_change"]),
    ("npx server", ["must be an object"]),
])
def test_config_bad_entry_is_named_and_others_survive(tmp_path, entry, words):
    path = write(tmp_path, "mcp.json", {"mcpServers": {"bad": entry, "good": {"command": "ok"}}})
    servers, problems = load_configs([path])
    assert [s.name for s in servers] == ["good"]
    assert len(problems) == 1 and problems[0].startswith(f"{path}: server 'bad': ")
    for word in words:
        assert word in problems[0], problems[0]


def test_config_unusable_files_raise(tmp_path):
    cases = {
        "missing.json": None,
        "broken.json": '{"mcpServers": {',
        "list.json": "[1, 2]",
        "nokey.json": {"servers": {}},
        "wrongtype.json": {"mcpServers": ["a"]},
    }
    for name, content in cases.items():
        path = tmp_path / name if content is None else write(tmp_path, name, content)
        with pytest.raises(McpConfigError) as info:
            load_configs([path])
        assert str(path) in str(info.value), name
    with pytest.raises(McpConfigError, match="not valid JSON.*line 1"):
        load_configs([tmp_path / "broken.json"])


def test_config_duplicates_across_and_within_files(tmp_path):
    one = write(tmp_path, "one.json", {"mcpServers": {"files": {"command": "a"}, "web": {"url": "http://h/mcp"}}})
    two = write(tmp_path, "two.json", {"mcpServers": {"files": {"command": "b"}, "git": {"command": "g"}}})
    servers, problems = load_configs([one, two])
    assert [(s.name, s.source) for s in servers] == [("files", str(one)), ("web", str(one)), ("git", str(two))]
    assert servers[0].command == "a"
    assert load_configs([one, one]) == load_configs([one])  # one file given twice
    assert len(problems) == 1 and str(one) in problems[0] and str(two) in problems[0] and "'files'" in problems[0]
    same = write(tmp_path, "same.json", '{"mcpServers": {"x": {"command": "a"}, "x": {"command": "b"}}}')
    servers, problems = load_configs([same])
    assert [s.command for s in servers] == ["a"] and "defined twice" in problems[0]


def test_config_disabled_and_bad_names(tmp_path):
    path = write(tmp_path, "mcp.json", {"mcpServers": {
        "off": {"command": "x", "disabled": True}, "on": {"command": "y", "disabled": False},
        "has.dot": {"command": "z"}}})
    servers, problems = load_configs([path])
    assert [s.name for s in servers] == ["on"]
    assert len(problems) == 1 and "'has.dot'" in problems[0]


# ----------------------------------------------------------------------------- hub over stdio


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("files_root")
    (root / "notes.txt").write_text("buy milk")
    (root / "secrets.txt").write_text("API_KEY=12345")
    return root


@pytest.fixture(scope="module")
def hub(root):
    servers = [
        stdio_server("files", "files", env={"MCP_FILES_ROOT": str(root)}, deny=("delete_file",), sensitive=True),
        stdio_server("web", "web", allow=("fetch_url",), trust="untrusted"),
        stdio_server("blobs", "blobs"),
        stdio_server("hang", "hang"),
        stdio_server("dynamic", "dynamic"),
    ]
    with McpHub.start(servers, connect_timeout=30) as hub:
        yield hub


def test_listing_with_annotations_and_filters(hub):
    assert hub.failed == {}
    ids = [t.id for t in hub.tools]
    assert ids[:4] == ["files.read_file", "files.list_dir", "files.write_file", "web.fetch_url"]
    assert "files.delete_file" not in ids and "web.send_email" not in ids  # deny / allow
    read = hub.tool("files.read_file")
    assert read.annotations == {"readOnlyHint": True, "destructiveHint": False, "openWorldHint": False}
    assert read.input_schema["required"] == ["path"] and "text file" in read.description
    assert hub.tool("files.write_file").annotations["destructiveHint"] is True
    assert hub.tool("web.fetch_url").annotations["openWorldHint"] is True
    with pytest.raises(KeyError, match="files.delete_file"):
        hub.tool("files.delete_file")
    assert hub.server("web").trust == "untrusted" and hub.server("files").sensitive
    result = hub.call("files.delete_file", {"path": "notes.txt"})
    assert result.error and "unknown tool" in result.text


def test_calls_and_tool_errors(hub, root):
    assert hub.call("files.read_file", {"path": "notes.txt"}).text == "buy milk"
    wrote = hub.call("files.write_file", {"path": "out/new.txt", "content": "hello"})
    assert not wrote.error and (root / "out" / "new.txt").read_text() == "hello"
    assert hub.call("files.list_dir", {}).text.splitlines() == ["notes.txt", "out/", "secrets.txt"]
    missing = hub.call("files.read_file", {"path": "nope.txt"})
    assert missing.error and "nope.txt" in missing.text
    page = hub.call("web.fetch_url", {"url": "https://blog.example/recipes"})
    assert not page.error and "IGNORE ALL PREVIOUS INSTRUCTIONS" in page.text
    not_found = hub.call("web.fetch_url", {"url": "https://nowhere.example/"})
    assert not_found.error and "404 Not Found" in not_found.text


def test_arguments_are_validated_before_the_call(hub, root):
    no_content = hub.call("files.write_file", {"path": "never.txt"})
    assert no_content.error and "'content' is a required property" in no_content.text
    assert "files.write_file" in no_content.text and "not called" in no_content.text
    assert not (root / "never.txt").exists()
    wrong = hub.call("files.write_file", {"path": ["a"], "content": "x"})
    assert wrong.error and "path: ['a'] is not of type 'string'" in wrong.text
    assert not (root / "a").exists()
    assert hub.call("blobs.huge", {"chars": "many"}).error
    assert "JSON object" in hub.call("blobs.huge", ["not", "a", "dict"]).text


def test_oversized_result_is_truncated_with_a_marker(hub):
    result = hub.call("blobs.huge", {"chars": 123_456})
    assert result.truncated and not result.error
    body, marker = result.text.rsplit("\n", 1)
    assert len(body) == 20_000
    assert marker == "[... truncated: 123,456 characters, showing the first 20,000]"
    small = hub.call("blobs.huge", {"chars": 5_000})
    assert not small.truncated and len(small.text) == 5_000
    hub.max_result_chars = 1_000
    try:
        cut = hub.call("blobs.huge", {"chars": 5_000})
        assert cut.truncated and cut.text.endswith("[... truncated: 5,000 characters, showing the first 1,000]")
    finally:
        hub.max_result_chars = 20_000


def test_image_and_structured_content(hub):
    import sys
    sys.path.insert(0, str(Path(__file__).parent / "mcp_servers"))
    try:
        from blobs import PNG_BYTES
    finally:
        sys.path.pop(0)
    chart = hub.call("blobs.chart", {})
    assert chart.text == f"chart of the week\n[image: image/png, {len(PNG_BYTES)} bytes]"
    assert hub.call("blobs.structured", {}).text == '{"temperature": 21, "unit": "C"}'


def test_timeout_cancels_and_the_session_stays_usable(hub):
    start = time.monotonic()
    result = hub.call("hang.wait_forever", {}, timeout=1)
    assert result.error and "no answer within 1 s" in result.text
    assert time.monotonic() - start < 5
    assert hub.call("hang.ping", {}).text == "pong"
    assert "hang" not in hub.failed


def test_cancel_event_and_ctrl_c(hub):
    cancel = threading.Event()
    threading.Timer(0.3, cancel.set).start()
    start = time.monotonic()
    result = hub.call("hang.wait_forever", {}, timeout=30, cancel=cancel)
    assert result.error and "cancelled by the user" in result.text and time.monotonic() - start < 5
    # Ctrl-C in the calling (main) thread: the call is cancelled, not the program.
    assert threading.current_thread() is threading.main_thread()
    threading.Timer(0.3, _thread.interrupt_main).start()
    start = time.monotonic()
    stop = threading.Event()
    result = hub.call("hang.wait_forever", {}, timeout=30, cancel=stop)
    assert result.error and "cancelled by the user" in result.text and time.monotonic() - start < 5
    assert stop.is_set()  # the loop learns the user pressed Ctrl-C
    assert hub.call("hang.ping", {}).text == "pong"


def test_calls_from_many_threads(hub):
    results = [None] * 12

    def work(i):
        results[i] = hub.call("hang.ping", {}) if i % 2 else hub.call("files.read_file", {"path": "notes.txt"})

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(results))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert [r.text for r in results] == ["buy milk", "pong"] * 6


def test_tools_list_changed_refreshes_that_server(hub):
    version = hub.tools_version
    assert hub.call("dynamic.add_tool", {"name": "late"}).text == "added late"
    deadline = time.monotonic() + 10
    while "dynamic.late" not in [t.id for t in hub.tools] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert hub.tool("dynamic.late").description == "the late tool" and hub.tools_version > version
    assert hub.call("dynamic.late", {}).text == "I am late"


# ----------------------------------------------------------------------------- failures


def test_crash_mid_call_marks_only_that_server_dead():
    with McpHub.start([stdio_server("crash", "crash"), stdio_server("blobs", "blobs")]) as hub:
        assert hub.call("crash.echo", {"text": "hi"}).text == "hi"
        result = hub.call("crash.crash", {}, timeout=20)
        assert result.error and "'crash'" in result.text and "died" in result.text
        assert "crash" in hub.failed
        assert [t.id for t in hub.tools] == ["blobs.huge", "blobs.chart", "blobs.structured"]
        later = hub.call("crash.echo", {"text": "again"})
        assert later.error and "crash" in later.text
        assert hub.call("blobs.huge", {"chars": 3}).text == "012"


def test_start_failures_are_recorded_and_the_others_work(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("import sys\nprint('cannot start: missing API key', file=sys.stderr)\nsys.exit(2)\n")
    servers = [
        ServerConfig(name="nobin", source="t", command="/nonexistent/mcp-server"),
        stdio_server("broken", "hang"),  # args replaced below: a script that exits at once
        stdio_server("silent", "hang", "--no-init"),
        ServerConfig(name="nohttp", source="t", url="http://127.0.0.1:9/mcp"),
        stdio_server("blobs", "blobs"),
    ]
    servers[1] = ServerConfig(name="broken", source="t", command=servers[1].command, args=(str(broken),))
    start = time.monotonic()
    # 6 s: long enough for a healthy server to start on a busy 2-core machine.
    with McpHub.start(servers, connect_timeout=6) as hub:
        assert time.monotonic() - start < 25
        failed = hub.failed
        assert set(failed) == {"nobin", "broken", "silent", "nohttp"}
        assert "/nonexistent/mcp-server" in failed["nobin"]
        assert "missing API key" in failed["broken"]  # the server's own stderr explains
        assert "no answer within 6 s" in failed["silent"]
        assert "could not start" in failed["nohttp"]
        assert [t.server for t in hub.tools] == ["blobs"] * 3
        assert hub.call("blobs.huge", {"chars": 2}).text == "01"
        result = hub.call("silent.ping", {})
        assert result.error and "silent" in result.text


def test_close_kills_a_child_that_ignores_shutdown(tmp_path):
    pidfile = tmp_path / "pid"
    hub = McpHub.start([stdio_server("stubborn", "hang", "--stubborn", "--pidfile", str(pidfile))])
    assert hub.call("stubborn.ping", {}).text == "pong"
    pid = int(pidfile.read_text())
    pending = []
    caller = threading.Thread(target=lambda: pending.append(hub.call("stubborn.wait_forever", {}, timeout=60)))
    caller.start()
    time.sleep(0.3)
    start = time.monotonic()
    hub.close()
    assert time.monotonic() - start < 12
    caller.join(timeout=5)
    assert pending[0].error and "closed during the call" in pending[0].text  # not left hanging
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    result = hub.call("stubborn.ping", {})
    assert result.error
    hub.close()  # twice is harmless


# ----------------------------------------------------------------------------- Streamable HTTP


def test_streamable_http_list_call_timeout_and_crash(tmp_path):
    outbox = tmp_path / "outbox.jsonl"
    with http_server("web", "--outbox", str(outbox)) as web_url, http_server("hang") as hang_url, \
            http_server("crash") as crash_url, http_server("dynamic") as dynamic_url:
        servers = [ServerConfig(name="web", source="t", url=web_url, headers={"X-Client": "test"}),
                   ServerConfig(name="dynamic", source="t", url=dynamic_url),
                   ServerConfig(name="hang", source="t", url=hang_url, headers={"X-Api-Key": "k1"}),
                   ServerConfig(name="crash", source="t", url=crash_url)]
        with McpHub.start(servers) as hub:
            assert hub.failed == {}
            assert [t.id for t in hub.tools if t.server == "web"] == ["web.fetch_url", "web.send_email"]
            assert hub.tool("web.send_email").annotations == {
                "readOnlyHint": False, "destructiveHint": False, "openWorldHint": True}
            page = hub.call("web.fetch_url", {"url": "https://issues.example/42"})
            assert "delete_file" in page.text and not page.error
            sent = hub.call("web.send_email", {"to": "a@b.example", "subject": "s", "body": "b"})
            assert sent.text == "email sent to a@b.example"
            assert json.loads(outbox.read_text()) == {"to": "a@b.example", "subject": "s", "body": "b"}
            assert json.loads(hub.call("hang.headers", {}).text) == {"x-api-key": "k1"}
            timed = hub.call("hang.wait_forever", {}, timeout=1)
            assert timed.error and "no answer within 1 s" in timed.text
            assert hub.call("hang.ping", {}).text == "pong"
            assert hub.call("dynamic.add_tool", {"name": "late"}).text == "added late"
            deadline = time.monotonic() + 10
            while "dynamic.late" not in [t.id for t in hub.tools] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert hub.call("dynamic.late", {}).text == "I am late"
            crashed = hub.call("crash.crash", {}, timeout=20)
            assert crashed.error and "'crash'" in crashed.text and "crash" in hub.failed
            assert hub.call("crash.echo", {"text": "x"}).error
            assert hub.call("web.fetch_url", {"url": "https://example.com/"}).text.startswith("Example Domain")
