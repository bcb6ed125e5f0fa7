"""What front ends hand to the engine and what they get back."""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, field

# Limits SamplingParams.validate enforces. Most match OpenAI's; where OpenAI has none
# (temperature, stop strings) they only keep a request from making the engine misbehave.
MAX_TEMPERATURE = 100.0
MAX_STOP_STRINGS = 16
MAX_LOGIT_BIAS = 1024  # entries; each value in [-100, 100] as in OpenAI
MAX_TOP_LOGPROBS = 20
# repetition_penalty divides positive logits by it and multiplies negative ones: within
# [1e-3, 100] a logit grows at most 1000-fold, finite in float32 (and bfloat16) for any
# logit a model gives; 0 < p < 1e-38 is 0 in float32 and made the logits inf, then NaN.
# mlx-lm, vLLM and llama.cpp only ask for > 0; the values people use lie in [0.5, 2].
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-3, 100.0
# Any top_p below the most likely token's probability (>= 1/vocab) keeps that token alone;
# one that is 0 in float32 (< 1.4e-45) kept none, and a uniformly random token was drawn.
MIN_TOP_P = 1e-8


def _is_int(x) -> bool:
    # bool is an int subclass: True would pass as 1, so it is rejected wherever a number is due.
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class Grammar:
    """A constraint on what may be generated, in llguidance's grammar format (the JSON text
    `llguidance.LLMatcher.grammar_from_*` returns: JSON schema, Lark, regex, or several).

    Built and checked by mlxlocal.grammar from what the request asked for; `param` is the
    request field it came from, named in any error about it.
    """

    spec: str
    param: str = "grammar"


