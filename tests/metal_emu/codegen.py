"""Source generation for the emulation: the translation unit `mx.fast.metal_kernel` would
build around a kernel body (mirrors mlx/backend/common/metal_kernel.cpp), with the dtype
tables and template arguments it needs, and the names a Metal kernel may not use."""

from __future__ import annotations

import re

import numpy as np

from .rewrite import _rewrite

# MLX dtype name -> (Metal type string as MLX's get_type_string, numpy storage dtype)
_TYPES = {
    "float32": ("float", np.float32),
    "float16": ("float16_t", np.float16),
    "bfloat16": ("bfloat16_t", np.uint16),
    "int8": ("int8_t", np.int8),
    "int16": ("int16_t", np.int16),
    "int32": ("int32_t", np.int32),
    "int64": ("int64_t", np.int64),
    "uint8": ("uint8_t", np.uint8),
    "uint16": ("uint16_t", np.uint16),
    "uint32": ("uint32_t", np.uint32),
    "uint64": ("uint64_t", np.uint64),
    "bool": ("bool", np.bool_),
}
_ALIASES = {"float": "float32", "half": "float16", "bfloat16_t": "bfloat16", "bool_": "bool",
            "float16_t": "float16"}

# The attributes MLX declares when the body mentions them (name, Metal type), in MLX's order.
_ATTRIBUTES = [
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
]
_MAX_CONSTANT_ARRAY_SIZE = 8  # MLX passes smaller inputs in the constant address space

def _dtype_name(d) -> str:
    """np.dtype / numpy type / mx.Dtype / string -> MLX dtype name ('float16', 'bfloat16', ...)."""
    if isinstance(d, str):
        name = d
    elif type(d).__name__ == "Dtype":  # mx.Dtype, e.g. mlx.core.float16
        name = str(d).rsplit(".", 1)[-1]
    else:
        try:
            name = np.dtype(d).name
        except TypeError as e:
            raise TypeError(f"metal_emu: unsupported dtype {d!r}") from e
    name = _ALIASES.get(name, name)
    if name not in _TYPES:
        raise TypeError(f"metal_emu: unsupported dtype {d!r}")
    return name


def _is_dtype_like(v) -> bool:
    if isinstance(v, (bool, int, np.integer, np.bool_)):
        return False
    try:
        _dtype_name(v)
        return True
    except TypeError:
        return False


def _template_value(v) -> tuple[str, str]:
    """(C++ template parameter kind, instantiation text) for one template argument."""
    if isinstance(v, (bool, np.bool_)):
        return "bool", "1" if v else "0"  # MLX streams bools without boolalpha
    if isinstance(v, (int, np.integer)):
        return "int", str(int(v))
    if _is_dtype_like(v):
        return "typename", _TYPES[_dtype_name(v)][0]
    raise TypeError(f"metal_emu: template argument {v!r} must be a dtype, an int or a bool")


# ---------------------------------------------------------------------------------------------
# Source generation (mirrors mlx/backend/common/metal_kernel.cpp)
# ---------------------------------------------------------------------------------------------
# Names a kernel may not use: Metal has no double, no C or C++ standard library (std::min,
# printf, malloc), no C float functions (expf: Metal's exp is overloaded), and none of the C++
# features the Metal spec lists as unsupported (new, goto, virtual, thread_local, exceptions,
# RTTI). Poisoned after metal.h: they fail to compile in the kernel and its header only.
_NOT_METAL = ("double", "std", "printf", "fprintf", "malloc", "calloc", "realloc", "memcpy", "memset",
              "expf", "exp2f", "logf", "log2f", "powf", "sqrtf", "fabsf", "floorf", "ceilf", "roundf",
              "fminf", "fmaxf", "sinf", "cosf", "tanhf", "erff", "fmodf", "new", "goto", "virtual",
              "thread_local", "throw", "try", "catch", "typeid", "dynamic_cast")


