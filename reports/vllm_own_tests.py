"""vLLM's OWN scheduler / KV-manager tests, run as shipped and with vtoken in place.

``run(version, python, out_dir, with_vtoken, jobs)`` runs vLLM's ``tests/v1/core`` twice
with ``python`` (any interpreter with vLLM, pytest and, for the second run, vtoken
installed: a side environment of ``vllm_envs`` works) and returns what diverged:

1. *The tests.* They ship in vLLM's sdist, not its wheel. The sdist is fetched with pip
   into ``~/.cache/vtoken/vllm-tests/<version>/sdist/`` (``VTOKEN_VLLM_TESTS_CACHE`` moves the
   cache; ``VTOKEN_VLLM_SDIST=PATH`` names a tarball to use instead). ``pip download
   --no-binary :all:`` cannot work on a CPU machine (pip prepares the sdist's metadata,
   whose build requirements pin a CUDA torch), so the download prepares the metadata in
   this interpreter instead (``--no-binary vllm --no-build-isolation``, with
   ``setuptools-scm`` / ``setuptools-rust`` in a ``buildtools/`` folder of the cache,
   ``VLLM_TARGET_DEVICE=empty``): only ``setup.py``'s version is computed, nothing is built.
   From the tarball only ``tests/v1/core/`` and the ``tests`` modules they import
   (followed transitively through ``from tests... import``, with their packages'
   ``__init__.py``) are extracted into ``tree/``. vLLM's root ``conftest.py`` is not: it
   imports models, the GPU and the HF hub. ``tree/tests/conftest.py`` is a minimal one of
   ours (the CPU environment, ``--optional``, ``caplog_vllm``, a ``nodeid`` junit property).
2. *Model configs.* Most scheduler tests build ``ModelConfig("facebook/opt-125m")``: they
   need the model's ``config.json`` and nothing else (no weights, no tokenizer is loaded).
   With ``stand_ins=True`` (default) the runs see an offline HF cache of our own
   (``HF_HOME=<cache>/hf-stand-ins``, ``HF_HUB_OFFLINE=1``) holding the published
   ``config.json`` shapes of ``STAND_IN_CONFIGS`` and nothing else; every other model id
   stays unavailable, so its tests are "not applicable". ``stand_ins=False``: no model at all.
3. *Two runs.* ``shipped``: pytest in a subprocess of ``python`` over the tree, vtoken's own
   pytest plugin disabled (``-p no:vtoken``). ``with_vtoken``: the same plus
   ``-p vtoken.reports.vllm_tests_plugin``, which attaches ``VTokenAdapter`` (reclamation on
   at its defaults, no eviction acting: no worker, an empty token table) to every vLLM
   scheduler the tests build (the mechanism is in that module's docstring). Both with
   ``-p no:cacheprovider``, never ``-x``, ``--timeout`` per test when pytest-timeout is
   installed there, ``jobs`` shards (test files dealt round-robin by size) in parallel.
   Results come from the junit XML (``-o junit_family=xunit1``), never from text.
4. *Not applicable.* A skipped test, and a failure whose text says it needed the HF hub
   (a model id not available offline), a GPU, or a Python package the environment lacks
   (not vLLM's, not the tests', not vtoken's), is "not applicable" with that reason
   (``NOT_APPLICABLE_RULES``); listed, never dropped.
5. *Divergences*: tests that passed as shipped and did not pass with vtoken. Each is
   classified by what failed: ``failure_of`` reads the exception it raised (``Type`` or
   ``Type[code]``), and ``DIVERGENCE_RULES`` (data: patterns on that, the error text and the
   plugin's counters, narrowed by the test id but never decided by it -> cause, kind ``bug`` |
   ``inherent``, reason), first match wins; a vtoken error no rule takes is
   ``vtoken_error:<Type[code]>`` (``bug``), anything else ``bug`` with reason
   ``unclassified: <first error line>``.

The result (and ``out_dir/vllm_own_tests.json``, the two junit files beside it)::

    {"version", "python", "vtoken_commit", "stand_ins", "tree", "wall_s",
     "shipped": {"passed", "failed", "not_applicable", "wall_s", "returncode",
                 "not_applicable_tests": [{"test", "reason"}], "failed_tests": [{"test", "error"}]},
     "with_vtoken": {... the same, plus "adapters_attached": tests where the adapter was attached
                     to a scheduler, "adapter_refused": tests where it refused one},
     "divergences": [{"test", "kind", "reason", "cause", "error", "failure"}],
     "causes": {cause: {"kind", "reason", "tests"}},
     "vtoken_only_passes": [test ids failing as shipped, passing with vtoken]}

CLI: ``python -m vtoken.reports.vllm_own_tests --version 0.33.0 --json`` (``--help``).
Nothing here imports vLLM or torch: it builds a tree and runs subprocesses.

Owns: the sdist cache and extracted test tree, the stand-in HF cache and the two runs' junit files.
May call: subprocess (pip, pytest), tarfile, ast, xml.etree; never vLLM or torch in this process.
Costs: two pytest runs of vLLM's ``tests/v1/core`` in ``jobs`` shards: minutes; the first fetch
more.
"""

from __future__ import annotations

import argparse
import ast
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Optional

REPO = Path(__file__).resolve().parent.parent
TESTS_ROOT = "tests/v1/core"
PLUGIN = "vtoken.reports.vllm_tests_plugin"

# ---------------------------------------------------------------------------- rules (data)

