"""The state directory's lock (``host_snapshot.lock_state_dir``): one daemon per directory. The
refusal of a second real daemon is in tests/daemon/test_warm_restart.py; these are the errors a
daemon cannot be made to meet on demand."""

from __future__ import annotations

import errno
import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

from daemon.storage import host_snapshot
from daemon.storage.host_snapshot import LOCK_FILE, lock_state_dir

HOLD = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, sys.argv[2].encode())
print("held", flush=True)
sys.stdin.read()
"""


def test_a_lock_another_process_holds_names_it(tmp_path: Path) -> None:
    for written, named in (("4242\n", "pid 4242"), ("", "pid unknown")):
        holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / LOCK_FILE),
                                   written], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True)
        try:
            assert holder.stdout is not None and holder.stdout.readline() == "held\n"
            assert lock_state_dir(str(tmp_path)) == (
                f"{str(tmp_path)!r} is in use by another radixd ({named}); give each daemon a "
                "state_dir of its own")
        finally:
            holder.communicate("")
        (tmp_path / LOCK_FILE).unlink()


def test_held_once_per_process_and_the_pid_written(tmp_path: Path) -> None:
    path = str(tmp_path)
    assert lock_state_dir(path) == ""
    assert lock_state_dir(path) == ""  # (this process holds it already)
    assert (tmp_path / LOCK_FILE).read_text() == f"{os.getpid()}\n"
    fd = os.open(tmp_path / LOCK_FILE, os.O_RDWR)
    try:  # held: another open file description cannot take it
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)


def test_a_lock_file_that_cannot_be_opened_is_named(tmp_path: Path) -> None:
    (tmp_path / LOCK_FILE).mkdir()
    got = lock_state_dir(str(tmp_path))
    assert got.startswith(f"cannot open {str(tmp_path / LOCK_FILE)!r}: "), got


def test_a_lock_that_fails_otherwise_is_named(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """flock's other errors (ENOLCK on some network file systems): a message naming the file,
    which the daemon prints with the key (exit 2), not a bare OSError (exit 1, restarted)."""
    def no_locks(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
    monkeypatch.setattr(host_snapshot.fcntl, "flock", no_locks)
    assert lock_state_dir(str(tmp_path)) == (
        f"cannot lock {str(tmp_path / LOCK_FILE)!r}: {os.strerror(errno.ENOLCK)}")
