"""The Ray cluster a campaign or a planted-fault run spreads over (``--ray ADDRESS|auto``):
joined, or refused in one line before any work.

Owns: nothing (Ray's connection is Ray's, process-wide).
May call: ray (imported only here, on demand), socket.
Costs: one TCP connect (5 s at most) and Ray's own ``init``.
"""

from __future__ import annotations


class RayUnavailable(RuntimeError):
    """``--ray`` without Ray installed, or no cluster at the address: one line, before any work."""


def ray_cluster(address: str | None):
    """Ray, connected: an already initialised Ray (a test's ``ray.init()``) is used as it is;
    otherwise ``ray.init(address=address)`` joins the cluster (``auto``: the one this machine
    belongs to). :class:`RayUnavailable` in one line when Ray is missing or nothing answers."""
    try:
        import ray
    except ImportError:
        raise RayUnavailable("--ray needs Ray, an optional extra: pip install 'vtoken[ray]'") from None
    if not ray.is_initialized():
        _reachable(address)  # Ray itself retries an address that does not answer for a minute or more
        try:
            ray.init(address=address, log_to_driver=False, include_dashboard=False)
        except (ConnectionError, RuntimeError, ValueError) as e:
            msg = (str(e).strip().splitlines() or [""])[0]
            raise RayUnavailable(f"no Ray cluster at {address!r}: {type(e).__name__}: {msg}"[:400]) from None
    return ray


def _reachable(address: str | None) -> None:
    """A ``host:port`` address must accept a TCP connection within 5 s (``auto`` and ``ray://``
    addresses are Ray's to resolve). :class:`RayUnavailable` otherwise."""
    import socket

    if not address or address == "auto" or "://" in address or ":" not in address:
        return
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except (OSError, ValueError) as e:
        raise RayUnavailable(f"no Ray cluster at {address!r}: {type(e).__name__}: {e}"[:400]) from None