# Tests that could not run here. A rule matches the error text (message + traceback) of a
# failure or error; a skip is always "not applicable" with its own message. ``{0}`` in the
# reason is the rule's first regex group.
NOT_APPLICABLE_RULES: list[dict] = [
    {"error": r"Invalid repository ID or local directory specified|LocalEntryNotFoundError|OfflineModeIsEnabled|"
              r"offline mode is enabled|outgoing traffic has been disabled|"
              r"couldn't connect to 'https://huggingface\.co'|Cannot find an appropriate cached snapshot",
     "reason": "needs the HF hub: model {model} is not available offline"},
    {"error": r"(?:Torch not compiled with CUDA|No CUDA GPUs are available|Found no NVIDIA driver|"
              r"CUDA driver|cudaGetDeviceCount|requires a CUDA|Expected a cuda device|CUDA error)",
     "reason": "needs a GPU (CUDA)"},
    {"error": r"No module named '((?!vllm\b|tests\b|vtoken\b)[\w]+)",
     "reason": "needs the Python package {0} (not installed in this environment)"},
]
# Where a model id is named in an HF failure (first match).
MODEL_ID_PATTERNS = [r"Invalid repository ID or local directory specified: '([^']+)'", r"repo_id = '([^']+)'",
                     r"huggingface\.co/([\w.-]+/[\w.-]+)/", r"model=\"([\w.-]+/[\w.-]+)\""]

# Divergences: tests passing as shipped and not with vtoken, classified by what failed. Every
# failure is first read as ``failure_of``: the exception it raised, ``Type`` or ``Type[code]``
# (vtoken's errors carry their code, the adapter's failed assumptions their check's name). A
# rule's keys, every one given must match, first match wins: ``failure`` (regex on that),
# ``error`` (regex on the error text: junit message + traceback), ``props`` (regex on the test's
# junit properties as JSON: the plugin's ``vtoken_stats``, what the adapters did), ``test``
# (regex on the test id: it only narrows, a rule never has it alone nor with ``failure`` alone
# beside it: a test's name never decides the cause). A failure no rule takes is filed by its
# exception: vtoken's own errors (``VTOKEN_ERRORS``) under ``vtoken_error:<Type[code]>``, the
# rest ``unclassified``. Measured on vLLM 0.33.0 by switching each adapter behaviour off
# in turn (headroom, the fence); kind "inherent": a consequence of vtoken's design that the
# test asserts on (the reservation's blocks in a free count); "bug": vtoken changes what vLLM
# does for a caller (admission, preemption, reset, idle accounting, a KV layout) where it
# need not. At 0.33.0 with the defaults no test diverges (multi-group layouts and the fence
# on the adapter's own clock: 1074 of 1074).
_TIGHT_POOL_TESTS = (r"test_priority_preemption_bug\.py::|::test_kv_connector_handles_preemption\[|"
                     r"::test_kv_connector_unable_to_allocate\[|::test_priority_scheduling_preemption$|"
                     r"::test_priority_scheduling_preemption_and_resumption_when_out_of_kv\[|"
                     r"::test_kv_pressure_preempt_mid_handoff\[|::test_hisparse_async_admission_requires_full_prompt")
_DEFER_TESTS = (r"::test_gate_disabled_without_connector$|"
                r"::test_evicted_blocks_release_their_auxiliary_outputs_past_capacity$|"
                r"::test_preempt_during_execution$|::test_kv_pressure_preemption_with_inflight_output\[")
_TIGHT_POOL_REASON = ("a headroom (none by default: in-place plans need no destination; one set in the "
                      "adapter settings is topped up from whatever is free) is not bounded by "
                      "the pool: in pools of 5-32 blocks it takes the blocks vLLM needs, so a request is "
                      "admitted a step late or not at all, or preempted, where vLLM alone runs it; an empty "
                      "step gives the headroom back and the next one retakes it (churn)")
_RESET_BLOCKED_REASON = ("reset_prefix_cache cannot succeed while the adapter keeps blocks allocated: the "
                         "headroom (unless given back first) or blocks its fence still holds; "
                         "reset_prefix_cache(reset_running_requests=True) then raises RuntimeError")
