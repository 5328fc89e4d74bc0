"""Suite-wide pytest configuration.

Tests marked ``gpu`` need CUDA. On a machine without it they are *deselected* (not skipped), so
the summary shows how many were left out rather than a wall of skips, and a CPU-only CI run does
not count them as passing. Tests marked ``cpu_only`` check behaviour without CUDA and are
deselected the same way on a machine that has it.

Tests marked ``browser`` (headless Chromium) and ``systemd_tools`` (systemd-analyze and friends)
need a Debian package that ``./scripts/test.sh`` installs. Where it is missing they *fail* at
setup with a message naming the package and the way to deselect them; they are not skipped. A
skip would let a run that never rendered the status page or verified the unit files look green;
leaving them out is a choice made on the command line (``-m "not browser"``), where it shows.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator

import pytest

#: marker -> (the executables its tests run, the Debian package that has them, why)
TOOL_MARKERS: dict[str, tuple[tuple[str, ...], str, str]] = {
    "browser": (("/usr/bin/chromium",), "chromium",
                "renders the admin status page in headless Chromium"),
    "systemd_tools": (("systemd-analyze", "systemd-socket-activate", "systemd-sysusers",
                       "systemd-tmpfiles"), "systemd",
                      "verifies the unit files and drives socket activation with systemd's tools"),
}


def pytest_configure(config: pytest.Config) -> None:
    # Also declared in pyproject.toml; registering here keeps the marker known when pytest is
    # run with another config file (or none).
    config.addinivalue_line("markers", "gpu: needs CUDA")
    config.addinivalue_line("markers", "cpu_only: checks behaviour on a machine without CUDA")
    config.addinivalue_line("markers", "browser: needs headless Chromium (/usr/bin/chromium); "
                                       "fails where it is missing")
    config.addinivalue_line("markers", "systemd_tools: needs systemd-analyze, "
                                       "systemd-socket-activate, systemd-sysusers, "
                                       "systemd-tmpfiles; fails where one is missing")


def missing_tools(tools: tuple[str, ...]) -> list[str]:
    """The executables of ``tools`` (absolute paths or names on PATH) that cannot be run."""
    return [t for t in tools
            if not (os.access(t, os.X_OK) if os.path.isabs(t) else shutil.which(t))]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Fail a test whose tool is missing before its fixtures start daemons, saying how to get the
    tool or leave the test out (see the module docstring for why it fails rather than skips)."""
    for marker, (tools, package, why) in TOOL_MARKERS.items():
        if item.get_closest_marker(marker) is None:
            continue
        missing = missing_tools(tools)
        if missing:
            pytest.fail(
                f"{', '.join(missing)} not found: this test {why}. Install it with `sudo apt-get "
                f"install --no-install-recommends {package}` (./scripts/test.sh does, unless "
                f"RADIXD_NO_APT=1), or deselect these tests with -m \"not {marker}\".",
                pytrace=False)


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    cpu_items = [item for item in items if item.get_closest_marker("cpu_only") is not None]
    # Only import torch (slow) when some collected test actually needs the answer.
    if not gpu_items and not cpu_items:
        return
    drop = cpu_items if _cuda_available() else gpu_items
    if not drop:
        return
    deselected = set(map(id, drop))
    config.hook.pytest_deselected(items=drop)
    items[:] = [item for item in items if id(item) not in deselected]


@pytest.fixture
def prefix() -> Iterator[str]:
    """A key prefix of this test's own on the shared Redis (tests/redis_procs.py), its keys
    removed afterwards."""
    import redis as redis_sync  # not every venv that runs a conftest here has it

    from tests.redis_procs import SHARED_URL

    p = f"radixd-test-{uuid.uuid4().hex[:12]}"
    yield p
    raw = redis_sync.Redis.from_url(SHARED_URL)
    try:
        keys = list(raw.scan_iter(match=p + ":*", count=1000))
        if keys:
            raw.delete(*keys)
    finally:
        raw.close()
