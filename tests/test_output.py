"""The output processor both engines share: EOS, stop strings, max_tokens, stats."""

from __future__ import annotations

import pytest

from mlxlocal.engine.output import Output
from mlxlocal.engine.session import common_prefix
from mlxlocal.engine.types import SamplingParams
from mlxlocal.source.loader import load_from_dir


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return load_from_dir(tiny_model).tokenizer


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def feed(out: Output, tokens: list[int]):
    chunks, finish = [], None
    for t in tokens:
        chunk, finish = out.token(t)
        if chunk is not None:
            chunks.append(chunk)
        if finish:
            break
    return chunks, finish


def test_stop_string_ends_it_and_holds_back_nothing_after(tokenizer):
    out = Output(tokenizer.detokenizer, SamplingParams(stop=["END"]), set(), 3, 100)
    chunks, finish = feed(out, ids(tokenizer, "hello END world"))
    assert finish == "stop"
    last = out.finish(finish)
    assert "".join(c.text for c in chunks) + last.text == "hello "
    assert last.finish_reason == "stop" and last.stats.completion_tokens == len(chunks)


def test_eos_is_not_a_chunk_and_length_counts_tokens(tokenizer):
    eos = ids(tokenizer, "!")[0]
    out = Output(tokenizer.detokenizer, SamplingParams(), {eos}, 3, 100)
    chunks, finish = feed(out, ids(tokenizer, "ab") + [eos] + ids(tokenizer, "cd"))
    assert finish == "stop" and [c.token for c in chunks] == ids(tokenizer, "ab")
    assert out.finish(finish).stats.finish_reason == "stop"
    # ignore_eos: the same id is an ordinary token; max_tokens (clipped) ends it.
    out = Output(tokenizer.detokenizer, SamplingParams(ignore_eos=True, max_tokens=50), {eos}, 3, 2)
    chunks, finish = feed(out, [eos] * 5)
    assert finish == "length" and len(chunks) == 2
    last = out.finish(finish)
    assert (last.stats.finish_reason, last.stats.truncated_by) == ("length", "context")


def test_common_prefix_leaves_one_prompt_token():
    assert common_prefix([1, 2, 3], [1, 2, 3]) == 2
    assert common_prefix([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix([1, 9, 3], [1, 2, 3, 4]) == 1
    assert common_prefix([], [5]) == 0
