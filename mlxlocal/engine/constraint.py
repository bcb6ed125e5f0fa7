"""Grammar-constrained decoding: one llguidance matcher per request, token masks per step.

A request's grammar (llguidance's format, built and checked by mlxlocal.grammar) is
compiled against the model's tokenizer when it is submitted. Each step the engine asks
every constrained request in the batch for the tokens its grammar allows next (computed on
the CPU, all rows in one call, while the device runs the step's forward), the sampler
picks among those only, and the picked token is fed back to the matcher. When the
grammar is complete only EOS is allowed, so the request ends there.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import llguidance
import llguidance.hf
import mlx.core as mx
import numpy as np

from mlxlocal.engine.types import Grammar
from mlxlocal.source.chat_format import ChatFormat

# Compiled grammars kept per tokenizer (least recently used dropped): a matcher holds its
# lexer, so the count stays small.
CACHE_GRAMMARS = 32
# llguidance's default limits, without its verbose errors: those quote the whole grammar
# (tens of KB for a large schema) into a message a client gets back.
LIMITS = llguidance.LLParserLimits(verbose_errors=False)


class GrammarTokenizers:
    """The model's tokenizer as llguidance sees it, built on first use (a 150k vocabulary
    takes a while) and shared by every matcher; plus one executor for batched masks."""

    def __init__(self, chat_format: ChatFormat, vocab: int):
        self._format = chat_format
        self.vocab = vocab  # the logits' width, which may exceed the tokenizer's
        self._ll: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self.executor = llguidance.LLExecutor()
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()  # spec -> fresh matcher
        self.counters = {"compiles": 0, "cache_hits": 0}

    @property
    def ll(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll is None:  # under the lock: built once
                # The turn's own end token: a grammar's end is where the model's reply ends.
                fmt = self._format
                self._ll = llguidance.hf.from_tokenizer(fmt.hf, n_vocab=self.vocab,
                                                        eos_token=fmt.eos_token_id)
            return self._ll

    def compile(self, grammar: Grammar) -> Constraint:
        """A fresh matcher for one request; ValueError naming the request field if the
        grammar does not compile against this tokenizer. A grammar compiled before (agents
        send the same schema every turn) is copied from the cache instead of compiled again."""
        with self._lock:
            cached = self._compiled.get(grammar.spec)
            if cached is not None:
                self._compiled.move_to_end(grammar.spec)
                self.counters["cache_hits"] += 1
                return Constraint(cached.deep_copy(), grammar)
        ll = self.ll
        # Outside the lock (a compile can take seconds): two requests with one new grammar
        # may both compile it.
        matcher = llguidance.LLMatcher(ll, grammar.spec, log_level=0, limits=LIMITS)
        if matcher.is_error():
            raise ValueError(f"{grammar.param}: {matcher.get_error()}")
        with self._lock:
            self.counters["compiles"] += 1
            self._compiled[grammar.spec] = matcher.deep_copy()
            while len(self._compiled) > CACHE_GRAMMARS:
                self._compiled.popitem(last=False)
        return Constraint(matcher, grammar)


class Constraint:
    """One request's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, grammar: Grammar):
        self.matcher = matcher
        self.grammar = grammar

    def advance(self, token: int) -> None:
        """Feed a generated token; a token the grammar refuses is a bug in masking."""
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"token {token} broke the grammar of {self.grammar.param}: "
                               f"{self.matcher.get_error()}")

    def forced(self) -> list[int]:
        """The tokens the grammar allows as the only continuation (may be empty)."""
        return [] if self.matcher.is_stopped() else list(self.matcher.compute_ff_tokens())

    @property
    def complete(self) -> bool:
        """The output so far is a whole document of the grammar."""
        return self.matcher.is_accepting() or self.matcher.is_stopped()


def allowed_tokens(tokenizers: GrammarTokenizers, constraints: list[Constraint]) -> mx.array:
    """[n, vocab] bool: the tokens each constraint allows next, rows in order."""
    words = (tokenizers.vocab + 31) // 32
    bitmask = np.empty((len(constraints), words), dtype=np.int32)
    tokenizers.executor.unsafe_compute_mask_ptr(
        [(c.matcher, i) for i, c in enumerate(constraints)], bitmask.ctypes.data, words * 4, len(constraints))
    for c in constraints:
        if c.matcher.is_error():
            raise RuntimeError(f"the grammar of {c.grammar.param} failed: {c.matcher.get_error()}")
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, : tokenizers.vocab]
    return mx.array(bits.view(np.bool_))  # 0/1 bytes: a bool view, no copy
