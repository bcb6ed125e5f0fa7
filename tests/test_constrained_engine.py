"""Grammar-constrained decoding in the engines: masks in batched sampling, pipelined steps,
forced tokens, finishes, and free requests left untouched (issue 14's engine half).

The grammars here are compiled by llguidance directly, not by mlxlocal.grammar, so the
engine is checked against a reference it does not build itself; random-weight models make
only the constraint able to produce a valid document.
"""

from __future__ import annotations

import json
import random

import jsonschema
import llguidance
import mlx.core as mx
import pytest

from mlxlocal.engine import Grammar, PagedEngine, SamplingParams, SimpleEngine, open_engine
from mlxlocal.engine.sampling import Sampler, sample_batch
from mlxlocal.source.loader import load_from_dir

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def schema_grammar(schema: dict, param: str = "response_format") -> Grammar:
    return Grammar(llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(schema), defaults={"whitespace_flexible": False}), param)


GRAMMAR = schema_grammar(SCHEMA)


def text_of(chunks) -> str:
    return "".join(c.text for c in chunks)


@pytest.fixture(scope="module", params=["native", "mlx-lm path", "hybrid", "sliding window"])
def engine(request, tiny_model, gemma_model, mlx_lm_models):
    path = {"native": tiny_model, "mlx-lm path": gemma_model, "hybrid": mlx_lm_models["hybrid"], "sliding window": mlx_lm_models["gemma3"]}[request.param]
    eng = open_engine(load_from_dir(path), block_size=16, kv_blocks=256)
    assert isinstance(eng, PagedEngine)
    yield eng
    eng.shutdown()


def prompt(eng, i: int = 0) -> list[int]:
    return eng.encode_text(f"Reply in JSON, please ({i}):")


def test_batched_constrained_outputs_validate(engine):
    """Eight constrained requests at once, greedy and sampled: every one is a whole document
    that validates, and the batch holds different documents (the sampler still samples)."""
    handles = [engine.submit(prompt(engine, i), SamplingParams(
        max_tokens=120, temperature=0.0 if i < 2 else 1.0, seed=i, grammar=GRAMMAR)) for i in range(8)]
    texts = []
    for h in handles:
        chunks = list(h)
        stats = chunks[-1].stats
        assert stats.finish_reason == "stop" and stats.grammar_complete is True, text_of(chunks)
        jsonschema.validate(json.loads(text_of(chunks)), SCHEMA)
        texts.append(text_of(chunks))
    assert len(set(texts)) >= 4, texts


