"""The on-disk (tmpfs) form of the host tier across a restart: an index and one page file per pool.

A graceful stop writes, into ``[server] state_dir``:

* ``host-<n>-<kind>.pages`` for every host pool that holds pages: the held pages, concatenated
  in the order the index lists their slots (only held slots, so the file is as large as what the
  tier held, not its capacity);
* ``host-index.bin``, written last and atomically (a temporary name, then ``rename``): the magic
  ``b"RXHS"``, the index format version (u32), a CRC-32 of the body (u32), and the body, one
  msgpack map (:class:`HostSnapshot`).

The body is extensible: ``sections`` maps a section name to its version, and a reader drops (with
a log line) a section whose version it does not know, rather than the whole snapshot. Sections of
version 1: ``tree`` (the host copies of the prefix tree, as nodes listed parent first) and
``keyed`` (the key-addressed store's stored pages). Per model the body records its layout
fingerprint and per pool the page size in bytes, the slots and a CRC-32 of each page's bytes
(:func:`zlib.crc32`, the checksum of :mod:`daemon.storage.codec`, for the same reasons: any
corruption up to 32 bits is caught, the rest with probability 2**-32).

Why written at stop rather than a pool mapped from tmpfs: the host pools are sealed memfds that
engines map (``kv_attach``); a regular tmpfs file cannot be sealed, and an engine truncating it
would crash the daemon with SIGBUS. The price is one copy of the held pages at stop and one at
start (memory bandwidth; see bench/restart_bench.py). The systemd fd store, where it is used
(``daemon/warm_restart.py``), writes no page: the pools' memfds themselves survive in systemd,
the same index (with ``file`` naming the stored fd) goes in a memfd of its own, and
:func:`memfd_pool` reads the pages in place from the old pool at start.

A snapshot is consumed when read (:func:`take_snapshot` removes the index first), so a daemon
that crashes later never restores pages it has since overwritten.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import pathlib
import stat
import struct
import zlib
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

log = logging.getLogger("radixd.warm_restart")

MAGIC = b"RXHS"
#: Version of the index container (the header and the body's top-level fields).
INDEX_VERSION = 1
#: Section versions this daemon writes and reads.
SECTIONS = {"tree": 1, "keyed": 1, "l3_ledger": 1}
INDEX_NAME = "host-index.bin"
_HEAD = struct.Struct("<4sII")
#: Names of the fds a stop puts in systemd's fd store start with this; any other fd passed at
#: start is a listening socket (systemd names those after the socket unit, or
#: ``FileDescriptorName=``): see daemon/sdnotify.py and daemon/warm_restart.py.
FDSTORE_PREFIX = "radixd-"


class SnapshotError(ValueError):
    """The index cannot be used at all (missing pieces are not errors: they restore nothing)."""


class PoolImage(msgspec.Struct, array_like=True):
    """One host pool's held pages: ``slots[i]``'s bytes are page ``i`` of ``file``. In the fd
    store a segmented pool (memory isolation) is one stored memfd per segment holding saved
    pages, named ``file`` + ``-seg<n>``, slot ``s`` at ``s - n * segment_pages`` in segment
    ``n = s // segment_pages``; ``segment_pages`` 0: ``file`` is the whole pool."""

    file: str
    page_nbytes: int
    slots: bytes  # array('i')
    crcs: bytes  # array('I'), one CRC-32 per page
    segment_pages: int = 0


class TreeNodeRecord(msgspec.Struct, array_like=True):
    """A node with a host copy. ``parent``: index of its parent in the list, -1 for the root of
    namespace ``ns``; ``host``/``host_swa``: array('i') of its host slots (``host_swa`` empty
    when it has no SWA copies, 0 entries where a page has none); ``age``: the tree's churn (tokens
    of KV inserted) since the node's last use, so that a restart keeps the eviction order (a
    snapshot written before 2026-11-29 has none: its nodes restore as used at the restart)."""

    parent: int
    ns: str
    tokens: bytes
    host: bytes
    host_swa: bytes
    age: int = 0


