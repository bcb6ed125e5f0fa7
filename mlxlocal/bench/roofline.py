"""Decode roofline: at batch 1 every generated token reads all weights plus the KV cache
once, so decode tok/s cannot beat memory bandwidth / bytes read per token.

Bandwidth comes from (first that applies): `--bandwidth`, the Apple chip table (macOS,
`sysctl -n machdep.cpu.brand_string`), or a measured large-array copy (numpy).
"""

from __future__ import annotations

import platform
import re
import subprocess
import time
from dataclasses import asdict, dataclass

# Unified-memory bandwidth in GB/s (Apple's published figures). A tuple entry maps the
# CPU core count to bandwidth where one name covers two bins (M3 Max, M4 Max).
APPLE_BANDWIDTH: dict[str, float | dict[int, float]] = {
    "M1": 68.25, "M1 Pro": 200.0, "M1 Max": 400.0, "M1 Ultra": 800.0,
    "M2": 100.0, "M2 Pro": 200.0, "M2 Max": 400.0, "M2 Ultra": 800.0,
    "M3": 100.0, "M3 Pro": 150.0, "M3 Max": {14: 300.0, 16: 400.0}, "M3 Ultra": 819.0,
    "M4": 120.0, "M4 Pro": 273.0, "M4 Max": {14: 410.0, 16: 546.0},
    "M5": 153.0,
}
_CHIP_RE = re.compile(r"\bM(\d+)(?:\s+(Pro|Max|Ultra))?\b", re.IGNORECASE)


def chip_bandwidth(brand: str, cpu_cores: int | None = None) -> tuple[str, float] | None:
    """('M3 Max', 400.0) for 'Apple M3 Max' (+ core count where it matters); None if unknown."""
    m = _CHIP_RE.search(brand or "")
    if not m:
        return None
    chip = f"M{m[1]}" + (f" {m[2].capitalize()}" if m[2] else "")
    value = APPLE_BANDWIDTH.get(chip)
    if value is None:
        return None
    if isinstance(value, dict):
        if cpu_cores in value:
            return f"{chip} ({cpu_cores}-core CPU)", value[cpu_cores]
        top = max(value)  # unknown bin: the full chip, stated as such
        return f"{chip} (assumed {top}-core CPU)", value[top]
    return chip, value


def _sysctl(name: str) -> str | None:
    try:
        out = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def measure_copy_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """GB/s of a large numpy array copy: (bytes read + bytes written) / time, best of a few."""
    import numpy as np

    src = np.ones(nbytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best / 1e9


@dataclass
class Bandwidth:
    gbps: float
    source: str  # "--bandwidth" | "chip table: Apple M3 Max" | "measured: numpy copy"


def detect_bandwidth(override: float | None = None) -> Bandwidth:
    if override is not None:
        return Bandwidth(float(override), "--bandwidth")
    if platform.system() == "Darwin":
        brand = _sysctl("machdep.cpu.brand_string") or ""
        cores = _sysctl("hw.physicalcpu")
        hit = chip_bandwidth(brand, int(cores) if cores and cores.isdigit() else None)
        if hit:
            return Bandwidth(hit[1], f"chip table: {hit[0]} ({brand})")
    return Bandwidth(measure_copy_bandwidth(), "measured: numpy copy, read+write bytes / time, best of 5")


DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """K and V for one position across all layers."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes


@dataclass
class Roofline:
    bandwidth_gbps: float
    bandwidth_source: str
    weight_bytes: int
    kv_bytes_per_token: int
    mean_context: float
    bytes_per_token: float
    bound_tps: float
    measured_decode_tps: float | None = None
    fraction: float | None = None
    comm_s_per_token: float = 0.0  # tensor parallel: the link's share of each token

    def as_dict(self) -> dict:
        return asdict(self)


def decode_roofline(bw: Bandwidth, weight_bytes: int, kv_per_token: int, mean_context: float,
                    measured_tps: float | None = None, comm_s_per_token: float = 0.0) -> Roofline:
    """Tokens/s if each token costs reading its bytes at `bw` (one rank's share under tensor
    parallelism, read by every rank at once) plus `comm_s_per_token` on the links."""
    per_token = weight_bytes + kv_per_token * mean_context
    bound = 1.0 / (per_token / (bw.gbps * 1e9) + comm_s_per_token)
    fraction = measured_tps / bound if measured_tps and bound > 0 else None
    return Roofline(bw.gbps, bw.source, int(weight_bytes), int(kv_per_token), float(mean_context),
                    float(per_token), bound, measured_tps, fraction, comm_s_per_token)