@dataclass(frozen=True)
class CacheEdit:
    """An edit of a request's KV cache in the middle of its prompt.

    Once the first `at` prompt tokens are in the cache, the tokens of the `drop` spans leave
    it: their blocks are freed, the kept tokens keep their K/V (which saw the dropped ones)
    and their rope positions. Then the keys of each `reposition` span are re-rotated so the
    span follows the kept token before it without a gap; with `close_tail` the tokens from
    `at` on follow the last kept token too (else they keep their own prompt index as their
    position, as drop alone does). Spans are [start, end) in the coordinates of the prompt
    given to submit, all before `at`, sorted, not overlapping each other or earlier edits'
    drops; edits are sorted by `at`, and `at` < len(prompt).
    """

    at: int
    drop: tuple[tuple[int, int], ...] = ()
    reposition: tuple[tuple[int, int], ...] = ()
    close_tail: bool = False


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding in the paged engine: how tokens are drafted each decode step.

    method "lookup": prompt lookup (n-gram matches over the prompt and the output so far, no
    extra model); "draft": a small draft model sharing the target's tokenizer (`draft`: its
    LoadedModel); "mtp": the model's own multi-token-prediction modules (a checkpoint that
    ships them: DeepSeek-V3, GLM-4.5, Qwen3.5). Each sequence drafts up to `num_draft_tokens` tokens (fewer while its recent
    drafts were rejected); the target verifies them all in one forward.
    """

    method: str = "lookup"
    draft: object = None  # mlxlocal.source.loader.LoadedModel for method "draft"
    num_draft_tokens: int = 4
    ngram_min: int = 1  # prompt lookup: the shortest suffix that may match
    ngram_max: int = 4  # and the longest, tried first

    def __post_init__(self):
        if self.method not in ("lookup", "draft", "mtp"):
            raise ValueError(f"speculative method must be 'lookup', 'draft' or 'mtp', got {self.method!r}")
        if self.method == "draft" and self.draft is None:
            raise ValueError("speculative method 'draft' needs a draft model")
        if not (_is_int(self.num_draft_tokens) and 1 <= self.num_draft_tokens <= 32):
            raise ValueError(f"num_draft_tokens must be an integer in [1, 32], got {self.num_draft_tokens!r}")
        if not (_is_int(self.ngram_min) and _is_int(self.ngram_max) and 1 <= self.ngram_min <= self.ngram_max):
            raise ValueError(f"prompt lookup n-gram sizes must satisfy 1 <= min <= max, got "
                             f"{self.ngram_min!r}, {self.ngram_max!r}")


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
    # OpenAI's: logits[t] -= frequency_penalty * count(t) + presence_penalty * (count(t) > 0),
    # counting only the tokens generated so far, not the prompt (as OpenAI and vLLM do).
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # Token id -> value added to its logit before sampling (OpenAI: in [-100, 100]).
    logit_bias: dict[int, float] | None = None
    # Only tokens the grammar allows are sampled; it ends the output (EOS) when complete.
    grammar: Grammar | None = None
    # False: this request decodes one token per step even on an engine that speculates.
    speculative: bool = True
    # A think block still open after this many generated tokens is closed: the engine writes
    # the model's think-end marker and decoding goes on (engine/think.py). None: no budget.
    think_budget: int | None = None

    def validate(self) -> None:
        """Raise ValueError naming the first field out of its range.

        Everything that does not need the model is checked here, so a request that passes
        cannot make the Sampler raise on the engine thread; EngineBase.validate adds the
        checks against the model's vocabulary.
        """
        def number(name: str, lo: float, hi: float, lo_open: bool = False) -> None:
            v = getattr(self, name)
            lo_ok = _is_real(v) and (v > lo if lo_open else v >= lo)
            if not (lo_ok and v <= hi):
                interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
                raise ValueError(f"{name} must be a finite number in {interval}, got {v!r}")

        def integer(name: str, lo: int, hi: int, hi_text: str, optional: bool = False) -> None:
            v = getattr(self, name)
            if optional and v is None:
                return
            if not (_is_int(v) and lo <= v < hi):
                raise ValueError(f"{name} must be an integer in [{lo}, {hi_text}), got {v!r}")

        integer("max_tokens", 1, 2**31, "2**31")
        number("temperature", 0.0, MAX_TEMPERATURE)
        number("top_p", MIN_TOP_P, 1.0)
        integer("top_k", 0, 2**31, "2**31")
        number("min_p", 0.0, 1.0)
        number("repetition_penalty", MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY)
        number("frequency_penalty", -2.0, 2.0)
        number("presence_penalty", -2.0, 2.0)
        # mx.random.key takes the seed as a uint64; kept below 2**63 so it is also a valid int64.
        integer("seed", 0, 2**63, "2**63", optional=True)
        integer("logprobs", 0, MAX_TOP_LOGPROBS + 1, str(MAX_TOP_LOGPROBS + 1), optional=True)
        integer("think_budget", 1, 2**31, "2**31", optional=True)
        if not isinstance(self.speculative, bool):
            raise ValueError(f"speculative must be true or false, got {self.speculative!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        # A bare string would be taken one character at a time.
        if not isinstance(self.stop, (list, tuple)):
            raise ValueError(f"stop must be a list of strings, got {type(self.stop).__name__}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop allows at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise ValueError(f"grammar must be a Grammar, got {type(self.grammar).__name__}")
        if self.grammar is not None and self.ignore_eos:
            # A complete document allows only EOS: ignoring it leaves nothing to sample.
            raise ValueError(f"ignore_eos cannot be combined with {self.grammar.param}")
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, dict):
                raise ValueError(f"logit_bias must be a mapping of token id to number, got {type(bias).__name__}")
            if len(bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias allows at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
            for k, v in bias.items():
                if not (_is_int(k) and k >= 0):
                    raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {k!r}")
                if not (_is_real(v) and -100 <= v <= 100):
                    raise ValueError(f"logit_bias values must be finite numbers in [-100, 100], got {v!r} for token {k}")


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    disk_tokens: int = 0  # of cached_tokens: read back from the disk tier (--kv-disk)
    completion_tokens: int = 0
    ttft_s: float = 0.0
    prefill_tps: float = 0.0
    decode_tps: float = 0.0
    peak_memory_bytes: int = 0
    finish_reason: str | None = None
    # Why a "length" finish happened: "max_tokens" (the caller's limit), "context" (the
    # context window was full), "kv_cache" (the paged KV pool was); None otherwise.
    truncated_by: str | None = None
    # Requests with a grammar: whether the output is a complete document of it (False after
    # a "length" finish that cut it short); None without a grammar.
    grammar_complete: bool | None = None
    forced_tokens: int = 0  # of completion_tokens: the grammar's only continuation, fed without sampling
    # Cache edits (CacheEdit): prompt tokens out of the cache when the reply was generated
    # (not attended), and keys re-rotated for this request (reused ones re-rotated earlier
    # are not counted again).
    dropped_tokens: int = 0
    repositioned_tokens: int = 0
    # Prompt tokens this request computed: prompt_tokens less the cached ones and, with cache
    # edits, less those its session had dropped before (neither reused nor computed).
    prefill_tokens: int = 0
    # Speculative decoding: tokens drafted for this request, and how many of them the target
    # accepted (each verify step also yields one token of the target's own).
    draft_tokens: int = 0
    accepted_tokens: int = 0

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
    # Ids the engine wrote after the last token unsampled (a thinking budget's think-end
    # marker, in a chunk without a token): not output, but in the context the model saw.
    written: tuple[int, ...] = ()
