"""A bounded proof of the planner's placement rule (``vtoken.placement.place``).

What this cannot see: ``place`` alone, up to its bound (``n_blocks * S`` symbolic bits, 8 x 16
by default: a pattern needing more is not covered); not the in-place placement into fills'
holes (``holes``), not ``propose``'s choice of sources and destinations, not the moves a
plan carries or their copy (the snapshot checkers and the planner machine see those).

For ``n_blocks`` source blocks of ``S`` tokens (``n_blocks * S`` candidates, logical order =
block order then offset order) the liveness of every candidate is a symbolic Bool, so one
proof covers all ``2**(n_blocks*S)`` liveness patterns. The *real* function runs on Z3
terms, and Z3 is asked for a liveness pattern that breaks each property:

- ``range``:    every live token gets ``0 <= offset < S`` and ``0 <= dest_index < ceil(T/S)``
                (``T`` = live tokens);
- ``dense``:    the ``k``-th live token (logical order) lands at ``dest_index*S + offset == k``
                (destinations are filled completely, one after another -- the module's
                contract; stated with an independent count, not with ``place``'s own);
- ``order``:    live ``i < j`` => ``dest_index*S + offset`` strictly increases;
- ``unique``:   no two live tokens share ``(dest_index, offset)``;
- ``excluded``: mapping ``dest_index`` through a concrete destination list (Python list
                indexing, negative indices included, out of range = IndexError) never gives a
                source block, a shared-prefix block, the tail block, the null block, or no
                block at all.

Encoding (why it is fast enough for 8 x 16 = 128 symbolic bits):

- ``place`` calls ``ite``, a cumulative sum, ``-``, ``//`` and ``%`` on arrays of whatever
  ``zero``/``one`` are: here object arrays (numpy applies each operator element by element,
  the cumulative sum as ``k_i = k_(i-1) + inc_i``), with ``ite`` vectorised by
  ``np.frompyfunc``. Z3's ``ArithRef`` has no ``//`` (``place(..., ite=z3.If, ...)`` raises
  TypeError), so the proof passes a thin wrapper, :class:`_Sym`, whose operators mean exactly
  Python's: ``a // S`` and ``a % S`` (``S`` a positive int) are fresh Ints ``q, r`` with
  ``a == S*q + r, 0 <= r < S`` (floor division and Python's modulo), shared between ``//``
  and ``%`` of the same term so integrality is not needed to see they agree; ``ite(c, a, b)``
  is ``If(c, a, b)``, named by a fresh Int, and when ``a - b`` simplifies to a constant
  ``d`` it is written ``b + d*x_c`` with the 0/1 indicator ``x_c == If(c, 1, 0)`` (an
  identity). Counts and offsets are thus linear integer terms: no arrays, no nested
  ``If`` chains for the solver to split on.
- Existential questions use one symbolic token index ``I`` with per-index facts
  ``I == i -> (live_i and D == dest_i and O == off_i and C == count_i)``; pair properties add
  ``Or_j(I < j and live_j and ...)`` (linear, not the 8128-pair disjunction). The search is
  split on ``I`` (``check(I == i)`` for each ``i``, last token first: cube-and-conquer),
  which is much faster than leaving the split to the solver; the last tokens are where an
  off-by-k placement overflows, so a counterexample usually comes from the first cube.
  (Measured, 8 x 16 on 2 cores: about 2 s of CPU to prove all five properties.)
- ``unique``'s question carries the redundant conjunct ``pos_j == pos_I`` (implied by
  ``dest_j == D and off_j == O``: the formula is equivalent), so each ``j`` is refuted by
  linear reasoning. ``excluded`` is asked with the proved ``range`` facts for ``I`` added:
  adding a formula already proved valid cannot hide a counterexample; when ``range`` is
  not proved (a planted fault) it is asked without them.

The result, :class:`ProofResult`, has a ``violations`` view: each refuted property as a
:class:`~vtoken.invariants.violation.Violation` (``[]``: none refuted).

Owns: nothing beyond the Z3 solver of one proof.
May call: vtoken.placement (the function proved), invariants.violation, numpy, z3.
Costs: one solver call per property and cube: about 2 s of CPU for 8 x 16 (exponential in the bound,
in principle).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import z3

from vtoken.placement import place

from .violation import Violation

PROPERTIES = ("range", "dense", "order", "unique", "excluded")


@dataclass
class ProofResult:
    proved: bool
    seconds: float
    counterexample: Optional[dict] = None  # the first failing property: live bits, token(s), values
    properties: dict = field(default_factory=dict)  # name -> proved | counterexample | unknown | skipped
    n_blocks: int = 0
    S: int = 0

    @property
    def violations(self) -> list[Violation]:
        """Each property the solver refuted, as a :class:`Violation` (invariant ``placement``,
        ``rule`` the property; ``[]``: none refuted -- an ``unknown`` property is not proved,
        but no violation was found). The first carries the counterexample as its model."""
        cex = self.counterexample or {}
        names = [n for n, status in self.properties.items() if status == "counterexample"]
        if cex.get("property") and cex["property"] not in names:
            names.insert(0, cex["property"])  # a refusal before the proof ran: place's shape
        return [Violation("placement", cex["why"], dict(cex), n) if cex.get("property") == n else
                Violation("placement", f"property {n}: the solver found a counterexample", {}, n) for n in names]

    def __str__(self) -> str:
        head = f"placement {self.n_blocks}x{self.S}: {'PROVED' if self.proved else 'NOT PROVED'} in {self.seconds:.2f}s"
        props = ", ".join(f"{k}={v}" for k, v in self.properties.items())
        tail = f"\n  counterexample: {self.counterexample}" if self.counterexample else ""
        return f"{head} ({props}){tail}"


class _Enc:
    """Side constraints collected while ``place`` runs on :class:`_Sym` terms."""

    def __init__(self):
        self.side: list = []
        self._ind: dict = {}
        self._dm: dict = {}
        self._n = 0

    def fresh(self, prefix: str) -> z3.ArithRef:
        self._n += 1
        return z3.Int(f"{prefix}!{self._n}")

    def indicator(self, c) -> z3.ArithRef:
        key = c.get_id()
        if key not in self._ind:
            x = self.fresh("x")
            self.side += [x == z3.If(c, 1, 0), x >= 0, x <= 1]
            self._ind[key] = x
        return self._ind[key]

    def divmod(self, e, S: int):
        key = (e.get_id(), S)
        if key not in self._dm:
            q, r = self.fresh("q"), self.fresh("r")
            self.side += [e == S * q + r, r >= 0, r < S]
            self._dm[key] = (q, r)
        return self._dm[key]


class _Sym:
    """A Z3 integer term with Python's integer operators (``//`` and ``%`` included)."""

    __slots__ = ("e", "enc")

    def __init__(self, e, enc: _Enc):
        self.e, self.enc = e, enc

    def _v(self, o):
        return o.e if isinstance(o, _Sym) else o

    def __add__(self, o):
        return _Sym(self.e + self._v(o), self.enc)

    __radd__ = __add__

    def __sub__(self, o):
        return _Sym(self.e - self._v(o), self.enc)

    def __rsub__(self, o):
        return _Sym(self._v(o) - self.e, self.enc)

    def __mul__(self, o):
        return _Sym(self.e * self._v(o), self.enc)

    __rmul__ = __mul__

    def _int_divisor(self, o) -> int:
        if isinstance(o, bool) or not isinstance(o, int) or o <= 0:
            raise TypeError(f"placement proof: division by {o!r}; only a positive int block size is modelled")
        return o

    def __floordiv__(self, o):
        return _Sym(self.enc.divmod(self.e, self._int_divisor(o))[0], self.enc)

    def __mod__(self, o):
        return _Sym(self.enc.divmod(self.e, self._int_divisor(o))[1], self.enc)


