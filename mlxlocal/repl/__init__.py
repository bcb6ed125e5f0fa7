"""The terminal front ends: `mlxlocal chat` (chat.py), `chat --mcp` and `run --mcp` (agent.py),
one `Conversation` (conversation.py) behind each; `python -m mlxlocal.repl` runs the chat."""
