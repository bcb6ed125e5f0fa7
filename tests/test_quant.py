"""AWQ/GPTQ repacking, `quantize` (modes, mixed-4-6, awq) and `perplexity`."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from conftest import FAMILY_CONFIGS, build_tiny

from mlxlocal.errors import ModelLoadError
from mlxlocal.quant.quantize import perplexity, perplexity_windows, quantize
from mlxlocal.quant.text import BUILTIN_TEXT
from mlxlocal.source.loader import load
from mlxlocal.weights.awq_gptq import convert_awq_gptq

# Part of the full run only: `python -m pytest -m "not slow"` is the quick subset.
pytestmark = pytest.mark.slow

CFG = dict(FAMILY_CONFIGS["qwen3"], hidden_size=128, intermediate_size=256, head_dim=32)
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


# ---- packers mirroring AutoAWQ (WQLinear_GEMM.from_linear) and AutoGPTQ (QuantLinear.pack)


def awq_pack(intweight: np.ndarray, bits: int = 4) -> np.ndarray:
    """[R, C] codes -> int32 [R, C*bits/32], AutoAWQ's interleaved order."""
    pack_num = 32 // bits
    order_map = [0, 2, 4, 6, 1, 3, 5, 7]
    out = np.zeros((intweight.shape[0], intweight.shape[1] // pack_num), dtype=np.uint32)
    for col in range(intweight.shape[1] // pack_num):
        for i in range(pack_num):
            out[:, col] |= intweight[:, col * pack_num + order_map[i]].astype(np.uint32) << (i * bits)
    return out.view(np.int32)


def gptq_pack_rows(intweight: np.ndarray, bits: int) -> np.ndarray:
    """[K, N] codes -> int32 [K*bits/32, N], AutoGPTQ's loop (incl. the straddling 3-bit)."""
    intweight = intweight.astype(np.uint32)
    q = np.zeros((intweight.shape[0] // 32 * bits, intweight.shape[1]), dtype=np.uint32)
    i = row = 0
    while row < q.shape[0]:
        if bits in (2, 4, 8):
            for j in range(i, i + 32 // bits):
                q[row] |= intweight[j] << (bits * (j - i))
            i += 32 // bits
            row += 1
        else:  # 3 bits
            for j in range(i, i + 10):
                q[row] |= intweight[j] << (3 * (j - i))
            i += 10
            q[row] |= intweight[i] << 30
            row += 1
            q[row] |= (intweight[i] >> 2) & 1
            i += 1
            for j in range(i, i + 10):
                q[row] |= intweight[j] << (3 * (j - i) + 1)
            i += 10
            q[row] |= intweight[i] << 31
            row += 1
            q[row] |= (intweight[i] >> 1) & 0x3
            i += 1
            for j in range(i, i + 10):
                q[row] |= intweight[j] << (3 * (j - i) + 2)
            i += 10
            row += 1
    return q.view(np.int32)


def gptq_pack_zeros(zeros: np.ndarray, bits: int, v1: bool) -> np.ndarray:
    """[G, N] zeros -> int32 [G, N*bits/32]; the old format stores zero - 1."""
    z = (zeros.astype(np.int64) - (1 if v1 else 0)) & 0xFFFFFFFF  # unmasked, as AutoGPTQ
    return np.ascontiguousarray(gptq_pack_rows(z.astype(np.uint32).T, bits).view(np.uint32).T).view(np.int32)


def rand_codes(rng, k, n, bits, group, min_zero=0):
    q = rng.integers(0, 1 << bits, size=(k, n)).astype(np.uint32)
    zeros = rng.integers(min_zero, 1 << bits, size=(k // group, n)).astype(np.uint32)
    scales = (2.0 ** rng.integers(-8, -2, size=(k // group, n))).astype(np.float32)  # exact products
    ref = (scales.repeat(group, 0) * (q.astype(np.float32) - zeros.repeat(group, 0))).T  # [N, K]
    return q, zeros, scales, ref


def dequant(conv, prefix):
    w, s, b = (conv.weights[f"{prefix}.{k}"] for k in ("weight", "scales", "biases"))
    g = conv.quantization.get(prefix, conv.quantization)["group_size"]
    return np.array(mx.dequantize(w, s, b, group_size=g, bits=conv.quantization["bits"]))


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_mlx_packing_matches_mx_dequantize(bits):
    from mlxlocal.weights.awq_gptq import pack_mlx, unpack_bitstream

    q = np.random.default_rng(bits).integers(0, 1 << bits, size=(8, 128)).astype(np.uint32)
    w = pack_mlx(q, bits)
    d = mx.dequantize(mx.array(w), mx.ones((8, 2)), mx.zeros((8, 2)), group_size=64, bits=bits)
    np.testing.assert_array_equal(np.array(d), q.astype(np.float32))
    np.testing.assert_array_equal(unpack_bitstream(w.view(np.int32), bits, 128, axis=1), q)


def test_awq_pack_dequantizes_exactly():
    rng = np.random.default_rng(0)
    q, zeros, scales, ref = rand_codes(rng, 256, 64, 4, 128)
    weights = {"l.qweight": mx.array(awq_pack(q)), "l.qzeros": mx.array(awq_pack(zeros)), "l.scales": mx.array(scales)}
    conv = convert_awq_gptq(weights, {"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128,
                                                              "version": "gemm", "zero_point": True}})
    assert conv.quantization == {"group_size": 128, "bits": 4, "mode": "affine"}
    assert conv.weights["l.weight"].dtype == mx.uint32 and conv.weights["l.weight"].shape == (64, 256 * 4 // 32)
    np.testing.assert_array_equal(dequant(conv, "l"), ref)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_gptq_pack_dequantizes_exactly(bits, fmt):
    rng = np.random.default_rng(bits)
    k, n, g = 384 if bits == 3 else 256, 64, 128
    # AutoGPTQ's v1 packer does not mask zero - 1, so a zero of 0 (-1) spills into its
    # neighbours in real v1 checkpoints; v1 tests use zeros >= 1, v2 the full range.
    q, zeros, scales, ref = rand_codes(rng, k, n, bits, g, min_zero=1 if fmt == "gptq" else 0)
    weights = {"l.qweight": mx.array(gptq_pack_rows(q, bits)), "l.scales": mx.array(scales),
               "l.qzeros": mx.array(gptq_pack_zeros(zeros, bits, v1=fmt == "gptq")),
               "l.g_idx": mx.array(np.arange(k, dtype=np.int32) // g)}
    conv = convert_awq_gptq(weights, {"quantization_config": {"quant_method": "gptq", "bits": bits, "group_size": g,
                                                              "desc_act": False, "checkpoint_format": fmt}})
    assert conv.quantization["bits"] == bits and not conv.notes
    np.testing.assert_array_equal(dequant(conv, "l"), ref)


def test_gptq_large_group_splits_exactly_and_act_order_requantizes():
    rng = np.random.default_rng(1)
    q, zeros, scales, ref = rand_codes(rng, 512, 32, 4, 256, min_zero=1)
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 256, "desc_act": False}
    weights = {"l.qweight": mx.array(gptq_pack_rows(q, 4)), "l.scales": mx.array(scales),
               "l.qzeros": mx.array(gptq_pack_zeros(zeros, 4, v1=True))}
    conv = convert_awq_gptq(dict(weights), {"quantization_config": qc})
    assert conv.quantization["group_size"] == 128
    np.testing.assert_array_equal(dequant(conv, "l"), ref)
    # act-order: a g_idx that scatters the groups over K -> dequantize + requantize, reported.
    g_idx = rng.permutation(np.arange(512) // 256).astype(np.int32)
    ref = (scales[g_idx] * (q.astype(np.float32) - zeros[g_idx])).T
    weights["l.g_idx"] = mx.array(g_idx)
    conv = convert_awq_gptq(weights, {"quantization_config": dict(qc, desc_act=True)})
    assert conv.notes and "act-order" in conv.notes[-1]
    err = np.abs(dequant(conv, "l") - ref).max()
    assert err <= np.abs(ref).max() / 15 + 1e-6  # within RTN error of a 4-bit 128 group


@pytest.mark.parametrize("qc, keys, match", [
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, (), "gemv"),
    ({"quant_method": "awq", "bits": 3, "group_size": 128, "version": "gemm"}, (), "3-bit"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, (), "marlin"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, ("l.q_perm",), "exllama v2"),
])
def test_unsupported_packings_are_named(qc, keys, match):
    weights = {"l.qweight": mx.zeros((16, 8), mx.int32), **{k: mx.zeros((4,)) for k in keys}}
    with pytest.raises(ModelLoadError, match=match):
        convert_awq_gptq(weights, {"quantization_config": qc})


# ---- whole checkpoints


@pytest.fixture(scope="module")
def fp_model(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("quant") / "fp", CFG)


def _rtn_codes(w: np.ndarray, bits: int, g: int):
    """w [N, K] -> codes [K, N], zeros/scales [K/g, N] (asymmetric, as AutoAWQ/GPTQ)."""
    n, k = w.shape
    wg = w.reshape(n, k // g, g)
    lo, hi = wg.min(-1), wg.max(-1)
    scales = ((hi - lo) / ((1 << bits) - 1)).astype(np.float32)
    zeros = np.clip(np.round(-lo / scales), 1, (1 << bits) - 1)  # >= 1: see gptq_pack_zeros
    q = np.clip(np.round(wg / scales[..., None]) + zeros[..., None], 0, (1 << bits) - 1)
    ref = (scales[..., None] * (q - zeros[..., None])).reshape(n, k)
    return q.reshape(n, k).T.astype(np.uint32), zeros.T.astype(np.uint32), scales.T, ref.astype(np.float32)


def _packed_checkpoint(src, dst_q, dst_ref, method):
    bits, g = 4, 64
    for d in (dst_q, dst_ref):
        shutil.copytree(src, d)
    weights = {k: np.array(v) for k, v in mx.load(str(src / "model.safetensors")).items()}
    packed, ref = dict(weights), dict(weights)
    for i in range(CFG["num_hidden_layers"]):
        for name in LINEARS:
            p = f"model.layers.{i}.{name}"
            q, zeros, scales, deq = _rtn_codes(weights.pop(f"{p}.weight"), bits, g)
            del packed[f"{p}.weight"]
            ref[f"{p}.weight"] = deq
            if method == "awq":
                packed.update({f"{p}.qweight": awq_pack(q), f"{p}.qzeros": awq_pack(zeros), f"{p}.scales": scales})
            else:
                packed.update({f"{p}.qweight": gptq_pack_rows(q, bits), f"{p}.scales": scales,
                               f"{p}.qzeros": gptq_pack_zeros(zeros, bits, v1=True),
                               f"{p}.g_idx": np.arange(q.shape[0], dtype=np.int32) // g})
    for d, w in ((dst_q, packed), (dst_ref, ref)):
        for f in d.glob("model*.safetensors*"):
            f.unlink()
        mx.save_safetensors(str(d / "model.safetensors"), {k: mx.array(v) for k, v in w.items()})
    cfg = json.loads((dst_q / "config.json").read_text())
    cfg["quantization_config"] = (
        {"quant_method": "awq", "bits": bits, "group_size": g, "version": "gemm", "zero_point": True}
        if method == "awq" else
        {"quant_method": "gptq", "bits": bits, "group_size": g, "desc_act": False, "sym": False,
         "checkpoint_format": "gptq"})
    (dst_q / "config.json").write_text(json.dumps(cfg))


def _logits(loaded, ids):
    return loaded.model(mx.array([ids]), loaded.make_cache())


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_packed_checkpoint_matches_dequantized_reference(fp_model, tmp_path, method):
    _packed_checkpoint(fp_model, tmp_path / "q", tmp_path / "ref", method)
    q, ref = load(str(tmp_path / "q")), load(str(tmp_path / "ref"))
    assert q.config["quantization"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    assert "affine 4-bit" in q.info.quantization
    ids = q.tokenizer.encode("The capital of France is Paris.")
    np.testing.assert_allclose(np.array(_logits(q, ids)), np.array(_logits(ref, ids)), atol=1e-4, rtol=1e-4)


# ---- quantize


def _greedy(fn, ids, n=8):
    ids = list(ids)
    for _ in range(n):
        ids.append(int(mx.argmax(fn(mx.array([ids]))[0, -1]).item()))
    return ids[-n:]


@pytest.mark.parametrize("kw", [
    dict(mode="affine"), dict(mode="affine", bits=8, group_size=32), dict(mode="mxfp4"), dict(mode="nvfp4"),
    dict(mode="mxfp8"), dict(recipe="mixed-4-6"), dict(method="awq", n_grid=4),
], ids=lambda kw: "-".join(str(v) for v in kw.values()))
def test_quantize_round_trips_in_mlxlocal_and_mlx_lm(fp_model, tmp_path, kw):
    from mlx_lm.utils import load as lm_load

    res = quantize(str(fp_model), tmp_path / "out", **kw)
    assert res.size_bytes > 0 and (tmp_path / "out" / "tokenizer.json").is_file()
    ours = load(str(tmp_path / "out"))
    theirs, _ = lm_load(str(tmp_path / "out"))
    ids = ours.tokenizer.encode("Local inference means the weights stay")
    a = _greedy(lambda x: ours.model(x, ours.make_cache()), ids)
    b = _greedy(theirs, ids)
    assert a == b
    q = json.loads((tmp_path / "out" / "config.json").read_text())["quantization"]
    assert q["mode"] == kw.get("mode", "affine") and q["bits"] == res.bits


def test_mixed_4_6_writes_per_layer_overrides(fp_model, tmp_path):
    res = quantize(str(fp_model), tmp_path / "out", recipe="mixed-4-6")
    q = json.loads((tmp_path / "out" / "config.json").read_text())["quantization"]
    six = {k for k, v in q.items() if isinstance(v, dict) and v["bits"] == 6}
    # 2 layers: the last one is in the "first/last eighth" band; tied embeddings are the head.
    assert six == {"model.layers.1.self_attn.v_proj", "model.layers.1.mlp.down_proj", "model.embed_tokens"}
    assert res.overrides == 3 and q["bits"] == 4
    modules = dict(load(str(tmp_path / "out")).model.named_modules())
    assert modules["model.layers.1.mlp.down_proj"].bits == 6
    assert modules["model.layers.0.mlp.down_proj"].bits == 4


def test_awq_does_not_raise_output_error_vs_rtn(fp_model, tmp_path):
    ref = load(str(fp_model))
    calib = perplexity_windows(ref.tokenizer.encode(BUILTIN_TEXT), 128)[:4]
    want = ref.model(calib, ref.make_cache())
    errs = {}
    for method in ("rtn", "awq"):
        quantize(str(fp_model), tmp_path / method, bits=3, method=method, n_grid=5, calib_seq_len=128,
                 calib_samples=4)
        m = load(str(tmp_path / method))
        errs[method] = mx.mean((m.model(calib, m.make_cache()) - want) ** 2).item()
    print(errs)
    assert errs["awq"] <= errs["rtn"] * 1.02, errs


# ---- perplexity


@pytest.mark.parametrize("quantized", [False, True])
def test_perplexity_matches_mlx_lm(fp_model, tmp_path, quantized):
    from mlx_lm.perplexity import eval_ppl
    from mlx_lm.utils import load as lm_load

    path = fp_model
    if quantized:
        quantize(str(fp_model), tmp_path / "q4")
        path = tmp_path / "q4"
    ours = load(str(path))
    res = perplexity(ours, BUILTIN_TEXT, seq_len=96, batch_size=3)
    model, tok = lm_load(str(path))
    data = perplexity_windows(tok.encode(BUILTIN_TEXT), 96)
    want, _ = eval_ppl(model, data, batch_size=5)
    assert res.windows == data.shape[0] > 3 and res.tokens == data.shape[0] * 95
    assert abs(res.ppl - want) / want < 1e-3


def test_cli_quantize_and_perplexity(fp_model, tmp_path):
    import typer
    from typer.testing import CliRunner

    from mlxlocal.cli.quant import register

    app = typer.Typer()
    register(app)
    r = CliRunner().invoke(app, ["quantize", "--model", str(fp_model), "--out", str(tmp_path / "o"), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout.strip().splitlines()[-1])["bits"] == 4
    r = CliRunner().invoke(app, ["perplexity", "--model", str(tmp_path / "o"), "--seq-len", "64", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout.strip().splitlines()[-1])["perplexity"] > 1
    r = CliRunner().invoke(app, ["quantize", "--model", str(fp_model), "--out", str(tmp_path / "x"), "--mode", "mxfp4",
                                 "--bits", "8"])
    assert r.exit_code == 1 and "fixed" in r.output
