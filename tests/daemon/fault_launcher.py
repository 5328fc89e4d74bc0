"""Runs radixd with one fault a real part cannot produce, planted on demand (tests only).

Used as a ``launcher`` of tests/daemon/conftest.py's ``Daemon``: its argv is
``fault_launcher.py PYTHON -m daemon.cli serve --config PATH``. SIGUSR2 adds one lock to a cached
leaf of model ``m`` that no receipt accounts for (what a lost unlock would leave): only the full
check sees it (the counter check and the checker's state version do not move). With
``FAULT_KIND=pin`` in its environment, SIGUSR2 instead pins that leaf for a tier job that never
ends (what a fetch or copy that skipped its cleanup would leave): only the stop's check at rest
sees it. ``FAULT_MODEL`` names the model SIGUSR2 plants in (default ``m``). ``FAULT_STOP``
breaks the stop itself: ``drain`` makes the tiers' drain raise after it planted such a pin (a job
the failed drain left running), ``drain_of_m`` does so for model ``m``'s drain alone (the other
models drain), ``check`` makes the check at rest raise, ``save`` the save of the host state for a
warm restart. ``FAULT_LOAD=hang`` makes a ``load`` of
model ``m`` pin that leaf and then never end (a copy that hangs). ``FAULT_COPY=slow`` makes every
copy of the tiers' ``run_plans`` start ``FAULT_COPY_DELAY_S`` seconds (default 1) late (a slow
device link: requests overtake the background copy they started; a copy small enough to run on
the loop, or one inside an eviction, sleeps on the loop); ``FAULT_COPY=fail`` makes it raise
after that delay (a device error).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from daemon import checker, cli, service, tiers  # noqa: E402

_targets: list = []
_init = checker.Checker.__init__


def _capture(self: checker.Checker, target: checker.Checkable, config: object) -> None:
    _targets.append(target)
    _init(self, target, config)  # type: ignore[arg-type]


def _plant(*_: object, model: str | None = None) -> None:
    tree = _targets[0].models[model or os.environ.get("FAULT_MODEL", "m")].cache.tree
    leaf = next(n for n in tree.iter_nodes() if n.parent is not None and not n.children)
    if os.environ.get("FAULT_KIND") == "pin":
        tree.pin(leaf)
        print(f"fault planted: node {leaf.id} pinned by no job", flush=True)
        return
    leaf.full_lock += 1
    print(f"fault planted: node {leaf.id} locked without a receipt", flush=True)


async def _failed_drain(self: service.Service, deadline: float) -> None:
    _plant()
    raise RuntimeError("fault planted: the drain failed")


_drain = tiers.TierManager.drain


async def _failed_drain_of_m(self: tiers.TierManager, deadline: float,
                             back_up_device: bool = False) -> int:
    if self is _targets[0].models["m"].tiers:
        _plant(model="m")
        raise RuntimeError("fault planted: the drain of model m failed")
    return await _drain(self, deadline, back_up_device)


_load = tiers.TierManager.load


async def _hung_load_of_m(self: tiers.TierManager, *args: object, **kw: object) -> object:
    if self is _targets[0].models["m"].tiers:
        _plant(model="m")
        print("fault planted: a load of model m that never ends", flush=True)
        await asyncio.Event().wait()
    return await _load(self, *args, **kw)  # type: ignore[arg-type]


_run_plans = tiers.run_plans


def _slow_run_plans(*args: object) -> object:
    time.sleep(float(os.environ.get("FAULT_COPY_DELAY_S", "1")))
    if os.environ.get("FAULT_COPY") == "fail":
        raise RuntimeError("fault planted: the copy failed")
    return _run_plans(*args)


def _failed_save(*_: object) -> None:
    raise OSError("fault planted: the save failed")


def _failed_check(self: service.Service, busy: object = ()) -> list[str]:
    raise RuntimeError("fault planted: the check at rest failed")


if __name__ == "__main__":
    checker.Checker.__init__ = _capture  # type: ignore[method-assign]
    stop_fault = os.environ.get("FAULT_STOP")
    if stop_fault == "drain":
        service.Service.stop_tiers = _failed_drain  # type: ignore[method-assign,assignment]
    elif stop_fault == "drain_of_m":
        tiers.TierManager.drain = _failed_drain_of_m  # type: ignore[method-assign]
    elif stop_fault == "save":
        service.save_host_state = _failed_save  # type: ignore[assignment]
    elif stop_fault == "check":
        service.Service.check_at_rest = _failed_check  # type: ignore[method-assign]
    if os.environ.get("FAULT_COPY") in ("slow", "fail"):
        tiers.run_plans = _slow_run_plans  # type: ignore[assignment]
    if os.environ.get("FAULT_LOAD") == "hang":
        tiers.TierManager.load = _hung_load_of_m  # type: ignore[method-assign]
    signal.signal(signal.SIGUSR2, _plant)
    sys.exit(cli.main(sys.argv[sys.argv.index("daemon.cli") + 1:]))
