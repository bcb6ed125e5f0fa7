"""Speculative decoding from the command line: --draft-model / --prompt-lookup /
--num-draft-tokens on generate, chat, run, serve and bench; the draft's tokenizer checked
against the model's; generate --json's draft fields; chat's /stats; bench's comparison."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
from conftest import FAMILY_CONFIGS, build_tiny
from engine_util import mlx_lm_greedy
from rich.console import Console
from typer.testing import CliRunner

from mlxlocal.cli import app
from mlxlocal.errors import ModelLoadError
from mlxlocal.source.loader import check_draft_tokenizer, load_from_dir

# Repeats its own n-grams: prompt lookup finds drafts in it (and in a looping reply).
REPEATING = "alpha beta gamma delta, alpha beta gamma delta, alpha beta gamma delta, alpha beta"


def cli(*args: str):
    return CliRunner().invoke(app, list(args))


def generate_json(model: Path, *extra: str, prompt: str = REPEATING, n: int = 24) -> dict:
    r = cli("generate", "-m", str(model), "-p", prompt, "-n", str(n), "--ignore-eos", "--json", *extra)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def other_vocab_model(tmp_path_factory) -> Path:
    """The tiny qwen3 shape with a 512-token vocabulary (the tiny model has 384)."""
    return build_tiny(tmp_path_factory.mktemp("vocab512") / "qwen3", dict(FAMILY_CONFIGS["qwen3"], vocab_size=512))


@pytest.fixture(scope="module")
def swapped_ids_model(tiny_model, tmp_path_factory) -> Path:
    """The tiny model with two tokens' ids swapped in its tokenizer: same size, other mapping."""
    path = tmp_path_factory.mktemp("swapped") / "qwen3"
    shutil.copytree(tiny_model, path)
    spec = json.loads((path / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (path / "tokenizer.json").write_text(json.dumps(spec))
    return path


# --- option errors: exit 2 naming the option, before any model loads ----------------------
COMMANDS = {
    "generate": ["generate", "-m", "synthetic:tiny", "-p", "hi"],
    "chat": ["chat", "-m", "synthetic:tiny"],
    "run": ["run", "-m", "synthetic:tiny", "--mcp", "absent.json", "a task"],
    "serve": ["serve", "-m", "synthetic:tiny"],
    "bench": ["bench", "spec"],
}
BAD = [
    (["--draft-model", "synthetic:tiny", "--prompt-lookup"], ["--draft-model", "--prompt-lookup", "not both"]),
    (["--num-draft-tokens", "3"], ["--num-draft-tokens", "needs a drafter"]),
    (["--prompt-lookup", "--num-draft-tokens", "0"], ["--num-draft-tokens", "1..32", "got 0"]),
    (["--draft-model", "synthetic:tiny", "--num-draft-tokens", "33"], ["--num-draft-tokens", "1..32", "got 33"]),
]


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("extra, words", BAD, ids=["both", "no-drafter", "zero", "too-many"])
def test_option_errors_exit_2_naming_the_option(command, extra, words):
    r = cli(*COMMANDS[command], *extra)
    assert r.exit_code == 2, r.output
    for word in words:
        assert word in r.output, r.output
    assert "Traceback" not in r.output


def test_bench_spec_runs_its_own_comparison():
    r = cli("bench", "spec", "--prompt-lookup", "--compare", "mlx-lm")  # not one of its options
    assert r.exit_code == 2 and "--compare" in r.output, r.output
    r = cli("bench", "spec")
    assert r.exit_code == 2 and "--draft-model MODEL, --prompt-lookup or --mtp" in r.output, r.output


def test_serve_options_open_every_engine_with_speculation(monkeypatch, tiny_model):
    seen = {}
    monkeypatch.setattr("mlxlocal.server.banner.run_server", lambda config, console: seen.update(c=config) or True)
    r = cli("serve", "-m", str(tiny_model), "--prompt-lookup", "--num-draft-tokens", "6")
    assert r.exit_code == 0, r.output
    spec = seen["c"].engine_options["speculative"]
    assert (spec.method, spec.draft_spec, spec.num_draft_tokens) == ("lookup", None, 6)
    r = cli("serve", "-m", str(tiny_model), "--draft-model", str(tiny_model))
    spec = seen["c"].engine_options["speculative"] if r.exit_code == 0 else None
    assert r.exit_code == 0 and (spec.method, spec.draft_spec, spec.num_draft_tokens) == ("draft", str(tiny_model), 4)


# --- the draft's tokenizer ---------------------------------------------------------------
@pytest.mark.parametrize("which, words", [
    ("other_vocab_model", ["512 tokens in the draft's vocabulary", "384 in the target's"]),
    ("swapped_ids_model", ["2 of 384 tokens map to other ids"]),
])
def test_draft_with_another_tokenizer_is_refused_naming_both_models(request, tiny_model, which, words):
    draft = request.getfixturevalue(which)
    r = cli("generate", "-m", str(tiny_model), "-p", "hi", "--draft-model", str(draft), "--json")
    assert r.exit_code == 1, r.output
    text = " ".join(r.output.split())
    for word in ["different tokenizers", f"draft model {draft.name} ({draft})", f"target model {tiny_model.name} "
                 f"({tiny_model})", *words]:
        assert word in text, text
    assert "Traceback" not in r.output


def test_tokenizer_check_names_the_token_that_differs(tiny_model, swapped_ids_model):
    target, draft = load_from_dir(tiny_model), load_from_dir(swapped_ids_model)
    with pytest.raises(ModelLoadError, match=r"'a' is id (\d+) in the target, id (?!\1)\d+ in the draft"):
        check_draft_tokenizer(target, draft)
    check_draft_tokenizer(target, load_from_dir(tiny_model))  # another copy of the same tokenizer: fine


def test_self_draft_shares_the_targets_weights_and_a_draft_loads_once(tiny_model, tmp_path):
    from mlxlocal.engine import SpeculationChoice

    self_draft = SpeculationChoice("draft", str(tiny_model))
    first, reloaded = load_from_dir(tiny_model), load_from_dir(tiny_model)  # e.g. after a keep_alive unload
    assert self_draft.draft_for(first) is first and self_draft.draft_for(reloaded) is reloaded
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model, copy)
    other = SpeculationChoice("draft", str(copy))
    draft = other.draft_for(first)
    assert draft is not first and draft.info.path == copy and other.draft_for(reloaded) is draft


def test_speculation_on_the_dense_engine_is_a_clear_error(monkeypatch, tiny_model):
    from mlxlocal.engine import NotPageable

    def not_pageable(loaded):
        raise NotPageable("chunked attention (test)")

    monkeypatch.setattr("mlxlocal.engine.make_runner", not_pageable)
    r = cli("generate", "-m", str(tiny_model), "-p", "hi", "--prompt-lookup")
    assert r.exit_code == 1, r.output
    text = " ".join(r.output.split())
    assert "speculative decoding (prompt lookup" in text and "dense one-sequence engine" in text, text
    assert "Traceback" not in r.output


# --- generate --json ----------------------------------------------------------------------
def test_self_draft_accepts_every_token_and_keeps_greedy_output(tiny_model):
    plain = generate_json(tiny_model)
    spec = generate_json(tiny_model, "--draft-model", str(tiny_model), "--num-draft-tokens", "3")
    assert plain["draft_tokens"] == plain["accepted_tokens"] == 0 and plain["acceptance_rate"] is None
    assert spec["tokens"] == plain["tokens"] and spec["text"] == plain["text"]
    assert spec["draft_tokens"] > 0 and spec["accepted_tokens"] == spec["draft_tokens"]
    assert spec["acceptance_rate"] == 1.0
    # Both are mlx-lm's greedy tokens for the same prompt (a reference outside the engine).
    from mlx_lm import load as mlx_lm_load

    tokenizer = mlx_lm_load(str(tiny_model))[1]
    ids = tokenizer.apply_chat_template([{"role": "user", "content": REPEATING}], add_generation_prompt=True)
    assert spec["prompt_tokens"] == len(ids)
    assert mlx_lm_greedy(tiny_model)(ids, 24) == spec["tokens"]


def test_prompt_lookup_json_fields_and_greedy_output(tiny_model):
    plain = generate_json(tiny_model, "--no-chat-template", n=32)
    spec = generate_json(tiny_model, "--no-chat-template", "--prompt-lookup", n=32)
    assert spec["tokens"] == plain["tokens"]
    assert spec["draft_tokens"] > 0 and 0 <= spec["accepted_tokens"] <= spec["draft_tokens"]
    assert spec["acceptance_rate"] == spec["accepted_tokens"] / spec["draft_tokens"]
    assert spec["completion_tokens"] == 32


# --- chat /stats ----------------------------------------------------------------------------
def test_chat_stats_show_acceptance(tiny_model):
    from mlxlocal.engine import SamplingParams, SpeculationChoice, open_engine
    from mlxlocal.repl.chat import ChatRepl

    options = {"max_num_seqs": 1, "speculative": SpeculationChoice("draft", str(tiny_model), 2)}
    engine = open_engine(load_from_dir(tiny_model), **options)
    try:
        out = io.StringIO()
        repl = ChatRepl(engine, Console(file=out, width=300), params=SamplingParams(max_tokens=12, ignore_eos=True),
                        engine_options=options)
        repl.turn(REPEATING)
        st = engine.stats()
        repl.command("/stats")
        text = out.getvalue()
        assert st["spec_drafted"] > 0 and st["spec_accepted"] == st["spec_drafted"]
        assert (f"speculate draft model {tiny_model}, up to 2 draft tokens per step: {st['spec_accepted']} of "
                f"{st['spec_drafted']} drafted tokens accepted (100%)") in text, text
        assert f"({repl.last_stats.accepted_tokens}/{repl.last_stats.draft_tokens} drafted accepted)" in text
    finally:
        engine.shutdown()


# --- bench ------------------------------------------------------------------------------------
def bench_json(*args: str) -> dict:
    r = cli("bench", *args, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout.strip().splitlines()[-1])


ROW_KEYS = {"prompt", "batch", "prompt_tokens", "acceptance", "accepted_per_step", "tokens_per_forward",
            "plain_decode_tps", "spec_decode_tps", "ratio", "identical", "verdict", "reply_distinct", "passes",
            "drafter"}


def test_bench_prompt_lookup_json(tiny_model):
    res = bench_json("spec", "-m", str(tiny_model), "--prompt-lookup", "-g", "16", "-n", "1", "--warmup", "0")
    s = res["speculative"]
    assert s["drafter"] == {"method": "lookup", "draft_model": None, "num_draft_tokens": 4}
    assert [(r["prompt"], r["batch"]) for r in s["rows"]] == [("repetitive", 1), ("free", 1)]
    for r in s["rows"]:
        assert set(r) == ROW_KEYS and r["identical"] is True
        (p,) = r["passes"]
        assert p["plain"]["tokens"] == p["spec"]["tokens"] == 16 and p["plain"]["drafted"] == 0
        assert r["ratio"] == pytest.approx(p["spec"]["decode_tps"] / p["plain"]["decode_tps"])
        assert r["verdict"] in ("wins", "loses", "even")


def test_bench_self_draft_accepts_everything_at_batch_1_and_2(tiny_model):
    res = bench_json("spec", "-m", str(tiny_model), "--draft-model", str(tiny_model), "-g", "12", "-n", "1", "--warmup",
                     "0", "-b", "2")
    rows = res["speculative"]["rows"]
    assert [(r["prompt"], r["batch"]) for r in rows] == [("repetitive", 1), ("free", 1), ("repetitive", 2),
                                                         ("free", 2)]
    for r in rows:
        assert r["identical"] is True and r["acceptance"] == 1.0, r
        # every draft accepted: more than one token per forward
        assert r["tokens_per_forward"] > 1 and r["passes"][0]["spec"]["tokens"] == 12 * r["batch"]
