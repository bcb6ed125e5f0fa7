"""The `tools` command group: offline looks at MCP tools. `tools check` replays a recorded
trace through the Rule-of-Two policy (mlxlocal.agents.policy) and judges the attempted call,
the same engine the tool loop enforces live. `tools rank` ranks a tools file's tools for
queries through the tool index (mlxlocal.agents.tool_index): which tools an agent step would
keep.

The package calls `register(app)`. Input problems exit 2 with one line naming the file and
the field; the verdict itself is never an error (exit 0 for allow, ask and block alike).
Models that cannot be loaded exit 1.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

from mlxlocal.cli.common import fail

tools_app = typer.Typer(name="tools", help="Offline looks at MCP tools: the Rule-of-Two policy on a trace, tool retrieval.",
                        no_args_is_help=True)


@tools_app.command("check")
def check(
    mcp: list[Path] = typer.Option(..., "--mcp", help="MCP config (mcpServers with trust / sensitive / policy); repeatable"),
    tools: Path = typer.Option(..., "--tools", help="TOOLS.json: a list of tools with server, name, description, inputSchema, annotations"),
    trace: Path = typer.Option(..., "--trace", help='TRACE.json: {"steps": [{"tool", "arguments", "result"}], "attempted_call": {"tool", "arguments"}}'),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object: decision, flags, reasons"),
) -> None:
    """Replay TRACE's steps through the Rule-of-Two policy; print the verdict on its attempted call."""
    # Imported here so `mlxlocal --help` does not pay for the agents package.
    from mlxlocal.agents.trace import PolicyInputError, load_check_inputs, replay

    try:
        policy, parsed = load_check_inputs(mcp, tools, trace)
    except PolicyInputError as e:
        fail(escape(str(e)), 2)
    decision = replay(policy, parsed)
    if as_json:
        print(json.dumps(decision.as_dict()))
        return
    console = Console(highlight=False, soft_wrap=True)  # per call: CliRunner captures stdout
    style = {"allow": "green", "ask": "yellow", "block": "bold red"}[decision.decision]
    call = parsed.attempted
    arguments = json.dumps(call.arguments)
    if len(arguments) > 200:  # the verdict is the point; the trace file has the whole call
        arguments = arguments[:200] + "…"
    console.print(f"[{style}]{decision.decision}[/] {escape(call.tool)} {escape(arguments)}")
    flags = decision.flags
    console.print(escape("flags: " + "  ".join(
        f"[{k}] {name} {'yes' if flags[name] else 'no'}"
        for k, name in (("A", "untrusted_input"), ("B", "sensitive"), ("C", "state_change")))))
    for reason in decision.reasons:
        console.print(f"  {escape(reason)}")


def _queries_file(path: Path) -> list[str]:
    """Q.json: a list of strings; objects with a "query" string are read too (the evaluation
    set's shape, which adds the relevant tool ids)."""
    from mlxlocal.agents.trace import PolicyInputError, _load_json

    data = _load_json(path, "queries file")
    if not isinstance(data, list) or not data:
        raise PolicyInputError(f"queries file {path}: (top level): expected a non-empty list of strings")
    out = []
    for i, item in enumerate(data):
        text = item.get("query") if isinstance(item, dict) else item
        if not isinstance(text, str) or not text.strip():
            raise PolicyInputError(f"queries file {path}: [{i}]{'.query' if isinstance(item, dict) else ''}: "
                                   "expected a non-empty string")
        out.append(text)
    return out


@tools_app.command("rank")
def rank(
    tools: Path = typer.Option(..., "--tools", help="TOOLS.json: a list of tools with server, name, description, inputSchema, annotations"),
    query: Optional[str] = typer.Option(None, "--query", help="One request to rank the tools for"),
    queries: Optional[Path] = typer.Option(None, "--queries", help="Q.json: a list of requests"),
    k: int = typer.Option(5, "--k", help="How many tools to keep per query"),
    stage1_only: bool = typer.Option(False, "--stage1-only", help="Stop after recall (BM25 + dense fused): no re-ranking"),
    embed_model: Optional[str] = typer.Option(None, "--embed-model", help="Embedding model for the dense stage (default: none, BM25 only)"),
    model: Optional[str] = typer.Option(None, "--model", help="Chat model that re-ranks the top candidates (stage 2)"),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object: per query the ranked ids with scores and stages"),
) -> None:
    """Rank the tools of TOOLS.json for each query: the ids `server.name` an agent step would keep."""
    from mlxlocal.agents.trace import PolicyInputError, load_tools_file

    if (query is None) == (queries is None):
        fail("give exactly one of --query and --queries", 2)
    if k < 1:
        fail("--k must be at least 1", 2)
    try:
        catalog = load_tools_file(tools)
        if query is not None:
            texts = [query]
        else:
            assert queries is not None  # exactly one of --query and --queries (checked above)
            texts = _queries_file(queries)
    except PolicyInputError as e:
        fail(escape(str(e)), 2)
    if query is not None and not query.strip():
        fail("--query must not be empty", 2)
    index = _index(catalog, embed_model, model, stage1_only)
    results = []
    for text in texts:
        r = index.rank_detail(text, k, stage1_only)
        entry = {"query": text, "results": [{"id": i, "score": round(s, 6)} for i, s in r.results],
                 "stages": r.stages}
        if r.note:
            entry["note"] = r.note
        results.append(entry)
    if as_json:
        print(json.dumps({"tools": len(catalog), "k": k, "queries": results}))
        return
    console = Console(highlight=False, soft_wrap=True)
    for entry in results:
        console.print(f"[bold]{escape(entry['query'])}[/]  [dim]({' + '.join(entry['stages'])})[/]")
        for n, r in enumerate(entry["results"], 1):
            console.print(f"  {n}. {escape(r['id'])}  [dim]{r['score']:.4f}[/]")
        if entry.get("note"):
            console.print(f"  [yellow]{escape(entry['note'])}[/]")


def _index(catalog, embed_model: Optional[str], model: Optional[str], stage1_only: bool):
    from mlxlocal.agents.tool_index import ToolIndex
    from mlxlocal.errors import MlxLocalError

    embedder = reranker = None
    try:
        if embed_model:
            from mlxlocal.embeddings import open_embedder

            embedder = open_embedder(embed_model)
        if model and not stage1_only:  # stage 1 alone never asks the model: do not load it
            from mlxlocal.agents.rerank import ChatReranker
            from mlxlocal.engine import open_engine
            from mlxlocal.source.loader import load

            reranker = ChatReranker(open_engine(load(model), max_num_seqs=1))
    except (MlxLocalError, OSError, ValueError) as e:
        fail(escape(f"cannot load {embed_model if embedder is None and embed_model else model}: {e}"), 1)
    return ToolIndex(catalog, embedder, reranker=reranker)


def register(app: typer.Typer) -> None:
    """Add the `tools` group to the main Typer app."""
    app.add_typer(tools_app, name="tools")
