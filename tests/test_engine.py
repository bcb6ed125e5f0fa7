"""Engine behaviour: sessions, stop strings, limits, sampling, cancellation."""

from __future__ import annotations

import re
import threading

import pytest

from mlxlocal.engine import SamplingParams, open_engine
from mlxlocal.engine.stop import StopMatcher
from mlxlocal.errors import ContextLengthError
from mlxlocal.source.loader import load_from_dir


@pytest.fixture(scope="module")
def engine(tiny_model):
    return open_engine(load_from_dir(tiny_model))


def run(engine, prompt, session=None, cancel=None, **kw):
    chunks = list(engine.generate(prompt, SamplingParams(**kw), session=session, cancel=cancel))
    tokens = [c.token for c in chunks if c.token is not None]
    return "".join(c.text for c in chunks), tokens, chunks[-1].stats


def test_session_reuses_prefix_and_matches_fresh_run(engine):
    messages = [{"role": "user", "content": "hello there, how are you today?"}]
    session = engine.new_session()
    prompt1 = engine.encode_chat(messages)
    text1, _, stats1 = run(engine, prompt1, session, max_tokens=8, ignore_eos=True)
    assert stats1.cached_tokens == 0
    messages += [{"role": "assistant", "content": text1}, {"role": "user", "content": "and then?"}]
    prompt2 = engine.encode_chat(messages)
    _, tokens2, stats2 = run(engine, prompt2, session, max_tokens=8, ignore_eos=True)
    # The second turn prefills only what is new: the first turn's prompt came from the cache.
    assert stats2.cached_tokens >= len(prompt1) - 1
    assert stats2.cached_tokens < len(prompt2)
    _, fresh_tokens, _ = run(engine, prompt2, max_tokens=8, ignore_eos=True)
    assert tokens2 == fresh_tokens


def test_session_diverging_prompt_trims_cache(engine):
    session = engine.new_session()
    a = engine.encode_text("one two three four five six seven")
    b = engine.encode_text("one two three nine")
    run(engine, a, session, max_tokens=4, ignore_eos=True)
    _, tokens_b, stats = run(engine, b, session, max_tokens=6, ignore_eos=True)
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    # A block the prefix cache also holds is never written into (copy on write): the
    # session then keeps only the whole blocks before the divergence.
    assert stats.cached_tokens in (common, common // 16 * 16)
    assert tokens_b == run(engine, b, max_tokens=6, ignore_eos=True)[1]


def test_identical_prompt_reprefills_last_token(engine):
    session = engine.new_session()
    p = engine.encode_text("repeat after me")
    first = run(engine, p, session, max_tokens=5, ignore_eos=True)[1]
    again, stats = run(engine, p, session, max_tokens=5, ignore_eos=True)[1:]
    assert stats.cached_tokens == len(p) - 1
    assert again == first


def test_stop_string_cuts_text(engine):
    p = engine.encode_text("the quick brown fox")
    text, tokens, _ = run(engine, p, max_tokens=20, ignore_eos=True)
    assert len(text) > 6
    stop = text[3:6]
    cut_text, _, stats = run(engine, p, max_tokens=20, ignore_eos=True, stop=[stop])
    assert stats.finish_reason == "stop"
    assert cut_text == text[: text.index(stop)]
    assert stop not in cut_text


@pytest.mark.parametrize(
    "pieces, stops, expected",
    [
        (["hel", "lo wor", "ld"], ["lo w"], ("hel", True)),
        (["abc", "de"], ["xyz"], ("abcde", False)),
        (["ab", "cX", "Y"], ["XYZ"], ("abc", False)),  # "XY" held back, still could become XYZ
        (["foo<", "/s", ">bar"], ["</s>"], ("foo", True)),
    ],
)
def test_stop_matcher(pieces, stops, expected):
    m = StopMatcher(stops)
    out, hit = "", False
    for p in pieces:
        text, hit = m.feed(p)
        out += text
        if hit:
            break
    assert (out, hit) == expected


def test_prompt_over_context_is_clear_error(engine):
    too_long = [5] * (engine.context_length + 1)
    with pytest.raises(ContextLengthError) as e:
        list(engine.generate(too_long, SamplingParams(max_tokens=1)))
    assert str(engine.context_length + 1) in str(e.value) and str(engine.context_length) in str(e.value)


def test_generation_stops_at_context_end(engine):
    n = engine.context_length - 3
    _, tokens, stats = run(engine, [7] * n, max_tokens=50, ignore_eos=True)
    assert len(tokens) == 3 and stats.finish_reason == "length" and stats.truncated_by == "context"
    _, tokens, stats = run(engine, [7] * n, max_tokens=2, ignore_eos=True)
    assert len(tokens) == 2 and (stats.finish_reason, stats.truncated_by) == ("length", "max_tokens")


def test_seeded_sampling_is_reproducible(engine):
    p = engine.encode_text("sample something")
    a = run(engine, p, max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)[1]
    b = run(engine, p, max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)[1]
    c = run(engine, p, max_tokens=12, temperature=1.0, seed=8, ignore_eos=True)[1]
    assert a == b and a != c


def test_cancel_stops_generation(engine):
    cancel = threading.Event()
    chunks = []
    for chunk in engine.generate(engine.encode_text("go on"), SamplingParams(max_tokens=200, ignore_eos=True), cancel=cancel):
        chunks.append(chunk)
        if len(chunks) == 3:
            cancel.set()
    assert chunks[-1].finish_reason == "cancelled"
    assert chunks[-1].stats.completion_tokens <= 4


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(temperature=-1), dict(top_p=0), dict(stop=[""])])
def test_bad_sampling_params_rejected(engine, bad):
    with pytest.raises(ValueError):
        list(engine.generate([1, 2], SamplingParams(**bad)))


