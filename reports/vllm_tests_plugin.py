"""A pytest plugin that puts vtoken in place in vLLM's OWN tests (``tests/v1/core``).

Loaded by ``vtoken.reports.vllm_own_tests`` for its second run, with
``-p vtoken.reports.vllm_tests_plugin``. Toolkit code: the system never imports it.

The mechanism
-------------
vLLM's tests build their schedulers in several places: ``tests/v1/core/utils.py::
create_scheduler`` (most of them), ``tests/v1/kv_connector/unit/utils.py::create_scheduler``,
``test_scheduler.py::create_scheduler_with_priority``, and a few tests call
``Scheduler(...)`` / ``AsyncScheduler(...)`` or a subclass of their own (``scheduler_cls=``)
directly. Patching one helper would miss the others, so the plugin patches the classes:

* at ``pytest_configure`` every class of vLLM's scheduler hierarchy that defines its own
  ``__init__`` (``Scheduler``, ``AsyncScheduler``, and any subclass already imported) gets
  a wrapped ``__init__``, and ``Scheduler.__init_subclass__`` wraps the ``__init__`` of any
  subclass defined later (a test's own scheduler class);
* the wrapper counts nesting (``AsyncScheduler.__init__`` calls ``Scheduler.__init__``):
  when the OUTERMOST ``__init__`` returns, the instance is complete and the adapter is
  attached with ``VTokenAdapter.attach(scheduler, **settings)``. ``attach`` keeps the
  instance, swaps its class for ``VToken<its class>`` (``vllm_adapter.hooks``: the
  before/after ``schedule()`` and ``update_from_output()``, before
  ``_free_request_blocks()`` hooks), reads the geometry and KV cache groups off it
  (``VllmHarness.around``) and keeps vLLM's ``defer_block_free`` as vLLM set it, exactly as
  an adapter-built scheduler.
  ``isinstance`` checks of the tests still hold (the new class subclasses the old one).
* settings: the adapter's defaults (reclamation on, ``PlannerConfig()``: in-place
  compaction, so no planner headroom; the soft reservation of ``keep_headroom`` is drawn only
  while a request holds an evicted token, so none here; runtime checks on) unless ``--vtoken-adapter-settings JSON`` says otherwise
  (``settings_arg``: the JSON shape of ``vtoken.vllm_adapter.config``, nested planner settings
  included, checked before any test runs). No eviction
  acts: no worker is attached and the token table stays empty, so no block is ever
  released or relocated; what remains is everything the adapter does around vLLM anyway
  (the headroom reservation and admission back-pressure, the fence's own clock, the hooks
  on free and reset, the block-list mirror and the runtime assumption checks over every
  KV cache group).
* an adapter that refuses the scheduler (``AdapterAssumptionError``, e.g. a vLLM version
  it was not audited on) raises out of the constructor: the test fails with that error, which
  is what vtoken in place would do.

Per test, the plugin adds junit properties ``vtoken_adapters`` (adapters attached during
the test), ``vtoken_refused`` (schedulers the adapter refused) and ``vtoken_stats`` (JSON: the adapters' summed counters that matter without
eviction: ``headroom_yielded``, ``backpressure_steps``, ``preemptions``, ``deferred_free_calls``
(frees the adapter's fence held), and ``headroom_target``, the largest reservation an adapter
kept), so a report can tell a test that never built a scheduler (vtoken not in play) from one
that did, and what vtoken did in it.

Owns: the wrapped scheduler ``__init__``s (for the whole session: nothing unwraps them) and weak
references to the adapters attached in the current test.
May call: vllm (scheduler classes), vtoken.vllm_adapter (adapter, hooks, harness, config: the option's check),
vtoken.argtypes, pytest.
Costs: one ``attach`` per scheduler a test builds, then the adapter's per-step cost.
"""

from __future__ import annotations

import functools
import json
import weakref

import pytest

_SETTINGS: dict = {}
_WRAPPED = "_vtoken_wrapped_init"
_CLASSES: dict = {}  # base scheduler class -> its VToken<base> class (one per base)
_attached: list = []  # weak references to the adapters attached during the current test
_refused: list = []  # schedulers the adapter refused during the current test (their error re-raised)
_STATS = ("headroom_yielded", "backpressure_steps", "preemptions", "deferred_free_calls")


