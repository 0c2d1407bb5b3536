"""Mutant generation for ``vtoken mutate`` (``vtoken.fuzz.mutation``): AST-located edits
spliced into the source text, so formatting and line numbers stay.

Mutants: comparison swaps (``< <= > >= == != in is``), arithmetic and bitwise operator swaps
(``+ - * // % & | << >>``, augmented assignments too), integer constants ``+1``/``-1`` (so
``0 <-> 1``), ``True <-> False``, ``and <-> or``, removal of ``not`` / ``~`` / unary ``-``,
negated ``if`` / ``while`` / conditional-expression tests, deletion of simple statements
(assignments, augmented assignments, expression calls, ``del``) inside functions, return
values replaced by ``None``, and slice bounds shifted by one. Never mutated: docstrings and
other strings, f-strings, ``raise`` statements (error codes and message formatting),
asserts, imports, annotations and decorators.

Owns: nothing (pure: text in, mutants out).
May call: ast, tokenize, hashlib, the standard library only.
Costs: O(module) per file.
"""

from __future__ import annotations

import ast
import bisect
import hashlib
import io
import textwrap
import tokenize
from dataclasses import dataclass, field
from typing import Optional

@dataclass
class Mutant:
    file: str  # repository-relative path of the mutated module
    line: int
    col: int
    op: str  # family: cmp, arith, augassign, const, bool, not, unary, negate, delete, return, slice
    desc: str
    original: str  # the original source line(s), stripped
    mutated: str  # the same line(s) after the mutation, stripped
    key: str = ""
    func: str = ""  # enclosing Class.function
    source: str = field(default="", repr=False)  # the whole mutated module


_CMP_SWAPS = {
    ast.Lt: ("<=", ">="), ast.LtE: ("<", ">"), ast.Gt: (">=", "<="), ast.GtE: (">", "<"),
    ast.Eq: ("!=",), ast.NotEq: ("==",), ast.In: ("not in",), ast.NotIn: ("in",),
    ast.Is: ("is not",), ast.IsNot: ("is",),
}
_BIN_SWAPS = {
    ast.Add: ("-",), ast.Sub: ("+",), ast.Mult: ("//",), ast.FloorDiv: ("*",), ast.Div: ("*",),
    ast.Mod: ("//",), ast.BitAnd: ("|",), ast.BitOr: ("&",), ast.BitXor: ("|",),
    ast.LShift: (">>",), ast.RShift: ("<<",),
}
_PAREN = {"(", ")"}


class _Source:
    """Byte-offset bookkeeping over one module's text (ast columns are UTF-8 byte offsets)."""

    def __init__(self, text: str):
        self.text = text
        self.data = text.encode()
        self.lines = text.splitlines(keepends=True)
        self.starts = [0]
        for ln in self.lines:
            self.starts.append(self.starts[-1] + len(ln.encode()))
        toks = []
        for t in tokenize.generate_tokens(io.StringIO(text).readline):
            if t.type in (tokenize.OP, tokenize.NAME) and t.string:
                toks.append((self._tok_off(t.start), self._tok_off(t.end), t.string))
        toks.sort()
        self.toks = toks
        self.tok_starts = [t[0] for t in toks]

    def _tok_off(self, pos) -> int:
        row, col = pos
        if row - 1 >= len(self.lines):
            return len(self.data)
        return self.starts[row - 1] + len(self.lines[row - 1][:col].encode())

    def off(self, lineno: int, col: int) -> int:
        return self.starts[lineno - 1] + col

    def span(self, node) -> tuple[int, int]:
        return self.off(node.lineno, node.col_offset), self.off(node.end_lineno, node.end_col_offset)

    def seg(self, a: int, b: int) -> str:
        return self.data[a:b].decode()

    def between(self, a: int, b: int) -> Optional[tuple[int, int]]:
        """The span of the operator tokens in ``[a, b)``, parentheses excluded."""
        i = bisect.bisect_left(self.tok_starts, a)
        found = []
        while i < len(self.toks) and self.toks[i][0] < b:
            s, e, string = self.toks[i]
            if e <= b and string not in _PAREN:
                found.append((s, e))
            i += 1
        if not found:
            return None
        return found[0][0], found[-1][1]

    def line_of(self, off: int) -> int:
        return bisect.bisect_right(self.starts, off)


