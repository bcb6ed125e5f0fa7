"""MCP test server with many tools (30, of an assistant's everyday kinds), for tool pruning.

    python tests/mcp_servers/toolbox.py [--http PORT]

Every tool takes the string arguments its schema lists and answers
"<name>: <arguments as JSON>", so a test sees which tool ran with what. The descriptions are
realistic on purpose: the tool index ranks them against what a user asks.
"""

from __future__ import annotations

import json
from typing import Any

from _common import parse_args, run
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import CallToolResult, TextContent, Tool, ToolAnnotations

# name, description, {argument: description}
TOOLS: list[tuple[str, str, dict[str, str]]] = [
    ("get_weather", "Current weather and temperature forecast for a city", {"city": "city name"}),
    ("convert_currency", "Convert an amount of money between currencies at today's exchange rate",
     {"amount": "how much", "from_currency": "ISO code", "to_currency": "ISO code"}),
    ("translate_text", "Translate text into another language", {"text": "what to translate", "language": "target"}),
    ("send_email", "Send an email message to a recipient", {"to": "address", "subject": "subject", "body": "text"}),
    ("search_inbox", "Search the mailbox for emails matching words", {"query": "words to look for"}),
    ("create_event", "Add a meeting or appointment to the calendar", {"title": "what", "when": "date and time"}),
    ("list_events", "List the calendar's meetings and appointments on a day", {"day": "date"}),
    ("set_reminder", "Remind the user of something at a given time", {"text": "what", "when": "time"}),
    ("create_issue", "Open a new issue in a GitHub repository", {"repo": "owner/name", "title": "title"}),
    ("list_pull_requests", "List open pull requests of a GitHub repository", {"repo": "owner/name"}),
    ("run_sql", "Run a SQL query against the analytics database", {"sql": "the query"}),
    ("read_file", "Read a text file from the workspace", {"path": "file path"}),
    ("write_file", "Write text to a file in the workspace", {"path": "file path", "content": "text"}),
    ("search_web", "Search the web and return result titles and links", {"query": "search terms"}),
    ("fetch_page", "Download a web page and return its text", {"url": "address"}),
    ("stock_quote", "Latest share price of a stock ticker on the market", {"ticker": "symbol"}),
    ("play_music", "Play a song, album or playlist on the speakers", {"what": "song or artist"}),
    ("set_thermostat", "Set the home heating thermostat to a temperature", {"degrees": "target"}),
    ("toggle_lights", "Turn the lights in a room on or off", {"room": "room", "state": "on or off"}),
    ("order_food", "Order a meal for delivery from a restaurant", {"restaurant": "where", "dish": "what"}),
    ("book_flight", "Book a plane ticket between two airports", {"origin": "from", "destination": "to"}),
    ("find_hotel", "Find hotel rooms available in a city for given dates", {"city": "where", "dates": "when"}),
    ("route_directions", "Driving or walking directions between two places", {"start": "from", "end": "to"}),
    ("post_message", "Post a message in a Slack channel", {"channel": "channel", "text": "message"}),
    ("add_contact", "Save a person's phone number and address in the contacts", {"name": "who", "phone": "number"}),
    ("add_todo", "Add an item to the to-do list", {"item": "what to do"}),
    ("compute_math", "Evaluate an arithmetic expression", {"expression": "e.g. 2*(3+4)"}),
    ("define_word", "Dictionary definition of an English word", {"word": "the word"}),
    ("track_package", "Where a parcel shipment is, by its tracking number", {"tracking_number": "number"}),
    ("transcribe_audio", "Turn a recorded audio file into text", {"path": "audio file"}),
]
READ_ONLY = {"read_file", "search_inbox", "list_events", "list_pull_requests", "get_weather", "convert_currency",
             "translate_text", "search_web", "stock_quote", "define_word", "compute_math", "track_package",
             "route_directions", "find_hotel", "fetch_page"}


class Toolbox(MCPServer):
    """The SDK's server serving the table above (a registered Python function per tool would
    be thirty near-identical definitions)."""

    async def list_tools(self) -> list[Tool]:
        return [Tool(name=name, description=description,
                     inputSchema={"type": "object", "required": list(args),
                                  "properties": {a: {"type": "string", "description": d} for a, d in args.items()}},
                     annotations=ToolAnnotations(read_only_hint=name in READ_ONLY, destructive_hint=False,
                                                 open_world_hint=False))
                for name, description, args in TOOLS]

    async def call_tool(self, name: str, arguments: dict[str, Any], context: Any = None) -> CallToolResult:
        if name not in {t[0] for t in TOOLS}:
            raise ToolError(f"no tool {name!r}")
        text = f"{name}: {json.dumps(arguments, sort_keys=True)}"
        return CallToolResult(content=[TextContent(type="text", text=text)])


if __name__ == "__main__":
    run(Toolbox("toolbox", log_level="WARNING"), parse_args())
