"""Restart scenario (`bench restart`): a long prefix served cold, then from the
disk tier after a restart (a new process on the same store), then from RAM.

Per repeat, a fresh store and a new prompt of -p tokens (so nothing is cached before the cold
run), one token generated each time:
- cold: an engine with --kv-disk, warmed up on another prompt of the same length, prefills the
  prompt (and writes its blocks through);
- disk: a new process opens an engine on the store (as `serve` does at startup) and times its
  first request, which reads the blocks back; a restarted process has no memory to reuse, so
  whatever a restore allocates it faults in, for either side;
- ram: the same request again in that process: the radix cache in RAM;
- restore bandwidth: the KV bytes read back ÷ the time to read and check them into the pools,
  and ÷ the whole restore's time (the prompt's chain hashed, files found, read, checked and
  indexed), beside a plain sequential read of the same block files (the machine's read path
  for them, page cache included);
- with --compare mlx-lm: mlx-lm's way to keep a prompt: prefill a prompt cache, save it with
  save_prompt_cache, then load_prompt_cache + the last token as its restore: in a new process
  (its model loaded and one token run first, so only the restore is timed), and again in this
  one (its buffers reused: its best case).
Time to first token is the token's arrival: the request's own bookkeeping after it is not.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from mlxlocal.bench.common import log, median, random_prompt


def _ttft(engine, prompt: list[int]) -> tuple[float, Any]:
    """Seconds from submit to the first token's arrival, and the request's stats."""
    from mlxlocal.engine import SamplingParams

    t = time.perf_counter()
    first, stats = None, None
    for c in engine.generate(prompt, SamplingParams(max_tokens=1, ignore_eos=True, temperature=0)):
        if first is None and (c.token is not None or c.finish_reason is not None):
            first = time.perf_counter() - t
        stats = c.stats or stats
    assert first is not None
    return first, stats


def _plain_read(store_dir: str) -> tuple[int, float]:
    """Bytes and seconds to read every block file of a store, one after another."""
    files = [e.path for e in os.scandir(store_dir) if e.name.endswith(".kv")]
    n, t = 0, time.perf_counter()
    for f in files:
        with open(f, "rb") as fh:
            n += len(fh.read())
    return n, time.perf_counter() - t


def _config(root: str, prompt: list[int]):
    from mlxlocal.engine import EngineConfig

    return EngineConfig(kv_disk=1 << 40, kv_disk_dir=root, kv_tokens=len(prompt) + 64)


def _in_new_process(side: str, model: str, root: str, prompt_file: str) -> dict:
    """One side's restore timed by a new Python process (`python -m mlxlocal.bench.restart`)."""
    cmd = [sys.executable, "-m", "mlxlocal.bench.restart", side, model, root, prompt_file]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"the restarted {side} process failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _ours_restarted(model: str, root: str, prompt: list[int]) -> dict:
    """In the new process: an engine on the store, its first request (from disk), then the
    same again (from RAM)."""
    from mlxlocal.engine import PagedEngine
    from mlxlocal.source.loader import load

    engine = PagedEngine(load(model), _config(root, prompt))
    disk, stats = _ttft(engine, prompt)
    tier = engine.tier
    assert tier is not None
    store = tier.store.stats()
    ram, _ = _ttft(engine, prompt)
    engine.shutdown()
    return dict(disk_s=disk, ram_s=ram, disk_tokens=stats.disk_tokens if stats else 0,
                read_bytes=store["read_bytes"], read_s=store["read_seconds"],
                restore_s=tier.restore_seconds)