def test_free_requests_get_the_same_tokens_in_a_mixed_batch(engine):
    free = [SamplingParams(max_tokens=24, ignore_eos=True),
            SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.9, seed=5, logprobs=2)]

    def tokens(chunks):
        return [(c.token, c.logprob) for c in chunks if c.token is not None]
    alone = [tokens(engine.submit(prompt(engine, 9 + i), p)) for i, p in enumerate(free)]
    handles = []
    for i in range(6):  # interleaved with constrained requests of every kind
        if i in (1, 4):
            handles.append(engine.submit(prompt(engine, 9 + i // 4), free[i // 4]))
        else:
            handles.append(engine.submit(prompt(engine, i), SamplingParams(
                max_tokens=80, temperature=0.7 * (i % 2), seed=i, grammar=GRAMMAR)))
    together = [tokens(handles[1]), tokens(handles[4])]
    for i in (0, 2, 3, 5):
        jsonschema.validate(json.loads(text_of(handles[i])), SCHEMA)
    assert together == alone


def test_grammar_that_cannot_finish_ends_with_length_and_says_so(engine):
    long = schema_grammar({"type": "array", "items": {"type": "integer"}, "minItems": 50})
    chunks = list(engine.submit(prompt(engine), SamplingParams(max_tokens=20, grammar=long)))
    stats = chunks[-1].stats
    assert stats.finish_reason == "length" and stats.truncated_by == "max_tokens"
    assert stats.grammar_complete is False
    assert text_of(chunks).startswith("[")


def test_forced_tokens_are_fed_in_one_forward_when_alone(engine, monkeypatch):
    """A schema with one possible document: alone, the engine feeds it as forced tokens in
    a few forwards, not one per token; the text is the document either way."""
    const = {"type": "object", "properties": {"answer": {"const": "forty-two, as computed"}},
             "required": ["answer"], "additionalProperties": False}
    grammar = schema_grammar(const)
    calls = []
    forward = engine.runner.forward
    monkeypatch.setattr(engine.runner, "forward",
                        lambda pools, seqs, n, **kw: calls.append(n) or forward(pools, seqs, n, **kw))
    chunks = list(engine.submit(prompt(engine), SamplingParams(max_tokens=60, grammar=grammar)))
    assert json.loads(text_of(chunks)) == {"answer": "forty-two, as computed"}
    n_tokens = chunks[-1].stats.completion_tokens
    assert n_tokens >= 5 and chunks[-1].finish_reason == "stop"
    # The prompt's prefill, the forced document in one chunk (hybrids cut it where a state
    # snapshot is kept), EOS sampled, and at most the pipeline's one wasted step: far fewer
    # forwards than tokens (one per token without jumping).
    assert len(calls) <= 4 < n_tokens, calls
    assert sum(calls[1:]) >= n_tokens


def test_bad_grammar_and_ignore_eos_are_refused_at_submit(engine):
    with pytest.raises(ValueError, match="response_format"):
        engine.submit(prompt(engine), SamplingParams(grammar=Grammar('{"grammars": [{"nonsense": 1}]}', "response_format")))
    with pytest.raises(ValueError, match="ignore_eos cannot be combined with response_format"):
        engine.submit(prompt(engine), SamplingParams(ignore_eos=True, grammar=GRAMMAR))
    # and the engine goes on
    assert json.loads(text_of(engine.submit(prompt(engine), SamplingParams(max_tokens=120, grammar=GRAMMAR))))


def test_sessions_keep_their_prefix_with_a_grammar(engine):
    session = engine.new_session()
    first = prompt(engine)
    text = text_of(engine.submit(first, SamplingParams(max_tokens=120, grammar=GRAMMAR), session=session))
    second = first + engine.encode_text(text + " And again:")
    chunks = list(engine.submit(second, SamplingParams(max_tokens=120, grammar=GRAMMAR), session=session))
    assert chunks[-1].stats.cached_tokens >= len(first)
    jsonschema.validate(json.loads(text_of(chunks)), SCHEMA)
    session.reset()


def test_dense_engine_honours_the_grammar(tiny_model):
    eng = SimpleEngine(load_from_dir(tiny_model), paged_reason="test")
    try:
        for seed in range(3):
            chunks = list(eng.generate(prompt(eng), SamplingParams(max_tokens=120, temperature=1.0, seed=seed,
                                                                   grammar=GRAMMAR)))
            assert chunks[-1].stats.grammar_complete is True
            jsonschema.validate(json.loads(text_of(chunks)), SCHEMA)
        with pytest.raises(ValueError, match="ignore_eos"):
            eng.generate(prompt(eng), SamplingParams(ignore_eos=True, grammar=GRAMMAR))
    finally:
        eng.shutdown()


def test_masked_batch_sampling_matches_the_per_request_sampler():
    """sample_batch with grammar masks on some rows picks, bit for bit, what each row's own
    Sampler picks with the same mask; the reported logprobs are the model's, unmasked."""
    vocab, n = 128, 10
    rng = random.Random(3)
    params = [SamplingParams(seed=i, temperature=rng.choice([0.0, 0.6, 1.0]), top_p=rng.choice([1.0, 0.9]),
                             logprobs=rng.choice([None, 0, 3])) for i in range(n)]
    alone, together = [Sampler(p) for p in params], [Sampler(p) for p in params]
    for step in range(6):
        logits = mx.random.normal((n, vocab), key=mx.random.key(step)) * 4
        rows = sorted(rng.sample(range(n), 6))
        masks = mx.random.uniform(shape=(len(rows), vocab), key=mx.random.key(100 + step)) < 0.1
        masks = masks.at[:, step].add(True)  # never empty
        tokens, lps = sample_batch(together, logits, [[1]] * n, [None] * n, (rows, masks))
        for i in range(n):
            mask = masks[rows.index(i) : rows.index(i) + 1] if i in rows else None
            token, full = alone[i](logits[i : i + 1], [1], None, mask)
            assert int(token.item()) == tokens[i].item(), (step, i)
            if i in rows:
                assert mask[0, int(token.item())].item()
            if params[i].logprobs is not None:
                want = mx.take_along_axis(full, token.reshape(1, 1), axis=-1).item()
                assert lps[i][0].item() == pytest.approx(want, abs=1e-5)


def test_one_by_one_fallback_keeps_the_masks(tiny_model, monkeypatch):
    """When batched sampling fails, the engine samples row by row: each constrained row
    still gets its own mask."""
    eng = open_engine(load_from_dir(tiny_model), block_size=16, kv_blocks=128)

    def broken(*args, **kwargs):
        raise RuntimeError("batched sampling broken")
    monkeypatch.setattr("mlxlocal.engine.sampling.sample_batch", broken)
    try:
        handles = [eng.submit(prompt(eng, i), SamplingParams(max_tokens=120, temperature=1.0, seed=i,
                                                             grammar=GRAMMAR if i % 2 else None)) for i in range(4)]
        for i, h in enumerate(handles):
            text = text_of(h)
            if i % 2:
                jsonschema.validate(json.loads(text), SCHEMA)
    finally:
        eng.shutdown()
