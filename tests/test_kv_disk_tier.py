"""The disk tier under the prefix cache (--kv-disk): a prefix written by one engine is read back by
the next (a restart), and the tokens and logprobs after it equal a cold run's; quantized pools,
the mlx-lm-path models, edited (AKV) histories, a foreign fingerprint, corrupt files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import BASE, FAMILY_CONFIGS, MLX_LM_CONFIGS, build_tiny

from mlxlocal.engine import EngineConfig, PagedEngine, SamplingParams, SpeculativeConfig
from mlxlocal.source.loader import load_from_dir
from mlxlocal.source.synthetic.weights import write_model_dir

WIDE = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64)
PROMPT = [(i * 37 + 11) % 300 for i in range(150)]  # 9 full blocks of 16, and 6 tokens


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tier")
    return {"native": build_tiny(root / "llama", dict(FAMILY_CONFIGS["llama"], **WIDE), template="llama3", seed=1),
            "mlx_lm": build_tiny(root / "gemma", dict(BASE, **WIDE, model_type="gemma", rope_theta=10000.0), seed=1),
            "hybrid": build_tiny(root / "hybrid", MLX_LM_CONFIGS["hybrid"], seed=1),
            # sliding-window layers (32 tokens: 2 blocks) beside global ones, native and mlx-lm's
            "window": build_tiny(root / "window", dict(
                FAMILY_CONFIGS["llama"], **WIDE, sliding_window=32,
                layer_types=["sliding_attention", "full_attention"]), template="llama3", seed=1),
            "gemma3": build_tiny(root / "gemma3", MLX_LM_CONFIGS["gemma3"], seed=1),
            # bfloat16 pools: read back through their bits (numpy has no bfloat16)
            "bf16": write_model_dir(root / "bf16", dict(FAMILY_CONFIGS["llama"], **WIDE), seed=1,
                                    dtype="bfloat16", chat_template="llama3")}


def engine(path: Path, disk: Path | None, **kw) -> PagedEngine:
    cfg = {"block_size": 16, "kv_blocks": 64, **kw}
    if disk is not None:
        cfg.update(kv_disk=64 << 20, kv_disk_dir=str(disk))
    return PagedEngine(load_from_dir(path), EngineConfig(**cfg))


def run(eng: PagedEngine, prompt: list[int], n: int = 8):
    """(tokens, logprobs, cached prompt tokens, of them from disk)."""
    chunks = list(eng.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True, logprobs=0)))
    toks = [c for c in chunks if c.token is not None]
    stats = chunks[-1].stats
    return [c.token for c in toks], [c.logprob for c in toks], stats.cached_tokens, stats.disk_tokens


def stored(path: Path, disk: Path, **kw):
    """PROMPT served by an engine on the store at `disk`, its blocks written down, the engine
    gone (a process that ended): the answer, as run() gives it."""
    first = engine(path, disk, **kw)
    answer = run(first, PROMPT)
    written(first)
    first.shutdown()
    return answer


def written(eng: PagedEngine) -> int:
    assert eng.tier is not None and eng.tier.store.flush()
    return eng.tier.store.stats()["writes"]  # blocks (a file holds a run of them)


WHOLE_BLOCKS = ("hybrid", "window", "gemma3")  # resume at block boundaries: no partial blocks kept


@pytest.mark.parametrize("kind,bits", [
    ("native", None), ("native", 8), ("bf16", None), ("mlx_lm", None), ("hybrid", None),
    ("window", None), ("window", 8), ("gemma3", None)])
def test_a_restart_reads_the_prefix_back_and_decodes_as_cold(models, tmp_path, kind, bits):
    q = {"kv_bits": bits} if bits else {}
    whole = kind in WHOLE_BLOCKS
    cold = engine(models[kind], None, **q)
    want = run(cold, PROMPT)
    cold.shutdown()
    first = engine(models[kind], tmp_path, **q)
    assert run(first, PROMPT)[:2] == want[:2]
    # The prompt's 9 full blocks, and its partial last block twice (at its first token, then
    # with the reply at the end); hybrid and window models keep no partial blocks.
    assert written(first) == 9 + (0 if whole else 2)
    first.shutdown()

    second = engine(models[kind], tmp_path, **q)  # a new process would see the same files
    toks, lps, cached, disk = run(second, PROMPT)
    # Every token of the prompt but the last (always computed) from disk: its full blocks,
    # and the partial last one (hybrid and window models resume at block boundaries).
    assert (cached, disk) == ((144, 144) if whole else (149, 149))
    assert toks == want[0]
    assert max(abs(a - b) for a, b in zip(lps, want[1])) < 1e-4, (lps, want[1])
    st = second.stats()
    blocks = 9 if whole else 10  # with the partial one
    assert st["disk_hit_blocks"] == blocks and st["disk_read_bytes"] > 0
    # Now in RAM: the next request hits there and reads nothing more from disk.
    # (A hybrid resumes at block boundaries only: it has no recurrent state mid-block.)
    assert run(second, PROMPT)[2:] == (144 if whole else 149, 0)
    assert second.stats()["disk_hit_blocks"] == blocks
    if second.windows is not None:  # window layers: the 2 blocks a query at 144 sees came back
        assert second.windows.first_needed(144) == 7
        assert len(second.windows.kept) >= 2
    second.shutdown()


def test_a_draft_models_kv_comes_back_with_the_blocks(models, tmp_path):
    """A draft model's pools share the target's block ids: its K/V is written and read back
    with theirs (a self-draft accepts every token only if it is there), in a store of the
    pair's own."""
    def drafted(disk):
        draft = SpeculativeConfig("draft", draft=load_from_dir(models["native"]),
                                  num_draft_tokens=3)
        return engine(models["native"], disk, speculative=draft)

    want = run(cold := drafted(None), PROMPT, 12)
    cold.shutdown()
    stored(models["native"], tmp_path)  # the target alone: another store
    first = drafted(tmp_path)
    assert run(first, PROMPT, 12)[:2] == want[:2]
    # 9 full blocks and the partial one at the first token; at the end (161 tokens computed)
    # a tenth full block and a partial one of 1 token.
    assert written(first) == 9 + 1 + 1 + 1
    first.shutdown()
    assert len([d for d in os.listdir(tmp_path) if not d.startswith(".")]) == 2
    second = drafted(tmp_path)
    toks, lps, cached, disk = run(second, PROMPT, 12)
    assert (cached, disk) == (149, 149) and toks == want[0]
    assert max(abs(a - b) for a, b in zip(lps, want[1])) < 1e-4
    st = second.stats()
    assert st["spec_drafted"] >= 6 and st["spec_accepted"] == st["spec_drafted"], st
    second.shutdown()


