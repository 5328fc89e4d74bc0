"""Riding through a daemon restart: the reconnect policy, written once for every client.

An operator restarts radixd to upgrade it or to change its configuration; with
``server.state_dir`` or systemd's descriptor store the host tier survives, so what engines lose
is their session: its receipts, the pages it held, its node ids. A client created with
``reconnect=Reconnect()`` notices the connection end (or ``shutting_down``), connects again with
exponential backoff and jitter until the successor answers, says hello with the same token and
name, maps the pools it had attached again *into the same tensors* (so an engine's views and CUDA
graphs over a CPU pool stay valid), and then raises :class:`~radixd_client.errors.SessionRestarted`
from the call that was cut, once. Every call after it runs on the new session. Nothing is
retried behind the caller's back: what the old session held is gone, and only the caller knows
which requests to start over (:meth:`radixd_client.RequestLifecycle.restart`).

This module does no I/O; the clients sleep and connect.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from .errors import ConnectFailed, RadixdError, SessionRestarted

__all__ = ["Attempts", "Reconnect", "live_models", "restarted"]


@dataclass(frozen=True)
class Reconnect:
    """How long and how often a client tries to reach a restarted daemon.

    ``max_wait_s``: give up (``ConnectFailed``) when the daemon has not answered a hello for
    this long; a daemon restart takes a few seconds to tens of seconds (its torch import, the
    warm restart's verification). ``initial_backoff_s`` and ``max_backoff_s`` bound the delay
    between attempts, which doubles each time, with full jitter so that many engines do not
    reconnect in lockstep.
    """

    max_wait_s: float = 120.0
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 2.0

    def __post_init__(self) -> None:
        if not self.max_wait_s > 0 or not 0 < self.initial_backoff_s <= self.max_backoff_s:
            raise ValueError("Reconnect needs max_wait_s > 0 and "
                             "0 < initial_backoff_s <= max_backoff_s")

    def delays(self, rng: random.Random | None = None) -> Iterator[float]:
        """Seconds to wait before each next attempt (the first attempt is immediate); the
        caller stops when ``max_wait_s`` has passed."""
        rng = rng or random.Random()
        cap = self.initial_backoff_s
        while True:
            yield rng.uniform(cap / 2, cap)
            cap = min(self.max_backoff_s, cap * 2)

    def attempts(self, path: str, clock: Callable[[], float] = time.monotonic) -> Attempts:
        """A schedule of attempts to reach ``path``, starting now."""
        return Attempts(self, path, clock)


class Attempts:
    """The waits between attempts to connect, until the policy's time is up."""

    def __init__(self, policy: Reconnect, path: str, clock: Callable[[], float]) -> None:
        self.policy, self.path, self.clock = policy, path, clock
        self.deadline = clock() + policy.max_wait_s
        self._delays = policy.delays()

    def wait_after(self, failure: BaseException) -> float:
        """Seconds to wait before the next attempt, or ``ConnectFailed`` when there is no time
        left for one."""
        delay = next(self._delays)
        if self.clock() + delay > self.deadline:
            raise ConnectFailed(f"radixd at {self.path!r} did not come back within "
                                f"{self.policy.max_wait_s:g} s ({failure})") from failure
        return delay


def live_models(attached: dict[str, Any]) -> list[str]:
    """The models whose pools a client must map again after a restart (closed ones are
    forgotten)."""
    for model in [m for m, pools in attached.items() if pools.closed]:
        del attached[model]
    return list(attached)


def models_to_remap(attached: dict[str, Any], kv_attached: dict[str, Any],
                    old_instance: str | None, new_instance: str | None) -> list[str]:
    """After a reconnect, the models whose device pools to map again in place. Reconnected to
    the same daemon instance (a timeout, a dropped connection): none, and nothing is closed,
    since the pools mapped here are its pools. To another instance: every live model, and the
    host pools from ``kv_attach`` are closed (:func:`forget_host_pools`)."""
    if new_instance == old_instance:
        return []
    forget_host_pools(kv_attached)
    return live_models(attached)


def forget_host_pools(kv_attached: dict[str, Any]) -> None:
    """After a restart: the host pools ``kv_attach`` mapped are the old daemon's, and their
    segment generations mean nothing to the new one. They stop following segments (the caller
    maps the new daemon's with ``kv_attach``)."""
    for pools in kv_attached.values():
        pools.close()
    kv_attached.clear()


def drop_unmappable(attached: dict[str, Any], model: str, err: Exception,
                    unmapped: dict[str, str]) -> None:
    """Pools that could not be mapped again in place (another layout, GPU pools, a model the
    new daemon does not serve) are closed and forgotten: the object refuses further use
    (``PoolError``) instead of handing out tensors over the old daemon's memory, and the next
    ``attach`` of the model maps the new pools afresh. Tensors and views taken from it before
    still map the old memory: the engine rebuilds them from the new ``attach``."""
    attached.pop(model).close()
    unmapped[model] = str(err) or type(err).__name__


def restarted(cause: RadixdError, old_session: int | None, client: Any,
              unmapped: dict[str, str] | None = None) -> SessionRestarted:
    """The error for the calls a restart cut (``old_session``: None where the caller does not
    know it); ``unmapped``: the models whose pools were dropped (:func:`drop_unmappable`), also
    in ``details["attach_again"]``."""
    ended = "its session" if old_session is None else f"session {old_session}"
    msg = (f"radixd went away ({cause.code}: {cause}); {ended} ended, this client is now "
           f"session {client.session} of daemon instance {client.instance}")
    if unmapped:
        msg += ("; the pools of " + ", ".join(sorted(unmapped)) + " could not be mapped again "
                "in place and are closed: attach again and rebuild the views ("
                + "; ".join(f"{m}: {why}" for m, why in sorted(unmapped.items())) + ")")
    return SessionRestarted(msg, details={"attach_again": dict(unmapped or {})})