def generate_source(name, source, header, input_names, output_names, inputs_meta,
                    output_dtypes, template, atomic_outputs=False):
    """Returns (translation unit, kernel name, line ranges {'header': (a, b), 'source': (c, d)}).

    inputs_meta: list of (dtype name, ndim, size) per input.
    """
    kernel_name = "custom_kernel_" + name
    tparams, targs = [], []
    for tname, value in template:
        kind, text = _template_value(value)
        tparams.append(f"{kind} {tname}")
        targs.append(text)
    if template:
        kernel_name += "_" + "_".join(targs)
    for dt, ndim, size in inputs_meta:
        kernel_name += "_" + _TYPES[dt][0]
        kernel_name += "s" if ndim == 0 else ("c" if size < _MAX_CONSTANT_ARRAY_SIZE else "")
    for dt in output_dtypes:
        kernel_name += "_" + _TYPES[dt][0]
    kernel_name = re.sub(r"\W", "_", kernel_name)

    next_id = [0]
    lines = ['#include "metal.h"  // tests/metal_emu/metal.h (precompiled when possible)',
             f"#pragma GCC poison {' '.join(_NOT_METAL)}",
             "// ---- header ----"]
    h0 = len(lines) + 1
    lines += _rewrite(header, next_id).split("\n")
    h1 = len(lines)
    lines.append("// ---- kernel (signature generated as by mx.fast.metal_kernel) ----")
    if template:
        lines.append("template <" + ", ".join(tparams) + ">")
    lines.append(f"[[kernel]] void {kernel_name}(")

    params, casts, index = [], [], 0
    for (dt, ndim, size), iname in zip(inputs_meta, input_names):
        t = _TYPES[dt][0]
        loc = "constant" if size < _MAX_CONSTANT_ARRAY_SIZE else "device"
        if ndim == 0:
            params.append(f"  const {loc} {t}& {iname} [[buffer({index})]]")
            casts.append(f"*(const {loc} {t}*)a[{index}]")
        else:
            params.append(f"  const {loc} {t}* {iname} [[buffer({index})]]")
            casts.append(f"(const {loc} {t}*)a[{index}]")
        index += 1
        if ndim > 0:
            if iname + "_shape" in source:
                params.append(f"  const constant int* {iname}_shape [[buffer({index})]]")
                casts.append(f"(const constant int*)a[{index}]")
                index += 1
            if iname + "_strides" in source:
                params.append(f"  const constant int64_t* {iname}_strides [[buffer({index})]]")
                casts.append(f"(const constant int64_t*)a[{index}]")
                index += 1
            if iname + "_ndim" in source:
                params.append(f"  const constant int& {iname}_ndim [[buffer({index})]]")
                casts.append(f"*(const constant int*)a[{index}]")
                index += 1
    for oname, dt in zip(output_names, output_dtypes):
        t = _TYPES[dt][0]
        if atomic_outputs:
            t = f"atomic<{t}>"
        params.append(f"  device {t}* {oname} [[buffer({index})]]")
        casts.append(f"(device {t}*)a[{index}]")
        index += 1
    for attr, atype in _ATTRIBUTES:
        if attr in source:
            params.append(f"  {atype} {attr} [[{attr}]]")
            casts.append(f"ti.{attr}")
    lines.append(",\n".join(params) + ") {")
    lines = "\n".join(lines).split("\n")
    s0 = len(lines) + 1
    lines += _rewrite(source, next_id).split("\n")
    s1 = len(lines)
    lines.append("}")
    targ = f"<{', '.join(targs)}>" if template else ""
    lines += [
        "// ---- emulator entry points ----",
        "static void mtl_entry(void** a, const ::mtl::ThreadInfo& ti) {",
        f"  {kernel_name}{targ}(" + ", ".join(casts) + ");",
        "}",
        'extern "C" __attribute__((visibility("default"))) int mtl_run(int nbufs, void** host,',
        "    const uint64_t* nbytes, const int* writeback, const char* const* names,",
        "    const uint32_t* grid, const uint32_t* tg, char* err, int errlen) {",
        "  return ::mtl::run(&mtl_entry, nbufs, host, nbytes, writeback, names, grid, tg, err,",
        "                    errlen);",
        "}",
        "",
    ]
    return "\n".join(lines), kernel_name, {"header": (h0, h1), "source": (s0, s1)}
