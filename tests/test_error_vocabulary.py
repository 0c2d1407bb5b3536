"""One error vocabulary for the system's callers, enforced.

Every error ``vtoken/`` raises for a caller is a :class:`vtoken.errors.VTokenError` with a
named ``code`` from its class's list in ``vtoken/errors.py`` (``TABLE_CODES``,
``ALLOCATOR_CODES``, ``SNAPSHOT_CODES``, ``CONFIG_CODES``, ``CALL_CODES``, ``ORDER_CODES``,
``PLAN_CODES``);
a bare builtin exception (``raise ValueError(...)``) is a breach. Internal invariants are
``assert``s. The classes that replaced builtins subclass them too (``CallError`` is a
``ValueError``, ``OrderError`` a ``RuntimeError``), so a caller's old ``except`` still holds.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from vtoken import errors

ROOT = Path(__file__).resolve().parent.parent
BUILTINS = {"ValueError", "RuntimeError", "TypeError", "KeyError", "IndexError", "Exception", "LookupError"}
CODES = {"TableError": errors.TABLE_CODES, "AllocatorError": errors.ALLOCATOR_CODES,
         "SnapshotError": errors.SNAPSHOT_CODES, "ConfigError": errors.CONFIG_CODES,
         "CallError": errors.CALL_CODES, "CallTypeError": errors.CALL_CODES, "CallIndexError": errors.CALL_CODES,
         "OrderError": errors.ORDER_CODES, "PlanError": errors.PLAN_CODES}


def raise_breaches(path: Path) -> list[str]:
    """``file:line why`` for each raise in ``path`` of a builtin exception, or of a listed
    error class with a literal code missing from its list."""
    out = []
    for n in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(n, ast.Raise) or n.exc is None:
            continue
        call = n.exc if isinstance(n.exc, ast.Call) else None
        func = call.func if call is not None else n.exc
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        if name in BUILTINS:
            out.append(f"{path.name}:{n.lineno} raises a bare {name}")
        elif name in CODES and call is not None and call.args and isinstance(call.args[0], ast.Constant):
            code = call.args[0].value
            if code not in CODES[name]:
                out.append(f"{path.name}:{n.lineno} raises {name}({code!r}), a code not in its list")
    return out


def test_the_system_raises_only_named_codes():
    files = sorted(p for p in (ROOT / "vtoken").rglob("*.py") if "__pycache__" not in p.parts)
    assert len(files) > 40
    found = [f"{p.relative_to(ROOT).parent}/{b}" for p in files for b in raise_breaches(p)]
    assert not found, "raises outside the error vocabulary:\n" + "\n".join(found)


@pytest.mark.parametrize("source, expect", [
    ("def f(x):\n    raise ValueError(f'bad {x}')\n", True),
    ("def f():\n    raise RuntimeError\n", True),  # a bare class, no call
    ("import builtins\ndef f():\n    raise builtins.TypeError('x')\n", True),
    ("from vtoken.errors import CallError\ndef f():\n    raise CallError('no_such_code', 'x')\n", True),
    ("from vtoken.errors import OrderError\ndef f():\n    raise OrderError('not_set_up', 'x')\n", False),
    ("from vtoken.errors import PlanError\ndef f():\n    raise PlanError('leaked', 'x')\n", True),
    ("from vtoken.errors import PlanError\ndef f():\n    raise PlanError('ownership', 'x')\n", False),
    ("def f():\n    try:\n        pass\n    except KeyError:\n        raise\n", False),  # a re-raise
    ("def f(x):\n    assert x, 'internal'\n", False),
])
def test_the_vocabulary_rule_finds_planted_breaches(tmp_path, source, expect):
    f = tmp_path / "probe.py"
    f.write_text(source)
    assert bool(raise_breaches(f)) == expect, raise_breaches(f)


@pytest.mark.parametrize("cls, builtin", [(errors.CallError, ValueError), (errors.CallTypeError, TypeError),
                                          (errors.CallIndexError, IndexError), (errors.OrderError, RuntimeError),
                                          (errors.ConfigError, ValueError)])
def test_named_errors_are_still_the_builtin_a_caller_caught(cls, builtin):
    e = cls("x", "message")
    assert isinstance(e, builtin) and isinstance(e, errors.VTokenError) and e.code == "x"
    assert str(e) == "[x] message"


def test_every_code_list_is_unique():
    for name in ("TABLE_CODES", "ALLOCATOR_CODES", "SNAPSHOT_CODES", "CONFIG_CODES", "CALL_CODES", "ORDER_CODES"):
        codes = getattr(errors, name)
        assert len(codes) == len(set(codes)), name


def _all_subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _all_subclasses(sub)


@pytest.mark.parametrize("cls", [errors.VTokenError, *sorted(set(_all_subclasses(errors.VTokenError)),
                                                              key=lambda c: c.__name__)],
                         ids=lambda c: c.__name__)
def test_every_error_pickles_with_its_code_message_and_attributes(cls):
    """An error raised in a worker process crosses to the engine pickled: each comes back as
    itself (its class, code, message and extra attributes), not as a TypeError of unpickling."""
    import pickle

    e = errors.RelocationCheckError("hash_mismatch", "token 3 moved", violations=[{"token": 3}]) \
        if cls is errors.RelocationCheckError else cls("bad_value", "the message")
    e.extra = {"step": 7}
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is cls and str(back) == str(e) and back.code == e.code and back.args == e.args
    assert back.__dict__ == e.__dict__


def test_the_adapters_assumption_error_pickles():
    import pickle

    from vtoken.vllm_adapter.assumptions import AdapterAssumptionError

    e = AdapterAssumptionError("fence", "block 4 freed before its fence")
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is AdapterAssumptionError and str(back) == str(e)
    assert (back.check, back.detail) == ("fence", "block 4 freed before its fence")
