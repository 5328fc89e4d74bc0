"""scripts/test.sh refuses a bad RADIXD_TEST_WORKERS before it installs or runs anything."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "test.sh"


@pytest.mark.parametrize("value", ["abc", "0", "-2", "1.5"])
def test_a_bad_worker_count_is_refused_with_exit_2(value: str) -> None:
    env = {**os.environ, "RADIXD_TEST_WORKERS": value}
    run = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 2, run.stderr
    assert "RADIXD_TEST_WORKERS must be a whole number of workers" in run.stderr
    assert "[radixd-env]" not in run.stderr  # nothing was set up first
