"""Agents on the local model: MCP client sessions, the tool loop, the Rule-of-Two policy; and
`launch` (coding agents such as Claude Code run against our server).

Below the front ends (cli, repl, server), above the engine: uses the engine contract only.
The tool loop keeps its state in a `mlxlocal.repl.conversation.Conversation`, the one module
of the REPL package that is itself engine contract and compaction only.
"""