class _Collector(ast.NodeVisitor):
    """Walks one module and records edits ``(start, end, replacement, op, desc, node)``."""

    def __init__(self, src: _Source):
        self.src = src
        self.edits: list[tuple] = []
        self.func_depth = 0
        self.scope = None  # the outermost enclosing function (its text is compile-checked)
        self.qual: list[str] = []  # enclosing class / function names (part of a mutant's key)

    # -------------------------------------------------------------- helpers
    def add(self, a, b, repl, op, desc, node):
        self.edits.append((a, b, repl, op, desc, node, self.scope, ".".join(self.qual)))

    def replace_expr(self, node, repl, op, desc):
        """Replace an expression, keeping the line count (pads inside parentheses)."""
        a, b = self.src.span(node)
        extra = node.end_lineno - node.lineno
        if extra:
            repl = "(" + repl + "\n" * extra + ")"
        self.add(a, b, repl, op, desc, node)

    def visit_list(self, nodes):
        for n in nodes:
            self.visit(n)

    # -------------------------------------------------------------- skipped outright
    def visit_Raise(self, node):  # error codes and message formatting
        return

    def visit_JoinedStr(self, node):
        return

    def visit_Import(self, node):
        return

    def visit_ImportFrom(self, node):
        return

    def visit_Assert(self, node):
        return

    def visit_Global(self, node):
        return

    # -------------------------------------------------------------- definitions
    def visit_FunctionDef(self, node):
        self.visit_list(node.args.defaults)
        self.visit_list([d for d in node.args.kw_defaults if d is not None])
        outer = self.scope
        self.scope = outer or node
        self.func_depth += 1
        self.qual.append(node.name)
        self.visit_list(node.body)
        self.qual.pop()
        self.func_depth -= 1
        self.scope = outer

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node):
        self.visit_list(node.args.defaults)
        self.visit(node.body)

    def visit_ClassDef(self, node):
        self.qual.append(node.name)
        self.visit_list(node.body)
        self.qual.pop()

    # -------------------------------------------------------------- statements
    def delete_stmt(self, node):
        if self.func_depth == 0:
            return
        a, b = self.src.span(node)
        self.add(a, b, "pass" + "\n" * (node.end_lineno - node.lineno), "delete", "delete statement", node)

    def visit_Expr(self, node):
        v = node.value
        if isinstance(v, ast.Constant):  # docstrings and bare constants
            return
        if isinstance(v, ast.Call):
            self.delete_stmt(node)
        self.visit(v)

    def visit_Assign(self, node):
        if any(isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets):
            return
        self.delete_stmt(node)
        self.visit_list(node.targets)
        self.visit(node.value)

    def visit_AnnAssign(self, node):
        if node.value is None:
            return
        self.delete_stmt(node)
        self.visit(node.target)
        self.visit(node.value)

    def visit_AugAssign(self, node):
        self.delete_stmt(node)
        swaps = _BIN_SWAPS.get(type(node.op), ())
        if swaps:
            _, ta = self.src.span(node.target)
            va, _ = self.src.span(node.value)
            sp = self.src.between(ta, va)
            if sp:
                old = self.src.seg(*sp)
                for new in swaps:
                    self.add(sp[0], sp[1], new + "=", "augassign", f"{old} -> {new}=", node)
        self.visit(node.target)
        self.visit(node.value)

    def visit_Delete(self, node):
        self.delete_stmt(node)
        self.visit_list(node.targets)

    def visit_Return(self, node):
        v = node.value
        if v is not None and not (isinstance(v, ast.Constant) and v.value is None):
            self.replace_expr(v, "None", "return", "return value -> None")
        if v is not None:
            self.visit(v)

    def _negate(self, test, what):
        a, b = self.src.span(test)
        self.add(a, b, "not (" + self.src.seg(a, b) + ")", "negate", f"negate {what} condition", test)

    def visit_If(self, node):
        self._negate(node.test, "if")
        self.visit(node.test)
        self.visit_list(node.body)
        self.visit_list(node.orelse)

    def visit_While(self, node):
        self._negate(node.test, "while")
        self.visit(node.test)
        self.visit_list(node.body)
        self.visit_list(node.orelse)

    def visit_IfExp(self, node):
        self._negate(node.test, "conditional-expression")
        self.visit(node.test)
        self.visit(node.body)
        self.visit(node.orelse)

    # -------------------------------------------------------------- expressions
    def visit_Constant(self, node):
        v = node.value
        if isinstance(v, bool):
            self.replace_expr(node, repr(not v), "const", f"{v!r} -> {not v!r}")
        elif isinstance(v, int):
            for new in (v + 1, v - 1):
                self.replace_expr(node, repr(new) if new >= 0 else f"({new})", "const", f"{v} -> {new}")

    def visit_Compare(self, node):
        operands = [node.left] + list(node.comparators)
        for i, op in enumerate(node.ops):
            _, la = self.src.span(operands[i])
            rb, _ = self.src.span(operands[i + 1])
            sp = self.src.between(la, rb)
            if sp is None:
                continue
            old = self.src.seg(*sp)
            for new in _CMP_SWAPS.get(type(op), ()):
                self.add(sp[0], sp[1], new, "cmp", f"{old} -> {new}", node)
        self.generic_visit(node)

    def visit_BinOp(self, node):
        _, la = self.src.span(node.left)
        rb, _ = self.src.span(node.right)
        sp = self.src.between(la, rb)
        if sp is not None:
            old = self.src.seg(*sp)
            for new in _BIN_SWAPS.get(type(node.op), ()):
                self.add(sp[0], sp[1], new, "arith", f"{old} -> {new}", node)
        self.visit(node.left)
        self.visit(node.right)

    def visit_BoolOp(self, node):
        old, new = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
        # one edit per operator token of this BoolOp, applied together
        spans = []
        for x, y in zip(node.values, node.values[1:]):
            _, xa = self.src.span(x)
            yb, _ = self.src.span(y)
            sp = self.src.between(xa, yb)
            if sp:
                spans.append(sp)
        if spans:
            self.add(spans, None, new, "bool", f"{old} -> {new}", node)
        self.visit_list(node.values)

    def visit_UnaryOp(self, node):
        kind = {ast.Not: "not", ast.Invert: "~", ast.USub: "-"}.get(type(node.op))
        if kind is not None:
            a, b = self.src.span(node.operand)
            self.replace_expr(node, "(" + self.src.seg(a, b) + ")", "not" if kind == "not" else "unary",
                              f"remove {kind}")
        self.visit(node.operand)

    def visit_Slice(self, node):
        for name in ("lower", "upper"):
            bound = getattr(node, name)
            if bound is None or isinstance(bound, ast.Constant):  # constants: the const mutations
                continue
            a, b = self.src.span(bound)
            text = self.src.seg(a, b)
            for d in ("+ 1", "- 1"):
                self.replace_expr(bound, f"({text}) {d}", "slice", f"slice {name} bound {d}")
        self.generic_visit(node)