def _mlx_lm_restarted(model: str, path: str, prompt: list[int]) -> dict:
    """In the new process: mlx-lm's model loaded and one token run (its first-call costs
    paid), then load_prompt_cache + the last token."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache

    ref = mlx_lm.load(model)[0]
    mx.eval(ref(mx.array([prompt[-1:]]), cache=make_prompt_cache(ref)))
    return dict(disk_s=_mlx_lm_restore(ref, path, prompt))


def _mlx_lm_restore(model, path: str, prompt: list[int]) -> float:
    """Seconds for mlx-lm's restore: load_prompt_cache, then the last token on it."""
    import mlx.core as mx
    from mlx_lm.models.cache import load_prompt_cache

    t = time.perf_counter()
    loaded = load_prompt_cache(path)
    mx.eval(model(mx.array([prompt[-1:]]), cache=loaded))
    return time.perf_counter() - t


def _ours(loaded, prompt: list[int], root: str, prompt_file: str) -> dict:
    from mlxlocal.engine import PagedEngine

    first = PagedEngine(loaded, _config(root, prompt))
    # Warm-up on another prompt of the same length: the cold request's shapes are measured
    # and compiled before the clock, as a server's earlier requests would have done.
    warm = [t + 1 for t in prompt[::-1]]
    _ttft(first, warm)
    cold, _ = _ttft(first, prompt)
    assert first.tier is not None
    if not first.tier.store.flush(600):
        log("the disk tier's writer did not finish within 600 s")
    store_dir = first.tier.store.dir
    first.shutdown()
    out = _in_new_process("ours", str(loaded.info.path), root, prompt_file)
    plain_bytes, plain_s = _plain_read(store_dir)
    read = out["read_bytes"]
    gbps = lambda s: read / s / 1e9 if s else None  # noqa: E731
    return dict(cold_s=cold, **out, read_gbps=gbps(out["read_s"]),
                restore_gbps=gbps(out["restore_s"]),
                plain_gbps=plain_bytes / plain_s / 1e9 if plain_s else None)


def _mlx_lm(model, model_dir: str, prompt: list[int], root: str, prompt_file: str) -> dict:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache, save_prompt_cache

    t = time.perf_counter()
    cache = make_prompt_cache(model)
    for i in range(0, len(prompt) - 1, 2048):
        model(mx.array([prompt[i:min(i + 2048, len(prompt) - 1)]]), cache=cache)
        mx.eval([c.state for c in cache])
    mx.eval(model(mx.array([prompt[-1:]]), cache=cache))
    cold = time.perf_counter() - t
    path = os.path.join(root, "mlx_lm_prompt_cache.safetensors")
    # The same state as ours keeps: the prompt but its last token.
    for c in cache:
        c.trim(1)
    save_prompt_cache(path, cache)
    del cache
    restarted = _in_new_process("mlx-lm", model_dir, path, prompt_file)["disk_s"]
    return dict(cold_s=cold, disk_s=restarted, reused_s=_mlx_lm_restore(model, path, prompt),
                file_bytes=os.path.getsize(path))


def restart_scenario(loaded, *, prompt_tokens: int, repeats: int, compare: str | None) -> dict:
    vocab = loaded.model_config.vocab_size if loaded.model_config else loaded.config["vocab_size"]
    ref = None
    if compare == "mlx-lm":
        import mlx_lm

        log(f"loading {loaded.info.path} with mlx_lm.load ...")
        ref = mlx_lm.load(str(loaded.info.path))[0]
    runs: list[dict] = []
    for r in range(repeats):
        prompt = random_prompt(prompt_tokens, vocab, seed=1000 + r)
        root = tempfile.mkdtemp(prefix="mlxlocal-restart-")
        try:
            log(f"restart repeat {r + 1}/{repeats}: {prompt_tokens} tokens cold, from disk, from RAM")
            prompt_file = os.path.join(root, "prompt.json")
            with open(prompt_file, "w") as f:
                json.dump(prompt, f)
            run = {"ours": _ours(loaded, prompt, os.path.join(root, "kv"), prompt_file)}
            if ref is not None:
                run["mlx_lm"] = _mlx_lm(ref, str(loaded.info.path), prompt, root, prompt_file)
            runs.append(run)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "repeats": repeats, "runs": runs}
    for who in ("ours", "mlx_lm"):
        if all(who in run for run in runs):
            keys = runs[0][who].keys()
            out[who] = {k: median([run[who][k] for run in runs]) for k in keys
                        if all(run[who][k] is not None for run in runs)}
    ours = out["ours"]
    out["cold_over_disk"] = ours["cold_s"] / ours["disk_s"]
    if ours.get("restore_gbps") and ours.get("plain_gbps"):
        out["restore_over_plain_read"] = ours["restore_gbps"] / ours["plain_gbps"]
        if ours.get("read_gbps"):
            out["read_over_plain_read"] = ours["read_gbps"] / ours["plain_gbps"]
    if "mlx_lm" in out:
        out["mlx_lm_restore_over_ours"] = out["mlx_lm"]["disk_s"] / ours["disk_s"]
        out["mlx_lm_reused_over_ours"] = out["mlx_lm"]["reused_s"] / ours["disk_s"]
    return out