_ASSERTED = r"^AssertionError$"  # the test's own assertion failed: vLLM behaved otherwise (not a vtoken error)
_HELD = r'"(?:headroom_target|deferred_free_calls)": [1-9]'  # the adapter kept blocks allocated
DIVERGENCE_RULES: list[dict] = [
    {"cause": "kv_groups", "kind": "bug",
     "failure": r"^AdapterAssumptionError\[(?:kv_groups|single_full_attention_pool)\]$",
     "reason": "a block the adapter holds is in a list of a KV cache group it does not mirror "
               "(sliding window, chunked-local, Mamba, cross-attention), or (before multi-group "
               "support) a multi-group layout was refused at start"},
    {"cause": "reset_prefix_cache_blocked", "kind": "bug", "failure": r"^(?:RuntimeError|AssertionError)$",
     "error": r"Failed to reset KV cache|reset_prefix_cache\(\)",
     "reason": _RESET_BLOCKED_REASON},
    {"cause": "reset_prefix_cache_blocked", "kind": "bug", "test": r"reset_prefix_cache", "failure": _ASSERTED,
     "props": _HELD, "reason": _RESET_BLOCKED_REASON},
    {"cause": "fence_defers_vllm_frees", "kind": "bug", "test": _DEFER_TESTS, "failure": _ASSERTED,
     "props": r'"deferred_free_calls": [1-9]',
     "reason": "vLLM's frees are deferred where vLLM frees at once (its defer_block_free is off): the "
               "adapter's fence must hold only its own blocks, so a freed or preempted request's blocks "
               "are not there for the allocation retry or the next admission (these tests pass with "
               "the fence on the adapter's own clock)"},
    {"cause": "tight_pool_headroom", "kind": "bug", "test": _TIGHT_POOL_TESTS, "failure": _ASSERTED,
     "props": r'"headroom_target": [1-9]', "reason": _TIGHT_POOL_REASON},
    {"cause": "tight_pool_headroom", "kind": "bug", "failure": _ASSERTED,
     "props": r'"(?:headroom_yielded|backpressure_steps)": [1-9]', "reason": _TIGHT_POOL_REASON},
    {"cause": "headroom_held_at_idle", "kind": "bug", "failure": _ASSERTED,
     "error": r"num_free_initially|num_gpu_blocks - 1|NUM_BLOCKS - 1|assert_scheduler_empty",
     "reason": "the headroom stays allocated with no request left: the pool never returns to its "
               "initial free count, vLLM's leak check (assert_scheduler_empty) fails and an idle "
               "engine reports the reservation as KV cache in use"},
    {"cause": "headroom_in_free_counts", "kind": "inherent", "failure": _ASSERTED,
     "error": r"get_num_free_blocks|num_free_blocks|get_usage|kv_cache_usage",
     "reason": "while requests run, the reservation's blocks are allocated: exact free-block "
               "counts and usage the test asserts are lower by the headroom"},
    {"cause": "backpressure_hides_requests", "kind": "bug", "failure": r"^(?:AssertionError|KeyError)$",
     "error": r"has_requests\(\)|finish_requests|get_num_unfinished_requests|not in scheduler\.requests",
     "reason": "admission back-pressure hides held requests from vLLM: not in scheduler.requests, "
               "not counted by has_requests(), lost by finish_requests (aborts)"},
]
# vtoken's error classes (``vtoken.errors`` and the adapter's ``AdapterAssumptionError``), by name:
# a failure raising one is vtoken's doing, whatever the test's name
VTOKEN_ERRORS = ("VTokenError", "TableError", "AllocatorError", "PlanError", "SnapshotError", "RelocationCheckError",
                 "CallError", "CallTypeError", "CallIndexError", "OrderError", "ConfigError", "AdapterAssumptionError")

# Published config.json shapes (no weights, no tokenizer) of the models vLLM's scheduler
# tests build a ModelConfig for: all they read is the architecture, max_model_len and vocab.
_OPT_SHARED = {  # the keys both OPT shapes publish with the same value
    "activation_dropout": 0.0, "activation_function": "relu", "architectures": ["OPTForCausalLM"],
    "attention_dropout": 0.0, "bos_token_id": 2, "dropout": 0.1, "eos_token_id": 2, "init_std": 0.02,
    "layerdrop": 0.0, "max_position_embeddings": 2048, "model_type": "opt", "pad_token_id": 1,
    "prefix": "</s>", "torch_dtype": "float16", "use_cache": True, "vocab_size": 50272}
STAND_IN_CONFIGS: dict[str, dict] = {
    "facebook/opt-125m": {**_OPT_SHARED, "_name_or_path": "facebook/opt-125m", "do_layer_norm_before": True,
                          "ffn_dim": 3072, "hidden_size": 768, "num_attention_heads": 12, "num_hidden_layers": 12,
                          "transformers_version": "4.21.0.dev0", "word_embed_proj_dim": 768},
    "facebook/opt-350m": {**_OPT_SHARED, "_name_or_path": "facebook/opt-350m", "do_layer_norm_before": False,
                          "ffn_dim": 4096, "hidden_size": 1024, "num_attention_heads": 16, "num_hidden_layers": 24,
                          "transformers_version": "4.20.0.dev0", "word_embed_proj_dim": 512},
}

CONFTEST = '''\
"""Minimal conftest written by vtoken.reports.vllm_own_tests (vLLM's root conftest imports
models, the GPU and the HF hub; the fixtures tests/v1/core uses from it are here)."""
import logging
import os

import pytest

# the CPU platform before vLLM is first imported: vtoken's one definition of it
from vtoken.vllm_adapter.harness import ensure_cpu_env  # noqa: E402

ensure_cpu_env()


def pytest_addoption(parser):
    parser.addoption("--optional", action="store_true", default=False, help="run optional tests")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--optional"):
        return
    skip = pytest.mark.skip(reason="need --optional option to run")
    for item in items:
        if "optional" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_setup(item):
    item.user_properties.append(("nodeid", item.nodeid))


@pytest.fixture()
def temporary_enable_log_propagate(monkeypatch):
    from vllm.logger import DEFAULT_LOGGING_CONFIG

    monkeypatch.setitem(DEFAULT_LOGGING_CONFIG["loggers"]["vllm"], "propagate", True)
    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)


@pytest.fixture()
def caplog_vllm(temporary_enable_log_propagate, caplog):
    with caplog.at_level(logging.INFO):
        yield caplog
'''

PYTEST_INI = """\
[pytest]
# written by vtoken.reports.vllm_own_tests: the rootdir of vLLM's extracted tests
markers =
    cpu_test: vLLM's marker for CPU-only tests
    skip_global_cleanup: vLLM's marker
    optional: vLLM's marker (run with --optional)
    core_model: vLLM's marker
    slow_test: vLLM's marker
    asyncio: pytest-asyncio's marker
"""


# ---------------------------------------------------------------------------- the cache
def cache_root() -> Path:
    return Path(os.environ.get("VTOKEN_VLLM_TESTS_CACHE") or Path.home() / ".cache" / "vtoken" / "vllm-tests")


@contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _pip_download(version: str, dest: Path, log) -> Path:
    """vLLM's sdist for ``version`` into ``dest`` (see the module docstring, step 1)."""
    dest.mkdir(parents=True, exist_ok=True)
    found = sorted(dest.glob(f"vllm-{version}.tar.gz"))
    if found:
        return found[0]
    tools = cache_root() / "buildtools"
    if not (tools / "setuptools_scm").is_dir() or not (tools / "setuptools_rust").is_dir():
        log(f"installing setuptools-scm / setuptools-rust into {tools}")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(tools),
                        "setuptools-scm", "setuptools-rust"], check=True, capture_output=True, text=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tools), os.environ.get("PYTHONPATH")])),
               VLLM_TARGET_DEVICE="empty", VLLM_SKIP_VERSION_SUFFIX="1")
    attempts = [
        ([sys.executable, "-m", "pip", "download", "--no-binary", "vllm", "--no-deps", "--no-build-isolation",
          f"vllm=={version}", "-d", str(dest)], env),
        ([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", f"vllm=={version}",
          "-d", str(dest)], None),
    ]
    errors = []
    for cmd, e in attempts:
        log("$ " + " ".join(cmd))
        p = subprocess.run(cmd, env=e, capture_output=True, text=True)
        found = sorted(dest.glob(f"vllm-{version}.tar.gz"))
        if found:
            return found[0]
        errors.append(f"{' '.join(cmd[3:6])}: rc {p.returncode}: {(p.stderr or p.stdout).strip()[-800:]}")
    raise RuntimeError(f"could not download the vLLM {version} sdist:\n" + "\n".join(errors))


def _module_files(dotted: str, names: set) -> list[str]:
    """Tarball-relative candidates of module ``dotted`` (``tests.x.y``) and its packages."""
    parts = dotted.split(".")
    out = []
    for i in range(1, len(parts)):
        out.append("/".join(parts[:i]) + "/__init__.py")
    base = "/".join(parts)
    for cand in (base + ".py", base + "/__init__.py"):
        if cand in names:
            out.append(cand)
    return out


