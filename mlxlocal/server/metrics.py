"""Prometheus metrics (prometheus_client), on a registry of the app's own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from mlxlocal.engine import Engine

DISK_GAUGES = {
    "disk_hit_blocks": "KV blocks read back from the disk tier",
    "disk_read_bytes": "Bytes of KV block files read from the disk tier",
    "disk_write_blocks": "KV blocks written to the disk tier",
    "disk_write_bytes": "Bytes of KV block files written to the disk tier",
    "disk_dropped_writes": "KV block writes dropped (the writer's queue full, or the disk failing)",
    "disk_corrupt_removed": "KV block files that did not verify and were removed",
    "disk_bytes": "Bytes of KV block files the disk tier holds",
}


class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("mlxlocal_requests", "Requests by endpoint and status", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("mlxlocal_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generated_tokens = Counter("mlxlocal_generated_tokens", "Tokens generated", registry=r)
        self.cancelled = Counter("mlxlocal_requests_cancelled", "Generations cut short because the client went away",
                                 registry=r)
        self.cancelled_unspent = Counter(
            "mlxlocal_cancelled_max_tokens_unspent",
            "Upper bound of generation tokens saved by cancellations (max_tokens minus tokens generated)",
            registry=r)
        self.running = Gauge("mlxlocal_requests_running", "Requests decoding or prefilling", registry=r)
        self.waiting = Gauge("mlxlocal_requests_waiting", "Requests queued for admission", registry=r)
        self.kv_used = Gauge("mlxlocal_kv_blocks_used", "KV blocks referenced by sequences", registry=r)
        self.kv_total = Gauge("mlxlocal_kv_blocks_total", "KV blocks in the pools now", registry=r)
        self.kv_max = Gauge("mlxlocal_kv_blocks_max", "KV blocks the pools may grow to (the budget)", registry=r)
        self.prefix_hits = Gauge("mlxlocal_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache", registry=r)
        # Speculative decoding (serve --draft-model / --prompt-lookup / --mtp), summed over the loaded
        # engines since each loaded: verify steps, tokens drafted, drafted tokens accepted.
        self.spec_steps = Gauge("mlxlocal_spec_verify_steps", "Speculative verify steps", registry=r)
        self.spec_drafted = Gauge("mlxlocal_spec_draft_tokens", "Tokens drafted for speculative decoding", registry=r)
        self.spec_accepted = Gauge("mlxlocal_spec_accepted_tokens", "Drafted tokens the model accepted", registry=r)
        self.spec_rate = Gauge("mlxlocal_spec_acceptance_ratio", "Drafted tokens accepted / drafted", registry=r)
        # A sequence's verify forward yields its accepted drafts and one token of the model's own.
        self.spec_per_forward = Gauge("mlxlocal_spec_tokens_per_forward",
                                      "Tokens per verify forward of a sequence (1 without drafts)", registry=r)
        # The disk tier (--kv-disk), per tier as the RAM cache's prefix_hits is: blocks read
        # back, bytes read and written, blocks written, writes dropped, bad files removed.
        self.disk = {k: Gauge(f"mlxlocal_kv_{k}", h, registry=r) for k, h in DISK_GAUGES.items()}
        self.ttft = Histogram("mlxlocal_time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.itl = Histogram("mlxlocal_inter_token_latency_seconds", "Time between streamed tokens", registry=r,
                             buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5))

    def exposition(self) -> bytes:
        """The text format, without the `*_created` series (start times nobody graphs); filtered
        here rather than by prometheus_client's process-wide disable_created_metrics()."""
        return generate_latest(_WithoutCreated(self.registry))

    def refresh(self, engines: list[Engine]) -> None:
        """Gauges from the engines' own counters, at scrape time."""
        totals = {"running": 0, "waiting": 0, "blocks_used": 0, "blocks_total": 0, "blocks_max": 0,
                  "prefix_hit_tokens": 0,
                  "spec_steps": 0, "spec_rows": 0, "spec_drafted": 0, "spec_accepted": 0, **dict.fromkeys(DISK_GAUGES, 0)}
        for engine in engines:
            stats = engine.stats()
            for key in totals:
                totals[key] += stats[key]
        self.running.set(totals["running"])
        self.waiting.set(totals["waiting"])
        self.kv_used.set(totals["blocks_used"])
        self.kv_total.set(totals["blocks_total"])
        self.kv_max.set(totals["blocks_max"])
        self.prefix_hits.set(totals["prefix_hit_tokens"])
        self.spec_steps.set(totals["spec_steps"])
        self.spec_drafted.set(totals["spec_drafted"])
        self.spec_accepted.set(totals["spec_accepted"])
        drafted, rows = totals["spec_drafted"], totals["spec_rows"]
        self.spec_rate.set(totals["spec_accepted"] / drafted if drafted else 0)
        self.spec_per_forward.set((rows + totals["spec_accepted"]) / rows if rows else 1)
        for k, gauge in self.disk.items():
            gauge.set(totals[k])


class _WithoutCreated:
    """A collector view of a registry that drops `*_created` samples (each collect() makes new metrics)."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry

    def collect(self):
        for metric in self.registry.collect():
            metric.samples = [s for s in metric.samples if s.name != metric.name + "_created"]
            yield metric
