"""A tool choice that requires a call, the same way in every dialect.

Nothing in decoding forces a call: a system hint tells the model to make one (for a named
tool, only that tool is offered by the caller). If it answers in text anyway, the text is
returned as an ordinary reply.
"""

from __future__ import annotations


def require_call(messages: list[dict], name: str | None = None) -> None:
    """Add the hint to the conversation's system message (creating one at the start)."""
    hint = (f"You must answer by calling the function `{name}`." if name
            else "You must answer by calling one or more of the provided tools.")
    if messages and messages[0]["role"] == "system":
        messages[0]["content"] = f"{messages[0]['content']}\n\n{hint}".strip()
    else:
        messages.insert(0, {"role": "system", "content": hint})
