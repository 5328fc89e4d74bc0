"""Shared by test folders that start real daemons outside tests/daemon/."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def loop_factories() -> list[Any]:
    """The event loops the asyncio client is tested on: asyncio's own and uvloop."""
    import asyncio

    import pytest

    params = [pytest.param(asyncio.new_event_loop, id="asyncio")]
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a daemon dependency
        pass
    else:
        params.append(pytest.param(uvloop.new_event_loop, id="uvloop"))
    return params


def daemon_conftest() -> Any:
    """tests/daemon/conftest.py (its Daemon, fixtures and helpers) under the name pytest gives
    it, loaded once: pytest runs in importlib mode, where conftests are not importable."""
    name = "tests.daemon.conftest"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "tests/daemon/conftest.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