def test_a_longer_prompt_continues_on_disk_after_ram(models, tmp_path):
    stored(models["native"], tmp_path)
    second = engine(models["native"], tmp_path)
    # 4 blocks restored, the last token's too (its 15 others copied from it: a prompt's last
    # token is always computed): RAM holds 64 tokens of the prefix ...
    assert run(second, PROMPT[:64])[2:] == (63, 63)
    longer = PROMPT + [5, 6, 7]
    toks, _, cached, disk = run(second, longer)
    # ... and the rest comes from disk after them: 9 full blocks and the 6 tokens of PROMPT's
    # partial last block that the longer prompt shares.
    assert cached == 150 and disk == 150 - 64
    cold = engine(models["native"], None)
    assert toks == run(cold, longer)[0]
    for e in (second, cold):
        e.shutdown()


def test_a_prompt_that_parts_from_a_stored_one_reads_back_only_what_they_share(models, tmp_path):
    """The file holding PROMPT's blocks goes on past where another prompt parts from it: only
    the shared blocks come back (a key covers everything before it: the file's last block is
    not this prompt's, so the blocks are compared until they part)."""
    stored(models["native"], tmp_path)
    second = engine(models["native"], tmp_path)
    other = PROMPT[:80] + [(i * 7 + 3) % 300 for i in range(60)]  # 5 blocks shared, then its own
    toks, _, cached, disk = run(second, other)
    assert cached == disk == 80
    cold = engine(models["native"], None)
    assert toks == run(cold, other)[0]
    for e in (second, cold):
        e.shutdown()


