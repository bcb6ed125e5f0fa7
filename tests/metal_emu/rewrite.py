"""Source rewriting for the Metal emulation: what C++ cannot read as Metal writes it.

`threadgroup` declarations become references into a per-threadgroup arena, and `1.0h`
half literals become casts.
"""

from __future__ import annotations

import re

_TG = re.compile(r"\bthreadgroup\b")
_HALF_LIT = re.compile(r"(?<![\w.])((?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?)[hH]\b")
_FIRST_DECL = re.compile(r"^\s*(.*?)\s*\b([A-Za-z_]\w*)\s*((?:\[[^\]]*\]\s*)*)$", re.S)
_NEXT_DECL = re.compile(r"^\s*([A-Za-z_]\w*)\s*((?:\[[^\]]*\]\s*)*)$", re.S)


def _split_top(text: str, sep: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text):
        if c in "([<{":
            depth += 1
        elif c in ")]>}":
            depth -= 1
        elif c == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


def _mask_comments(text: str) -> str:
    """Comments replaced by spaces (newlines kept), so positions stay the same."""
    return _COMMENT.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


def _rewrite_threadgroup(source: str, next_id: list[int]) -> str:
    """`threadgroup T a[N], b;` -> references into the per-threadgroup arena.

    Only statements that declare threadgroup *variables* are rewritten; pointers and references
    to threadgroup memory (`threadgroup float* p`, parameters, casts) keep the (empty) qualifier.
    Comments are ignored (matched on a copy with comments blanked out).
    """
    text = _mask_comments(source)
    out, pos = [], 0
    for m in _TG.finditer(text):
        if m.start() < pos:
            continue
        depth, j, end = 0, m.end(), None
        while j < len(text):
            c = text[j]
            if c in "([{":
                depth += 1
            elif c in ")]}":
                if depth == 0:
                    break
                depth -= 1
            elif c == ";" and depth == 0:
                end = j
                break
            j += 1
        if end is None:
            continue
        decl = text[m.end():end]
        outside = re.sub(r"\[[^\]]*\]", "", decl)
        if any(ch in outside for ch in "*&(={"):
            continue
        parts = _split_top(decl, ",")
        first = _FIRST_DECL.match(parts[0])
        if not first or not first.group(1).strip():
            continue
        ctype = first.group(1).strip()
        decls = [(first.group(2), first.group(3))]
        ok = True
        for p in parts[1:]:
            nd = _NEXT_DECL.match(p)
            if not nd:
                ok = False
                break
            decls.append((nd.group(1), nd.group(2)))
        if not ok:
            continue
        stmts = []
        for name, dims in decls:
            dims = re.sub(r"\s+", "", dims)
            stmts.append(f"auto& {name} = ::mtl::tg_var<{ctype} {dims}>({next_id[0]});")
            next_id[0] += 1
        out.append(source[pos:m.start()])
        out.append(" ".join(stmts) + "\n" * decl.count("\n"))
        pos = end + 1
    out.append(source[pos:])
    return "".join(out)


def _rewrite(text: str, next_id: list[int]) -> str:
    text = _HALF_LIT.sub(r"((half)(\1))", text)
    return _rewrite_threadgroup(text, next_id)
