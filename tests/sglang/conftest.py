"""SGLang's own classes against a real radixd (tests/daemon/conftest.py's Daemon, strict checker)
and the real Redis; run in .venv-sglang by scripts/test.sh (the main suite ignores this folder)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tests.harness import daemon_conftest  # noqa: E402

conf = daemon_conftest()

# One SGLang page: 4 tokens x 2 layers x 1 head x 8 x float32, K and V: 512 B.
GEOMETRY = {"layers": 2, "heads": 1, "head_dim": 8, "page_size": 4}
MODEL = {"name": "m", "page_size": 4, "sliding_window": 8, "num_full_layers": 2,
         "num_swa_layers": 2, "num_kv_heads": 1, "head_dim": 8, "dtype": "float32",
         "device": "cpu", "full_pages": 16, "swa_pages": 16, "host_pages": 64,
         "host_swa_pages": 32,
         # the backend uses the host pools only; device pages this small cannot be cut into
         # OS-page segments
         "memory_isolation": "none"}


@pytest.fixture
def make_daemon(tmp_path: Path) -> Iterator[Any]:
    daemons: list[Any] = []

    def factory(config: dict[str, Any] | None = None) -> Any:
        d = tmp_path / f"d{len(daemons)}"
        d.mkdir()
        config = dict(config or {})
        config.setdefault("models", [MODEL])
        daemon = conf.Daemon(d, config)
        daemons.append(daemon)
        return daemon

    yield factory
    conf.check_and_stop([d for d in daemons if not getattr(d, "killed", False)])


def extra(daemon: Any, **kw: Any) -> dict[str, Any]:
    """The ``--hicache-storage-backend-extra-config`` of docs/sglang.md, for this daemon."""
    return {"backend_name": "radixd", "module_path": "radixd_sglang",
            "class_name": "RadixdHiCacheStorage", "interface_v1": 1,
            "socket": daemon.socket, "model": "m", "timeout_s": 5, **kw}