class KeyedRecord(msgspec.Struct, array_like=True):
    ns: str
    kind: str
    key: bytes
    slot: int
    # whether Redis has the page (under write-back an eviction must write one that it has not);
    # absent in snapshots of versions before it: taken as written, as those were restored
    in_l3: bool = True
    # the churn since its last commit or hit, as TreeNodeRecord.age (the list runs least
    # recently used first per pool kind, from 2026-11-29)
    age: int = 0
    # the namespace's kv_clear generation known when it was stored (KeyedPage.gen), -1 for
    # none; absent before 2026-11-29: none
    gen: int = -1


class L3LedgerRecord(msgspec.Struct, array_like=True):
    """A value this daemon wrote to Redis, counted against its namespace's ``quota_l3_bytes``
    (oldest first in the list: daemon.storage.l3_ledger)."""

    ns: str
    page_id: bytes
    pool: str
    nbytes: int


class ModelImage(msgspec.Struct):
    fingerprint: bytes
    pools: dict[str, PoolImage] = {}
    tree: list[TreeNodeRecord] = []
    keyed: list[KeyedRecord] = []
    l3_ledger: list[L3LedgerRecord] = []
    #: the keyed pages' kv_clear generations known per namespace, and the namespaces whose
    #: clear had not reached Redis yet (daemon/storage/keyed_names.py)
    kv_gens: dict[str, int] = {}
    kv_clearing: list[str] = []


class HostSnapshot(msgspec.Struct):
    sections: dict[str, int]
    models: dict[str, ModelImage]


