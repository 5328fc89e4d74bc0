"""Suite-wide pytest configuration.

Tests marked ``gpu`` need CUDA. On a machine without it they are *deselected* (not skipped), so
the summary shows how many were left out rather than a wall of skips, and a CPU-only CI run does
not count them as passing. Tests marked ``cpu_only`` check behaviour without CUDA and are
deselected the same way on a machine that has it.
"""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    # Also declared in pyproject.toml; registering here keeps the marker known when pytest is
    # run with another config file (or none).
    config.addinivalue_line("markers", "gpu: needs CUDA")
    config.addinivalue_line("markers", "cpu_only: checks behaviour on a machine without CUDA")


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
