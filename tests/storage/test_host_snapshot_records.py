"""The snapshot's records read across versions of the daemon: a tree node saved before the age
field (2026-11-29) reads as used at the restart, and a daemon from before it reads a new one."""

from __future__ import annotations

import msgspec

from daemon.storage.host_snapshot import KeyedRecord, TreeNodeRecord


class _RecordBeforeAge(msgspec.Struct, array_like=True):
    """TreeNodeRecord as a daemon from before 2026-11-29 wrote and read it."""

    parent: int
    ns: str
    tokens: bytes
    host: bytes
    host_swa: bytes


def test_a_node_saved_without_an_age_restores_as_used_at_the_restart() -> None:
    old = msgspec.msgpack.encode(_RecordBeforeAge(-1, "ns", b"t" * 16, b"h" * 4, b""))
    got = msgspec.msgpack.decode(old, type=TreeNodeRecord)
    assert (got.parent, got.ns, got.tokens, got.host, got.age) == (-1, "ns", b"t" * 16,
                                                                    b"h" * 4, 0)


def test_an_older_daemon_reads_a_node_with_an_age() -> None:
    new = msgspec.msgpack.encode(TreeNodeRecord(3, "ns", b"t" * 16, b"h" * 4, b"", age=640))
    got = msgspec.msgpack.decode(new, type=_RecordBeforeAge)
    assert (got.parent, got.tokens, got.host) == (3, b"t" * 16, b"h" * 4)


class _KeyedRecordBeforeGen(msgspec.Struct, array_like=True):
    """KeyedRecord as a daemon from before its ``gen`` field wrote and read it."""

    ns: str
    kind: str
    key: bytes
    slot: int
    in_l3: bool = True
    age: int = 0


def test_a_keyed_page_saved_without_a_generation_restores_with_none_known() -> None:
    old = msgspec.msgpack.encode(_KeyedRecordBeforeGen("ns", "full", b"k", 7, False, 12))
    got = msgspec.msgpack.decode(old, type=KeyedRecord)
    assert (got.ns, got.kind, got.key, got.slot, got.in_l3, got.age, got.gen) == (
        "ns", "full", b"k", 7, False, 12, -1)


def test_an_older_daemon_reads_a_keyed_page_with_a_generation() -> None:
    new = msgspec.msgpack.encode(KeyedRecord("ns", "swa", b"k", 9, True, 3, gen=5))
    got = msgspec.msgpack.decode(new, type=_KeyedRecordBeforeGen)
    assert (got.kind, got.slot, got.in_l3, got.age) == ("swa", 9, True, 3)
