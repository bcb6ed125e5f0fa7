"""Turn a replay file of recorded Anthropic /v1/messages requests into OpenAI
/v1/chat/completions requests, to replay the same conversation against a server without
the Messages API (mlx_lm.server) with `mlxlocal bench replay OUT.jsonl --url URL`.

    python scripts/anthropic_to_chat.py session.jsonl session_chat.jsonl

The mapping is the one our Anthropic router uses: the top-level system prompt and any
system entries inside `messages` become one system message (in that order), text blocks
are joined, tool_use blocks become assistant tool_calls and tool_result blocks tool
messages; thinking blocks are dropped (a chat request has no place for them); tools keep
their name, description and input_schema (as `parameters`).
"""

from __future__ import annotations

import json
import sys


def _text(content) -> str:
    if isinstance(content, str):
        return content
    return "".join(b.get("text", "") for b in content or [] if b.get("type") == "text")


def convert(body: dict) -> dict:
    system = [_text(body.get("system"))] if body.get("system") else []
    messages: list[dict] = []
    for m in body.get("messages", []):
        content = m.get("content")
        if m["role"] == "system":
            system.append(_text(content))
            continue
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content or []
        if m["role"] == "assistant":
            out = {"role": "assistant", "content": _text(blocks)}
            calls = [{"id": b["id"], "type": "function",
                      "function": {"name": b["name"], "arguments": json.dumps(b.get("input", {}))}}
                     for b in blocks if b.get("type") == "tool_use"]
            if calls:
                out["tool_calls"] = calls
            messages.append(out)
            continue
        for b in blocks:
            if b.get("type") == "tool_result":
                messages.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": _text(b.get("content"))})
        text = _text(blocks)
        if text:
            messages.append({"role": "user", "content": text})
    out = {"model": body.get("model"), "messages": ([{"role": "system", "content": "\n\n".join(system)}]
                                                    if system else []) + messages,
           "max_tokens": body.get("max_tokens"), "stream": True}
    if body.get("tools"):
        out["tools"] = [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                          "parameters": t.get("input_schema", {})}}
                        for t in body["tools"] if "name" in t]
    return out


def main(src: str, dst: str) -> None:
    with open(src) as f, open(dst, "w") as g:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                body = rec.get("body", rec)
                g.write(json.dumps({"path": "/v1/chat/completions", "body": convert(body)}) + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
