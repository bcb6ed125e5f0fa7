"""Sizes for people: one formatting of byte counts for the loader, the chat and the server."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units, one decimal; whole bytes below 1 KiB)."""
    size = float(n)
    for unit in ("B", "KiB", "MiB"):
        if abs(size) < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"
