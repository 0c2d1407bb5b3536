"""The synthetic attention model that drives H2O and Scissorhands in the simulator: a stated,
seeded model in place of Llama-3.1-8B's attention.

- Importance: token ``i`` has ``w_i = exp(sigma * z_i)`` (``sigma = 1.5``), ``z`` a
  unit-variance Gaussian sequence smoothed with an exponential kernel (``rho = 0.3``); the
  first ``n_sink = 4`` tokens are sinks (``w x 50``).
- Recency: a query at ``q`` weights token ``i <= q`` by ``w_i * (1 + (q - i) / tau) ** -alpha``
  (``tau = 32``, ``alpha = 1``).
- Noise: each share, per window, times an independent lognormal factor (``noise = 0.5``).
- Normalisation: each query spends one unit over the live tokens.

Policies observe attention once per window of ``E`` decode steps, summed over the window
(the recency sum in its continuous approximation, one normalisation per window). A run is a
pure function of the caller's seeded ``numpy.random.Generator``.

Owns: nothing (a frozen model; the caller's generator holds the randomness).
May call: numpy, dataclasses, vtoken.sim.config; never spec/, invariants/, fuzz/ or reports/.
Costs: ``importance`` O(tokens); ``window`` O(live tokens) per observation window.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from .config import need_int, need_number


@dataclass(frozen=True)
class AttentionModel:
    sigma: float = 1.5
    rho: float = 0.3
    n_sink: int = 4
    sink_boost: float = 50.0
    tau: float = 32.0
    alpha: float = 1.0
    noise: float = 0.5

    def __post_init__(self) -> None:
        """Every field checked (:class:`~vtoken.errors.ConfigError` naming
        ``AttentionModel.<field>`` and the value): ``sigma``, ``alpha``, ``noise`` finite
        numbers >= 0; ``rho`` in [0, 1) (the kernel ``rho ** k`` must decay); ``sink_boost``,
        ``tau`` finite numbers > 0; ``n_sink`` an integer >= 0. O(1)."""
        o = "AttentionModel"
        for name in ("sigma", "alpha", "noise"):
            need_number(o, name, getattr(self, name), 0)
        need_number(o, "rho", self.rho, 0, 1, hi_open=True)
        for name in ("sink_boost", "tau"):
            need_number(o, name, getattr(self, name), 0, lo_open=True)
        need_int(o, "n_sink", self.n_sink, 0)

    def describe(self) -> dict:
        return asdict(self)

    # ---------------------------------------------------------------- importance
    def importance(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """Intrinsic importance ``w`` of ``n`` tokens (float64, all > 0)."""
        e = rng.standard_normal(n + 32)
        if self.rho > 0:
            k = self.rho ** np.arange(32)
            z = np.convolve(e, k)[31:31 + n] / np.sqrt(np.sum(k * k))
        else:
            z = e[:n]
        w = np.exp(self.sigma * z)
        w[: min(self.n_sink, n)] *= self.sink_boost
        return w

    # ---------------------------------------------------------------- attention
    def _cum(self, d: np.ndarray) -> np.ndarray:
        """Continuous ``sum_{x < d} (1 + x/tau)^-alpha`` for ``d >= 0``."""
        d = np.maximum(d, 0.0)
        if abs(self.alpha - 1.0) < 1e-12:
            return self.tau * np.log1p(d / self.tau)
        a = 1.0 - self.alpha
        return self.tau / a * ((1.0 + d / self.tau) ** a - 1.0)

    def window(self, w: np.ndarray, ids: np.ndarray, q0: int, q1: int,
               rng: np.random.Generator) -> np.ndarray:
        """Attention received by live tokens ``ids`` from the queries at positions
        ``[q0, q1)`` (a query at ``q`` sees tokens ``<= q``), summed over the queries,
        normalised so the total is ``q1 - q0``."""
        if q1 <= q0 or len(ids) == 0:
            return np.zeros(len(ids))
        idf = ids.astype(np.float64)
        g = self._cum(q1 - idf) - self._cum(np.maximum(q0, idf) - idf)
        a = w[ids] * g
        if self.noise > 0:  # lognormal(0, noise), drawn in float32 (the hot path of the schedules)
            a *= np.exp(self.noise * rng.standard_normal(len(ids), dtype=np.float32))
        tot = a.sum()
        if tot > 0:
            a *= (q1 - q0) / tot
        return a
