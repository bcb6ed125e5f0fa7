"""Agents on the local model: MCP client sessions, the tool loop, the Rule-of-Two policy; and
`launch` (coding agents such as Claude Code run against our server).

Below the front ends (cli, repl, server), above the engine: uses the engine contract only.
A `Conversation` (conversation.py: messages, the ids the model saw and wrote, its session)
holds the tool loop's state and the REPLs' (repl/).
"""