def _make_ite(enc: _Enc):
    def ite(c, a, b):
        ae, be = (a.e if isinstance(a, _Sym) else z3.IntVal(a)), (b.e if isinstance(b, _Sym) else z3.IntVal(b))
        v = enc.fresh("k")
        d = z3.simplify(ae - be)
        if z3.is_int_value(d):  # If(c, b + d, b) == b + d * If(c, 1, 0)
            enc.side.append(v == be + d.as_long() * enc.indicator(c))
        else:
            enc.side.append(v == z3.If(c, ae, be))
        return _Sym(v, enc)

    return ite


def _dest_block(d, dests: list[int], missing: int = -1):
    """``dests[d]`` with Python's list indexing as an If-chain; ``missing`` for IndexError."""
    e = z3.IntVal(missing)
    for k in reversed(range(-len(dests), len(dests))):
        e = z3.If(d == k, dests[k], e)
    return e


def _live_bits(m, bits) -> list[int]:
    return [1 if z3.is_true(m.eval(b, model_completion=True)) else 0 for b in bits]


def _term(x):
    """The Z3 integer term of one entry of ``place``'s output (a :class:`_Sym` or a concrete int)."""
    return x.e if isinstance(x, _Sym) else z3.IntVal(int(x))


def _run_place(enc: _Enc, live: list, S: int):
    """``place`` on the symbolic liveness ``live``: its output, and its two arrays' shapes (None: not a pair)."""
    flags = np.empty(len(live), dtype=object)  # place() runs on object arrays: each element a Z3 term
    flags[:] = live
    out = place(flags, S, ite=np.frompyfunc(_make_ite(enc), 3, 1), zero=_Sym(z3.IntVal(0), enc),
                one=_Sym(z3.IntVal(1), enc))
    shapes = [np.shape(x) for x in out] if isinstance(out, tuple) and len(out) == 2 else None
    return out, shapes


