"""Planted faults as patches: ``(file, function, old text -> new text)``, never code in the system.

A :class:`Patch` names one function of the shipped tree (``vtoken/table.py``,
``TokenTable._claim``) and a piece of its source to replace. It applies only if ``old``
occurs exactly once inside that function's source span (found with ``ast``); otherwise
:class:`PatchError` says which file, function and text no longer match, so a patch that
rots when the code changes fails loudly instead of silently testing nothing.

Two ways to apply the same patch:

- :func:`apply_to_tree` rewrites the file inside a shadow copy of the tree
  (``vtoken.fuzz.shadow``): the planted-fault runner imports the faulty package from
  there, in its own process, so nothing of the fault ever exists in the installed code;
- :func:`planted` (a context manager, for unit tests) compiles the patched function in its
  module's namespace and swaps it onto the live class or module for the duration of a
  ``with`` block, then puts the original back. Only what a patch names changes.

Both start from the text of the file as it is in the repository, so they agree.

Owns: the originals it swapped out inside a ``planted`` block, restored on exit.
May call: ast, importlib, pathlib, textwrap; the patched modules themselves (by name).
Costs: O(file) parse per patch; one compile per patched function.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

# repository folder -> import prefix (pyproject's package-dir mapping), for the folders a fault may
# patch: the system and the toolkit below the audit (fuzz/ never imports reports/, tests/test_layers.py)
_MODULE_PREFIX = {"vtoken": "vtoken", "spec": "vtoken.spec", "invariants": "vtoken.invariants", "fuzz": "vtoken.fuzz"}


class PatchError(Exception):
    """A patch does not apply to the current source (the code it targets changed)."""


@dataclass(frozen=True)
class Patch:
    file: str  # repository-relative path, e.g. "vtoken/table.py"
    function: str  # qualified name inside the module: "TokenTable._claim", "place"
    old: str  # text inside the function's source, exactly once
    new: str  # its replacement

    @property
    def module(self) -> str:
        parts = Path(self.file).with_suffix("").parts
        return ".".join((_MODULE_PREFIX.get(parts[0], parts[0]),) + parts[1:])


def _find_function(tree: ast.AST, qualname: str):
    node = tree
    for part in qualname.split("."):
        found = None
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and child.name == part:
                found = child
                break
        if found is None:
            return None
        node = found
    return node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


def _span(text: str, patch: Patch) -> tuple[int, int, ast.AST]:
    """Character offsets of the function (decorators included) in ``text``."""
    try:
        tree = ast.parse(text)
    except SyntaxError as e:
        raise PatchError(f"{patch.file}: does not parse ({e})") from None
    fn = _find_function(tree, patch.function)
    if fn is None:
        raise PatchError(f"{patch.file}: no function {patch.function!r} (renamed or moved?)")
    lines = text.splitlines(keepends=True)
    first = min([fn.lineno] + [d.lineno for d in fn.decorator_list])
    start = sum(len(l) for l in lines[: first - 1])
    end = sum(len(l) for l in lines[: fn.end_lineno])
    return start, end, fn


def apply_text(text: str, patch: Patch) -> str:
    """``text`` (the whole file) with the patch applied; PatchError if it does not apply."""
    a, b, _ = _span(text, patch)
    body = text[a:b]
    n = body.count(patch.old)
    if n != 1:
        raise PatchError(f"{patch.file}:{patch.function}: the text to replace occurs {n} times (want exactly 1):\n"
                         f"{textwrap.indent(patch.old, '    ')}")
    out = text[:a] + body.replace(patch.old, patch.new) + text[b:]
    try:
        ast.parse(out)
    except SyntaxError as e:
        raise PatchError(f"{patch.file}:{patch.function}: the patched file does not parse ({e})") from None
    return out


def apply_to_tree(root: Path, patches: Iterable[Patch], layout: dict | None = None) -> list[Path]:
    """Apply patches to the files of a shadow tree rooted at ``root``.

    ``layout`` maps a repository folder to its place in the tree (the shadow package lays
    ``spec/`` out as ``vtoken/spec/``...); default: the same paths. A patched file is
    rewritten (unlinked first: shadow trees hard-link their files to a snapshot).
    """
    layout = layout or {}
    done = []
    for p in patches:
        head, _, rest = p.file.partition("/")
        target = Path(root) / (layout.get(head, head) + "/" + rest)
        if not target.exists():
            raise PatchError(f"{p.file}: not in the shadow tree at {target}")
        text = apply_text(target.read_text(), p)
        target.unlink()
        target.write_text(text)
        done.append(target)
    return done


# ---------------------------------------------------------------------------------- in process
def _owner_and_name(mod, qualname: str):
    parts = qualname.split(".")
    owner = mod
    for part in parts[:-1]:
        owner = getattr(owner, part)
    return owner, parts[-1]


def _compile_function(mod, patch: Patch, text: str):
    a, b, fn = _span(text, patch)
    path = mod.__file__
    src = textwrap.dedent(text[a:b])
    if any(isinstance(n, ast.Name) and n.id == "super" for n in ast.walk(fn)):
        raise PatchError(f"{patch.file}:{patch.function}: uses super(); it cannot be swapped in process "
                         f"(use the shadow tree)")
    ns: dict = {}
    code = compile(src, path, "exec")
    exec(code, mod.__dict__, ns)  # module globals for name lookups; the new function lands in ns
    return ns[patch.function.split(".")[-1]]


@contextlib.contextmanager
def planted(patches: Iterable[Patch]):
    """Swap the patched functions into the live modules for a ``with`` block (tests).

    The patched source is the module's own file (``module.__file__``, so an installed
    package works too) with every patch of that function applied in order. A module-level
    function is also swapped wherever a ``vtoken`` module imported it by name. The
    originals are restored on exit, whatever happens.
    """
    patches = list(patches)
    by_fn: dict[tuple[str, str], list[Patch]] = {}
    for p in patches:
        by_fn.setdefault((p.file, p.function), []).append(p)
    swapped = []
    try:
        for (_file, function), ps in by_fn.items():
            mod = importlib.import_module(ps[0].module)
            text = Path(mod.__file__).read_text()
            for p in ps:
                text = apply_text(text, p)
            owner, name = _owner_and_name(mod, function)
            new = _compile_function(mod, ps[0], text)
            old = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
            if isinstance(old, staticmethod):
                new = staticmethod(new)
            elif isinstance(old, classmethod):
                new = classmethod(new)
            holders = [(owner, name)]
            if not isinstance(owner, type):  # also where it was imported by name
                for mname, m in list(sys.modules.items()):
                    if m is None or m is owner or not (mname == "vtoken" or mname.startswith("vtoken.")):
                        continue
                    for attr, val in list(vars(m).items()):
                        if val is old:
                            holders.append((m, attr))
            for h, attr in holders:
                setattr(h, attr, new)
                swapped.append((h, attr, old))
        yield
    finally:
        for owner, name, old in reversed(swapped):
            setattr(owner, name, old)
