"""The layer rule, enforced: the system never imports the toolkit; the reference model never
imports the system.

Layers (README, "Architecture"): the system is ``vtoken/`` outside its command layer
``vtoken/cli/``; the toolkit is ``spec/``, ``invariants/``, ``fuzz/`` and ``reports/`` (installed as
``vtoken.spec``, ``vtoken.invariants``, ``vtoken.fuzz``, ``vtoken.reports``). Only the commands
and the toolkit may import the toolkit; where the system needs a check it takes a callable
(``check_relocations=``, ``plan_hook``, ``copy_engine_factory``). Every import counts, also the
ones inside functions (a lazy import is still a dependency).
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOLKIT = ("vtoken.spec", "vtoken.invariants", "vtoken.fuzz", "vtoken.reports")
TOOLKIT_DIRS = {"spec": "vtoken.spec", "invariants": "vtoken.invariants", "fuzz": "vtoken.fuzz",
                "reports": "vtoken.reports"}


_DYNAMIC = re.compile(r"^((?:vtoken\.(?:spec|invariants|fuzz|reports|cli)|(?:spec|invariants|fuzz|reports)\.\w+)"
                      r"(?:\.\w+)*)(?::\w+)?$")


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] in TOOLKIT_DIRS:
        parts = TOOLKIT_DIRS[parts[0]].split(".") + parts[1:]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in ``path``, relative ones resolved."""
    mod = _module_name(path)
    package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # ``from vtoken import invariants`` names a module too
            out.extend((node.lineno, f"{target}.{a.name}") for a in node.names)
            out.append((node.lineno, target))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _DYNAMIC.match(node.value):
            # a module named in a string (``importlib.import_module("vtoken.fuzz...")``,
            # ``"module:function"`` tables) is an import by name
            out.append((node.lineno, _DYNAMIC.match(node.value).group(1)))
    return out


def _is(target: str, prefixes) -> bool:
    top = ("spec", "invariants", "fuzz", "reports")  # the source folders, importable from the repo root
    return any(target == p or target.startswith(p + ".") for p in prefixes) or target.split(".")[0] in top


def system_files() -> list[Path]:
    return sorted(p for p in (ROOT / "vtoken").rglob("*.py") if "cli" not in p.relative_to(ROOT / "vtoken").parts[:1])


def breaches(files, forbidden) -> list[str]:
    return [f"{p.relative_to(ROOT)}:{line} imports {t}" for p in files for line, t in imports_of(p) if _is(t, forbidden)]


def test_system_imports_no_toolkit():
    files = system_files()
    assert len(files) > 20  # the walk found the system (a walk over nothing passes anything)
    found = breaches(files, TOOLKIT)
    assert not found, "the system imports the toolkit:\n" + "\n".join(found)


def _imports_folder(target: str, folder: str) -> bool:
    """Does ``target`` name a module of the toolkit ``folder`` (``fuzz``: ``vtoken.fuzz...`` or,
    from the repository root, ``fuzz...``)?"""
    pkg = TOOLKIT_DIRS[folder]
    return target == pkg or target.startswith(pkg + ".") or target.split(".")[0] == folder


def test_invariants_import_no_fuzz():
    """The checks never import the fuzzers (the fuzzers drive the checks, not the other way):
    a check that needs a faulty engine takes it as an argument (``i3_probe(engine_cls=)``)."""
    files = sorted((ROOT / "invariants").rglob("*.py"))
    assert len(files) > 8
    found = [f"{p.relative_to(ROOT)}:{line} imports {t}" for p in files for line, t in imports_of(p)
             if _imports_folder(t, "fuzz")]
    assert not found, "invariants/ imports fuzz/:\n" + "\n".join(found)


@pytest.mark.parametrize("source, expect", [
    ("def f():\n    from vtoken.fuzz.faulty_engines import factory\n", True),  # lazy: still a breach
    ("from ..fuzz import catalogue\n", True),  # relative
    ("import fuzz.planted\n", True),  # from the repository root
    ("ENGINE = 'vtoken.fuzz.faulty_engines:factory'\n", True),  # by name
    ("from .z3_checks import check_snapshot\n", False),
    ("from vtoken.copy_engine import KVCopyEngine\n", False),
])
def test_the_invariants_rule_finds_planted_breaches(tmp_path, monkeypatch, source, expect):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    f = tmp_path / "invariants" / "probe.py"
    f.parent.mkdir(parents=True)
    f.write_text(source)
    found = [t for _line, t in imports_of(f) if _imports_folder(t, "fuzz")]
    assert bool(found) == expect, found


