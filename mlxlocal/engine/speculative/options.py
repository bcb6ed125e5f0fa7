"""What a front end's --draft-model / --prompt-lookup / --num-draft-tokens ask for, made into
the engine's SpeculativeConfig for a loaded target model.

The CLI, the chat REPL, the agent loop, the server's registry and bench pass a
`SpeculationChoice` to `open_engine(loaded, speculative=...)` (the package's), which resolves
it for that target (the draft loaded once and kept for later targets: chat's /model, the
server's reloads after keep_alive), its tokenizer checked against the target's before any
engine starts.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

from mlxlocal.engine.types import SpeculativeConfig
from mlxlocal.errors import ModelLoadError
from mlxlocal.source.loader import LoadedModel, check_draft_tokenizer

DEFAULT_DRAFT_TOKENS = 4
DEFAULT_MTP_TOKENS = 3  # an MTP module is trained one token ahead: chained further, it misses more


@dataclass
class SpeculationChoice:
    method: str  # "lookup" (prompt lookup), "draft" (a draft model) or "mtp" (the model's own heads)
    draft_spec: str | None = None  # the draft's model spec (method "draft")
    num_draft_tokens: int = DEFAULT_DRAFT_TOKENS
    auto: bool = False  # method "mtp" (--mtp auto): only for models that have MTP modules
    _path: Path | None = field(default=None, repr=False)  # the draft's resolved directory
    _draft: LoadedModel | None = field(default=None, repr=False)  # loaded once, unless a self-draft
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self):
        # The engine's own checks, at parse time: a bad value is refused before any model loads.
        SpeculativeConfig(method=self.method, draft=self.draft_spec, num_draft_tokens=self.num_draft_tokens)

    def describe(self) -> str:
        how = {"lookup": "prompt lookup", "mtp": "MTP (the model's own heads)"}.get(
            self.method, f"draft model {self.draft_spec}")
        when = ", for models that ship MTP modules" if self.auto else ""
        return f"{how}{when}, up to {self.num_draft_tokens} draft tokens per step"

    def as_dict(self) -> dict:
        return {"method": self.method, "draft_model": self.draft_spec, "num_draft_tokens": self.num_draft_tokens,
                **({"auto": True} if self.auto else {})}

    def draft_for(self, target: LoadedModel) -> LoadedModel:
        """The draft model for `target`: the target itself when the spec names the same model
        directory (a self-draft: no second copy of the weights, nothing kept past the target's
        life), else loaded once and kept for the next targets."""
        from mlxlocal.source import hub
        from mlxlocal.source.loader import load

        with self._lock:
            if self._path is None:
                self._path = hub.resolve(self.draft_spec).path.resolve()
            # A tensor-parallel target cannot draft for itself on rank 0 alone: a whole copy.
            if self._path == target.info.path.resolve() and target.shard is None:
                return target
            if self._draft is None:
                self._draft = load(self.draft_spec, tp=1)  # drafts run on rank 0 only
            draft = self._draft
        check_draft_tokenizer(target, draft)
        return draft

    def applies_to(self, target: LoadedModel) -> bool:
        """False only for --mtp auto on a model without MTP modules: it decodes as it is."""
        return not (self.method == "mtp" and self.auto and not target.mtp)

    def config_for(self, target: LoadedModel) -> SpeculativeConfig | None:
        """The engine's config for `target`; None where the choice does not apply to it."""
        if not self.applies_to(target):
            return None
        if self.method == "mtp" and not target.mtp:
            raise SpeculationError(f"{target.info.name} has no MTP modules to draft with (`mlxlocal show` "
                                   "says whether its checkpoint had them); give --draft-model or "
                                   "--prompt-lookup instead")
        draft = self.draft_for(target) if self.method == "draft" else None
        return SpeculativeConfig(method=self.method, draft=draft, num_draft_tokens=self.num_draft_tokens)


class SpeculationError(ModelLoadError):
    """Speculative decoding asked of a model that cannot do it (the dense engine, a draft the
    engine refuses): said when the engine opens, as one line, like a load error."""


def speculation_of(options: dict) -> SpeculationChoice | None:
    choice = options.get("speculative")
    return choice if isinstance(choice, SpeculationChoice) else None
