"""One launch description per kernel call, shared by the Metal dispatch and the emulation tests.

Each kernel module builds a `LaunchSpec` from shapes and dtypes alone (`launch_spec(...)`), so
the tests under tests/metal_emu run exactly the source, template, grid and threadgroup that
`mx.fast.metal_kernel` gets on a Mac. `run` is the only place a Metal kernel object is created
(lazily, on first use, and only when Metal is available).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx
import numpy as np

# Dtypes the kernels are instantiated for, by MLX name (the template / output dtype strings).
KERNEL_DTYPES = ("float16", "bfloat16", "float32")

_MX_DTYPES = {
    "float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32,
    "int32": mx.int32, "uint32": mx.uint32,
}
_NP_DTYPES = {"int32": np.int32, "float32": np.float32}


def dtype_name(dtype: mx.Dtype) -> str:
    """'float16' for mx.float16 etc. (the spelling used in templates and output dtypes)."""
    return str(dtype).rsplit(".", 1)[-1]


@dataclass(frozen=True)
class LaunchSpec:
    """Everything `mx.fast.metal_kernel` needs for one call, except the tensor inputs.

    `input_names` lists the tensor inputs first, then the small constant inputs described by
    `constants` ((values, dtype) per name, in order) that the launcher builds itself.
    """

    name: str
    source: str
    header: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    template: tuple[tuple[str, int | str], ...]
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    output_shapes: tuple[tuple[int, ...], ...]
    output_dtypes: tuple[str, ...]
    constants: tuple[tuple[tuple[int | float, ...], str], ...] = ()

    def constant_arrays(self) -> list[np.ndarray]:
        """The constant inputs as numpy arrays (what the emulation harness is given)."""
        return [np.asarray(v, dtype=_NP_DTYPES[d]) for v, d in self.constants]


@lru_cache(maxsize=None)
def _metal_kernel(name: str, source: str, header: str, input_names: tuple, output_names: tuple):
    return mx.fast.metal_kernel(
        name=name, input_names=list(input_names), output_names=list(output_names),
        source=source, header=header,
    )


@lru_cache(maxsize=4096)
def _constant(values: tuple, dtype: str) -> mx.array:
    return mx.array(values, dtype=_MX_DTYPES[dtype])


def run(spec: LaunchSpec, tensors: list[mx.array]) -> list[mx.array]:
    """Launch `spec` on Metal with `tensors` (+ its constants); returns the outputs."""
    kernel = _metal_kernel(spec.name, spec.source, spec.header, spec.input_names,
                           spec.output_names)
    inputs = list(tensors) + [_constant(tuple(v), d) for v, d in spec.constants]
    return kernel(
        inputs=inputs,
        template=[(k, _MX_DTYPES[v] if isinstance(v, str) else v) for k, v in spec.template],
        grid=spec.grid,
        threadgroup=spec.threadgroup,
        output_shapes=[list(s) for s in spec.output_shapes],
        output_dtypes=[_MX_DTYPES[d] for d in spec.output_dtypes],
    )


def metal_available() -> bool:
    return mx.metal.is_available()
