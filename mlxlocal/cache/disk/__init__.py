"""The disk tier of the KV cache: block files keyed by prefix hash and model fingerprint.

keys.py: a block's key (its prefix's hash); format.py: the model Fingerprint and the
checksummed file format;
store.py: DiskStore, the budgeted store with its background writer; tier.py: DiskTier, the
seam the engine's prefix reuse calls to write blocks down and read them back into the pools.
"""

from __future__ import annotations

import os
from pathlib import Path


def default_kv_dir() -> Path:
    """$MLXLOCAL_HOME/kv, else ~/.cache/mlxlocal/kv."""
    home = os.environ.get("MLXLOCAL_HOME")
    return Path(home) / "kv" if home else Path.home() / ".cache" / "mlxlocal" / "kv"
