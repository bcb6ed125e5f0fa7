"""MLX work off the main thread: the per-thread worker stream and a one-shot thread.

A leaf: the engines, the embedder and the server's model loading all use it, and none of
them is the others' home.
"""

from __future__ import annotations

import threading

import mlx.core as mx

# A stream per worker thread (MLX streams belong to the thread that made them); a thread
# using it calls mx.clear_streams() before it ends, or the process aborts at exit.
WORKER_STREAM = mx.new_thread_local_stream(mx.default_device())


def in_own_thread(fn, *args):
    """fn(*args) on a thread of its own that clears its MLX streams before it ends.

    A pooled thread (asyncio.to_thread) that ran MLX work keeps that thread's resources
    until interpreter exit, where MLX may abort the process ("terminate called without an
    active exception"). What fn returns must be evaluated: a lazy array would still point
    at the streams cleared here.
    """
    box: dict = {}

    def run():
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # re-raised in the caller
            box["error"] = e
        finally:
            mx.clear_streams()

    thread = threading.Thread(target=run, name="mlxlocal-load")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]
