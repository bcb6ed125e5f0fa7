"""Agents on the local model: MCP client sessions, the tool loop, the Rule-of-Two policy.

Below the front ends (cli, chat, server), above the engine: uses the engine contract only.
"""
