"""``radixd bench soak`` for 90 seconds: clients, Redis and the daemon itself killed or restarted
under load, every hit verified, and nothing mismatched, violated or leaked at the end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from radixd_bench.soak_worker import PageVerifier, expected_values

REPO = Path(__file__).resolve().parents[2]


def test_the_page_check_catches_one_wrong_value() -> None:
    """The soak's verdict is only as good as its comparison: one value off in one page of a
    pool is one mismatched page."""
    P, tokens = 4, [5, 9, 2, 7, 1, 3, 8, 6]

    class Pools:
        t = torch.zeros(2, 2, 4, P, 1, 8)

        def pool(self, kind: str) -> torch.Tensor:
            return self.t

    pages = PageVerifier(Pools(), P)
    table = [2, 3]
    pages.write("full", table, tokens, 0, 8)
    assert Pools.t[0, 1, 3, 1, 0, 5].item() == expected_values(tokens, 0, 8)[5]
    assert pages.verify("full", table, tokens, 0, 8) == (2, 0)
    Pools.t[1, 0, 3, 2, 0, 7] += 1
    assert pages.verify("full", table, tokens, 0, 8) == (2, 1)
    Pools.t[1, 0, 3, 2, 0, 7] -= 1
    # another last token: the values of its page (not of the page before) change
    assert pages.verify("full", table, [*tokens[:7], 4], 0, 8) == (2, 1)


@pytest.mark.soak
def test_a_90_second_soak_has_no_mismatch_violation_or_leak(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, "-m", "daemon.cli", "bench", "soak", "--duration", "90",
         "--kill-every", "15", "--redis-kill-every", "30", "--restart-at", "45",
         "--workdir", str(tmp_path / "work"), "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=400)
    assert out.exists(), proc.stdout + proc.stderr
    r = json.loads(out.read_text())
    summary = proc.stdout + proc.stderr
    assert r["mismatches"] == 0, summary
    assert r["violations"] == [], summary
    assert r["leaked_pages"] == 0, summary
    assert proc.returncode == 0, summary
    assert r["verified_pages"] > 100, summary  # hits happened and were read back
    assert r["client_kills"] >= 4 and r["redis_kills"] >= 2 and r["daemon_restarts"] == 1
    assert r["restart"]["old_exit_code"] == 0, summary
    assert r["restart"]["host_pages_kept"] > 0, summary  # the warm restart kept the host tier
    assert r["requests"] > 100, summary