def _apply(data: bytes, a, b, repl: str) -> bytes:
    if isinstance(a, list):  # several spans replaced by the same text (BoolOp operators)
        out = data
        for s, e in sorted(a, reverse=True):
            out = out[:s] + repl.encode() + out[e:]
        return out
    return data[:a] + repl.encode() + data[b:]


def _lines(text: str, lo: int, hi: int) -> str:
    ls = text.splitlines()
    return " | ".join(x.strip() for x in ls[lo - 1:hi])


def _compiles(text: str, scope, shift: int) -> bool:
    """Syntax check: the enclosing function alone (dedented) when there is one, else the module."""
    try:
        if scope is None:
            compile(text, "<mutant>", "exec")
        else:
            first = scope.decorator_list[0].lineno if scope.decorator_list else scope.lineno
            chunk = "\n".join(text.splitlines()[first - 1:scope.end_lineno + shift])
            compile(textwrap.dedent(chunk), "<mutant>", "exec")
    except (SyntaxError, ValueError):
        return False
    return True


def generate(source: str, relpath: str = "<module>") -> list[Mutant]:
    """All mutants of one module's source, in source order; syntax-checked, without
    textual duplicates."""
    src = _Source(source)
    tree = ast.parse(source)
    col = _Collector(src)
    col.visit(tree)
    seen = {hashlib.sha1(src.data).digest()}
    keys: dict[str, int] = {}
    out = []
    for a, b, repl, op, desc, node, scope, qual in col.edits:
        data = _apply(src.data, a, b, repl)
        h = hashlib.sha1(data).digest()
        if h in seen:
            continue
        seen.add(h)
        text = data.decode()
        shift = text.count("\n") - source.count("\n")
        if not _compiles(text, scope, shift):
            continue
        start = a[0][0] if isinstance(a, list) else a
        end = a[-1][1] if isinstance(a, list) else b
        lo, hi = src.line_of(start), src.line_of(max(start, end - 1))
        orig = _lines(source, lo, hi)
        mut = _lines(text, lo, hi + shift)
        k = hashlib.sha1("\0".join((relpath, qual, orig, mut, desc)).encode()).hexdigest()[:12]
        keys[k] = keys.get(k, 0) + 1
        if keys[k] > 1:
            k = f"{k}-{keys[k]}"
        out.append(Mutant(relpath, lo, node.col_offset, op, desc, orig, mut, k, qual, text))
    out.sort(key=lambda m: (m.line, m.col))
    return out


# ====================================================================== the shadow tree