def fuzz_report_breaches(files) -> list[str]:
    """``path:line imports target`` for each import of ``reports/`` in ``files``."""
    return [f"{p.relative_to(ROOT)}:{line} imports {t}" for p in files for line, t in imports_of(p)
            if _imports_folder(t, "reports")]


def test_fuzz_imports_no_reports():
    """The fuzzers never import the audit (``reports/`` sits above them: it runs and reports
    the checks). A detector the planted runs share with the audit lives in ``fuzz/``
    (``fuzz/vllm_prefix.py``: the prefix-equality check)."""
    files = sorted(p for p in (ROOT / "fuzz").rglob("*.py") if "__pycache__" not in p.parts)
    assert len(files) > 10  # the walk found the fuzzers
    found = fuzz_report_breaches(files)
    assert not found, "fuzz/ imports reports/:\n" + "\n".join(found)


@pytest.mark.parametrize("source, expect", [
    ("def f():\n    from vtoken.reports.vllm_runs import prefix_equality\n", True),  # lazy: the old breach
    ("from ..reports import audit\n", True),  # relative
    ("import reports.bench\n", True),  # from the repository root
    ("CHECK = 'vtoken.reports.vllm_runs:prefix_equality'\n", True),  # by name
    ("from .vllm_prefix import prefix_equality\n", False),
    ("from vtoken.invariants.relocation_hash import RelocationChecker\n", False),
    ("x = 'reports and fuzz'\n", False),
])
def test_the_fuzz_rule_finds_planted_breaches(tmp_path, monkeypatch, source, expect):
    """The fuzz -> reports rule, fed a planted breach in a temporary ``fuzz/`` (and clean code)."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    f = tmp_path / "fuzz" / "probe.py"
    f.parent.mkdir(parents=True)
    f.write_text(source)
    found = fuzz_report_breaches([f])
    assert bool(found) == expect, found
    if expect:
        assert found[0].startswith("fuzz/probe.py:")


CLI = "vtoken.cli"


def _imports_cli(target: str) -> bool:
    """Does ``target`` name the command layer (``vtoken.cli`` or one of its modules)?"""
    return target == CLI or target.startswith(CLI + ".")


def toolkit_files() -> list[Path]:
    return sorted(p for d in TOOLKIT_DIRS for p in (ROOT / d).rglob("*.py")
                  if "__pycache__" not in p.parts and not (d == "reports" and len(p.relative_to(ROOT).parts) > 2))


def cli_breaches(files) -> list[str]:
    return [f"{p.relative_to(ROOT)}:{line} imports {t}" for p in files for line, t in imports_of(p) if _imports_cli(t)]


def test_toolkit_imports_no_command_layer():
    """The toolkit never imports ``vtoken/cli/``: the command layer sits on top (it parses
    arguments and calls bodies); a toolkit command's argument types come from
    ``vtoken.argtypes``, a benchmark body lives in ``reports/``."""
    files = toolkit_files()
    assert len(files) > 30  # the walk found the toolkit
    found = cli_breaches(files)
    assert not found, "the toolkit imports the command layer:\n" + "\n".join(found)


@pytest.mark.parametrize("folder, source, expect", [
    ("fuzz", "def main(argv):\n    from vtoken.cli.args import positive_int\n", True),  # lazy: still a breach
    ("reports", "from vtoken.cli.bench import bench_table\n", True),
    ("invariants", "import vtoken.cli.decode\n", True),
    ("spec", "from vtoken import cli\n", True),
    ("fuzz", "MAIN = 'vtoken.cli.main:main'\n", True),  # by name
    ("reports", "from vtoken.argtypes import positive_int\n", False),
    ("fuzz", "from vtoken.client import x\n", False),  # a prefix of the name is not the package
])
def test_the_command_layer_rule_finds_planted_breaches(tmp_path, monkeypatch, folder, source, expect):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    f = tmp_path / folder / "probe.py"
    f.parent.mkdir(parents=True)
    f.write_text(source)
    found = cli_breaches([f])
    assert bool(found) == expect, found


def test_spec_imports_no_system():
    files = sorted((ROOT / "spec").rglob("*.py"))
    assert files
    found = [f"{p.relative_to(ROOT)}:{line} imports {t}" for p in files for line, t in imports_of(p)
             if (t == "vtoken" or t.startswith("vtoken.")) and not t.startswith("vtoken.spec")]
    assert not found, "the reference model imports the system:\n" + "\n".join(found)


@pytest.mark.parametrize("source, expect", [
    ("from vtoken.invariants.relocation_hash import RelocationChecker\n", True),
    ("def f():\n    from ..invariants import z3_checks\n", True),  # lazy and relative: still a breach
    ("import vtoken.fuzz.campaign\n", True),
    ("from vtoken import reports\n", True),
    ("from ..table import TokenTable\n", False),
    ("import numpy\n", False),
    ("import importlib\nimportlib.import_module('vtoken.fuzz.campaign')\n", True),  # by name
    ("COMMANDS = {'fuzz': 'vtoken.fuzz.campaign:main_fuzz'}\n", True),
    ("x = 'spec and fuzz'\n", False),
])
def test_the_walk_finds_breaches(tmp_path, monkeypatch, source, expect):
    """The checker itself, fed a breach it must name (and clean code it must pass)."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    f = tmp_path / "vtoken" / "vllm_adapter" / "probe.py"
    f.parent.mkdir(parents=True)
    f.write_text(source)
    found = breaches([f], TOOLKIT)
    assert bool(found) == expect, found
    if expect:
        assert "vtoken/vllm_adapter/probe.py:" in found[0]