def _imports_of(source: str) -> set[str]:
    """``tests...`` modules a file imports (``from tests.a import b`` gives tests.a and tests.a.b)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    mods = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods |= {a.name for a in node.names if a.name.split(".")[0] == "tests"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] == "tests":
            mods.add(node.module)
            mods |= {f"{node.module}.{a.name}" for a in node.names}
    return mods


def extract_tests(tarball: Path, tree: Path) -> list[str]:
    """``tests/v1/core/**`` and the ``tests`` modules it imports (transitively), from the
    sdist into ``tree``; vLLM's conftest files outside ``tests/v1/core`` are never taken.
    Returns the extracted paths (relative to ``tree``)."""
    with tarfile.open(tarball) as tf:
        members = {}
        for m in tf.getmembers():
            if not m.isfile():
                continue
            rel = m.name.split("/", 1)[1] if "/" in m.name else m.name
            if rel.startswith("tests/"):
                members[rel] = m
        names = set(members)
        want = {n for n in names if n.startswith(TESTS_ROOT + "/")}
        want |= {"tests/__init__.py", "tests/v1/__init__.py"} & names
        todo = [n for n in want if n.endswith(".py")]
        seen = set(todo)
        while todo:
            n = todo.pop()
            src = tf.extractfile(members[n]).read().decode("utf-8", "replace")
            for mod in _imports_of(src):
                for f in _module_files(mod, names):
                    if f in names and f not in seen and not f.endswith("conftest.py"):
                        seen.add(f)
                        want.add(f)
                        todo.append(f)
        if tree.exists():
            shutil.rmtree(tree)
        for rel in sorted(want):
            target = tree / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(tf.extractfile(members[rel]).read())
    (tree / "tests" / "conftest.py").write_text(CONFTEST)
    (tree / "pytest.ini").write_text(PYTEST_INI)
    return sorted(want)


def write_stand_ins(hf_home: Path, configs: dict = STAND_IN_CONFIGS) -> list[str]:
    """An offline HF cache holding only ``config.json`` for each model id of ``configs``."""
    rev = "0" * 40
    for model, cfg in configs.items():
        repo = hf_home / "hub" / ("models--" + model.replace("/", "--"))
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / "main").write_text(rev)
        snap = repo / "snapshots" / rev
        snap.mkdir(parents=True, exist_ok=True)
        (snap / "config.json").write_text(json.dumps(cfg, indent=1))
    return sorted(configs)


def ensure_tests(version: str, log=lambda s: None) -> Path:
    """The extracted tree for ``version`` (cached; built on first use)."""
    root = cache_root() / version
    tree = root / "tree"
    with _locked(root / ".lock"):
        if (tree / ".complete").exists():
            return tree
        given = os.environ.get("VTOKEN_VLLM_SDIST")
        tarball = Path(given) if given else _pip_download(version, root / "sdist", log)
        files = extract_tests(tarball, tree)
        (tree / ".complete").write_text(json.dumps({"sdist": str(tarball), "files": files}, indent=1))
    return tree


# ---------------------------------------------------------------------------- junit
def _first_line(text: str) -> str:
    for line in (text or "").splitlines():
        line = line.strip()
        if line:
            return line[:300]
    return ""


def parse_junit(xml_text: str) -> dict[str, dict]:
    """test id -> {"outcome": passed|failed|error|skipped, "message", "text", "properties"}.

    The test id is the ``nodeid`` property (our conftest records it), else it is rebuilt from
    the xunit1 ``file`` and ``classname`` attributes. A collection error has no test: its
    id is the file it could not collect. A test reported twice (a call failure and a
    teardown error) keeps the worse outcome."""
    root = ET.fromstring(xml_text)
    out: dict[str, dict] = {}
    rank = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}
    for tc in root.iter("testcase"):
        props = {p.get("name"): p.get("value") for p in tc.iter("property")}
        name, cls, file = tc.get("name", ""), tc.get("classname", ""), tc.get("file")
        tid = props.get("nodeid")
        if not tid:
            if file:
                mod = file[:-3].replace("/", ".") if file.endswith(".py") else file
                rest = cls[len(mod) + 1:] if cls.startswith(mod + ".") else ""
                tid = "::".join([file] + ([rest.replace(".", "::")] if rest else []) + [name])
            elif not cls:  # collection error: name is the dotted module path
                tid = name.replace(".", "/") + ".py" if not name.endswith(".py") else name
            else:
                tid = cls.replace(".", "/") + ".py::" + name
        outcome, message, text = "passed", "", ""
        for tag in ("error", "failure", "skipped"):
            el = tc.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message, text = el.get("message", "") or "", el.text or ""
                if tag == "skipped" and el.get("type") == "pytest.xfail":
                    outcome = "passed"  # an expected failure behaved as expected
                break
        rec = {"outcome": outcome, "message": message, "text": text, "properties": props}
        old = out.get(tid)
        if old is None or rank[outcome] > rank[old["outcome"]]:
            if old is not None:
                rec["properties"] = {**old["properties"], **props}
            out[tid] = rec
    return out


def _match(rule: dict, test: str, error: str, props: str = "", failure: str = ""):
    m_err = None
    if "test" in rule and not re.search(rule["test"], test):
        return None
    if "props" in rule and not re.search(rule["props"], props):
        return None
    if "failure" in rule and not re.search(rule["failure"], failure):
        return None
    if "error" in rule:
        m_err = re.search(rule["error"], error)
        if m_err is None:
            return None
    return m_err or True


# an exception named in a failure's text: ``[module.]Type[: rest]``
_EXC = re.compile(r"(?:^|(?<=[\s\"'(]))(?:[A-Za-z_]\w*\.)*([A-Z]\w*(?:Error|Exception|Exit|Interrupt))(?::\s*(.*))?")


def failure_of(rec: dict) -> str:
    """What a failed test raised, read off its junit record: the exception's class name with
    vtoken's ``[code]`` (a ``VTokenError``: ``ConfigError[bad_type]``) or the adapter's
    ``[check]`` (``AdapterAssumptionError[kv_groups]``) when it carries one; ``AssertionError``
    for a bare ``assert``; ``unknown`` when the text names no exception. The junit message (the
    exception that ended the test) first, then the traceback's ``E`` lines, last first."""
    msg = (rec.get("message") or "").strip()
    cands = [msg.splitlines()[0]] if msg else []
    cands += [ln[1:].strip() for ln in reversed((rec.get("text") or "").splitlines()) if ln.startswith("E ")]
    for c in cands:
        c = re.sub(r"^E\s+", "", c)  # a traceback line quoted as the message
        if c.startswith("assert ") or c == "assert":
            return "AssertionError"
        m = _EXC.search(c)
        if m is None:
            continue
        name, rest = m.group(1), m.group(2) or ""
        code = re.search(r"\[(\w+)\]:", rest) if name == "AdapterAssumptionError" else re.match(r"\[(\w+)\]", rest)
        return f"{name}[{code.group(1)}]" if code and name in VTOKEN_ERRORS else name
    return "unknown"


def not_applicable_reason(rec: dict, rules: list[dict] = NOT_APPLICABLE_RULES) -> Optional[str]:
    """Why a test could not run here, or None when it ran (passed or really failed)."""
    if rec["outcome"] == "skipped":
        return "skipped: " + (_first_line(rec["message"]) or "no reason given")
    if rec["outcome"] not in ("failed", "error"):
        return None
    error = rec["message"] + "\n" + rec["text"]
    for rule in rules:
        m = _match(rule, "", error)
        if m:
            groups = m.groups() if m is not True else ()
            model = next((mm.group(1) for mm in (re.search(p, error) for p in MODEL_ID_PATTERNS) if mm), "?")
            return rule["reason"].format(*groups, model=model)
    return None


def error_line(rec: dict) -> str:
    """The first informative line of a failure: the exception line of the traceback (``E   ...``)
    when there is one, else the message's first line."""
    for line in (rec.get("text") or "").splitlines():
        if line.startswith("E   ") and line[4:].strip():
            return line[4:].strip()[:300]
    return _first_line(rec.get("message", "")) or rec.get("outcome", "")


def classify_divergence(test: str, rec: dict, rules: list[dict] = DIVERGENCE_RULES) -> dict:
    """``{"test", "kind", "reason", "cause", "error", "failure"}`` for a test that passed as
    shipped and not with vtoken (``rec``: its with-vtoken junit record), by what failed
    (``failure_of``, the error text, the adapters' counters; see ``DIVERGENCE_RULES``): the
    first rule that matches; else a vtoken error under ``vtoken_error:<failure>`` (kind
    ``bug``); else ``unclassified`` (``bug``)."""
    error = (rec.get("message") or "") + "\n" + (rec.get("text") or "")
    props = json.dumps(rec.get("properties") or {}, sort_keys=True).replace('\\"', '"')
    first, failure = error_line(rec), failure_of(rec)
    out = {"test": test, "error": first, "failure": failure}
    for rule in rules:
        if _match(rule, test, error, props, failure):
            return {**out, "kind": rule["kind"], "reason": rule["reason"], "cause": rule["cause"]}
    if failure.split("[")[0] in VTOKEN_ERRORS:
        return {**out, "kind": "bug", "cause": f"vtoken_error:{failure}",
                "reason": f"vtoken raised {failure} (the adapter refused its settings or the scheduler, or an "
                          f"assumption broke): {first}"}
    return {**out, "kind": "bug", "reason": f"unclassified: {first}", "cause": "unclassified"}


def summarize(results: dict[str, dict]) -> dict:
    """Counts and the not-applicable / failed lists of one run."""
    s = {"passed": 0, "failed": 0, "not_applicable": 0, "not_applicable_tests": [], "failed_tests": []}
    for tid in sorted(results):
        rec = results[tid]
        why = not_applicable_reason(rec)
        if why is not None:
            s["not_applicable"] += 1
            s["not_applicable_tests"].append({"test": tid, "reason": why})
        elif rec["outcome"] == "passed":
            s["passed"] += 1
        else:
            s["failed"] += 1
            s["failed_tests"].append({"test": tid, "error": error_line(rec)})
    return s


def compare(shipped: dict[str, dict], vtoken: dict[str, dict], rules: list[dict] = DIVERGENCE_RULES) -> dict:
    """Divergences (passed as shipped, not with vtoken), grouped by cause."""
    divs, better = [], []
    for tid in sorted(shipped):
        a = shipped[tid]
        b = vtoken.get(tid)
        a_ok = a["outcome"] == "passed"
        if b is None:
            if a_ok:
                divs.append(classify_divergence(tid, {"outcome": "error", "message": "missing from the with-vtoken "
                                                                                    "run", "text": ""}, rules))
            continue
        b_ok = b["outcome"] == "passed"
        if a_ok and not b_ok:
            divs.append(classify_divergence(tid, b, rules))
        elif b_ok and not a_ok and not_applicable_reason(a) is None:
            better.append(tid)
    causes: dict[str, dict] = {}
    for d in divs:
        c = causes.setdefault(d["cause"], {"kind": d["kind"], "reason": d["reason"], "tests": []})
        c["tests"].append(d["test"])
    return {"divergences": divs, "causes": causes, "vtoken_only_passes": better}


# ---------------------------------------------------------------------------- running
def _probe(python: str, adapter_settings: Optional[dict] = None) -> dict:
    """What ``python`` has; with ``adapter_settings``, also what its vtoken says of them
    (``settings_error``: the ``ConfigError`` line of ``vllm_adapter.config.adapter_settings``
    for an attached adapter, None when accepted). One subprocess."""
    code = ("import json, sys, importlib.util as u\n"
            "d = {}\n"
            "try:\n import vllm; d['vllm'] = vllm.__version__\n"
            "except Exception as e: d['vllm'] = None; d['vllm_error'] = repr(e)[:300]\n"
            "for m in ('pytest', 'pytest_timeout', 'vtoken'): d[m] = u.find_spec(m) is not None\n"
            "if len(sys.argv) > 1 and d['vtoken']:\n"
            " try:\n"
            "  from vtoken.vllm_adapter.config import adapter_settings\n"
            "  adapter_settings(json.loads(sys.argv[1]), attach=True); d['settings_error'] = None\n"
            " except Exception as e: d['settings_error'] = str(e).splitlines()[0][:500] if str(e) else repr(e)\n"
            "print(json.dumps(d))\n")
    argv = [python, "-c", code] + ([json.dumps(adapter_settings)] if adapter_settings is not None else [])
    p = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    if p.returncode:
        raise RuntimeError(f"{python} cannot be probed: {p.stderr.strip()[-500:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def _shards(tree: Path, targets: list[str], jobs: int) -> list[list[str]]:
    files = []
    for t in targets:
        p = tree / t.split("::")[0]
        if p.is_dir():
            files += [str(f.relative_to(tree)) for f in sorted(p.rglob("test_*.py"))]
        else:
            files.append(t)
    if jobs <= 1 or len(files) <= 1:
        return [files]
    size = lambda f: (tree / f.split("::")[0]).stat().st_size if (tree / f.split("::")[0]).exists() else 0
    shards: list[list[str]] = [[] for _ in range(min(jobs, len(files)))]
    load = [0] * len(shards)
    for f in sorted(files, key=size, reverse=True):  # largest first onto the lightest shard
        i = load.index(min(load))
        shards[i].append(f)
        load[i] += size(f)
    return [s for s in shards if s]


def _pytest(python: str, tree: Path, targets: list[str], junit: Path, *, vtoken: bool, timeout: Optional[int],
            env: dict, adapter_settings: Optional[dict], log_file: Path) -> int:
    cmd = [python, "-m", "pytest", "-c", str(tree / "pytest.ini"), "--rootdir", str(tree),
           "-p", "no:cacheprovider", "-p", "no:vtoken", "-q", "-rN", "-o", "junit_family=xunit1",
           "--junitxml", str(junit)]
    if timeout:
        cmd += [f"--timeout={int(timeout)}"]
    if vtoken:
        cmd += ["-p", PLUGIN]
        if adapter_settings:
            cmd += ["--vtoken-adapter-settings", json.dumps(adapter_settings)]
    cmd += targets
    with open(log_file, "w") as fh:
        fh.write("$ " + " ".join(cmd) + "\n")
        fh.flush()
        p = subprocess.run(cmd, cwd=str(tree), env=env, stdout=fh, stderr=subprocess.STDOUT)
    return p.returncode


def run_suite(python: str, tree: Path, targets: list[str], out_dir: Path, label: str, *, vtoken: bool, jobs: int,
              timeout: Optional[int], env: dict, adapter_settings: Optional[dict] = None) -> tuple[dict, dict]:
    """One run (``jobs`` shards in parallel): (junit records by test id, run info)."""
    shards = _shards(tree, targets, jobs)
    t0 = time.monotonic()
    from concurrent.futures import ThreadPoolExecutor

    def one(i_s):
        i, shard = i_s
        junit = out_dir / (f"{label}.xml" if len(shards) == 1 else f"{label}-{i}.xml")
        rc = _pytest(python, tree, shard, junit, vtoken=vtoken, timeout=timeout, env=env,
                     adapter_settings=adapter_settings,
                     log_file=out_dir / (f"{label}.log" if len(shards) == 1 else f"{label}-{i}.log"))
        return junit, rc

    with ThreadPoolExecutor(max_workers=len(shards)) as ex:
        done = list(ex.map(one, enumerate(shards)))
    wall = time.monotonic() - t0
    results: dict[str, dict] = {}
    rcs = []
    for junit, rc in done:
        rcs.append(rc)
        if junit.exists():
            results.update(parse_junit(junit.read_text()))
    info = {"wall_s": round(wall, 1), "returncode": max(rcs) if rcs else None, "shards": len(shards),
            "junit": [str(j) for j, _ in done]}
    if not results:
        logs = sorted(out_dir.glob(f"{label}*.log"))
        tail = logs[0].read_text()[-1500:] if logs else ""
        raise RuntimeError(f"the {label} run produced no junit results (rc {info['returncode']}):\n{tail}")
    return results, info


def _git_commit() -> str:
    try:
        rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "vtoken"],
                               capture_output=True, text=True).stdout.strip()
        return rev + ("+dirty(vtoken/)" if dirty else "")
    except OSError:
        return "unknown"


class PreflightError(RuntimeError):
    """``python`` cannot run the tests of ``version``; ``arg`` names the command-line argument
    at fault (``--python`` or ``--version``)."""

    def __init__(self, arg: str, message: str):
        super().__init__(message)
        self.arg = arg


def preflight(python: str, version: Optional[str] = None, with_vtoken: bool = True,
              adapter_settings: Optional[dict] = None) -> tuple[dict, str]:
    """What ``python`` has (``_probe``: one subprocess importing vLLM; nothing written) and the
    version to test (``version`` or the one it has). Raises :class:`PreflightError` when it
    has no vLLM, another version, no pytest, (``with_vtoken``) no vtoken, or when its vtoken
    refuses ``adapter_settings`` (``--adapter-settings``: the refusal's one line)."""
    try:
        probe = _probe(python, adapter_settings if with_vtoken else None)
    except (OSError, subprocess.SubprocessError, RuntimeError, ValueError) as e:
        raise PreflightError("--python", f"{python} cannot be run: {str(e)[-300:]}") from None
    if not probe.get("vllm"):
        raise PreflightError("--python", f"{python} has no importable vLLM: {probe.get('vllm_error')}")
    have = probe["vllm"].split("+")[0]
    version = version or have
    if version != have:
        raise PreflightError("--version", f"{python} has vLLM {probe['vllm']}, not {version}")
    if not probe.get("pytest"):
        raise PreflightError("--python", f"{python} has no pytest")
    if with_vtoken and not probe.get("vtoken"):
        raise PreflightError("--python", f"{python} cannot import vtoken (install this checkout there)")
    if with_vtoken and probe.get("settings_error"):
        raise PreflightError("--adapter-settings", probe["settings_error"])
    return probe, version


def run(version: str = None, python: str = sys.executable, out_dir: Path = None, with_vtoken: bool = True,
        jobs: int = 1, *, targets: Optional[Iterable[str]] = None, timeout: Optional[int] = 300,
        stand_ins: bool = True, adapter_settings: Optional[dict] = None, shipped: bool = True,
        log=None) -> dict:
    """Run vLLM's ``tests/v1/core`` as shipped and with vtoken in place; see the module docstring.

    Args:
        version: vLLM's version (default: the one ``python`` imports). The tests are those
            of this version's sdist; it must be the version ``python`` has.
        python: the interpreter whose vLLM (and, with ``with_vtoken``, vtoken) runs the tests.
        out_dir: where the junit files, pytest logs and ``vllm_own_tests.json`` go
            (default: a fresh temporary folder).
        with_vtoken: also run with the adapter in place (and compare).
        jobs: parallel pytest processes per run (test files are sharded).
        targets: test files or node ids relative to the tree (default: ``tests/v1/core``).
        timeout: per-test seconds (only where pytest-timeout is installed), None for none.
        stand_ins: serve ``STAND_IN_CONFIGS`` from an offline HF cache of our own.
        adapter_settings: the attached adapter's settings (default: none), as JSON values:
            ``AdapterConfig``'s fields, ``planner_config`` a nested dict of ``PlannerConfig``'s
            (``vllm_adapter.config.adapter_settings``, checked in ``python`` first: a refusal
            raises :class:`PreflightError` before any run).
        shipped: run the shipped suite (False: only the vtoken run, no comparison).
    """
    log = log or (lambda s: print(s, file=sys.stderr))
    t0 = time.monotonic()
    probe, version = preflight(python, version, with_vtoken, adapter_settings)
    tree = ensure_tests(version, log)
    # absolute: pytest runs with the extracted tree as its working directory, so a relative
    # --junitxml would land there (the audit passes reports/<ts>/vllm-own-tests: "no junit results")
    out_dir = (Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix=f"vllm-own-tests-{version}-"))).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONHASHSEED="0", TOKENIZERS_PARALLELISM="false")
    env.pop("PYTEST_ADDOPTS", None)
    models = []
    if stand_ins:
        hf = cache_root() / "hf-stand-ins"
        with _locked(cache_root() / ".hf.lock"):
            models = write_stand_ins(hf)
    else:
        hf = Path(tempfile.mkdtemp(prefix="vtoken-empty-hf-"))
    env["HF_HOME"] = str(hf)
    env.pop("HF_HUB_CACHE", None)
    env.pop("HUGGINGFACE_HUB_CACHE", None)
    targets = list(targets) if targets else [TESTS_ROOT]
    per_test = timeout if probe.get("pytest_timeout") else None
    report = {"version": version, "python": python, "vllm": probe["vllm"], "vtoken_commit": _git_commit(),
              "tree": str(tree), "targets": targets, "stand_ins": models, "jobs": jobs,
              "per_test_timeout_s": per_test, "out_dir": str(out_dir)}
    recs = {}
    if shipped:
        log(f"vLLM {version}: shipped run of {targets} ({jobs} job(s))")
        recs["shipped"], info = run_suite(python, tree, targets, out_dir, "shipped", vtoken=False, jobs=jobs,
                                          timeout=per_test, env=env)
        report["shipped"] = {**summarize(recs["shipped"]), **info}
    if with_vtoken:
        log(f"vLLM {version}: run with vtoken in place")
        recs["with_vtoken"], info = run_suite(python, tree, targets, out_dir, "with_vtoken", vtoken=True,
                                              jobs=jobs, timeout=per_test, env=env,
                                              adapter_settings=adapter_settings)
        s = summarize(recs["with_vtoken"])
        s["adapters_attached"] = sum(1 for r in recs["with_vtoken"].values()
                                     if int(r["properties"].get("vtoken_adapters") or 0) > 0)
        s["adapter_refused"] = sum(1 for r in recs["with_vtoken"].values()
                                   if int(r["properties"].get("vtoken_refused") or 0) > 0)
        report["with_vtoken"] = {**s, **info}
    if shipped and with_vtoken:
        report.update(compare(recs["shipped"], recs["with_vtoken"]))
    report["wall_s"] = round(time.monotonic() - t0, 1)
    (out_dir / "vllm_own_tests.json").write_text(json.dumps(report, indent=1))
    return report


def format_text(r: dict) -> str:
    lines = [f"vLLM {r['version']} own tests ({', '.join(r['targets'])}), vtoken {r['vtoken_commit']}, "
             f"stand-in configs: {', '.join(r['stand_ins']) or 'none'}"]
    for k in ("shipped", "with_vtoken"):
        if k in r:
            s = r[k]
            lines.append(f"  {k:12s} passed {s['passed']:4d}  failed {s['failed']:4d}  not applicable "
                         f"{s['not_applicable']:4d}  ({s['wall_s']} s)")
    if "divergences" in r:
        lines.append(f"  divergences: {len(r['divergences'])}")
        for cause, c in sorted(r["causes"].items(), key=lambda kv: -len(kv[1]["tests"])):
            lines.append(f"    [{c['kind']}] {cause}: {len(c['tests'])} test(s) - {c['reason']}")
            for t in c["tests"]:
                lines.append(f"        {t}")
    return "\n".join(lines)


def _version_arg(value: str) -> str:
    from .vllm_envs import valid_version

    if not valid_version(value):
        raise argparse.ArgumentTypeError(f"expected a vLLM version such as 0.33.0, got {value!r}")
    return value


def _python_arg(value: str) -> str:
    exe = shutil.which(value) if os.sep not in value else (value if os.access(value, os.X_OK) else None)
    if not exe or not Path(exe).is_file():
        raise argparse.ArgumentTypeError(f"{value!r} is not an executable interpreter")
    return value


def _target_arg(value: str) -> str:
    p = Path(value.split("::")[0])
    if not value or p.is_absolute() or ".." in p.parts:
        raise argparse.ArgumentTypeError(f"{value!r}: a test file or node id relative to the test tree "
                                         f"(e.g. {TESTS_ROOT}/test_scheduler.py)")
    return value


def main(argv=None) -> int:
    """The command line; a bad argument, or an interpreter that cannot run the tests
    (:func:`preflight`), is refused in argparse's one line (exit 2) before anything is
    fetched or written."""
    from vtoken.argtypes import json_object, nonneg_int, positive_int, writable_dir

    ap = argparse.ArgumentParser(prog="python -m vtoken.reports.vllm_own_tests", description=__doc__.split("\n")[0])
    ap.add_argument("--version", type=_version_arg, default=None, help="vLLM version (default: the one --python imports)")
    ap.add_argument("--python", type=_python_arg, default=sys.executable,
                    help="interpreter with vLLM (and vtoken) installed")
    ap.add_argument("--out", type=writable_dir, default=None, help="output folder (junit files, logs, the JSON)")
    ap.add_argument("--no-vtoken", action="store_true", help="only the shipped run")
    ap.add_argument("--jobs", type=positive_int, default=1, help="parallel pytest processes per run")
    ap.add_argument("--timeout", type=nonneg_int, default=300, help="per-test timeout in seconds (0: none)")
    ap.add_argument("--no-stand-ins", action="store_true", help="no stand-in model configs")
    ap.add_argument("--adapter-settings", type=json_object, default=None,
                    help="JSON settings of the attached adapter (AdapterConfig's fields, planner settings nested: "
                         "'{\"planner_config\": {\"headroom\": 64, \"in_place\": false}}'), checked by --python's "
                         "vtoken before anything runs")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    ap.add_argument("targets", nargs="*", type=_target_arg,
                    help=f"test files / node ids under the tree (default {TESTS_ROOT})")
    a = ap.parse_args(argv)
    if a.no_vtoken and a.adapter_settings is not None:
        ap.error("argument --adapter-settings: not with --no-vtoken (no adapter is attached)")
    try:
        preflight(a.python, a.version, not a.no_vtoken, a.adapter_settings or None)
    except PreflightError as e:
        ap.error(f"argument {e.arg}: {e}")
    r = run(a.version, a.python, None if a.out is None else Path(a.out), not a.no_vtoken, a.jobs,
            targets=a.targets or None, timeout=a.timeout or None, stand_ins=not a.no_stand_ins,
            adapter_settings=a.adapter_settings or None)
    print(json.dumps(r, indent=1) if a.json else format_text(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
