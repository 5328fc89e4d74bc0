"""Fixtures for the example engine's tests: the model, its daemon config, real daemons, Redis.

``make_daemon`` is tests/daemon/conftest.py's fixture (a real ``radixd serve`` on a real Unix
socket, strict invariant checker, a clean full check and exit at teardown), loaded the way
tests/ops/conftest.py loads it.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.harness import daemon_conftest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # `examples` is not installed; pytest runs in importlib mode
    sys.path.insert(0, str(REPO))

from examples.hf_engine import build_model, daemon_model_config, tiny_config  # noqa: E402

MODEL_NAME = "hf-tiny"
REDIS_URL = "redis://127.0.0.1:6379/0"




_dc = daemon_conftest()
make_daemon = _dc.make_daemon  # the fixture itself, re-exported for this folder


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    """The model is tiny: intra-op threads only spin against the daemon process on a small
    machine (a decode step was 20 times slower with 2 threads under load). Restored after the
    module, so other folders' tests keep torch's default."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def hf_config() -> Any:
    return tiny_config()


@pytest.fixture(scope="session")
def hf_model(hf_config: Any) -> Any:
    """The model every engine and the reference use: seed 0, as the CLI builds it."""
    return build_model(hf_config, seed=0)


@pytest.fixture
def daemon_config(hf_config: Any) -> dict[str, Any]:
    """A daemon config with the example model, its host (L2) tier on, write-through."""
    model = daemon_model_config(hf_config, name=MODEL_NAME, page_size=4, full_pages=512,
                                swa_pages=256, host_pages=1024, host_swa_pages=512,
                                write_policy="write_through")
    return {"models": [model]}


@pytest.fixture
def l3_section() -> Iterator[dict[str, Any]]:
    """The daemon's ``[l3]`` section: the local Redis, with a key prefix of this test's own
    (its keys are deleted afterwards, and expire anyway)."""
    prefix = f"radixd-test-hf-{uuid.uuid4().hex[:12]}"
    yield {"url": REDIS_URL, "key_prefix": prefix, "ttl_s": 600}
    import redis

    r = redis.Redis.from_url(REDIS_URL)
    try:
        keys = list(r.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            r.delete(*keys)
    finally:
        r.close()
