"""Multi-token prediction: MTP modules load from two families' checkpoint layouts, draft in the
paged engine, and never change what the model says.

- DeepSeek-V3 (`model.layers.{N}.eh_proj...`) and Qwen3.5 (`mtp.fc...`) tiny checkpoints in
  their exact tensor names load with their MTP module; the model itself still gives mlx-lm's
  own greedy tokens (mlx-lm drops the module), and a conversion without the module says so.
- Greedy outputs with MTP drafting equal plain decoding, batch 1 and batched, on both.
- On synthetic:mtp-tiny (trained here, synthetic/trained.py) the drafts are accepted far above
  chance on held-out text, every first draft equals the one a dense reference computes (the
  model's hidden states and the module over mlx-lm's own caches, no paged pools), and sampled
  tokens keep the model's own distribution (chi-square against mlx-lm's probabilities).
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mtp_util import mlx_lm_reference, write_deepseek, write_qwen35
from test_speculative import assert_follows_the_model

from mlxlocal.engine import (
    SamplingParams,
    SpeculationChoice,
    SpeculationError,
    SpeculativeConfig,
    open_engine,
)
from mlxlocal.source.loader import load
from mlxlocal.source.synthetic import materialize

PROMPT = [5, 17, 42, 99, 7, 3, 250, 11] * 3
MTP = SpeculativeConfig("mtp", num_draft_tokens=3)


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    return {"deepseek": write_deepseek(root / "deepseek"), "qwen3.5": write_qwen35(root / "qwen35")}


@pytest.fixture(scope="module")
def trained():
    """synthetic:mtp-tiny, trained on its first use (about 2 minutes) and kept under
    MLXLOCAL_HOME like every synthetic model."""
    return load(str(materialize("synthetic:mtp-tiny", quiet=True)))


def tokens(engine, prompt, n=24, **kw):
    chunks = list(engine.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True, **kw)))
    return [c.token for c in chunks if c.token is not None], chunks[-1].stats


def batch_tokens(engine, prompts, n=24):
    handles = [engine.submit(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p in prompts]
    return [[c.token for c in h if c.token is not None] for h in handles]


@pytest.mark.parametrize("family", ["deepseek", "qwen3.5"])
def test_checkpoint_layouts_load_their_mtp_module(family_dirs, family):
    path = family_dirs[family]
    loaded = load(str(path))
    assert len(loaded.mtp) == 1
    layout = ("model.layers.N, as DeepSeek-V3 and GLM-4.5" if family == "deepseek"
              else "mtp.*, as Qwen3.5")
    assert f"MTP: 1 module(s) loaded ({layout}); --mtp drafts with them" in loaded.info.notes
    file = mx.load(str(path / "model.safetensors"))
    module = dict(tree_flatten(loaded.mtp[0].parameters()))
    if family == "deepseek":  # the module's own parts, as the checkpoint names them
        assert mx.array_equal(module["eh_proj.weight"], file["model.layers.2.eh_proj.weight"])
        assert mx.array_equal(module["norm.weight"], file["model.layers.2.shared_head.norm.weight"])
        # its layer through the family's sanitize: experts stacked, kv_b_proj split
        assert module["layer.mlp.switch_mlp.gate_proj.weight"].shape[0] == 4
        assert mx.array_equal(module["layer.mlp.switch_mlp.up_proj.weight"][3],
                              file["model.layers.2.mlp.experts.3.up_proj.weight"])
        # shared_head.head and embed_tokens equal the model's: shared, not held twice
        assert "head.weight" not in module and "embed.weight" not in module
    else:  # Qwen keeps norms zero-centred: +1, as mlx-lm does the model's own
        assert mx.array_equal(module["eh_proj.weight"], file["mtp.fc.weight"])
        assert mx.allclose(module["enorm.weight"], file["mtp.pre_fc_norm_embedding.weight"] + 1)
        assert mx.allclose(module["hnorm.weight"], file["mtp.pre_fc_norm_hidden.weight"] + 1)
        assert mx.allclose(module["layer.input_layernorm.weight"],
                           file["mtp.layers.0.input_layernorm.weight"] + 1)
    # The model itself is untouched: mlx-lm's own model on the model's tensors agrees.
    ref = mlx_lm_reference(path)
    ours = loaded.model
    x = mx.array([PROMPT])
    assert mx.allclose(ours(x), ref(x), atol=1e-4)


@pytest.mark.parametrize("family", ["deepseek", "qwen3.5"])
def test_greedy_identical_with_and_without_mtp(family_dirs, family):
    loaded = load(str(family_dirs[family]))
    plain = open_engine(loaded, kv_blocks=128, max_num_seqs=4)
    spec = open_engine(loaded, kv_blocks=128, max_num_seqs=4, speculative=MTP)
    try:
        want, _ = tokens(plain, PROMPT)
        got, stats = tokens(spec, PROMPT)
        assert got == want and stats.draft_tokens > 0
        prompts = [PROMPT[i:] for i in range(4)]
        assert batch_tokens(spec, prompts) == batch_tokens(plain, prompts)
    finally:
        plain.shutdown()
        spec.shutdown()


def test_a_conversion_without_the_module_says_so_and_mtp_n_is_refused(tmp_path):
    loaded = load(str(write_deepseek(tmp_path / "dropped", mtp=False)))
    assert loaded.mtp == []
    assert any("declares 1 module(s) but the checkpoint has none" in n for n in loaded.info.notes)
    with pytest.raises(SpeculationError, match="has no MTP modules"):
        open_engine(loaded, kv_blocks=64, speculative=SpeculationChoice("mtp", None, 3))
    # auto: the model decodes as it is
    auto = SpeculationChoice("mtp", None, 3, auto=True)
    engine = open_engine(loaded, kv_blocks=64, speculative=auto)
    try:
        assert engine.stats()["spec_steps"] == 0 and tokens(engine, PROMPT, 4)[1].draft_tokens == 0
    finally:
        engine.shutdown()


def held_out(loaded) -> list[list[int]]:
    return list(json.loads((loaded.info.path / "bench_prompts.json").read_text()).values())


@pytest.mark.slow
def test_trained_fixture_drafts_are_accepted_and_outputs_identical(trained):
    """Acceptance on held-out text of the kind it learnt, far above chance (1 / 384)."""
    prompts = held_out(trained)
    plain = open_engine(trained, kv_blocks=256, max_num_seqs=8)
    spec = open_engine(trained, kv_blocks=256, max_num_seqs=8, speculative=MTP)
    try:
        for prompt in prompts:
            want, _ = tokens(plain, prompt, 48)
            got, stats = tokens(spec, prompt, 48)
            assert got == want
            assert stats.draft_tokens >= 12, stats
            assert stats.accepted_tokens / stats.draft_tokens > 0.5, stats
        batch = [p[i:] for p in prompts for i in range(4)]  # 8 streams
        assert batch_tokens(spec, batch, 32) == batch_tokens(plain, batch, 32)
        st = spec.stats()
        assert st["spec_accepted"] / st["spec_drafted"] > 0.5
        assert st["spec_rows"] > st["spec_steps"]  # sequences verified together
    finally:
        plain.shutdown()
        spec.shutdown()


def record_first_drafts(engine) -> list[tuple[list[int], np.ndarray]]:
    """(each drafting sequence's tokens up to its last, the module's logits for the token
    after), as the engine drafts: the first feed of every propose()."""
    seen: list[tuple[list[int], np.ndarray]] = []
    drafter = engine.spec.drafter
    feed = drafter._feed

    def feeding(seqs, firsts, tokens, hidden, last=None):
        logits, out = feed(seqs, firsts, tokens, hidden, last)
        if last is not None:  # propose's feeds of what is pending (not the chain's, not follow's)
            rows = np.array(logits)  # evaluated here, on the engine's thread (its stream)
            seen.extend((s.tokens[: s.num_computed + 1], rows[i]) for i, s in enumerate(seqs))
        return logits, out

    drafter._feed = feeding
    return seen


def reference_logits(loaded, seen: list[int]) -> mx.array:
    """The module's logits for the token after seen[-1], computed densely: the model's
    pre-norm hidden states over seen[:-1] (mlx-lm's code, no cache), then the module over
    positions 0.. with the tokens after them, on mlx-lm's own KVCache."""
    from mlx_lm.models.base import create_attention_mask
    from mlx_lm.models.cache import KVCache

    from mlxlocal.models.mtp import TargetParts

    inner = loaded.model.model
    x = mx.array([seen[:-1]])
    h = inner.embed_tokens(x)
    mask = create_attention_mask(h, None, return_array=True)
    for layer in inner.layers:
        h = layer(h, mask, None)
    logits, _ = loaded.mtp[0](mx.array([seen[1:]]), h, KVCache(), TargetParts(loaded.model))
    return logits[0, -1]


def assert_like_the_reference(loaded, seen) -> None:
    assert len(seen) > 5
    for history, logits in seen:
        want = reference_logits(loaded, history)
        assert np.abs(logits - np.array(want)).max() < 1e-3, len(history)


@pytest.mark.slow
def test_first_drafts_equal_a_dense_reference(trained):
    """Every verify step's first draft comes from the logits the module computes from the
    whole history by another code path: the pending hidden states and the paged module K/V
    line up with what the module was trained on."""
    engine = open_engine(trained, kv_blocks=256, max_num_seqs=4, speculative=MTP)
    seen = record_first_drafts(engine)
    try:
        prompts = held_out(trained)
        batch_tokens(engine, [prompts[0], prompts[1][5:]], 24)
        tokens(engine, prompts[0], 24)  # from the prefix cache: drafting resumes after one step
    finally:
        engine.shutdown()
    assert_like_the_reference(trained, seen)


@pytest.mark.slow
def test_sampling_with_mtp_keeps_the_model_distribution(trained):
    """Sampled through the MTP engine (seeds 0..N), the 2nd and 3rd tokens given the ones
    before follow the model's own distribution, from mlx-lm's code on the same weights."""
    eng = open_engine(trained, kv_blocks=512, max_num_seqs=16, speculative=MTP)
    model = mlx_lm_reference(trained.info.path)
    prompt = held_out(trained)[0][:24]
    params = dict(temperature=1.0, top_k=4)
    outs = []
    try:
        for start in range(0, 640, 16):
            handles = [eng.submit(prompt, SamplingParams(max_tokens=3, ignore_eos=True,
                                                         seed=s, **params))
                       for s in range(start, start + 16)]
            outs += [[c.token for c in h if c.token is not None] for h in handles]
        assert eng.stats()["spec_accepted"] > 0
    finally:
        eng.shutdown()
    assert_follows_the_model(model, prompt, outs, params["temperature"], params["top_k"])


@pytest.mark.slow
def test_mtp_with_quantized_kv_sessions_and_cache_edits(trained):
    from mlxlocal.engine import CacheEdit

    prompt = held_out(trained)[0]
    plain = open_engine(trained, kv_blocks=256, kv_bits=8, kv_group_size=32)
    spec = open_engine(trained, kv_blocks=256, kv_bits=8, kv_group_size=32, speculative=MTP)
    try:
        want, _ = tokens(plain, prompt, 32)
        got, stats = tokens(spec, prompt, 32)
        assert got == want and stats.accepted_tokens > 0
        # a session's second turn starts from its blocks: still identical, still drafting
        s_plain, s_spec = plain.new_session(), spec.new_session()
        turn = prompt[:30]
        a = [c.token for c in plain.generate(turn, SamplingParams(max_tokens=16, ignore_eos=True),
                                             session=s_plain) if c.token is not None]
        b = [c.token for c in spec.generate(turn, SamplingParams(max_tokens=16, ignore_eos=True),
                                            session=s_spec) if c.token is not None]
        assert a == b
        more = turn + a + prompt[30:40]
        p16 = SamplingParams(max_tokens=16, ignore_eos=True)
        chunks_a = list(plain.generate(more, p16, session=s_plain))
        chunks_b = list(spec.generate(more, p16, session=s_spec))
        assert ([c.token for c in chunks_a if c.token is not None]
                == [c.token for c in chunks_b if c.token is not None])
        assert chunks_b[-1].stats.cached_tokens > 0
        # a request with a cache edit decodes without drafting, and as without MTP
        edit = [CacheEdit(at=40, drop=((8, 16),))]
        p = SamplingParams(max_tokens=12, ignore_eos=True)
        assert ([c.token for c in plain.generate(prompt, p, edits=edit) if c.token is not None]
                == [c.token for c in spec.generate(prompt, p, edits=edit) if c.token is not None])
    finally:
        plain.shutdown()
        spec.shutdown()


# --- the command line -------------------------------------------------------------------
@pytest.mark.parametrize("command", ["generate", "chat", "run", "serve"])
@pytest.mark.parametrize("extra, words", [
    (["--mtp", "maybe"], ["--mtp", "auto, off or a number", "'maybe'"]),
    (["--mtp", "0"], ["--mtp", "1..32", "'0'"]),
    (["--mtp", "3", "--prompt-lookup"], ["--mtp N", "--prompt-lookup", "not both"]),
], ids=["word", "zero", "two-drafters"])
def test_mtp_option_errors_exit_2_naming_it(command, extra, words):
    from test_spec_cli import COMMANDS, cli

    r = cli(*COMMANDS[command], *extra)
    assert r.exit_code == 2, r.output
    text = " ".join(r.output.split())
    for word in words:
        assert word in text, text


def test_generate_mtp_on_a_model_without_heads(family_dirs, tmp_path):
    from test_spec_cli import cli, generate_json

    dropped = write_deepseek(tmp_path / "dropped", mtp=False)
    r = cli("generate", "-m", str(dropped), "-p", "hi", "-n", "4", "--mtp", "3", "--json")
    assert r.exit_code == 1 and "has no MTP modules" in " ".join(r.output.split()), r.output
    # auto (the default): plain decoding there, MTP drafting where the heads are
    assert generate_json(dropped, n=8)["draft_tokens"] == 0
    out = generate_json(family_dirs["deepseek"], n=16)
    assert out["draft_tokens"] > 0
    assert out["text"] == generate_json(family_dirs["deepseek"], "--mtp", "off", n=16)["text"]


@pytest.mark.slow
def test_the_modules_kv_comes_back_from_the_disk_tier(trained, tmp_path):
    """The MTP pools share the model's block ids: their K/V is saved and read back with the
    blocks (in a store of the model-and-MTP pair's own), so a restored prefix drafts as the
    module computes from the whole history."""
    import os

    prompt = held_out(trained)[0]
    disk = dict(kv_disk=1 << 30, kv_disk_dir=str(tmp_path), kv_blocks=256)
    first = open_engine(trained, speculative=MTP, **disk)
    want, _ = tokens(first, prompt, 16)
    assert first.tier.store.flush(60)
    first.shutdown()
    plain = open_engine(trained, **disk)  # the model alone keeps another store
    tokens(plain, prompt, 4)
    plain.shutdown()
    assert len([d for d in os.listdir(tmp_path) if not d.startswith(".")]) == 2
    second = open_engine(trained, speculative=MTP, **disk)
    seen = record_first_drafts(second)
    try:
        got, stats = tokens(second, prompt, 16)
    finally:
        second.shutdown()
    assert got == want and stats.disk_tokens >= 48 and stats.accepted_tokens > 0
    assert_like_the_reference(trained, seen)


def test_a_quantized_conversion_that_kept_its_module(tmp_path):
    """Quantized like the rest of the checkpoint: the module's projections load quantized
    (bits and group size off its tensors) and draft; greedy output is plain decoding's."""
    import mlx.nn as nn
    from mtp_util import write_deepseek_quantized

    loaded = load(str(write_deepseek_quantized(tmp_path / "q4")))
    assert len(loaded.mtp) == 1
    assert isinstance(loaded.mtp[0].eh_proj, nn.QuantizedLinear) and loaded.mtp[0].eh_proj.bits == 4
    plain = open_engine(loaded, kv_blocks=64)
    spec = open_engine(loaded, kv_blocks=64, speculative=MTP)
    try:
        want, _ = tokens(plain, PROMPT, 16)
        got, stats = tokens(spec, PROMPT, 16)
        assert got == want and stats.draft_tokens > 0
    finally:
        plain.shutdown()
        spec.shutdown()


def test_mimo_modules_are_named_not_loaded(tmp_path):
    """MiMo keeps its modules as model.mtp_layers.*, a layout not read yet: the model loads
    (its family's sanitize drops them), `show` says so, and --mtp N is refused."""
    from mtp_util import write_mimo

    loaded = load(str(write_mimo(tmp_path / "mimo")))
    assert loaded.mtp == []
    assert any("MiMo modules (model.mtp_layers) are not loaded" in n for n in loaded.info.notes)
    with pytest.raises(SpeculationError, match="has no MTP modules"):
        open_engine(loaded, kv_blocks=64, speculative=SpeculationChoice("mtp", None, 2))


def test_a_trained_preset_says_what_its_text_is(tmp_path):
    """What generate and chat say of a synthetic model's text: a trained preset's directory is
    told from a random one's (and from none) by its marker."""
    from mlxlocal.source.synthetic import MARKER, is_trained

    (tmp_path / MARKER).write_text(json.dumps({"preset": "mtp-tiny"}))
    assert is_trained(tmp_path)
    (tmp_path / MARKER).write_text(json.dumps({"preset": "tiny"}))
    assert not is_trained(tmp_path) and not is_trained(tmp_path / "absent")
