"""Sessions are leases, and the pools are shared memory: both with real client processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from array import array
from pathlib import Path

import pytest
from radixd_client import Client, pages

REPO = Path(__file__).resolve().parents[2]
MODEL = "m"
P = 4  # page size of the test model (tests/daemon/conftest.py SMALL_MODEL)


def toks(*ids: int) -> bytes:
    return array("i", ids).tobytes()


def run_client(script: str, *args: str, wait: bool = True) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), str(REPO / "clients" / "python"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if wait:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        proc.stdout_text = out  # type: ignore[attr-defined]
    return proc


def usage(c: Client) -> dict[str, int]:
    return c.stats(MODEL).models[MODEL]


HOLDER = """
import sys, time
from array import array
from radixd_client import Client
c = Client(sys.argv[1], client_name="victim")
toks = array("i", range(1, 33)).tobytes()
a = c.alloc("m", 8)
c.insert("m", toks, a.full_pages, a.swa_pages)
m = c.match("m", toks, lock=True)          # a lock on the cached path
b = c.alloc("m", 5)                         # pages held, never inserted
with c.batch() as bt:                       # and a lock taken inside a batch
    h = bt.match("m", toks[:64], lock=True)
print("ready", m.receipt, h.result().receipt, flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("how", ["kill9", "sigterm", "close"])
def test_a_dead_client_leaks_nothing(daemon, how: str) -> None:
    """kill -9 of a client mid-session (and the polite ways) releases every lock and page."""
    proc = run_client(HOLDER, daemon.socket, wait=False)
    line = proc.stdout.readline()
    assert line.startswith("ready"), proc.stderr.read()
    with Client(daemon.socket) as observer:
        before = usage(observer)
        assert before["held_full_pages"] == 5 and before["held_swa_pages"] == 5
        if how == "kill9":
            os.kill(proc.pid, signal.SIGKILL)
        elif how == "sigterm":
            os.kill(proc.pid, signal.SIGTERM)
        else:
            proc.stdin and proc.stdin.close()
            os.kill(proc.pid, signal.SIGINT)
        proc.wait(10)
        deadline = time.monotonic() + 10
        while usage(observer)["held_full_pages"] and time.monotonic() < deadline:
            time.sleep(0.02)
        after = usage(observer)
        assert after["held_full_pages"] == 0 and after["held_swa_pages"] == 0
        # the cached path survives (it belongs to the tree) and is no longer locked: evictable
        freed = observer.evict(MODEL, full_pages=1000, swa_pages=1000)
        assert freed.full_pages == 8
        assert usage(observer)["tree_full_pages"] == 0
    daemon.check()


def test_kill9_in_the_middle_of_a_request_stream(daemon) -> None:
    """A client killed while it is sending requests as fast as it can: nothing leaks."""
    script = """
import sys, random
from array import array
from radixd_client import Client
c = Client(sys.argv[1])
rng = random.Random(7)
print("go", flush=True)
while True:
    t = array("i", [rng.randrange(1, 50) for _ in range(rng.randrange(4, 40))]).tobytes()
    m = c.match("m", t, lock=True)
    n = len(t) // 4 // 4 - m.prefix_len // 4
    try:
        a = c.alloc("m", n + 1)
    except Exception:
        c.unlock("m", m.receipt)
        continue
    c.cache_finished("m", t, a.full_pages, a.swa_pages, m.prefix_len, 0, m.receipt)
"""
    for delay in (0.05, 0.2, 0.5):
        proc = run_client(script, daemon.socket, wait=False)
        assert proc.stdout.readline().startswith("go"), proc.stderr.read()
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        daemon.check()
    with Client(daemon.socket) as c:
        deadline = time.monotonic() + 10
        while usage(c)["held_full_pages"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert usage(c)["held_full_pages"] == 0


WRITER = """
import sys
from array import array
from radixd_client import Client
c = Client(sys.argv[1], client_name="writer")
pools = c.attach("m")
toks = array("i", range(100, 100 + 24)).tobytes()    # 6 pages of 4 tokens
a = c.alloc("m", 6)
full = array("i"); full.frombytes(a.full_pages)
swa = array("i"); swa.frombytes(a.swa_pages)
for i, p in enumerate(full):                          # "the forward pass": write K and V
    pools.full[:, 0, p].fill_(1000.0 + i)
    pools.full[:, 1, p].fill_(-1000.0 - i)
for i, p in enumerate(swa):
    pools.swa[:, :, p].fill_(7.0 + i)
r = c.insert("m", toks, a.full_pages, a.swa_pages)
print(r.inserted_len, flush=True)
"""

READER = """
import json, sys
from array import array
from radixd_client import Client
c = Client(sys.argv[1], client_name="reader")
pools = c.attach("m")
toks = array("i", range(100, 100 + 24)).tobytes()
m = c.match("m", toks, lock=True)
full = array("i"); full.frombytes(m.full_pages)
swa = array("i"); swa.frombytes(m.swa_pages)
k = [float(pools.full[0, 0, p].flatten()[0]) for p in full]
v = [float(pools.full[0, 1, p].flatten()[-1]) for p in full]
s = [float(pools.swa[0, 0, p].flatten()[0]) for p in swa]
c.unlock("m", m.receipt)
print(json.dumps({"prefix_len": m.prefix_len, "k": k, "v": v, "swa": s}), flush=True)
"""


def test_kv_written_by_one_process_is_read_by_another(daemon) -> None:
    """Client A writes KV into its pages through the shared pools and inserts them; client B
    matches the prefix and reads the same bytes through its own mapping."""
    w = run_client(WRITER, daemon.socket)
    assert w.stdout_text.strip() == "24"
    got = json.loads(run_client(READER, daemon.socket).stdout_text)
    assert got["prefix_len"] == 24
    assert got["k"] == [1000.0 + i for i in range(6)]
    assert got["v"] == [-1000.0 - i for i in range(6)]
    assert got["swa"] == [7.0 + 4, 7.0 + 5]  # the window (8 tokens = 2 pages) of live SWA
    daemon.check()


def test_pages_helper_and_attach_in_process(daemon) -> None:
    with Client(daemon.socket) as c:
        pools = c.attach(MODEL)
        assert tuple(pools.full.shape) == (1, 2, 64, P, 1, 64)
        a = c.alloc(MODEL, 2)
        ids = pages(a.full_pages)
        assert len(ids) == 2 and 0 not in ids
        c.free(MODEL, a.full_pages, a.swa_pages)
