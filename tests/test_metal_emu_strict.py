"""The emulation's strict checks (issue 19): each is shown catching a deliberately broken kernel
that a laxer harness accepted. Outputs start poisoned, buffers end at a guard page, threads run
in seeded interleavings, half/bfloat operators round every result, what Metal lacks (double,
std::, C float functions, new, goto) does not compile, and the Metal-language check (libclang,
real address spaces, no C/C++ library) rejects what g++ alone ran: address-space mix-ups,
stores into constant memory, writable globals, functions metal.h does not model."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import metal_emu
import numpy as np
import pytest
from metal_emu import KernelCompileError, KernelRuntimeError
from test_metal_emu_harness import run1

pytestmark = pytest.mark.skipif(not metal_emu.compiler_available(),
                                reason=metal_emu.skip_reason())


def test_outputs_start_poisoned_so_a_missing_store_fails():
    """MLX leaves outputs uninitialised. A kernel that skips the store where its result is 0
    passed when the emulation started outputs at zero; now those elements read NaN / -1."""
    x = np.array([1.5, 0.0, -2.0, 0.0] * 8, np.float32)
    skips = "uint i = thread_position_in_grid.x; if (inp0[i] != 0.0f) { out[i] = inp0[i]; }"
    zeroed = run1(skips, [x], (32,), grid=(32, 1, 1), init_value=0.0)  # the old default
    np.testing.assert_array_equal(zeroed, x)  # the bug hides
    got = run1(skips, [x], (32,), grid=(32, 1, 1))
    assert np.isnan(got[x == 0]).all() and (got[x != 0] == x[x != 0]).all()
    for dtype, poison in ((np.int32, -1), (np.uint32, 0xFFFFFFFF), (np.float16, None)):
        out = run1("uint i = thread_position_in_grid.x; if (i > 0) { out[i] = 7; }", [x], (4,), dtype,
                   grid=(4, 1, 1))
        assert (np.isnan(out[0]) if poison is None else out[0] == poison) and (out[1:] == 7).all()


BARRIER_KERNEL = """
    uint i = thread_position_in_threadgroup.x;
    threadgroup float tg[64];
    tg[i] = inp0[i];
    BARRIER
    out[i] = i > 0 ? tg[i - 1] : 0.0f;
