"""The thinking budget (SamplingParams.think_budget) in the engines: one submission, the
think-end marker written once the budget is spent inside an open think block, decoding on.

The model is steered with logit_bias (every engine applies it): it writes "x" at every
step, so a prompt that ends with the opening marker gives a think block that never closes
by itself. The marker is fed to the model (the session holds it) but not counted as output.
"""

from __future__ import annotations

import pytest

from mlxlocal.engine import SamplingParams, SimpleEngine, SpeculativeConfig, open_engine
from mlxlocal.source.loader import load_from_dir

CLOSE = "\n</think>\n\n"


@pytest.fixture(scope="module")
def paged(tiny_model):
    return open_engine(load_from_dir(tiny_model))


@pytest.fixture(scope="module")
def dense(gemma_model):
    return SimpleEngine(load_from_dir(gemma_model))


@pytest.fixture(scope="module")
def lookup(tiny_model):  # drafts of "x" are always right: the marker lands inside a verify
    return open_engine(load_from_dir(tiny_model), speculative=SpeculativeConfig("lookup"))


def ids(engine, text: str) -> list[int]:
    return list(engine.tokenizer.encode(text, add_special_tokens=False))


def thinking_prompt(engine, open_block: bool = True) -> list[int]:
    prompt = engine.encode_chat([{"role": "user", "content": "think hard"}])
    return prompt + (ids(engine, "<think>\n") if open_block else [])


def generate(engine, prompt, session=None, **kw):
    x = ids(engine, "x")[0]
    params = SamplingParams(logit_bias={x: 100.0}, ignore_eos=True, **kw)
    return list(engine.generate(prompt, params, session=session))


def run(engine, prompt, session=None, **kw):
    chunks = generate(engine, prompt, session, **kw)
    tokens = [c.token for c in chunks if c.token is not None]
    return "".join(c.text for c in chunks), tokens, chunks[-1].stats


@pytest.mark.parametrize("name", ["paged", "dense", "lookup"])
def test_budget_writes_the_think_end_in_one_submission(name, request):
    engine = request.getfixturevalue(name)
    x = ids(engine, "x")[0]
    prompt, session = thinking_prompt(engine), engine.new_session()
    text, tokens, stats = run(engine, prompt, session, max_tokens=20, think_budget=5)
    assert text == "x" * 5 + CLOSE + "x" * 15
    # The marker is no output: 20 tokens counted, the full max_tokens after it.
    assert tokens == [x] * 20 and stats.completion_tokens == 20
    assert stats.finish_reason == "length" and stats.truncated_by == "max_tokens"
    assert name != "lookup" or stats.accepted_tokens > 0  # tokens came from verified drafts
    # ... but the model saw it: the session's cache holds it between the thoughts and the answer.
    assert session.tokens[: len(prompt) + 5 + len(ids(engine, CLOSE)) + 1] == (
        prompt + [x] * 5 + ids(engine, CLOSE) + [x])


@pytest.mark.parametrize("name", ["paged", "lookup"])
def test_the_answer_follows_the_marker(name, request):
    """The tokens after the marker are the model's continuation of prompt + thoughts + marker:
    their logprobs are those of a fresh request with all of that as its prompt."""
    engine = request.getfixturevalue(name)
    prompt, x = thinking_prompt(engine), ids(engine, "x")[0]
    budgeted = generate(engine, prompt, max_tokens=12, think_budget=5, logprobs=3)
    fresh = generate(engine, prompt + [x] * 5 + ids(engine, CLOSE), max_tokens=7, logprobs=3)

    def runners_up(chunks):  # x's own logprob is ~0 under its bias: the others tell the state
        return [c.top_logprobs[1:] for c in chunks if c.token is not None]
    after, expected = runners_up(budgeted)[5:], runners_up(fresh)
    assert [[t for t, _ in top] for top in after] == [[t for t, _ in top] for top in expected]
    values = [v for top in expected for _, v in top]
    assert [v for top in after for _, v in top] == pytest.approx(values, abs=1e-3)
    # Before the marker: other states, other runners-up (the check above can tell).
    assert runners_up(budgeted)[:5] != expected[:5]


def test_the_dense_cache_holds_the_marker(dense):
    """The dense engine reports no logprobs: its session's cache, reused by a next turn, must
    continue as a fresh cache over the same ids does."""
    prompt, x, session = thinking_prompt(dense), ids(dense, "x")[0], dense.new_session()
    _, tokens, _ = run(dense, prompt, session, max_tokens=8, think_budget=3)
    history = prompt + [x] * 3 + ids(dense, CLOSE) + [x] * 5
    turn = history + ids(dense, " and then")
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    reused = list(dense.generate(turn, params, session=session))
    assert reused[-1].stats.cached_tokens == len(history) - 1
    fresh = list(dense.generate(turn, params))
    assert [c.token for c in reused] == [c.token for c in fresh]


@pytest.mark.parametrize("name", ["paged", "dense"])
def test_no_marker_without_an_open_block_or_under_the_budget(name, request):
    engine = request.getfixturevalue(name)
    # No think block open: the budget has nothing to close.
    closed = thinking_prompt(engine, open_block=False)
    assert run(engine, closed, max_tokens=12, think_budget=4)[0] == "x" * 12
    # The reply ends before the budget does.
    assert run(engine, thinking_prompt(engine), max_tokens=6, think_budget=6)[0] == "x" * 6
    # No budget: thinks to the end.
    assert run(engine, thinking_prompt(engine), max_tokens=8)[0] == "x" * 8


def test_batched_requests_keep_their_own_budgets(paged):
    prompt = thinking_prompt(paged)
    x = ids(paged, "x")[0]
    handles = [paged.submit(prompt, SamplingParams(max_tokens=16, think_budget=b, ignore_eos=True,
                                                   logit_bias={x: 100.0})) for b in (3, None, 9)]
    texts = ["".join(c.text for c in h) for h in handles]
    assert texts == ["x" * 3 + CLOSE + "x" * 13, "x" * 16, "x" * 9 + CLOSE + "x" * 7]


def test_the_marker_needs_room_in_the_context(paged):
    ctx = paged.context_length
    marker = len(ids(paged, CLOSE))
    filler = ids(paged, " a") * ctx
    prompt = thinking_prompt(paged)
    # Room for 3 thoughts, the marker and 1 token more: the answer gets that one.
    prompt = filler[: ctx - len(prompt) - (3 + marker + 1)] + prompt
    text, tokens, stats = run(paged, prompt, max_tokens=100, think_budget=3)
    assert text == "x" * 3 + CLOSE + "x" and len(tokens) == 4
    assert stats.finish_reason == "length" and stats.truncated_by == "context"
    # No room for the marker and an answer token: it ends at the budget.
    text, tokens, stats = run(paged, filler[:1] + prompt, max_tokens=100, think_budget=3)
    assert text == "x" * 3 and stats.truncated_by == "context"


@pytest.mark.parametrize("bad", [0, -1, 2**31, 1.5, True, "8"])
def test_think_budget_is_checked(bad):
    with pytest.raises(ValueError, match="think_budget"):
        SamplingParams(think_budget=bad).validate()