def settings_arg(value: str) -> dict:
    """``--vtoken-adapter-settings``: a JSON object of the attached adapter's settings, checked
    by ``vtoken.vllm_adapter.config.adapter_settings`` (``AdapterConfig``'s fields, a nested
    ``planner_config`` object of ``PlannerConfig``'s; vLLM's configuration is each scheduler's
    own, refused here); a refusal is argparse's, so pytest reports it as a usage error naming
    the option before any test runs. Returns the settings as given (``attach`` takes them)."""
    import argparse

    from vtoken.argtypes import json_object
    from vtoken.errors import ConfigError
    from vtoken.vllm_adapter.config import adapter_settings

    try:
        return adapter_settings(json_object(value), attach=True)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def pytest_addoption(parser):
    # checked as the command line is parsed (pytest's usage error, before any test)
    parser.addoption("--vtoken-adapter-settings", type=settings_arg, default={},
                     help="JSON settings of VTokenAdapter.attach, e.g. '{\"planner_config\": {\"headroom\": 64, "
                          "\"in_place\": false}}' (default: the adapter's defaults)")


def _vtoken_class(base: type) -> type:
    from vtoken.vllm_adapter.hooks import scheduler_class

    if base not in _CLASSES:
        _CLASSES[base] = scheduler_class(base)
    return _CLASSES[base]


def attach(scheduler) -> None:
    """Attach an adapter to a finished scheduler instance (the wrapper's last act)."""
    from vtoken.vllm_adapter.adapter import VTokenAdapter

    if getattr(scheduler, "vtoken_adapter", None) is not None:
        return  # built by an adapter already
    if not hasattr(type(scheduler), "vtoken_adapter"):
        scheduler.__class__ = _vtoken_class(type(scheduler))
    try:
        ad = VTokenAdapter.attach(scheduler, **_SETTINGS)
    except Exception as e:  # noqa: BLE001 - counted, then the test sees it
        _refused.append(type(e).__name__)
        raise
    _attached.append(weakref.ref(ad))


def _wrap(cls: type) -> None:
    init = cls.__dict__.get("__init__")
    if init is None or getattr(init, _WRAPPED, False) or hasattr(cls, "vtoken_adapter"):
        return

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        depth = self.__dict__.get("_vtoken_init_depth", 0)
        self.__dict__["_vtoken_init_depth"] = depth + 1
        try:
            init(self, *args, **kwargs)
        finally:
            if depth:
                self.__dict__["_vtoken_init_depth"] = depth
            else:
                self.__dict__.pop("_vtoken_init_depth", None)
        if depth == 0:
            attach(self)

    setattr(__init__, _WRAPPED, True)
    cls.__init__ = __init__


def install(settings: dict | None = None) -> None:
    """Patch vLLM's scheduler classes (idempotent)."""
    from vtoken.vllm_adapter import harness as _harness  # noqa: F401 - CPU environment before vLLM
    from vllm.v1.core.sched.scheduler import Scheduler
    import vllm.v1.core.sched.async_scheduler  # noqa: F401 - the subclass exists before the walk

    _SETTINGS.clear()
    _SETTINGS.update(settings or {})
    todo = [Scheduler]
    while todo:
        c = todo.pop()
        _wrap(c)
        todo.extend(c.__subclasses__())
    if not getattr(Scheduler.__dict__.get("__init_subclass__"), _WRAPPED, False):
        previous = Scheduler.__dict__.get("__init_subclass__")

        def __init_subclass__(cls, **kw):
            if previous is not None:
                previous.__func__(cls, **kw)
            else:
                super(Scheduler, cls).__init_subclass__(**kw)
            _wrap(cls)

        setattr(__init_subclass__, _WRAPPED, True)
        Scheduler.__init_subclass__ = classmethod(__init_subclass__)


def _headroom_target(ad) -> int:
    """The reservation ``ad`` keeps while requests run (0: none; unknown: 0)."""
    try:
        return int(ad.reserve.target())
    except Exception:  # noqa: BLE001 - a test may have torn the pool down: report none
        return 0


def pytest_configure(config):
    install(config.getoption("--vtoken-adapter-settings") or {})
    config.addinivalue_line("markers", "vtoken_in_place: vLLM's schedulers run with the vtoken adapter attached")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _attached.clear()
    _refused.clear()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item):
    ads = [a for a in (r() for r in _attached) if a is not None]
    stats = {k: sum(int(a.stats.get(k, 0)) for a in ads) for k in _STATS}
    # what the divergence rules read besides the failure: the largest reservation an adapter kept
    stats["headroom_target"] = max((_headroom_target(a) for a in ads), default=0)
    item.user_properties.append(("vtoken_adapters", len(_attached)))
    item.user_properties.append(("vtoken_refused", len(_refused)))
    item.user_properties.append(("vtoken_stats", json.dumps(stats, sort_keys=True)))