"""


def test_seeded_schedules_expose_a_missing_barrier():
    """Each thread reads what the thread before it wrote. Without the barrier, thread order
    (the emulation's only order before) happens to run the writer first and the kernel passes;
    seeded interleavings run some reader first, which reads unwritten threadgroup memory."""
    x = np.arange(1, 65, dtype=np.float32)
    want = np.concatenate([[0.0], x[:-1]]).astype(np.float32)
    broken = BARRIER_KERNEL.replace("BARRIER", "")
    fixed = BARRIER_KERNEL.replace("BARRIER", "threadgroup_barrier(mem_flags::mem_threadgroup);")
    np.testing.assert_array_equal(run1(broken, [x], (64,), grid=(64, 1, 1), threadgroup=(64, 1, 1)), want)
    wrong = [seed for seed in range(8) if not np.array_equal(
        run1(broken, [x], (64,), grid=(64, 1, 1), threadgroup=(64, 1, 1), schedule_seed=seed), want)]
    assert len(wrong) >= 6  # almost every interleaving breaks it
    for seed in range(8):  # with the barrier every interleaving gives the same answer
        np.testing.assert_array_equal(
            run1(fixed, [x], (64,), grid=(64, 1, 1), threadgroup=(64, 1, 1), schedule_seed=seed), want)


def test_seeded_schedules_keep_simd_and_barrier_semantics():
    """Shuffled order still releases SIMD functions and barriers only when every live thread
    arrives: a reduction over a threadgroup gives the same bits under every seed."""
    src = """
        uint i = thread_position_in_threadgroup.x;
        threadgroup float part[4];
        float s = simd_sum(inp0[thread_position_in_grid.x]);
        if (thread_index_in_simdgroup == 0) part[simdgroup_index_in_threadgroup] = s;
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (i == 0) out[threadgroup_position_in_grid.x] = part[0] + part[1] + part[2] + part[3];
    """
    x = np.random.default_rng(0).standard_normal(512).astype(np.float32)
    base = run1(src, [x], (4,), grid=(512, 1, 1), threadgroup=(128, 1, 1))
    np.testing.assert_allclose(base, x.reshape(4, 128).sum(axis=1), rtol=1e-5)
    for seed in range(4):
        np.testing.assert_array_equal(
            run1(src, [x], (4,), grid=(512, 1, 1), threadgroup=(128, 1, 1), schedule_seed=seed), base)


def test_half_and_bfloat_arithmetic_rounds_every_operation():
    """Metal rounds each half (and bfloat) operation's result: 2048 + 1 + 1 is 2048 in half
    (2049 rounds to even, twice), 2050 when the sum is kept in float and rounded once."""
    h = np.array([2048, 1, 1], np.float16)
    out = run1("out[0] = inp0[0] + inp0[1] + inp0[2];", [h], (1,), np.float16, grid=(1, 1, 1),
               threadgroup=(1, 1, 1))
    assert out[0] == 2048
    out = run1("out[0] = float(inp0[0]) + float(inp0[1]) + float(inp0[2]);", [h], (1,), np.float16,
               grid=(1, 1, 1), threadgroup=(1, 1, 1))
    assert out[0] == 2050
    b = metal_emu.bfloat16(metal_emu.float32_to_bf16(np.array([256, 1, 1], np.float32)))
    out = run1("out[0] = float(inp0[0] + inp0[1] + inp0[2]);", [b], (1,), np.float32, grid=(1, 1, 1),
               threadgroup=(1, 1, 1))
    assert out[0] == 256  # bfloat spacing is 2 at 256: each +1 rounds back


@pytest.mark.parametrize("code,metal", [
    ("double d = inp0[i]; out[i] = float(d * 2.0);", "float d = inp0[i]; out[i] = d * 2.0f;"),
    ("out[i] = std::min(inp0[i], 1.0f);", "out[i] = min(inp0[i], 1.0f);"),
    ("out[i] = expf(inp0[i]);", "out[i] = exp(inp0[i]);"),
    ("out[i] = fmaxf(inp0[i], 0.0f);", "out[i] = fmax(inp0[i], 0.0f);"),
    ("float* p = new float[1]; p[0] = inp0[i]; out[i] = p[0];", "float p[1]; p[0] = inp0[i]; out[i] = p[0];"),
    ("if (i > 99) goto end; out[i] = inp0[i]; end:;", "if (i <= 99) { out[i] = inp0[i]; }"),
])
def test_what_metal_lacks_does_not_compile(code, metal):
    """double, the C++ standard library, C's float functions, new and goto compiled as C++
    before; Apple's compiler rejects them, and so does the emulation now, naming the
    identifier (the Metal-language check first, g++ too without it)."""
    x = np.linspace(-1, 1, 8, dtype=np.float32)
    prefix = "uint i = thread_position_in_grid.x; "
    for metal_check in (True, False):
        with pytest.raises(KernelCompileError, match="poisoned"):
            run1(prefix + code, [x], (8,), grid=(8, 1, 1), metal_check=metal_check)
    run1(prefix + metal, [x], (8,), grid=(8, 1, 1))  # the Metal spelling compiles and runs


def test_a_read_one_element_past_the_end_is_caught():
    """Buffers end exactly at a guard page. This kernel reads inp0[15] of a 15-float buffer:
    with buffers padded to 64 bytes (the emulation before) it read 4 bytes of padding and
    passed silently; now the read faults, naming the buffer and the thread."""
    src = "uint i = thread_position_in_grid.x; out[i] = inp0[i + 1];"
    x = np.arange(15, dtype=np.float32)
    with pytest.raises(KernelRuntimeError, match=r"thread_position_in_grid=\(14,0,0\).*buffer 'inp0'"):
        run1(src, [x], (15,), grid=(15, 1, 1))
    np.testing.assert_array_equal(run1(src, [x], (14,), grid=(14, 1, 1)), x[1:])  # in bounds: fine


# --------------------------------------------------------------------------------------------
# The Metal-language check (metal_emu/check.py): real address spaces, no C/C++ library
# --------------------------------------------------------------------------------------------
needs_clang = pytest.mark.skipif(not metal_emu.check.available(),
                                 reason="the Metal-language check needs libclang (dev extra)")
SMALL = np.array([1.0, 2.0, 3.0, 4.0], np.float32)  # < 8 elements: MLX passes it as `constant`
BIG = np.arange(32, dtype=np.float32)
IDX = "uint i = thread_position_in_grid.x; "

# (what, header, source, inputs, expected output, the check's message). Each compiles and runs
# under g++, where the address-space keywords are empty and C's libm is visible; Metal rejects it.
NOT_METAL = [
    ("constant pointer converted to a device pointer", "",
     IDX + "const device float* p = inp1; out[i] = inp0[i] + p[i % 4];",
     [BIG, SMALL], BIG + np.tile(SMALL, 8),
     r"'device float const \*' with an lvalue of type 'const constant float \*'"),
    ("threadgroup array passed as a device pointer",
     "inline void put(device float* p, uint i, float v) { p[i] = v; }",
     IDX + "threadgroup float t[32]; put(t, i, inp0[i] * 2.0f); "
     "threadgroup_barrier(mem_flags::mem_threadgroup); out[i] = t[31 - i];",
     [BIG], BIG[::-1] * 2, r"no matching function for call to 'put'(.|\n)*threadgroup float"),
    ("store through an input's const device pointer, its const cast away", "",
     IDX + "float* p = const_cast<float*>(inp0); p[i] = 0.0f; out[i] = 1.0f;",
     [BIG], np.ones(32, np.float32),
     r"const_cast from 'device float const \*' to 'float \*' is not allowed"),
    ("store into constant memory", "constant float table[4] = {1.0f, 2.0f, 3.0f, 4.0f};",
     IDX + "if (i == 0) { table[0] = 5.0f; } out[i] = inp0[i];", [BIG], BIG,
     r"cannot assign to variable 'table' with const-qualified type 'const constant float\[4\]'"),
    ("thread pointer to device memory", "",
     IDX + "const float* p = inp0 + i; out[i] = *p + 1.0f;", [BIG], BIG + 1,
     r"'const float \*' with an rvalue of type 'device float const \*'"),
    ("writable program-scope variable", "float first = 0.0f;",
     IDX + "if (i == 0) { first = inp0[0]; } out[i] = inp0[i];", [BIG], BIG,
     r"'first' is writable program-scope or static storage"),
    ("threadgroup variable with an initialiser", "",
     IDX + "threadgroup float z = 1.0f; out[i] = inp0[i] + z;", [BIG], BIG + 1,
     r"automatic variable qualified with an address space \(Metal: a threadgroup variable"),
    ("a function metal.h does not model (C's ldexp)", "",
     IDX + "out[i] = ldexp(inp0[i], 2);", [BIG], BIG * 4, r"undeclared identifier 'ldexp'"),
]


@needs_clang
@pytest.mark.parametrize("what,header,source,inputs,want,message", NOT_METAL,
                         ids=[c[0] for c in NOT_METAL])
def test_metal_check_rejects_what_gxx_accepts(what, header, source, inputs, want, message):
    """g++ alone compiles and runs each kernel (the right answer, even); the Metal-language
    check rejects it as Apple's compiler would, naming the kernel line and the problem."""
    got = run1(source, inputs, (32,), grid=(32, 1, 1), header=header, metal_check=False)
    np.testing.assert_array_equal(got, want)
    with pytest.raises(KernelCompileError, match=message) as err:
        run1(source, inputs, (32,), grid=(32, 1, 1), header=header)
    assert "kernel 't' is not valid Metal" in str(err.value)
    assert re.search(r"kernel (source|header) line 1 ", str(err.value))


MODELLED_HEADER = """
struct Tile { static constant constexpr const int N = 4; };  // MLX's STEEL_CONST spelling
constant float kScale[2] = {1.0f, 2.0f};
"""
MODELLED = """
    const uint i = thread_position_in_grid.x;
    constant float local_table[2] = {0.0f, 0.5f};
    threadgroup float4 tg4[8];
    threadgroup atomic_uint count[1];
    if (i == 0) { atomic_store_explicit(&count[0], 0u, memory_order_relaxed); }
    const device packed_float4* x4 = (const device packed_float4*)x;
    const float4 v = x4[i / 4];
    const half4 hv = half4(v);
    tg4[i / 4] = float4(hv) * 2.0f;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    atomic_fetch_add_explicit(&count[0], 1u, memory_order_relaxed);
    float4 w = tg4[i / 4] + v;
    w += v;
    w = x4[(i / 4 + 1) % 8];  // assigned from device memory
    const float e = w[i % 4] + dot(v, float4(1.0f)) + float(bs[i % 4]) + float(hs[i]) * 1.0h;
    const bfloat16_t b = static_cast<bfloat16_t>(e) + static_cast<bfloat16_t>(hs[i]) * 0.0f;
    const uint round_trip = as_type<uint>(as_type<half2>(as_type<uint>(e)));  // == bits of e
    const float s = simd_sum(e) + simd_shuffle_down(e, 1u) + float(simd_any(e > 1.0f));
    const uint loc = elem_to_loc(uint(i), x_shape, x_strides, x_ndim);
    out[i] = float(b) + metal::precise::exp(-abs(e)) + clamp(e, -1.0f, 1.0f)
             + fma(e, e, 0.0f) + float(as_type<uint>(e) - round_trip) + float(loc) + s * 0.0f
             + float(Limits<half>::finite_max) * 0.0f + kScale[i % 2] * Tile::N + local_table[i % 2];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (i == 0) { out[0] = float(atomic_load_explicit(&count[0], memory_order_relaxed)); }
"""


@needs_clang
def test_metal_check_accepts_the_modelled_builtins():
    """Vectors loaded from and stored to device / threadgroup memory, converted, indexed;
    constant tables at program and function scope, static constexpr members; threadgroup and
    device atomics; half and bfloat inputs, half -> bfloat; SIMD functions; shape/strides;
    as_type, Limits: valid Metal that the check must let through (no false alarm from
    clang's C++), with the same result as the emulation alone."""
    x = np.linspace(-1, 1, 32).astype(np.float32)
    bits = metal_emu.bfloat16(metal_emu.float32_to_bf16(x[:8]))
    args = ("t", MODELLED, MODELLED_HEADER, ["x", "bs", "hs"], ["out"], [x, bits, x.astype(np.float16)],
            [(32,)], [np.float32], (32, 1, 1), (32, 1, 1))
    (want,) = metal_emu.run_kernel(*args, metal_check=False)
    (got,) = metal_emu.run_kernel(*args)
    np.testing.assert_array_equal(got, want)
    assert want[0] == 32  # every thread's atomic add landed
    (counts,) = metal_emu.run_kernel(
        "t", "atomic_fetch_add_explicit(&c[thread_position_in_grid.x % 2], 1, "
        "memory_order_relaxed);", "", ["x"], ["c"], [x], [(2,)], [np.int32], (32, 1, 1),
        (32, 1, 1), init_value=0, atomic_outputs=True)
    np.testing.assert_array_equal(counts, [16, 16])


@needs_clang
def test_metal_check_parses_each_source_once(tmp_path, monkeypatch):
    """The check costs one libclang parse per distinct source (metal.h precompiled once): a
    clean parse is remembered in the process and on disk (another process reuses it); a new
    source is parsed again."""
    from metal_emu import check

    parses = []
    monkeypatch.setattr(check, "_clean", set())
    index = check._index_()
    monkeypatch.setattr(index, "parse", lambda path, **k: parses.append(path) or type(index).parse(
        index, path, **k))
    src, _, ranges = metal_emu.generate_source(
        "t", IDX + "out[i] = inp0[i];", "", ["inp0"], ["out"], [("float32", 1, 32)], ["float32"], [])
    check.check("t", src, ranges, tmp_path)
    check.check("t", src, ranges, tmp_path)
    assert [Path(p).name for p in parses][0] == "metal.h"  # precompiled once, first
    assert len(parses) == 2
    check._clean.clear()  # a new process: the marker file answers
    check.check("t", src, ranges, tmp_path)
    assert len(parses) == 2
    check.check("t", src.replace("inp0[i]", "inp0[i] + 1.0f"), ranges, tmp_path)
    assert len(parses) == 3 and parses[2].endswith(".cpp")


def _declared(extra: list[str]) -> set[str]:
    """Names metal.h declares at global scope and in metal / fast / precise, parsed with
    libclang with `extra` flags (no parse errors allowed)."""

    import clang.cindex as ci
    from metal_emu import check

    header = check._HERE / "metal.h"
    tu = check._index_().parse(str(header), args=["-x", "c++-header", "-std=c++17", "-nostdinc",
                                                  "-nostdinc++", *extra])
    errors = [str(d) for d in tu.diagnostics if d.severity >= ci.Diagnostic.Error]
    assert not errors, errors[:5]
    names = set()

    def walk(cursor, scope):
        for c in cursor.get_children():
            if c.location.file is None or Path(c.location.file.name) != header:
                continue
            if c.kind == ci.CursorKind.NAMESPACE:
                walk(c, scope + c.spelling + "::")
            elif scope in ("", "metal::", "metal::fast::", "metal::precise::"):
                names.add(scope + c.spelling)

    walk(tu.cursor, "")
    return names


@needs_clang
def test_metal_check_declares_what_metal_h_models():
    """The check reuses metal.h (MTL_CHECK: no runtime, no C++ library, address spaces): both
    modes parse and declare the same Metal names, so a built-in the emulation models is one the
    check knows, and the check knows no other. (The g++ mode is parsed here with g++'s own
    include directories.)"""
    verbose = subprocess.run([metal_emu._cxx(), "-std=c++20", "-xc++", "-E", "-v", "-"], input="",
                             capture_output=True, text=True).stderr
    dirs = re.search(r"#include <\.\.\.> search starts here:\n(.*?)End of search", verbose, re.S)
    gxx = _declared([f"-isystem{d}" for d in dirs.group(1).split()])
    checked = _declared(["-DMTL_CHECK", f"-I{metal_emu.check._HERE}"])
    assert gxx == checked
    assert {"metal::simd_sum", "metal::atomic_fetch_add_explicit", "metal::exp", "vec", "bfloat",
            "metal::fast::exp", "elem_to_loc"} <= checked
