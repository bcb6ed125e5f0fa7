"""Speculative decoding: the drafters and the engine's speculative step (drafting.py), and what
a front end's --draft-model / --prompt-lookup / --mtp ask for, resolved per target (options.py)."""

from __future__ import annotations

from mlxlocal.engine.speculative.drafting import (
    MISSES,
    PAUSE,
    LookupIndex,
    ModelDrafter,
    SpecState,
    Speculator,
    accept_drafts,
)
from mlxlocal.engine.speculative.mtp import MTPDrafter
from mlxlocal.engine.speculative.options import (
    DEFAULT_DRAFT_TOKENS,
    DEFAULT_MTP_TOKENS,
    SpeculationChoice,
    SpeculationError,
    speculation_of,
)

__all__ = [
    "DEFAULT_DRAFT_TOKENS", "DEFAULT_MTP_TOKENS", "MISSES", "PAUSE", "LookupIndex", "MTPDrafter",
    "ModelDrafter", "SpecState", "SpeculationChoice", "SpeculationError", "Speculator", "accept_drafts", "speculation_of",
]