@pytest.mark.parametrize("prompt,names", [
    ([1, -1], "got -1"), ([1, 10**6], "got 1000000"), ([1, 2.0], "integers"), ([1, None], "integers"),
    ([1, 2**70], "integers")])
def test_prompt_ids_outside_the_vocabulary_or_not_integers_rejected(engine, prompt, names):
    with pytest.raises(ValueError, match=re.escape(names)):
        engine.submit(prompt, SamplingParams(max_tokens=1))
    assert [c.token for c in engine.generate([1, 2], SamplingParams(max_tokens=2, ignore_eos=True))
            if c.token is not None] != []  # nothing queued by the refusals: it still serves


def test_chat_template_renders_tools(engine):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "weather in Paris?"}]
    with_tools = engine.decode(engine.encode_chat(messages, tools=tools))
    without = engine.decode(engine.encode_chat(messages))
    assert "get_weather" in with_tools and "get_weather" not in without
    assert with_tools.rstrip().endswith(without.rstrip().rsplit("\n", 1)[-1])


def test_simple_engine_submit_streams_like_generate(tmp_path):
    """Models on the mlx-lm path serve the same submit API (sync and asyncio) as the paged engine."""
    import asyncio

    from conftest import BASE, build_tiny

    from mlxlocal.engine import SimpleEngine

    path = build_tiny(tmp_path / "gemma", dict(BASE, model_type="gemma", rope_theta=10000.0))
    engine = SimpleEngine(load_from_dir(path))
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    expected = [c.token for c in engine.generate([3, 4, 5], params) if c.token is not None]
    assert [c.token for c in engine.submit([3, 4, 5], params) if c.token is not None] == expected

    async def stream():
        handle = engine.submit([3, 4, 5], params, loop=asyncio.get_running_loop())
        return [c.token async for c in handle.astream() if c.token is not None]

    assert asyncio.run(stream()) == expected
    with pytest.raises(ContextLengthError):
        engine.submit([5] * engine.context_length, params)


def test_simple_engine_says_what_ended_the_reply(tmp_path):
    """The mlx-lm path reports the context window and max_tokens like the paged engine."""
    from conftest import BASE, build_tiny

    from mlxlocal.engine import SimpleEngine

    path = build_tiny(tmp_path / "gemma", dict(BASE, model_type="gemma", rope_theta=10000.0))
    engine = SimpleEngine(load_from_dir(path))
    n = engine.context_length - 4
    _, tokens, stats = run(engine, [7] * n, max_tokens=50, ignore_eos=True)
    assert len(tokens) == 4 and (stats.finish_reason, stats.truncated_by) == ("length", "context")
    _, tokens, stats = run(engine, [7] * 10, max_tokens=3, ignore_eos=True)
    assert len(tokens) == 3 and (stats.finish_reason, stats.truncated_by) == ("length", "max_tokens")
    stop = engine.decode([tokens[0]])
    _, _, stats = run(engine, [7] * 10, max_tokens=3, ignore_eos=True, stop=[stop])
    assert (stats.finish_reason, stats.truncated_by) == ("stop", None)
