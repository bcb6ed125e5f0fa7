"""One request's output side, the same for every engine: token ids in, Chunks out.

EOS, the streaming detokenizer, stop strings, max_tokens, timings and the final stats.
An engine calls `first_token` when the prompt is done, `token` for each sampled id (it
says when that token ended the request) and `finish` once, for the last chunk.
"""

from __future__ import annotations

import time

import mlx.core as mx

from mlxlocal.engine.stop import StopMatcher
from mlxlocal.engine.types import Chunk, GenerationStats, SamplingParams


class Output:
    def __init__(self, detokenizer, params: SamplingParams, eos: set[int], prompt_len: int,
                 max_tokens: int, t_submit: float | None = None):
        self.detok = detokenizer
        self.detok.reset()
        self.params = params
        self.stops = StopMatcher(params.stop)
        self.eos = set() if params.ignore_eos else eos
        self.max_tokens = max_tokens  # params.max_tokens clipped to the context left
        self.stats = GenerationStats(prompt_tokens=prompt_len)
        self.t_submit = time.perf_counter() if t_submit is None else t_submit
        self.t_first = 0.0
        self.generated = 0
        self._stopped = False  # a stop string matched: finish() has no text to add

    def first_token(self, prefilled: int | None = None) -> None:
        """The prompt is computed: time to first token and prefill speed (once). `prefilled`:
        the prompt tokens computed, when not simply those not cached (cache edits)."""
        if self.t_first:
            return
        self.t_first = time.perf_counter()
        st = self.stats
        st.ttft_s = self.t_first - self.t_submit
        st.prefill_tokens = st.prompt_tokens - st.cached_tokens if prefilled is None else prefilled
        st.prefill_tps = st.prefill_tokens / max(st.ttft_s, 1e-9)

    def token(self, token: int, logprob: float | None = None,
              top: list[tuple[int, float]] | None = None) -> tuple[Chunk | None, str | None]:
        """(the chunk to send, or None for EOS; "stop" / "length" if this token ends it).

        After a stop string the chunk holds the text before it and finish() adds nothing.
        """
        if token in self.eos:
            return None, "stop"
        self.generated += 1
        self.detok.add_token(token)
        text, hit = self.stops.feed(self.detok.last_segment)
        chunk = Chunk(text, token, logprob=logprob, top_logprobs=top)
        if hit:
            self._stopped = True
            return chunk, "stop"
        return chunk, "length" if self.generated >= self.max_tokens else None

    def write(self, tokens) -> tuple[Chunk, str | None]:
        """Tokens the engine writes into the output unsampled (a thinking budget's marker):
        their text, in a chunk without a token; not counted as generated. "stop" when a stop
        string matched in it."""
        for token in tokens:
            self.detok.add_token(token)
        text, hit = self.stops.feed(self.detok.last_segment)
        self._stopped = self._stopped or hit
        return Chunk(text, written=tuple(tokens)), "stop" if hit else None

    def finish(self, reason: str, cause: str | None = None) -> Chunk:
        """The last chunk: held-back text (unless a stop string matched) and the stats."""
        tail, stopped = "", self._stopped
        if not stopped:
            self.detok.finalize()
            tail, stopped = self.stops.feed(self.detok.last_segment)
            tail += "" if stopped else self.stops.flush()
        st = self.stats
        st.completion_tokens = self.generated
        st.set_finish("stop" if stopped else reason, self.params.max_tokens, cause)
        if self.t_first:
            elapsed = time.perf_counter() - self.t_first
            st.decode_tps = (self.generated - 1) / elapsed if self.generated > 1 and elapsed > 0 else 0.0
        st.peak_memory_bytes = int(mx.get_peak_memory())
        return Chunk(tail, None, st.finish_reason, st)
