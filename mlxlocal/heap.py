"""Hand freed heap memory back to the operating system after a big job.

glibc keeps what a thread frees in that thread's malloc arena for reuse, so a worker that
tokenized a few megabytes of text holds hundreds of MB of RSS it no longer uses, for ever.
malloc_trim(0) returns the free pages; elsewhere (macOS, musl) it is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or None).malloc_trim
    except (OSError, AttributeError):
        return None


def trim() -> bool:
    """Return free heap pages to the OS; whether this platform can."""
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)
    return True