@dataclass
class PageSource:
    """Verified access to one pool's saved pages: ``page(slot)`` is the bytes saved for ``slot``
    when they match their checksum, else None (never served)."""

    page_nbytes: int
    offsets: dict[int, int] = field(default_factory=dict)  # slot -> index in the file
    crcs: array = field(default_factory=lambda: array("I"))
    data: memoryview | None = None
    #: the data is the whole old pool (a memfd from the fd store): page ``slot`` is at
    #: ``slot * page_nbytes``, not at its index in the file
    in_place: bool = False
    #: a segmented old pool from the fd store: segment -> its memfd's bytes (``data`` unused)
    segment_pages: int = 0
    segments: dict[int, memoryview] = field(default_factory=dict)

    def page(self, slot: int) -> bytes | memoryview | None:
        """The saved page of old ``slot`` if it passes its checksum, else None. A page of an
        old pool's memfd is copied before it is checked: an engine that still maps the old pool
        may write it, and the bytes checked must be the bytes stored."""
        i = self.offsets.get(slot)
        data, at = self.data, (slot if self.in_place else i)
        if self.segment_pages and i is not None:
            data = self.segments.get(slot // self.segment_pages)
            at = slot % self.segment_pages
        if i is None or data is None:
            return None
        start = at * self.page_nbytes
        chunk = data[start : start + self.page_nbytes]
        if self.in_place or self.segment_pages:
            chunk = bytes(chunk)
        if len(chunk) != self.page_nbytes or zlib.crc32(chunk) != self.crcs[i]:
            return None
        return chunk


def pool_file(model_index: int, kind: str) -> str:
    return f"host-{model_index}-{kind}.pages"


def check_state_dir(path: str, create: bool = True) -> str:
    """Create ``path`` if missing and prove it is a writable directory; returns the error text
    (empty when usable), for start-up to report with the key's name. ``create=False`` (the
    config check, which may run as another user than the daemon's, while it serves) makes and
    tries nothing: an absolute path, and a directory if it exists."""
    if not os.path.isabs(path):
        return f"{path!r} is not an absolute path"
    if not create:
        return f"{path!r} is not a directory" if os.path.lexists(path) and \
            not os.path.isdir(path) else ""
    try:
        _make_private(path)
    except OSError as exc:
        return f"cannot create {path!r}: {exc.strerror}"
    if not os.path.isdir(path):
        return f"{path!r} is not a directory"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"{path!r} is not writable by uid {os.getuid()}"
    return _others_could_write(path)


def _make_private(path: str) -> None:
    """Make ``path`` and the missing directories above it, each mode 0700 (makedirs gives
    those above the umask's mode: 0770 under the shipped unit's UMask=0007, which would let the
    engines' group rename the state directory)."""
    missing = []
    while not os.path.lexists(path):
        missing.append(path)
        path = os.path.dirname(path)
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(d, 0o700)


def _others_could_write(path: str) -> str:
    """Why another user could read or change what ``path`` holds (empty: none could). A stop
    writes every tenant's host-tier KV there, and a start serves what it finds there as cached
    KV, so it must be open to this user only, and no one else may be able to rename it, a
    directory on its way or a link on its way: every directory and link the lookup of ``path``
    passes through (links followed one at a time) must be this user's or root's, and none of
    those directories writable by group or others unless sticky (as /tmp)."""
    try:
        walked, real = _lookup_walk(path)
    except OSError as exc:
        return f"{path!r}: {exc.strerror or exc}"
    me = (0, os.geteuid())
    for d in walked:
        st = os.lstat(d)
        if st.st_uid not in me:
            return (f"{path!r}: {d} belongs to uid {st.st_uid}, not to this user "
                    f"({os.geteuid()}): its owner could replace what this daemon restores and "
                    "serves as cached KV; give a directory of this user's")
        if d == real and st.st_mode & 0o077:
            return (f"{path!r}: {d} is open to its group or others (mode "
                    f"{st.st_mode & 0o7777:04o}): a stop writes every tenant's KV there and a "
                    "start serves what it finds there; chmod 700 it")
        if stat.S_ISDIR(st.st_mode) and st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            return (f"{path!r}: {d} is writable by its group or others (mode "
                    f"{st.st_mode & 0o7777:04o}): they could rename what it holds on the way to "
                    "the state directory; chmod go-w it, or give a directory elsewhere")
    return ""


def _lookup_walk(path: str) -> tuple[list[str], str]:
    """Every directory and symbolic link the kernel passes through to look ``path`` up (links
    followed one at a time, as realpath does not show), and where it ends."""
    cur, todo, walked, hops = "/", list(pathlib.PurePath(path).parts[1:]), ["/"], 0
    while todo:
        part = todo.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            cur = os.path.dirname(cur)
            continue
        step = os.path.join(cur, part)
        walked.append(step)
        if not os.path.islink(step):
            cur = step
            continue
        hops += 1
        if hops > 40:
            raise OSError(errno.ELOOP, "too many levels of symbolic links")
        target = pathlib.PurePath(os.readlink(step))
        if target.is_absolute():
            cur, todo = "/", [*target.parts[1:], *todo]
        else:
            todo = [*target.parts, *todo]
    return walked, cur


#: the file a daemon holds locked (flock) in ``state_dir`` for its whole life
LOCK_FILE = "radixd.lock"
_held: dict[str, int] = {}  # state_dir -> the locked file's descriptor, kept open until exit


def lock_state_dir(path: str) -> str:
    """Hold ``path`` for this process until it exits (the kernel lets go however it ends,
    SIGKILL included); returns the error text (empty when held). Two daemons on one directory
    would delete each other's page files at their stops and restore the other's index: the
    second is refused at start instead."""
    if path in _held:
        return ""
    lock = os.path.join(path, LOCK_FILE)
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        return f"cannot open {lock!r}: {exc.strerror}"
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = ""
        with contextlib.suppress(OSError):
            holder = os.read(fd, 32).decode(errors="replace").strip()
        os.close(fd)
        if isinstance(exc, BlockingIOError):
            return (f"{path!r} is in use by another radixd (pid {holder or 'unknown'}); give "
                    "each daemon a state_dir of its own")
        return f"cannot lock {lock!r}: {exc.strerror}"
    with contextlib.suppress(OSError):  # the pid only names the holder in the message above
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held[path] = fd
    return ""


def write_pool(state_dir: str | None, name: str, pages: Iterator[tuple[int, memoryview]],
               page_nbytes: int) -> PoolImage:
    """Write the pages of one pool (slot, bytes) to ``name``; returns their index entry. With
    no ``state_dir`` (the fd store: the pool's memfd itself survives) nothing is written, only
    the slots and checksums are recorded."""
    slots, crcs = array("i"), array("I")
    with contextlib.ExitStack() as stack:
        f = stack.enter_context(_private_file(os.path.join(state_dir, name))) \
            if state_dir is not None else None
        for slot, data in pages:
            if f is not None:
                f.write(data)
            slots.append(slot)
            crcs.append(zlib.crc32(data))
    return PoolImage(name, page_nbytes, slots.tobytes(), crcs.tobytes())


def _private_file(path: str) -> Any:
    """``path`` opened to write anew, mode 0600 whatever the umask: it holds tenants' KV."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    os.fchmod(fd, 0o600)  # (a file left by an older version keeps its mode through O_TRUNC)
    return os.fdopen(fd, "wb", buffering=1 << 20)


def encode_index(snap: HostSnapshot) -> bytes:
    """The index's bytes: header (magic, version, CRC-32 of the body) and body."""
    body = msgspec.msgpack.encode(snap)
    return _HEAD.pack(MAGIC, INDEX_VERSION, zlib.crc32(body)) + body


def write_index(state_dir: str, snap: HostSnapshot) -> int:
    """Write the index atomically (it names the page files, so it goes last); returns bytes."""
    raw = encode_index(snap)
    path = os.path.join(state_dir, INDEX_NAME)
    tmp = path + ".tmp"
    with _private_file(tmp) as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(raw)


def decode_index(raw: bytes) -> HostSnapshot:
    """The index from its bytes; SnapshotError names what is wrong with it."""
    if len(raw) < _HEAD.size:
        raise SnapshotError(f"index is {len(raw)} bytes, shorter than its header")
    magic, version, crc = _HEAD.unpack_from(raw)
    if magic != MAGIC:
        raise SnapshotError(f"index magic {magic!r}, expected {MAGIC!r}")
    if version != INDEX_VERSION:
        raise SnapshotError(f"index format version {version}; this daemon reads {INDEX_VERSION}")
    body = memoryview(raw)[_HEAD.size :]
    if zlib.crc32(body) != crc:
        raise SnapshotError("index checksum mismatch")
    try:
        snap = msgspec.msgpack.decode(body, type=HostSnapshot)
    except msgspec.DecodeError as exc:
        raise SnapshotError(f"index body does not decode: {exc}") from None
    for name, ver in list(snap.sections.items()):
        if SECTIONS.get(name) != ver:
            log.warning("warm restart: dropping section %r version %s (this daemon reads %s)",
                        name, ver, SECTIONS.get(name, "none"))
            del snap.sections[name]
    return snap


def take_snapshot(state_dir: str) -> HostSnapshot | None:
    """Read and consume the index of ``state_dir``: None when there is none (a first start, or
    the last stop was not graceful). Raises SnapshotError for an index that cannot be used."""
    path = os.path.join(state_dir, INDEX_NAME)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    os.unlink(path)  # consumed: a later crash must not restore pages overwritten since
    return decode_index(raw)


def open_pool(state_dir: str, image: PoolImage) -> PageSource:
    """The saved pages of one pool (an empty source when its file is missing or short)."""
    src = PageSource(image.page_nbytes)
    slots = array("i")
    slots.frombytes(image.slots)
    src.crcs.frombytes(image.crcs)
    if len(src.crcs) != len(slots) or os.sep in image.file:
        return src
    try:
        with open(os.path.join(state_dir, image.file), "rb") as f:
            src.data = memoryview(f.read())
    except OSError as exc:
        log.warning("warm restart: cannot read %s: %s", image.file, exc)
        return src
    src.offsets = {s: i for i, s in enumerate(slots)}
    return src


def memfd_pool(fd: int | None, image: PoolImage) -> PageSource:
    """The held pages of an old pool's memfd (from the fd store), mapped read-only: no copy
    here; a page is read (and checked) only when the restore stores it. An empty source when
    the fd is missing or too small for the slots the index names."""
    src = PageSource(image.page_nbytes, in_place=True)
    slots = as_slots(image.slots)
    src.crcs.frombytes(image.crcs)
    if fd is None or len(src.crcs) != len(slots):
        return src
    try:
        size = os.fstat(fd).st_size
        if not slots or size < (max(slots) + 1) * image.page_nbytes:
            return src
        src.data = memoryview(mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ))
    except (OSError, ValueError) as exc:
        log.warning("warm restart: cannot map the stored pool %s: %s", image.file, exc)
        return src
    src.offsets = {s: i for i, s in enumerate(slots)}
    return src