def _live_counts(enc: _Enc, live: list) -> list:
    """The specification side, independent of ``place``: ``cnt[i]`` live tokens before token ``i``, ``cnt[N]`` all."""
    x = [enc.indicator(b) for b in live]
    cnt = [z3.IntVal(0)]
    for i in range(len(live)):
        c = z3.Int(f"count_{i + 1}")
        enc.side.append(c == cnt[-1] + x[i])
        cnt.append(c)
    return cnt


def _layout(n_blocks: int) -> tuple[list, dict]:
    """The concrete blocks around the plan: the destinations, and each excluded block with why it is excluded."""
    sources = list(range(1, n_blocks + 1))
    shared = [n_blocks + 1, n_blocks + 2]
    tail = n_blocks + 3
    dests = [n_blocks + 4 + k for k in range(n_blocks)]
    excluded = {0: "null block", -1: "no block (IndexError)", tail: "tail block"}
    excluded.update({b: "source block" for b in sources})
    excluded.update({b: "shared-prefix block" for b in shared})
    return dests, excluded


def _search_cubes(s: z3.Solver, I, N: int, deadline: float) -> tuple[str, Optional[int]]:
    """One property's search, cube ``I == i`` by cube: (proved | counterexample | unknown, ``i`` of the sat cube)."""
    for i in reversed(range(N)):  # late tokens first: where off-by-k placements overflow
        left = deadline - time.perf_counter()
        if left <= 0:
            return "unknown", None
        s.set("timeout", max(1, int(left * 1000)))
        r = s.check(I == i)
        if r == z3.unknown:
            return "unknown", None
        if r == z3.sat:
            return "counterexample", i
    return "proved", None


