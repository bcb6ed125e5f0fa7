"""The Metal-language check: the exact translation unit a kernel becomes, parsed by libclang
(C++17, -fsyntax-only) with -DMTL_CHECK, before the emulation compiles it with g++.

What g++ cannot see and this does (metal.h, MTL_CHECK):
* address spaces are real and incompatible (device, constant, threadgroup; thread = the default
  one, as an unqualified pointer in Metal): constant -> device pointers, a threadgroup array
  passed as `device float*`, a device pointer kept in a thread pointer are errors naming both;
* constant memory is read-only (a store into a program-scope `constant` array is an error), there
  is no other program-scope or static storage (a writable global / static is an error), and
  a pointer keeps its space through const_cast / reinterpret_cast (C-style casts may change it);
* no C/C++ library is visible (-nostdinc; check_std.h declares only what metal.h's own bodies
  use, and `std`/`double` are poisoned after metal.h): a function metal.h does not model
  (hypot, ::expf, ...) is an undeclared identifier instead of a libm call.
clang's C++ has no member functions per address space (Metal declares its vectors' for each):
errors that only come from that (operator[], assignment or a copy of a vec or struct in device /
threadgroup / constant memory) are dropped (_metal_allows), and the expression they are in is
not checked further.

Each distinct source (and metal.h) is parsed once per machine: a marker file in the emulator's
cache records a clean parse; metal.h is precompiled once (check_metal_<hash>.pch there). Without the libclang module the check is skipped (`available()`).
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import os
import re
import threading
from pathlib import Path
from typing import NamedTuple

_HERE = Path(__file__).resolve().parent
_ARGS = ["-x", "c++", "-std=c++17", "-nostdinc", "-nostdinc++", "-DMTL_CHECK", f"-I{_HERE}",
         f"-I{_HERE / 'include'}",
         "-Wno-unknown-attributes",
         "-Wno-duplicate-decl-specifier", "-ferror-limit=20"]
_lock = threading.Lock()
_index = None
_clean: set[str] = set()


@atexit.register
def _drop_index() -> None:  # before interpreter teardown, when cindex could no longer free it
    global _index
    _index = None


def available() -> bool:
    try:
        import clang.cindex as ci

        return ci.conf.lib is not None  # loads the shared library
    except Exception:  # noqa: BLE001 - no module, or its libclang.so does not load
        return False


def _index_():
    global _index
    if _index is None:
        import clang.cindex as ci

        _index = ci.Index.create()
    return _index


@functools.lru_cache(maxsize=None)
def _version() -> str:
    import clang.cindex as ci

    fn = ci.conf.lib.clang_getClangVersion
    fn.restype = ci._CXString
    fn.errcheck = ci._CXString.from_result
    return fn()


def check(name: str, src: str, ranges: dict, cache: Path) -> None:
    """Raises KernelCompileError (from metal_emu) naming the kernel, the line of its source and
    clang's message when `src` is not valid Metal as modelled here; returns quietly otherwise."""
    headers = _headers_key()
    key = hashlib.sha256(f"{src}\0{headers}".encode()).hexdigest()[:24]
    marker = cache / f"check_{key}.ok"
    if key in _clean or marker.exists():
        _clean.add(key)
        return
    path = cache / f"check_{key}.cpp"
    with _lock:
        pch = _pch(cache, headers)
        errors = _errors(str(path), src, ["-include-pch", str(pch)] if pch else [], ranges)
        if errors and pch:  # the verdict without the precompiled header (stale, or just sure)
            errors = _errors(str(path), src, [], ranges)
    if not errors:
        marker.touch()
        _clean.add(key)
        return
    path.write_text(src)
    from . import KernelCompileError

    text = "\n".join(_describe(d, src, str(path), ranges) for d in errors[:8])
    raise KernelCompileError(
        f"metal_emu: kernel '{name}' is not valid Metal (Metal-language check: libclang, real "
        f"address spaces, only the Metal built-ins metal.h models):\n{text}\n"
        f"(generated source: {path}; run_kernel(..., metal_check=False) runs the emulation "
        f"without this check)", stderr="\n".join(d.text for d in errors), source=src)


class _Diag(NamedTuple):
    """A clang diagnostic copied out of its translation unit (which owns the original)."""

    spelling: str
    file: str | None
    line: int
    column: int
    text: str
    children: tuple[_Diag, ...] = ()


def _copy(d) -> _Diag:
    loc = d.location
    return _Diag(d.spelling, loc.file.name if loc.file else None, loc.line, loc.column, str(d),
                 tuple(_copy(c) for c in d.children))


def _errors(path: str, src: str, extra: list[str], ranges: dict) -> list[_Diag]:
    import clang.cindex as ci

    tu = _index_().parse(path, args=_ARGS + extra, unsaved_files=[(path, src)])
    diags = [_copy(d) for d in tu.diagnostics if d.severity >= ci.Diagnostic.Error]
    lines = src.split("\n")
    return [d for d in diags if not _metal_allows(d, lines)] + _writable_statics(tu, path, ranges)


def _writable_statics(tu, path: str, ranges: dict) -> list[_Diag]:
    """Metal has no writable program-scope or static storage (it must be `constant`); C++ does,
    and on the emulator every thread would share it."""
    import clang.cindex as ci

    scopes = (ci.CursorKind.TRANSLATION_UNIT, ci.CursorKind.NAMESPACE, ci.CursorKind.STRUCT_DECL,
              ci.CursorKind.CLASS_DECL)
    found = []
    for top in tu.cursor.get_children():
        if top.location.file is None or top.location.file.name != path:
            continue
        for c in top.walk_preorder():
            if c.kind != ci.CursorKind.VAR_DECL or not any(
                    a <= c.location.line <= b for a, b in ranges.values()):
                continue
            if c.semantic_parent.kind not in scopes and c.storage_class != ci.StorageClass.STATIC:
                continue
            qualifiers = c.type.spelling.split("[")[0]
            if "address_space(2)" in qualifiers or "const" in qualifiers.split():
                continue
            msg = (f"'{c.spelling}' is writable program-scope or static storage, which Metal "
                   f"does not have: declare it `constant` (read-only), use threadgroup memory or "
                   f"a buffer")
            line, col = c.location.line, c.location.column
            found.append(_Diag(msg, path, line, col, f"{path}:{line}:{col}: error: {msg}"))
    return found


