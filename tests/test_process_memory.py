"""daemon.process_memory against the real C library, in a child process (trimming the test
runner's own heap would tell nothing about the daemon's, and its figures move with other tests)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

_CHILD = textwrap.dedent("""
    import json
    from daemon.process_memory import heap_stats, rss_bytes, trim

    base = heap_stats()
    # many small objects freed in an order that leaves holes below the top of the heap: glibc
    # keeps such memory unless it is trimmed
    blocks = [bytearray(4000) for _ in range(40_000)]
    for b in blocks:
        b[::512] = b"x" * len(b[::512])  # touch every page
    keep = blocks[::50]
    del blocks
    held = heap_stats()
    rss_held = rss_bytes()
    released = trim()
    after = heap_stats()
    print(json.dumps({"base_in_use": base.in_use, "held_free": held.free_held,
                      "held_in_use": held.in_use, "after_in_use": after.in_use,
                      "rss_held": rss_held, "rss_after": rss_bytes(), "released": released,
                      "kept": len(keep)}))
""")


def test_trim_gives_freed_heap_back_to_the_kernel() -> None:
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                         check=True, timeout=120)
    r = json.loads(out.stdout)
    assert r["held_free"] > 100 * 2**20  # ~150 MB freed, kept by glibc
    assert r["released"] is True
    # trimming frees nothing in use (the interpreter's own calls in between may move a few
    # hundred bytes either way; what was freed is a thousand times more)
    assert abs(r["after_in_use"] - r["held_in_use"]) < 2**17
    assert r["rss_held"] - r["rss_after"] > 100 * 2**20  # ...but gives the free pages back