def print_restart(s: dict, con) -> None:
    from rich.table import Table

    ms = lambda x: f"{x * 1000:,.0f} ms"  # noqa: E731
    t = Table(title=f"restart: a {s['prompt_tokens']:,}-token prefix, first token; median of {s['repeats']}")
    t.add_column("")
    t.add_column("mlxlocal (--kv-disk)", justify="right")
    mlx = s.get("mlx_lm")
    if mlx:
        t.add_column("mlx-lm (save/load_prompt_cache)", justify="right")
    o = s["ours"]
    t.add_row("cold (prefill)", ms(o["cold_s"]), *([ms(mlx["cold_s"])] if mlx else []))
    t.add_row("after a restart (from disk)", ms(o["disk_s"]), *([ms(mlx["disk_s"])] if mlx else []))
    if mlx:
        t.add_row("from disk, in one process (mlx-lm: its buffers reused)", "-",
                  ms(mlx["reused_s"]))
    t.add_row("from RAM", ms(o["ram_s"]), *(["-"] if mlx else []))
    t.add_row("cold ÷ from disk", f"x{s['cold_over_disk']:.1f}",
              *([f"x{mlx['cold_s'] / mlx['disk_s']:.1f}"] if mlx else []))
    con.print(t)
    if o.get("restore_gbps"):
        mb, plain = o["read_bytes"] / 1e6, o["plain_gbps"]
        con.print(f"a plain read of the block files: {plain:.2f} GB/s")
        if o.get("read_gbps"):
            con.print(f"read and checked into the KV pools: {mb:,.1f} MB in "
                      f"{o['read_s'] * 1000:,.1f} ms = {o['read_gbps']:.2f} GB/s "
                      f"(x{s['read_over_plain_read']:.2f} of the plain read)")
        con.print(f"the whole restore (prefix hashed, files found, read, checked, indexed): "
                  f"{o['restore_s'] * 1000:,.1f} ms = {o['restore_gbps']:.2f} GB/s "
                  f"(x{s['restore_over_plain_read']:.2f})")
    if mlx:
        con.print("from disk after a restart, mlx-lm ÷ ours: "
                  f"x{s['mlx_lm_restore_over_ours']:.2f}; "
                  f"against mlx-lm's load into reused buffers: x{s['mlx_lm_reused_over_ours']:.2f} "
                  f"(its prompt cache file {mlx['file_bytes'] / 1e6:,.1f} MB)")


def _child(argv: list[str]) -> None:
    """`python -m mlxlocal.bench.restart ours|mlx-lm MODEL ROOT|CACHE PROMPT.json`: one side's
    restore in this new process, as a JSON line."""
    side, model, where, prompt_file = argv
    with open(prompt_file) as f:
        prompt = json.load(f)
    out = _ours_restarted(model, where, prompt) if side == "ours" else \
        _mlx_lm_restarted(model, where, prompt)
    print(json.dumps(out))


if __name__ == "__main__":
    _child(sys.argv[1:])
