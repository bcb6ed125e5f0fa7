"""What front ends hand to the engine and what they get back."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    # None: no logprobs; N >= 0: the sampled token's logprob plus the N most likely.
    logprobs: int | None = None

    def validate(self) -> None:
        checks = [
            (self.max_tokens >= 1, "max_tokens must be >= 1"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (all(s for s in self.stop), "stop strings must not be empty"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "top logprobs must be in [0, 20]"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float = 0.0
    prefill_tps: float = 0.0
    decode_tps: float = 0.0
    peak_memory_bytes: int = 0
    finish_reason: str | None = None
    # Why a "length" finish happened: "max_tokens" (the caller's limit), "context" (the
    # context window was full), "kv_cache" (the paged KV pool was); None otherwise.
    truncated_by: str | None = None

    def set_finish(self, reason: str, max_tokens: int, cause: str | None = None) -> None:
        """Record the finish reason; call after completion_tokens is final. Both engines
        clip max_tokens to the context left, so a short "length" reply means the context."""
        self.finish_reason = reason
        if reason != "length":
            self.truncated_by = None
        elif cause is not None:
            self.truncated_by = cause
        else:
            self.truncated_by = "max_tokens" if self.completion_tokens >= max_tokens else "context"

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Chunk:
    """One streamed step: the new text (stop strings held back), the token, and on the
    last chunk the finish reason ("stop", "length", "cancelled") and the stats."""

    text: str
    token: int | None = None
    finish_reason: str | None = None
    stats: GenerationStats | None = None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