def memfd_segments_pool(stored: dict[str, int], image: PoolImage) -> PageSource:
    """The held pages of a segmented old pool: each segment's memfd from the fd store (named
    ``image.file-seg<n>``), mapped read-only, no copy. A segment whose fd is missing (systemd
    kept fewer than were stored: FileDescriptorStoreMax=) or short serves none of its pages."""
    src = PageSource(image.page_nbytes, segment_pages=image.segment_pages)
    slots = as_slots(image.slots)
    src.crcs.frombytes(image.crcs)
    if len(src.crcs) != len(slots) or image.segment_pages < 1:
        return src
    sp = image.segment_pages
    for seg in sorted({s // sp for s in slots}):
        fd = stored.get(f"{image.file}-seg{seg}")
        if fd is None:
            continue
        try:
            size = os.fstat(fd).st_size
            top = max(s for s in slots if s // sp == seg) - seg * sp
            if size < (top + 1) * image.page_nbytes:
                continue
            src.segments[seg] = memoryview(mmap.mmap(fd, size, flags=mmap.MAP_SHARED,
                                                     prot=mmap.PROT_READ))
        except (OSError, ValueError) as exc:
            log.warning("warm restart: cannot map stored segment %s-seg%d: %s", image.file,
                        seg, exc)
    src.offsets = {s: i for i, s in enumerate(slots)}
    return src


def read_fd(fd: int) -> bytes:
    """The whole content of a (memfd) file descriptor, from offset 0."""
    size = os.fstat(fd).st_size
    chunks, off = [], 0
    while off < size:
        chunk = os.pread(fd, size - off, off)
        if not chunk:
            break
        chunks.append(chunk)
        off += len(chunk)
    return b"".join(chunks)


def remove_pages(state_dir: str) -> None:
    """Delete the page files (after a restore, or when a stop saves nothing)."""
    for name in os.listdir(state_dir):
        if name.startswith("host-") and (name.endswith(".pages") or name.endswith(".tmp")):
            try:
                os.unlink(os.path.join(state_dir, name))
            except OSError as exc:  # pragma: no cover - a file removed by someone else
                log.warning("warm restart: cannot remove %s: %s", name, exc)


def as_slots(raw: bytes) -> array:
    a = array("i")
    a.frombytes(raw)
    return a


def to_plain(snap: HostSnapshot) -> dict[str, Any]:
    """A JSON-able summary of a snapshot (logs and tests)."""
    return {name: {"nodes": len(m.tree), "keyed": len(m.keyed),
                   "pages": {k: len(p.slots) // 4 for k, p in m.pools.items()}}
            for name, m in snap.models.items()}