def test_a_request_arriving_while_others_decode_is_read_ahead_then_restored(models, tmp_path):
    want = stored(models["native"], tmp_path)
    files = sum(e.stat().st_size for e in os.scandir(tmp_path) if e.is_dir()
                for e in os.scandir(e.path) if e.name.endswith(".kv"))
    second = engine(models["native"], tmp_path)
    other = iter(second.submit([7, 8, 9], SamplingParams(max_tokens=200, ignore_eos=True)))
    first = next(other)  # decoding: the next request's blocks are read ahead first
    assert first.token is not None
    toks, lps, cached, disk = run(second, PROMPT)
    # The files of the prompt's full blocks were read ahead, off the engine thread (not
    # those of its partial last block, which only the restore reads), then restored.
    assert 0 < second.tier.prefetcher.read_bytes < files
    assert (cached, disk) == (149, 149) and (toks, lps) == want[:2]
    rest = list(other)
    assert len([c for c in rest if c.token is not None]) == 199, rest[-1]
    # Served from RAM now: nothing more is read ahead.
    assert run(second, PROMPT)[2:] == (149, 0)
    assert second.tier.prefetcher.read_bytes < files
    second.shutdown()


def test_a_restore_that_grows_the_pools_reads_into_the_grown_ones(models, tmp_path):
    want = stored(models["native"], tmp_path)
    second = engine(models["native"], tmp_path, kv_blocks=None, kv_memory=8 << 20)
    start = second.stats()["blocks_total"]
    for i in range(start // 10):  # other prompts' blocks, kept by the prefix cache, fill it
        run(second, [(t * 7 + i * 13 + 1) % 300 for t in range(150)], 1)
    full = second.stats()["blocks_total"]
    toks, lps, cached, disk = run(second, PROMPT)
    assert second.stats()["blocks_total"] > full  # grown while its blocks were read back
    assert (cached, disk) == (149, 149) and (toks, lps) == want[:2]
    second.shutdown()


def test_other_kv_precision_is_another_store(models, tmp_path):
    stored(models["native"], tmp_path)
    other = engine(models["native"], tmp_path, kv_bits=8)  # fingerprint differs: nothing to reuse
    assert run(other, PROMPT)[2:] == (0, 0)
    other.shutdown()
    assert len([d for d in os.listdir(tmp_path) if not d.startswith(".")]) == 2


@pytest.mark.parametrize("kind", ["truncated", "flipped", "emptied", "garbage"])
def test_corrupt_block_files_are_removed_and_the_request_served_by_prefill(models, tmp_path, kind):
    """The prompt's 9 blocks are one file, checked as one: damaged, it is removed and the
    prompt prefilled (the answer is a cold run's) and written again, so the next restart has
    it all."""
    want = stored(models["native"], tmp_path)
    (store,) = [tmp_path / d for d in os.listdir(tmp_path)]
    (f,) = [f for f in store.glob("*.kv") if f.stat().st_size > 9 * 16 * 512]  # the prompt's run
    data = f.read_bytes()
    f.write_bytes({"truncated": data[: len(data) // 2], "emptied": b"", "garbage": b"not a block",
                   "flipped": data[:-9] + bytes([data[-9] ^ 1]) + data[-8:]}[kind])
    second = engine(models["native"], tmp_path)
    toks, lps, cached, disk = run(second, PROMPT)
    assert (cached, disk) == (0, 0) and toks == want[0]
    assert second.stats()["disk_corrupt_removed"] == 1
    written(second)  # the prefilled blocks written again: the store heals
    second.shutdown()
    third = engine(models["native"], tmp_path)
    assert run(third, PROMPT)[2:] == (149, 149)
    third.shutdown()


def test_a_restarted_server_answers_from_disk_and_says_so(models, tmp_path):
    """Through `serve`: the second server's first request has its prompt cached (usage's
    cached_tokens), /metrics counts the blocks read back and written."""
    import httpx
    from server_util import running_server

    from mlxlocal.server import ServerConfig

    opts = {"kv_blocks": 64, "kv_disk": 64 << 20, "kv_disk_dir": str(tmp_path)}
    body = {"model": str(models["native"]), "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    texts, usages = [], []
    for _ in range(2):  # two servers, one after the other, on one store
        with running_server(ServerConfig(models=[str(models["native"])], engine_options=opts)) as (url, app):
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
            usages.append(r.json()["usage"])
            assert app.state.registry.models[0].engine.tier.store.flush()
            metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert texts[0] == texts[1]
    assert usages[0]["prompt_tokens_details"]["cached_tokens"] == 0
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] == 149  # all but the last token
    assert "mlxlocal_kv_disk_hit_blocks 10.0" in metrics  # 9 full blocks and the partial one
    assert "mlxlocal_kv_disk_bytes " in metrics and "mlxlocal_kv_disk_bytes 0.0" not in metrics


def test_cache_commands_list_show_and_remove_stores(models, tmp_path):
    from typer.testing import CliRunner

    from mlxlocal.cli import app

    for bits in (None, 8):
        stored(models["native"], tmp_path, **({"kv_bits": bits} if bits else {}))
    cli = CliRunner()
    out = cli.invoke(app, ["cache", "ls", "--dir", str(tmp_path)], env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    assert "2 store(s)" in out.output and "8-bit (group 64)" in out.output and "float32" in out.output
    digests = sorted(d for d in os.listdir(tmp_path) if not d.startswith("."))
    shown = cli.invoke(app, ["cache", "show", digests[0][:8], "--dir", str(tmp_path)])
    assert shown.exit_code == 0 and digests[0] in shown.output and str(models["native"]) in shown.output
    both = cli.invoke(app, ["cache", "show", str(models["native"]), "--dir", str(tmp_path)])
    assert both.exit_code == 1 and "names 2 stores" in both.output  # the model name is ambiguous here
    gone = cli.invoke(app, ["cache", "rm", digests[0], "--dir", str(tmp_path)])
    assert gone.exit_code == 0 and "removed KV store" in gone.output
    assert sorted(d for d in os.listdir(tmp_path) if not d.startswith(".")) == digests[1:]
    assert cli.invoke(app, ["cache", "rm", "feedbeef", "--dir", str(tmp_path)]).exit_code == 1
    assert cli.invoke(app, ["cache", "clear", "--dir", str(tmp_path)], input="n\n").exit_code == 1
    cleared = cli.invoke(app, ["cache", "clear", "--yes", "--dir", str(tmp_path)])
    assert cleared.exit_code == 0 and "removed 1 KV store(s)" in cleared.output
    assert not [d for d in os.listdir(tmp_path) if not d.startswith(".")]


def test_kv_disk_options_are_checked(models, tmp_path):
    from typer.testing import CliRunner

    from mlxlocal.cli import app

    cli = CliRunner()
    base = ["generate", "-m", str(models["native"]), "-p", "hi", "--max-tokens", "1"]
    bad = cli.invoke(app, base + ["--kv-disk-dir", str(tmp_path)])
    assert bad.exit_code == 2 and "--kv-disk-dir applies with --kv-disk only" in bad.output
    bad = cli.invoke(app, base + ["--kv-disk", "1GB", "--no-prefix-cache"])
    assert bad.exit_code == 2 and "--no-prefix-cache" in bad.output
    bad = cli.invoke(app, base + ["--kv-disk", "lots"])
    assert bad.exit_code == 2 and "lots" in bad.output


def test_blocks_under_an_edit_history_come_back_only_to_that_history(models, tmp_path):
    """Cache edits (AKV drops) key the blocks they touched by their history: after a restart
    the same request and edits get every full block of the kept view from disk; a plain
    request only the untouched prefix. Each answer equals a cold engine's."""
    from mlxlocal.engine import CacheEdit

    edit = [CacheEdit(at=120, drop=((40, 60),))]

    def answer(eng, edits):
        chunks = list(eng.generate(PROMPT, SamplingParams(max_tokens=3, ignore_eos=True, logprobs=0),
                                   edits=edits))
        return [c.token for c in chunks if c.token is not None], chunks[-1].stats

    first = engine(models["native"], tmp_path)
    answer(first, edit)
    written(first)
    first.shutdown()
    cold = engine(models["native"], None)
    second = engine(models["native"], tmp_path)
    toks, st = answer(second, edit)
    assert toks == answer(cold, edit)[0]
    assert st.cached_tokens == st.disk_tokens == 128  # every full block of the 130 kept tokens
    toks, st = answer(second, None)
    assert toks == answer(cold, None)[0] and st.cached_tokens == 32  # blocks before the drop at 40 only
    for e in (second, cold):
        e.shutdown()


def test_a_session_with_drops_comes_back_after_a_restart(models, tmp_path):
    """A session's turn 2 dropped a span of turn 1: its blocks, keyed by that history, are on
    disk. After a restart the session is gone; its next turn, sent with the same edits as the
    API sends them every turn, gets the kept view's blocks from disk and answers as a cold
    engine given the whole prompt and the edits."""
    from mlxlocal.engine import CacheEdit

    params = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=0)

    def turn(eng, prompt, edits=None, session=None):
        chunks = list(eng.generate(prompt, params, session=session, edits=edits))
        return [c.token for c in chunks if c.token is not None], chunks[-1].stats

    first = engine(models["native"], tmp_path)
    s = first.new_session()
    t1, _ = turn(first, PROMPT[:60], session=s)
    convo = PROMPT[:60] + t1
    p2 = convo + PROMPT[60:120]
    e1 = CacheEdit(at=len(convo), drop=((10, 30),))
    t2, st2 = turn(first, p2, [e1], session=s)
    assert st2.dropped_tokens == 20
    written(first)
    first.shutdown()

    p3 = p2 + t2 + PROMPT[120:140]
    cold = engine(models["native"], None)
    want, _ = turn(cold, p3, [e1])
    second = engine(models["native"], tmp_path)
    got, st3 = turn(second, p3, [e1], session=second.new_session())
    assert got == want
    kept = len(p2) + 4 - 20  # turn 2's kept view: its prompt and reply, less the drop
    assert st3.disk_tokens == st3.cached_tokens == (kept - 1) // 16 * 16, st3  # every full block
    for e in (second, cold):
        e.shutdown()


def test_show_reports_the_models_stores(models, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from mlxlocal.cli import app

    monkeypatch.setenv("MLXLOCAL_HOME", str(tmp_path))  # the default store directory: <home>/kv
    cli = CliRunner()
    before = cli.invoke(app, ["show", str(models["native"])], env={"COLUMNS": "200"})
    assert before.exit_code == 0 and "KV on disk" not in before.output
    stored(models["native"], tmp_path / "kv")
    after = cli.invoke(app, ["show", str(models["native"])], env={"COLUMNS": "200"})
    assert after.exit_code == 0, after.output
    (line,) = [x for x in after.output.splitlines() if "KV on disk" in x]
    assert "10 blocks" in line and "float32, block 16" in line  # 9 full blocks and the partial one
