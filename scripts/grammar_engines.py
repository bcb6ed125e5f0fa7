"""Compare two grammar engines for constrained decoding: llguidance and xgrammar.

  PYTHONPATH=. .venv/bin/python scripts/grammar_engines.py \
      [--xgrammar-python /tmp/xgr/bin/python] [--steps 300] [--batch 8] [--json]

The llguidance half runs in this interpreter (the project's venv). xgrammar needs torch,
which the project does not depend on, so its half runs in another interpreter given by
--xgrammar-python (a throwaway venv with xgrammar installed); without it only llguidance
is measured.

Tokenizer: mlxlocal's synthetic byte-level BPE tokenizer with Qwen3's vocab size (151936
ids, as `synthetic:qwen3-0.6b` builds it), written to --tokenizer-dir and loaded by both
halves with transformers' AutoTokenizer (a PreTrainedTokenizerFast).

Workloads: three JSON schemas (nested objects, arrays, enums, numbers, patterns, anyOf)
and plain JSON object mode ({"type": "object"}; for xgrammar with strict_mode=False so any
properties are allowed, as llguidance does by default). Both engines allow flexible
whitespace (their defaults). Each workload has 8 valid documents made from a fixed seed;
each document is tokenized with the tokenizer's own encode() and EOS appended, and the
same token ids drive both engines (forced tokenization: both engines accept any
tokenization of valid text, and every step checks that the next token is in the mask).

Batch: --batch matchers, slot i starting on document i; a slot that finishes its
document resets its matcher and goes on with the next document, so every step has
--batch live matchers at different places. Each step fills the [batch, vocab/32] int32
bitmask, then every slot consumes its next token. Two passes per workload, each with
fresh matchers: "seq" fills the masks one matcher at a time (and times each single-token
consume), "par" uses the engine's batch API (llguidance: LLExecutor with
fill_next_token_bitmask_par and consume_token_par; xgrammar: BatchGrammarMatcher's
batch_fill_next_token_bitmask and batch_accept_token), with --threads threads.

Cross-check: the table gives the mean number of allowed tokens per step (row 0 of the
"seq" pass) and, with both engines, on how many steps the two counts differ and by how
much (xgrammar minus llguidance). Known differences at this commit: inside forced text
(a fixed key or enum value) xgrammar also allows non-canonical splits of it (e.g. "an"
after `"qu` of "quantity"), llguidance only the canonical ones; xgrammar stops a number
with a minimum/maximum at 6 fraction digits, llguidance does not; inside strings
xgrammar allows the tokenizer's added tokens (<|endoftext|>, <think>, ...) and DEL.

Compile: llguidance has no compile cache (an LLMatcher is built from the grammar text
for each request, and it builds its lexer lazily during the first masks), so "cached" is
a second construction; xgrammar's GrammarCompiler caches compiled grammars, so "cached"
is a second compile of the same schema. Matchers are made the way a server would: one
LLMatcher per request from the grammar text; one GrammarMatcher per request from the
(cached) CompiledGrammar.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from grammar_workloads import OBJECT_SCHEMA, VOCAB, WORKLOADS, make_docs  # beside this script

# ---------------------------------------------------------------- engines
# Each engine runs in its own interpreter; imports stay inside the classes.


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok_dir: str, vocab: int, threads: int):
        import llguidance
        import llguidance.hf
        import llguidance.numpy as lnp
        import numpy as np
        from transformers import AutoTokenizer

        self.np, self.lnp, self.ll = np, lnp, llguidance
        t0 = time.perf_counter()
        hf = AutoTokenizer.from_pretrained(tok_dir)
        t1 = time.perf_counter()
        self.tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
        t2 = time.perf_counter()
        self.executor = llguidance.LLExecutor(num_threads=threads)
        self.vocab = vocab
        self.init = {"hf_load_s": t1 - t0, "engine_tokenizer_s": t2 - t1}
        self.version = importlib.metadata.version("llguidance")

    def compile(self, schema: dict) -> tuple[float, float]:
        LLMatcher = self.ll.LLMatcher
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            self.grammar = LLMatcher.grammar_from_json_schema(schema)
            m = LLMatcher(self.tok, self.grammar)
            times.append(time.perf_counter() - t0)
            if m.is_error():
                raise RuntimeError(m.get_error())
        return times[0], times[1]

    def matcher(self):
        m = self.ll.LLMatcher(self.tok, self.grammar)
        assert not m.is_error(), m.get_error()
        return m

    def bitmask(self, batch: int):
        return self.lnp.allocate_token_bitmask(batch, self.vocab)

    def fill(self, m, mask, i: int) -> None:
        self.lnp.fill_next_token_bitmask(m, mask, i)

    def fill_batch(self, ms, mask) -> None:
        self.lnp.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(ms)],
                                             mask)

    def consume(self, m, token: int) -> bool:
        return m.consume_token(token)

    def consume_batch(self, ms, tokens) -> list[bool]:
        return self.executor.consume_token_par(list(zip(ms, tokens)))

    def reset(self, m) -> None:
        m.reset()

    def error(self, m) -> str:
        return m.get_error()


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok_dir: str, vocab: int, threads: int):
        import numpy as np
        import xgrammar as xgr
        from transformers import AutoTokenizer

        self.np, self.xgr = np, xgr
        t0 = time.perf_counter()
        hf = AutoTokenizer.from_pretrained(tok_dir)
        t1 = time.perf_counter()
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
        t2 = time.perf_counter()
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads)
        t3 = time.perf_counter()
        self.batcher = xgr.BatchGrammarMatcher(max_threads=threads)
        self.vocab = vocab
        self.init = {"hf_load_s": t1 - t0, "engine_tokenizer_s": t2 - t1,
                     "engine_compiler_s": t3 - t2}
        self.version = importlib.metadata.version("xgrammar")

    def compile(self, schema: dict) -> tuple[float, float]:
        strict = schema is not OBJECT_SCHEMA and schema != OBJECT_SCHEMA
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            self.compiled = self.compiler.compile_json_schema(json.dumps(schema),
                                                              strict_mode=strict)
            times.append(time.perf_counter() - t0)
        return times[0], times[1]

    def matcher(self):
        return self.xgr.GrammarMatcher(self.compiled)

    def bitmask(self, batch: int):
        # A numpy array (DLPack) rather than a torch tensor: same memory layout.
        return self.np.full((batch, (self.vocab + 31) // 32), -1, dtype=self.np.int32)

    def fill(self, m, mask, i: int) -> None:
        m.fill_next_token_bitmask(mask, i)

    def fill_batch(self, ms, mask) -> None:
        self.batcher.batch_fill_next_token_bitmask(ms, mask)

    def consume(self, m, token: int) -> bool:
        return m.accept_token(token)

    def consume_batch(self, ms, tokens) -> list[bool]:
        return self.xgr.BatchGrammarMatcher.batch_accept_token(ms, tokens)

    def reset(self, m) -> None:
        m.reset()

    def error(self, m) -> str:
        return "token rejected"


def _stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"n": len(xs), "p50": statistics.median(xs), "p90": xs[int(0.9 * (len(xs) - 1))],
            "mean": statistics.fmean(xs), "max": xs[-1], "first": None}


def run_pass(eng, streams: list[list[int]], batch: int, steps: int, par: bool) -> dict:
    """`steps` batch steps with fresh matchers; slot i starts on stream i."""
    pc = time.perf_counter
    ms = [eng.matcher() for _ in range(batch)]
    doc = list(range(batch))
    pos = [0] * batch
    mask = eng.bitmask(batch)
    mask_t, consume_t, allowed = [], [], []
    resets = 0
    for _ in range(steps):
        if par:
            t0 = pc()
            eng.fill_batch(ms, mask)
            mask_t.append(pc() - t0)
        else:
            t0 = pc()
            for i, m in enumerate(ms):
                eng.fill(m, mask, i)
            mask_t.append(pc() - t0)
        toks = [streams[doc[i] % len(streams)][pos[i]] for i in range(batch)]
        # The next token of each document must be allowed (checked outside the timing).
        for i, t in enumerate(toks):
            if not (int(mask[i, t // 32]) >> (t % 32)) & 1:
                raise RuntimeError(f"{eng.name}: token {t} of doc {doc[i]} at {pos[i]} masked")
        allowed.append(sum(int(x).bit_count() for x in mask[0].view(eng.np.uint32)))
        if par:
            t0 = pc()
            ok = eng.consume_batch(ms, toks)
            consume_t.append(pc() - t0)
        else:
            ok = []
            for m, t in zip(ms, toks):
                t0 = pc()
                ok.append(eng.consume(m, t))
                consume_t.append(pc() - t0)
        for i, good in enumerate(ok):
            if not good:
                raise RuntimeError(f"{eng.name}: doc {doc[i]} token {pos[i]} rejected: "
                                   f"{eng.error(ms[i])}")
            pos[i] += 1
            if pos[i] == len(streams[doc[i] % len(streams)]):
                eng.reset(ms[i])
                doc[i] += batch
                pos[i] = 0
                resets += 1
    mask_s = _stats(mask_t)
    mask_s["first"] = mask_t[0]
    return {"mask_batch": mask_s, "consume": _stats(consume_t), "resets": resets,
            "allowed_row0_mean": statistics.fmean(allowed), "allowed_row0": allowed}


def run_engine(kind: str, spec: dict) -> dict:
    cls = {"llguidance": LLGuidance, "xgrammar": XGrammar}[kind]
    eng = cls(spec["tokenizer_dir"], spec["vocab"], spec["threads"])
    out = {"engine": kind, "version": eng.version, "init": eng.init, "workloads": {}}
    for w in spec["workloads"]:
        first, cached = eng.compile(WORKLOADS[w["name"]][0])
        res = {"compile_first_s": first, "compile_cached_s": cached}
        for mode in ("seq", "par"):
            res[mode] = run_pass(eng, w["streams"], spec["batch"], spec["steps"], mode == "par")
        out["workloads"][w["name"]] = res
    return out


# ---------------------------------------------------------------- driver


def build_spec(args) -> dict:
    from transformers import AutoTokenizer

    from mlxlocal.source.synthetic.tokenizer import write_tokenizer

    tok_dir = Path(args.tokenizer_dir)
    if not (tok_dir / "tokenizer.json").is_file():
        tok_dir.mkdir(parents=True, exist_ok=True)
        write_tokenizer(tok_dir, args.vocab, "chatml")
    hf = AutoTokenizer.from_pretrained(str(tok_dir))
    if len(hf) != args.vocab:
        raise SystemExit(f"tokenizer has {len(hf)} ids, expected {args.vocab}")
    workloads = []
    for name in WORKLOADS:
        docs = make_docs(name, args.docs, args.seed)
        streams = [hf.encode(d, add_special_tokens=False) + [hf.eos_token_id] for d in docs]
        workloads.append({"name": name, "docs": docs, "streams": streams})
    return {"tokenizer_dir": str(tok_dir), "vocab": args.vocab, "batch": args.batch,
            "steps": args.steps, "threads": args.threads, "workloads": workloads}


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.3f}"


def _us(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e6:.1f}"


def table(spec: dict, results: list[dict]) -> str:
    cols = [r["engine"] for r in results]
    rows: list[tuple[str, list[str]]] = []
    rows.append(("version", [r["version"] for r in results]))
    rows.append(("hf AutoTokenizer load (s)", [f"{r['init']['hf_load_s']:.3f}" for r in results]))
    rows.append(("engine tokenizer init (s)",
                 [f"{r['init']['engine_tokenizer_s']:.3f}" for r in results]))
    rows.append(("  + GrammarCompiler() (s)",
                 [f"{r['init']['engine_compiler_s']:.3f}" if "engine_compiler_s" in r["init"]
                  else "-" for r in results]))
    for w in spec["workloads"]:
        name = w["name"]
        lens = [len(s) for s in w["streams"]]
        rows.append((f"[{name}] tokens/doc {min(lens)}-{max(lens)}", ["" for _ in results]))
        ws = [r["workloads"][name] for r in results]
        rows.append(("  compile first (ms)", [_ms(x["compile_first_s"]) for x in ws]))
        rows.append(("  compile cached/again (ms)", [_ms(x["compile_cached_s"]) for x in ws]))
        for mode, label in (("seq", "loop of 8"), ("par", "batch API")):
            rows.append((f"  mask b{spec['batch']} {label} p50 (ms)",
                         [_ms(x[mode]["mask_batch"]["p50"]) for x in ws]))
            rows.append((f"  mask b{spec['batch']} {label} p90 (ms)",
                         [_ms(x[mode]["mask_batch"]["p90"]) for x in ws]))
            rows.append((f"  mask b{spec['batch']} {label} first step (ms)",
                         [_ms(x[mode]["mask_batch"]["first"]) for x in ws]))
        rows.append(("  consume 1 token p50 (us)", [_us(x["seq"]["consume"]["p50"]) for x in ws]))
        rows.append(("  consume 1 token p90 (us)", [_us(x["seq"]["consume"]["p90"]) for x in ws]))
        rows.append((f"  consume b{spec['batch']} batch API p50 (us)",
                     [_us(x["par"]["consume"]["p50"]) for x in ws]))
        rows.append(("  allowed tokens/step, mean (row 0)",
                     [f"{x['seq']['allowed_row0_mean']:.0f}" for x in ws]))
        if len(ws) == 2:  # same tokens in the same order: the masks should agree
            a, b = (x["seq"]["allowed_row0"] for x in ws)
            diff = [y - x for x, y in zip(a, b) if x != y]
            rows.append(("  steps whose allowed count differs", [f"{len(diff)}/{len(a)}",
                         f"{min(diff, default=0):+d}..{max(diff, default=0):+d}"]))
    w0 = max(len(r[0]) for r in rows)
    wc = [max(len(c), *(len(r[1][i]) for r in rows)) for i, c in enumerate(cols)]
    lines = [" " * w0 + "  " + "  ".join(c.rjust(wc[i]) for i, c in enumerate(cols))]
    for label, vals in rows:
        lines.append(label.ljust(w0) + "  " + "  ".join(v.rjust(wc[i]) for i, v in enumerate(vals)))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--xgrammar-python", help="interpreter with xgrammar installed")
    ap.add_argument("--tokenizer-dir", default=os.path.join(tempfile.gettempdir(),
                                                            "grammar-engines-tok"))
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--skip-llguidance", action="store_true")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--worker", choices=["llguidance", "xgrammar"], help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker:  # the other interpreter's half: spec in, results out
        spec = json.loads(Path(args.spec).read_text())
        print(json.dumps(run_engine(args.worker, spec)))
        return

    spec = build_spec(args)
    results = []
    if not args.skip_llguidance:
        results.append(run_engine("llguidance", spec))
    if args.xgrammar_python:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(spec, f)
        try:
            proc = subprocess.run([args.xgrammar_python, __file__, "--worker", "xgrammar",
                                   "--spec", f.name], capture_output=True, text=True)
        finally:
            os.unlink(f.name)
        if proc.returncode != 0:
            raise SystemExit(f"xgrammar half failed:\n{proc.stderr}")
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    if args.json:
        summary = {k: v for k, v in spec.items() if k != "workloads"}
        summary["workloads"] = {w["name"]: {"docs": len(w["docs"]),
                                            "tokens": [len(s) for s in w["streams"]]}
                                for w in spec["workloads"]}
        print(json.dumps({"spec": summary, "results": results}, indent=2))
    else:
        print(f"vocab {spec['vocab']}, batch {spec['batch']}, {spec['steps']} steps per pass, "
              f"{spec['threads']} threads for batch APIs, {os.cpu_count()} CPUs")
        print(table(spec, results))


if __name__ == "__main__":
    main()
