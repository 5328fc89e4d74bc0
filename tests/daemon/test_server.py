"""The socket server (daemon/server.py) against a real daemon: frames it cannot decode are
answered and the session survives; a held attach applies backpressure."""

from __future__ import annotations

import contextlib
import time

import msgspec
import pytest
from radixd_client import protocol

from .conftest import Raw

MODEL = "m"


@pytest.mark.parametrize("op", [[1, 2], {"x": 1}])
def test_unhashable_op_gets_an_error_and_the_session_survives(daemon, op) -> None:
    """server.py:176 (_bad_frame): `op not in P.OPS` raises TypeError for an unhashable op (a
    list or a map): the exception escapes data_received, asyncio drops the connection (and the
    session with everything it held) instead of answering bad_frame/unknown_op."""
    c = Raw(daemon.socket)
    c.send(msgspec.msgpack.encode({"id": 7, "op": op}))
    resp = c.recv()  # actual: ConnectionError("closed")
    assert not resp.ok and resp.error.code in ("bad_frame", "unknown_op")
    assert c.call(protocol.Ping(id=8, payload=b"x")).ok
    c.close()



def test_deeply_nested_body_gets_an_error_and_the_session_survives(daemon) -> None:
    """server.py:128-131: _handle catches only msgspec.DecodeError/ValidationError around
    decode_request, but msgspec raises RecursionError for a deeply nested value (here inside an
    unknown field of a ping, which msgspec would otherwise skip). It escapes data_received and
    asyncio drops the connection and the session (every lock and page it held) instead of
    answering bad_frame (docs/design.md section 7: 'the session survives unless the framing
    itself is broken')."""
    c = Raw(daemon.socket)
    body = b"\x83\xa2op\xa4ping\xa2id\x09\xa1x" + b"\x91" * 200_000 + b"\xc0"
    c.send(body)
    resp = c.recv()  # actual: ConnectionError("closed")
    assert not resp.ok and resp.error.code == "bad_frame"
    assert c.call(protocol.Ping(id=10, payload=b"y")).ok
    c.close()


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_attach_hold_has_no_read_backpressure(daemon) -> None:
    """While an attach waits for the transport's write buffer to drain (`holding`),
    data_received keeps appending to the connection's frame buffer and _process returns; reading
    is paused only above the write high-water mark (max_inflight * 64 KiB = 16 MiB). A client that
    leaves one big response unread (below the mark), sends attach and then streams requests makes
    the daemon buffer all of them: unbounded memory (and `_send_with_fds` polls every 1 ms
    forever). Expected: reading stops (backpressure) while frames are held."""
    c = Raw(daemon.socket)
    # one unread response of 4 MiB: the kernel takes a few hundred KiB, the transport keeps the
    # rest, below the 16 MiB high-water mark, so reading is not paused
    c.send(protocol.encode_body(protocol.Ping(id=1, payload=b"\0" * (4 << 20))))
    time.sleep(0.3)
    c.send(protocol.encode_body(protocol.Attach(id=2, model=MODEL)))
    time.sleep(0.3)
    before = _rss_kib(daemon.proc.pid)
    frame = protocol.encode(protocol.Ping(id=3, payload=b"\1" * (1 << 20)))
    c.s.settimeout(5)
    sent = 0
    with contextlib.suppress(TimeoutError):  # the send stalling is the backpressure expected
        for _ in range(256):  # 256 MiB of requests
            c.s.sendall(frame)
            sent += len(frame)
    time.sleep(0.5)
    grown_mib = (_rss_kib(daemon.proc.pid) - before) / 1024
    c.close()
    assert sent < 64 << 20 and grown_mib < 64, (
        f"the daemon read {sent >> 20} MiB it cannot process yet; its RSS grew {grown_mib:.0f} MiB")


@pytest.mark.parametrize("preset", [None, "ACTIVE"])
def test_served_openmp_workers_sleep_after_a_region_unless_the_operator_chose(
        tmp_path, monkeypatch, preset) -> None:
    """`radixd serve` has torch's OpenMP workers sleep as soon as a parallel region ends (a spin
    count of 0; libgomp's default is 300,000, about 3 ms per worker after every small copy):
    OpenMP reports what it read when torch loaded it (OMP_DISPLAY_ENV). An operator's own
    OMP_WAIT_POLICY is kept."""
    import re

    from .conftest import Daemon

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    env = {"OMP_DISPLAY_ENV": "VERBOSE"}
    if preset is not None:
        env["OMP_WAIT_POLICY"] = preset
    d = Daemon(tmp_path, {}, env=env)
    try:
        d.check()
    finally:
        code = d.stop()
    log = d.log()
    assert code == 0, log[-3000:]
    spin = re.search(r"GOMP_SPINCOUNT = '(\d+)'", log)
    assert spin is not None, log[-3000:]
    assert (int(spin.group(1)) == 0) == (preset is None), spin.group(0)


def test_a_socket_directory_others_may_write_is_warned_of(make_daemon, tmp_path) -> None:
    """Whoever may write the directory that holds the engines' socket (or the admin one), or
    one above it, could rename the socket and bind their own, then read the tokens clients
    send: served, as the operator chose, but with a warning naming the directory. A directory
    only its owner writes, or a sticky one, gets none."""
    shared, private = tmp_path / "shared", tmp_path / "private"
    for d, mode in ((shared, 0o2770), (private, 0o750)):
        d.mkdir()
        d.chmod(mode)
    loud = make_daemon({"server": {"socket": str(shared / "radixd.sock")},
                        "admin": {"unix_socket": str(shared / "admin.sock")}}, name="loud")
    quiet = make_daemon({"server": {"socket": str(private / "radixd.sock")},
                         "admin": {"unix_socket": str(private / "admin.sock")}}, name="quiet")
    text = loud.log()
    for key, name in (("server.socket", "radixd.sock"), ("admin.unix_socket", "admin.sock")):
        assert (f"{key}: {shared / name}: {shared} is writable by its group (mode 2770) and not "
                "sticky") in text, text
    assert "is writable by" not in quiet.log()