def prove_placement(n_blocks: int = 8, S: int = 16, timeout_s: float = 60.0,
                    stop_at_first: bool = False) -> ProofResult:
    """Prove the placement rule for every liveness pattern of ``n_blocks`` blocks of ``S``.

    The layout around the plan is concrete: sources ``1..n_blocks``, two shared-prefix
    blocks and a tail block after them, destinations after those (``n_blocks`` of them, the
    most a plan of ``n_blocks`` sources can need). ``timeout_s`` bounds the whole proof; a
    property the solver cannot settle in time is ``unknown`` (not proved). With
    ``stop_at_first`` the proof stops at the first counterexample (the rest are
    ``skipped``).
    """
    t0 = time.perf_counter()
    N = n_blocks * S
    enc = _Enc()
    live = [z3.Bool(f"live_{i}") for i in range(N)]
    out, shapes = _run_place(enc, live, S)
    if shapes != [(N,), (N,)]:
        return ProofResult(False, time.perf_counter() - t0,
                           {"property": "shape", "why": f"place returned {shapes or type(out).__name__}, not "
                                                        f"two arrays of {N} entries"}, {}, n_blocks, S)
    d = [_term(x) for x in out[0]]
    off = [_term(x) for x in out[1]]
    pos = [S * d[i] + off[i] for i in range(N)]

    cnt = _live_counts(enc, live)
    T = cnt[N]
    nd = z3.Int("n_dests")  # ceil(T / S)
    dests, excluded = _layout(n_blocks)

    I = z3.Int("I")
    DI, OI, CI = z3.Int("D_I"), z3.Int("O_I"), z3.Int("C_I")
    PI = S * DI + OI
    s = z3.Solver()
    s.add(enc.side)
    s.add(S * nd >= T, S * nd < T + S, 0 <= I, I < N)
    for i in range(N):
        s.add(z3.Implies(I == i, z3.And(live[i], DI == d[i], OI == off[i], CI == cnt[i])))
    range_ok = z3.And(0 <= OI, OI < S, 0 <= DI, DI < nd)
    blk = _dest_block(DI, dests)
    negations = {
        "range": lambda: z3.Not(range_ok),
        "dense": lambda: PI != CI,
        "order": lambda: z3.Or([z3.And(I < j, live[j], pos[j] <= PI) for j in range(N)]),
        # pos_j == PI is implied by the other two conjuncts (an equivalent formula); stating it
        # lets the solver refute each j by linear reasoning alone.
        "unique": lambda: z3.Or([z3.And(I < j, live[j], pos[j] == PI, d[j] == DI, off[j] == OI) for j in range(N)]),
        "excluded": lambda: z3.Or([blk == b for b in excluded]),
    }
    lemmas = {"excluded": ("range", range_ok)}

    status: dict = {}
    cex = None
    deadline = t0 + timeout_s
    for name in PROPERTIES:
        if stop_at_first and cex is not None:
            status[name] = "skipped"
            continue
        s.push()
        s.add(negations[name]())
        if name in lemmas and status.get(lemmas[name][0]) == "proved":
            s.add(lemmas[name][1])
        result, i = _search_cubes(s, I, N, deadline)
        if result == "counterexample" and cex is None:
            cex = _explain(name, s.model(), live, d, off, cnt, i, N, S, dests, excluded)
        s.pop()
        status[name] = result
    proved = all(v == "proved" for v in status.values())
    return ProofResult(proved, time.perf_counter() - t0, cex, status, n_blocks, S)


def _explain(name, m, live, d, off, cnt, i, N, S, dests, excluded) -> dict:
    ev = lambda e: m.eval(e, model_completion=True).as_long()  # noqa: E731
    bits = _live_bits(m, live)
    ce = {"property": name, "live": bits, "live_tokens": [k for k in range(N) if bits[k]],
          "token": i, "dest_index": ev(d[i]), "offset": ev(off[i]), "expected_position": ev(cnt[i])}
    if name in ("order", "unique"):
        for j in range(i + 1, N):
            if bits[j] and ((name == "order" and ev(d[j]) * S + ev(off[j]) <= ev(d[i]) * S + ev(off[i]))
                            or (name == "unique" and (ev(d[j]), ev(off[j])) == (ev(d[i]), ev(off[i])))):
                ce.update(other_token=j, other_dest_index=ev(d[j]), other_offset=ev(off[j]))
                break
    if name == "range":
        ce["n_dests"] = -(-sum(bits) // S)
    if name == "excluded":
        di = ce["dest_index"]
        blk = dests[di] if -len(dests) <= di < len(dests) else -1
        ce.update(dest_block=blk, excluded_as=excluded.get(blk, "?"))
    ce["why"] = {
        "range": f"live token {i} -> (dest {ce['dest_index']}, offset {ce['offset']}) outside [0, {ce.get('n_dests')}) x [0, {S})",
        "dense": f"live token {i} is live token #{ce['expected_position']} but lands at position {ce['dest_index'] * S + ce['offset']}",
        "order": f"live tokens {i} < {ce.get('other_token')} land out of order",
        "unique": f"live tokens {i} and {ce.get('other_token')} share (dest {ce['dest_index']}, offset {ce['offset']})",
        "excluded": f"live token {i} -> dest index {ce['dest_index']} -> {ce.get('excluded_as')}",
    }[name]
    return ce


def main(argv=None) -> int:  # python -m vtoken.invariants.placement_proof [n_blocks S]
    import sys

    args = [int(a) for a in (argv if argv is not None else sys.argv[1:])]
    res = prove_placement(*args)
    print(res)
    return 0 if res.proved else 1


if __name__ == "__main__":
    raise SystemExit(main())
