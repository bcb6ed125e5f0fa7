"""`bench endpoint --url URL --compare-url URL2 [--compare-url URL3]`: the same concurrent load against
several OpenAI-compatible servers (ours, mlx_lm.server, vllm-mlx, rapid-mlx ...), side by side.

The servers run one at a time: each repeat sends every server, in turn (the order reversed on
odd repeats), -c concurrent streaming requests of the same prompts (new ones each repeat, so no
server's prefix cache carries over), then one request alone for the single-stream rate. The
prompts' seed is drawn anew per comparison (or given): vllm-mlx and rapid-mlx keep their prefix
caches on disk across restarts, so fixed prompts would be cache hits for them run after run. The
table has medians over repeats: aggregate tok/s (output tokens of the load ÷ its wall time),
p50 TTFT under load, p50 per-stream decode tok/s under load, and the single stream's decode
tok/s; ratios are each server ÷ the first (--url).
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import httpx

from mlxlocal.bench.common import log, median
from mlxlocal.bench.endpoint import _base_url, measure_endpoint
from mlxlocal.errors import EndpointBenchError


def served_model(url: str, model: str | None) -> str:
    """The model name to send: `model` where the server lists it (or lists nothing), else
    the first it lists (each server names the same directory its own way)."""
    try:
        r = httpx.get(f"{_base_url(url)}/v1/models", timeout=10.0, trust_env=False)
        ids = [m.get("id") for m in r.json().get("data", []) if isinstance(m, dict)]
    except (httpx.HTTPError, ValueError, AttributeError) as e:
        if model is None:
            raise EndpointBenchError(
                f"{url}: no --model given and GET /v1/models failed ({e})"
            ) from e
        return model
    names = [i for i in ids if isinstance(i, str)]
    if model is not None and (model in names or not names):
        return model
    if not names:
        raise EndpointBenchError(f"{url}: no --model given and /v1/models lists none")
    return names[0]


def compare_endpoints(
    urls: list[str],
    model: str | None = None,
    *,
    concurrency: int = 8,
    requests: int | None = None,
    prompt_tokens: int = 256,
    gen_tokens: int = 64,
    repeats: int = 3,
    single: bool = True,
    timeout: float = 600.0,
    names: dict[str, str] | None = None,
    seed: int | None = None,
) -> dict:
    """The comparison (see above); `names`: the model name to send a URL, where not the
    one served_model picks."""
    if len(set(map(_base_url, urls))) != len(urls):
        raise EndpointBenchError("--url and --compare-url must name different servers")
    names = {u: (names or {}).get(u) or served_model(u, model) for u in urls}
    if seed is None:  # prompts no server has seen, in memory or on disk
        seed = random.SystemRandom().randrange(1, 1 << 30)
    raw: dict[str, dict[str, list[dict]]] = {u: {"load": [], "single": []} for u in urls}
    order: list[str] = []
    for r in range(repeats):
        for u in urls if r % 2 == 0 else urls[::-1]:
            log(f"endpoint compare repeat {r + 1}/{repeats}: {u} ({concurrency} streams)")
            raw[u]["load"].append(
                asyncio.run(
                    measure_endpoint(
                        u,
                        names[u],
                        concurrency=concurrency,
                        requests=requests or concurrency,
                        prompt_tokens=prompt_tokens,
                        gen_tokens=gen_tokens,
                        seed=seed + r,
                        timeout=timeout,
                    )
                )
            )
            if single:
                raw[u]["single"].append(
                    asyncio.run(
                        measure_endpoint(
                            u,
                            names[u],
                            concurrency=1,
                            requests=1,
                            prompt_tokens=prompt_tokens,
                            gen_tokens=gen_tokens,
                            seed=seed + 1_000_003 + r,
                            timeout=timeout,
                        )
                    )
                )
            order.append(u)
    rows: list[dict[str, Any]] = []
    for u in urls:
        loads, singles = raw[u]["load"], raw[u]["single"]
        rows.append(
            dict(
                url=_base_url(u),
                model=names[u],
                aggregate_tps=median([x["output_throughput"] for x in loads]),
                ttft_p50_s=median([x["ttft_s"]["p50"] for x in loads]),
                stream_decode_tps_p50=median([x["decode_tps_per_request"]["p50"] for x in loads]),
                single_decode_tps=median([x["decode_tps_per_request"]["p50"] for x in singles])
                if singles
                else None,
                completed=sum(x["completed"] for x in loads),
                failed=sum(x["failed"] for x in loads),
                aggregate_tps_runs=[x["output_throughput"] for x in loads],
                errors=sorted({e for x in loads + singles for e in x["errors"]}),
            )
        )
    first = rows[0]
    for row in rows:
        row["aggregate_ratio"] = (
            row["aggregate_tps"] / first["aggregate_tps"] if first["aggregate_tps"] else None
        )
    return dict(
        concurrency=concurrency,
        requests=requests or concurrency,
        prompt_tokens=prompt_tokens,
        gen_tokens=gen_tokens,
        repeats=repeats,
        seed=seed,
        rows=rows,
        order=order,
    )


def _f(x, fmt: str) -> str:
    return "-" if x is None or x != x else fmt.format(x)


def print_comparison(c: dict, con=None) -> None:
    from rich.console import Console
    from rich.table import Table

    con = con or Console()
    t = Table(
        title=f"{c['concurrency']} concurrent streams ({c['requests']} requests, "
        f"~{c['prompt_tokens']}-token prompts, {c['gen_tokens']} tokens each), "
        f"servers one at a time, medians of {c['repeats']}, prompt seed {c.get('seed')}"
    )
    for name in (
        "server",
        "aggregate tok/s",
        "÷ first",
        "p50 TTFT",
        "per stream",
        "alone",
        "failed",
    ):
        t.add_column(name, justify="left" if name == "server" else "right")
    for row in c["rows"]:
        ttft = row["ttft_p50_s"]
        t.add_row(
            row.get("label") or row["url"],
            _f(row["aggregate_tps"], "{:.1f}"),
            _f(row["aggregate_ratio"], "×{:.2f}"),
            _f(ttft and ttft * 1000, "{:.0f} ms"),
            _f(row["stream_decode_tps_p50"], "{:.1f}"),
            _f(row["single_decode_tps"], "{:.1f}"),
            str(row["failed"]),
        )
    con.print(t)
    con.print(
        "tok/s: aggregate = output tokens of the load ÷ its wall time; per stream = p50 of each "
        "request's decode rate under the load; alone = one request by itself",
        highlight=False,
    )