def _headers_key() -> str:
    parts = [(_HERE / "metal.h").read_text(), (_HERE / "check_std.h").read_text(),
             " ".join(_ARGS), _version()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def _pch(cache: Path, headers: str) -> Path | None:
    """metal.h precompiled for the check (a kernel's parse takes ~5 ms with it, ~90 ms without);
    None when metal.h does not parse cleanly in check mode (the kernel's parse then says why)."""
    # clang rejects a PCH whose header moved or was touched since: name those in the key too
    stamp = " ".join(f"{f}:{f.stat().st_mtime_ns}" for f in (_HERE / "metal.h",
                                                              _HERE / "check_std.h"))
    pch = cache / f"check_metal_{hashlib.sha256(f'{headers} {stamp}'.encode()).hexdigest()[:24]}.pch"
    if not pch.exists():
        import clang.cindex as ci

        tu = _index_().parse(str(_HERE / "metal.h"), args=_ARGS[2:] + ["-x", "c++-header"])
        if any(d.severity >= ci.Diagnostic.Error for d in tu.diagnostics):
            return None
        tmp = pch.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        tu.save(str(tmp))
        os.replace(tmp, pch)
    return pch


_SPACES = {"1": "device", "2": "constant", "3": "threadgroup"}
_CONVERSIONS = ("cannot initialize", "assigning to", "static_cast from", "C-style cast from",
                "functional-style cast from", "no viable conversion", "cannot convert")
_THIS_AS = "'this' object is in address space"
_REF_AS = "cannot bind reference in address space"


def _metal_allows(diag: _Diag, lines: list[str]) -> bool:
    """Errors that only clang's C++ makes: a member function (operator[], the implicit copy
    assignment or copy constructor) called on an object in device / threadgroup / constant
    memory (Metal declares them for every address space; clang's C++ cannot), a `constant`
    variable declared in a function (clang's C++ allows address spaces on globals only), and a
    conversion between half and bfloat (Metal converts, as MLX's copy kernels do; __bf16 not)."""
    if "'_Float16'" in diag.spelling and "'__bf16'" in diag.spelling and diag.spelling.startswith(
            _CONVERSIONS):  # the check's bfloat is clang's __bf16, which will not take a half
        return True
    if diag.spelling.startswith("automatic variable qualified with an address space"):
        statement = re.split(r"[;{}]", lines[diag.line - 1][:diag.column])[-1] if diag.line else ""
        return "constant" in statement.split()
    notes = [c.spelling for c in diag.children if c.spelling.startswith("candidate")]
    if not notes:
        return False
    if diag.spelling.startswith("no viable overloaded operator[]"):
        return all(_THIS_AS in n for n in notes)
    if diag.spelling.startswith("no viable overloaded '='"):  # into, or from, another space
        return all(_THIS_AS in n or (_REF_AS in n and "implicit" in n) for n in notes)
    if diag.spelling.startswith("no matching constructor for initialization"):
        copies = [n for n in notes if "implicit copy constructor" in n or "implicit move" in n]
        return bool(copies) and all(_REF_AS in n for n in copies)
    return False


def _metal_words(text: str) -> str:
    """clang's spelling of an address space -> Metal's keyword."""
    return re.sub(r"__attribute__\(\(address_space\((\d)\)\)\)", lambda m: _SPACES[m.group(1)],
                  text)


def _describe(diag, src: str, path: str, ranges: dict) -> str:
    """One error: clang's message, where it is in the kernel (following template-instantiation
    notes back to the generated file when the error is inside metal.h), and the lines there."""
    lines = src.split("\n")
    here = [w for w in (diag, *diag.children) if w.file == path]  # kernel lines first
    inside = [w for w in here if any(a <= w.line <= b for a, b in ranges.values())]
    loc = (inside or here or [None])[0]
    msg = "error: " + _metal_words(diag.spelling)
    if msg.startswith("error: automatic variable qualified"):
        msg += " (Metal: a threadgroup variable takes no initialiser; device memory is buffers)"
    if "poisoned" in msg and loc is not None:  # name it: 'double', 'std', 'expf', ...
        ident = re.match(r"\w+", lines[loc.line - 1][loc.column - 1:])
        msg += f" '{ident.group(0)}' (not in Metal)" if ident else ""
    if diag.file is not None and diag.file != path:
        msg += f" (in {Path(diag.file).name}:{diag.line})"
    notes = [c.spelling for c in diag.children if c.spelling.startswith("candidate")][:2]
    msg += "".join(f"\n    note: {_metal_words(n)}" for n in notes)
    if loc is None:
        return msg
    ln = loc.line
    part = "generated line %d" % ln
    for what, (a, b) in ranges.items():
        if a <= ln <= b:
            part = f"kernel {what} line {ln - a + 1} (generated line {ln})"
    ctx = "\n".join(f"  {'>' if k == ln else ' '}{k:5d} | {lines[k - 1]}"
                    for k in range(max(1, ln - 1), min(len(lines), ln + 1) + 1))
    return f"{part}: {msg}\n{ctx}"