def _architecture_section() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("## Architecture")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


@pytest.mark.parametrize("folder", ["vtoken", "vtoken/cli", "vtoken/vllm_adapter", "vtoken/vllm_engine", "vtoken/sim",
                                    "vtoken/model",
                                    "vtoken/policies", "spec", "invariants", "fuzz", "reports"])
def test_readme_architecture_names_every_module(folder):
    """The README's architecture section matches ``ls``: every module of every folder is
    named in its row (a module added without a line there fails here)."""
    section = _architecture_section()
    mods = sorted(p.name for p in (ROOT / folder).glob("*.py") if p.name != "__init__.py")
    assert mods, folder
    missing = [m for m in mods if f"`{m}`" not in section]
    assert not missing, f"README architecture section does not name {folder}/: {missing}"


HEADER_LABELS = ("Owns:", "May call:", "Costs:")
HEADER_DIRS = ("vtoken", "spec", "invariants", "fuzz", "reports")


def _tracked_modules() -> list[Path]:
    """Every git-tracked ``.py`` module of the system and the toolkit (a Path walk, minus
    ``__pycache__`` and report folders' generated files, where git is not there)."""
    import subprocess

    try:
        out = subprocess.run(["git", "ls-files", "--", *(f"{d}/*.py" for d in HEADER_DIRS)], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
        return sorted(ROOT / p for p in out if (ROOT / p).exists())
    except (OSError, subprocess.CalledProcessError):
        return sorted(p for d in HEADER_DIRS for p in (ROOT / d).rglob("*.py")
                      if "__pycache__" not in p.parts and not (d == "reports" and len(p.relative_to(ROOT).parts) > 2))


def missing_header_labels(path: Path) -> list[str]:
    """The labels of the module header (issue 12) that no line of ``path``'s docstring starts with."""
    doc = ast.get_docstring(ast.parse(path.read_text(), filename=str(path))) or ""
    starts = [line.lstrip() for line in doc.splitlines()]
    return [lab for lab in HEADER_LABELS if not any(s.startswith(lab) for s in starts)]


def test_every_module_states_owns_calls_costs():
    """Each module opens with what it owns, what it may call and what it costs: three
    labelled lines of its docstring (``Owns:``, ``May call:``, ``Costs:``)."""
    files = _tracked_modules()
    assert len(files) > 60  # the walk found the modules
    found = [f"{p.relative_to(ROOT)}: missing {', '.join(m)}" for p in files if (m := missing_header_labels(p))]
    assert not found, "modules without an Owns / May call / Costs header:\n" + "\n".join(found)


def test_the_header_check_names_what_is_missing(tmp_path):
    f = tmp_path / "m.py"
    f.write_text('"""A module.\n\nOwns: nothing.\n  Costs: O(1).\n"""\n')
    assert missing_header_labels(f) == ["May call:"]
    f.write_text("x = 1\n")
    assert missing_header_labels(f) == list(HEADER_LABELS)
