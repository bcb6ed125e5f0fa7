"""Restart scenario (`bench restart`): a long prefix served cold, then from the
disk tier by a new engine on the same store (what a restarted process finds), then from RAM.

Per repeat, a fresh store and a new prompt of -p tokens (so nothing is cached before the cold
run), one token generated each time:
- cold: an engine with --kv-disk, warmed up on another prompt of the same length, prefills the
  prompt (and writes its blocks through);
- disk: a new engine on the store: its first request reads the blocks back;
- ram: the same engine again: the radix cache in RAM;
- restore bandwidth: the KV bytes read back ÷ the time to read and check them into the pools,
  and ÷ the whole restore's time (the prompt's chain hashed, files found, read, checked and
  indexed), beside a plain sequential read of the same block files (the machine's read path
  for them, page cache included);
- with --compare mlx-lm: mlx-lm's way to keep a prompt: prefill a prompt cache, save it with
  save_prompt_cache, then load_prompt_cache + the last token as its restore.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Any

from mlxlocal.bench.common import log, median, random_prompt


def _ttft(engine, prompt: list[int]) -> tuple[float, Any]:
    from mlxlocal.engine import SamplingParams

    t = time.perf_counter()
    stats = None
    for c in engine.generate(prompt, SamplingParams(max_tokens=1, ignore_eos=True, temperature=0)):
        stats = c.stats or stats
    return time.perf_counter() - t, stats


def _plain_read(store_dir: str) -> tuple[int, float]:
    """Bytes and seconds to read every block file of a store, one after another."""
    files = [e.path for e in os.scandir(store_dir) if e.name.endswith(".kv")]
    n, t = 0, time.perf_counter()
    for f in files:
        with open(f, "rb") as fh:
            n += len(fh.read())
    return n, time.perf_counter() - t


def _ours(loaded, prompt: list[int], root: str) -> dict:
    from mlxlocal.engine import EngineConfig, PagedEngine

    cfg = EngineConfig(kv_disk=1 << 40, kv_disk_dir=root, kv_tokens=len(prompt) + 64)
    first = PagedEngine(loaded, cfg)
    # Warm-up on another prompt of the same length, then it again from RAM (its last token
    # alone: what a restored request runs, as mlx-lm's side runs its last token before its
    # clock), then its last block anew: the shapes the cold and the restored request run are
    # measured and compiled before the clock, as a server's earlier requests would have done.
    warm = [t + 1 for t in prompt[::-1]]
    _ttft(first, warm)
    _ttft(first, warm)
    _ttft(first, warm[:-16] + prompt[:16])
    cold, _ = _ttft(first, prompt)
    assert first.tier is not None
    if not first.tier.store.flush(600):
        log("the disk tier's writer did not finish within 600 s")
    first.shutdown()
    second = PagedEngine(loaded, cfg)
    disk, stats = _ttft(second, prompt)  # its first request
    tier = second.tier
    assert tier is not None
    store = tier.store.stats()
    read, read_s, restore_s = store["read_bytes"], store["read_seconds"], tier.restore_seconds
    ram, _ = _ttft(second, prompt)
    second.shutdown()
    plain_bytes, plain_s = _plain_read(tier.store.dir)
    gbps = lambda s: read / s / 1e9 if s else None  # noqa: E731
    return dict(cold_s=cold, disk_s=disk, ram_s=ram, disk_tokens=stats.disk_tokens if stats else 0,
                read_bytes=read, read_s=read_s, read_gbps=gbps(read_s), restore_s=restore_s,
                restore_gbps=gbps(restore_s),
                plain_gbps=plain_bytes / plain_s / 1e9 if plain_s else None)


def _mlx_lm(model, prompt: list[int], root: str) -> dict:
    import mlx.core as mx
    from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache

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
    t = time.perf_counter()
    loaded = load_prompt_cache(path)
    mx.eval(model(mx.array([prompt[-1:]]), cache=loaded))
    restored = time.perf_counter() - t
    return dict(cold_s=cold, disk_s=restored, file_bytes=os.path.getsize(path))


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
            run = {"ours": _ours(loaded, prompt, root)}
            if ref is not None:
                run["mlx_lm"] = _mlx_lm(ref, prompt, root)
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
        con.print(f"from disk, mlx-lm ÷ ours: x{s['mlx_lm_restore_over_ours']:.2f} "
                  f"(its prompt cache file {mlx['file_bytes'] / 1e6:,.1f} MB)")
