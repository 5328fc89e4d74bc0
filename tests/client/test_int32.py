"""Token and page arguments: every accepted input type becomes the same int32 LE bytes."""

from __future__ import annotations

import struct
from array import array
from typing import Any

import pytest
from radixd_client import pages
from radixd_client.protocol import int32_bytes, int32_list

np = pytest.importorskip("numpy")

VALUES = [0, 1, -1, 17, 2**31 - 1, -(2**31), 123456]
EXPECTED = struct.pack(f"<{len(VALUES)}i", *VALUES)


def _numpy_inputs() -> list[Any]:
    a64 = np.array(VALUES, dtype=np.int64)
    wide = np.zeros(2 * len(VALUES), dtype=np.int32)
    wide[::2] = VALUES
    return [
        pytest.param(np.array(VALUES, dtype=np.int32), id="numpy-int32"),
        pytest.param(a64, id="numpy-int64"),
        pytest.param(np.array(VALUES, dtype=">i4"), id="numpy-big-endian-int32"),
        pytest.param(wide[::2], id="numpy-int32-strided"),
    ]


INPUTS = [
    pytest.param(EXPECTED, id="bytes"),
    pytest.param(bytearray(EXPECTED), id="bytearray"),
    pytest.param(memoryview(EXPECTED), id="memoryview-bytes"),
    pytest.param(memoryview(array("i", VALUES)), id="memoryview-array-i"),
    pytest.param(array("i", VALUES), id="array-i"),
    pytest.param(array("l", VALUES), id="array-l"),
    pytest.param(array("q", VALUES), id="array-q"),
    pytest.param(list(VALUES), id="list"),
    pytest.param(tuple(VALUES), id="tuple"),
    pytest.param(iter(VALUES), id="iterator"),
    *_numpy_inputs(),
]


@pytest.mark.parametrize("values", INPUTS)
def test_accepted_inputs(values: Any) -> None:
    out = int32_bytes(values)
    assert type(out) is bytes
    assert out == EXPECTED
    assert pages(out).tolist() == VALUES
    assert int32_list(out) == VALUES


def test_small_ints_and_ranges() -> None:
    assert int32_bytes(range(4)) == struct.pack("<4i", 0, 1, 2, 3)
    assert int32_bytes(np.array([1, 2], dtype=np.uint16)) == struct.pack("<2i", 1, 2)
    assert int32_bytes(array("h", [-3, 3])) == struct.pack("<2i", -3, 3)
    assert int32_bytes([np.int64(5), np.int32(6)]) == struct.pack("<2i", 5, 6)


def test_empty_inputs() -> None:
    for empty in (b"", (), [], array("i"), np.array([], dtype=np.int64), range(0)):
        assert int32_bytes(empty) == b""
    assert pages(b"").tolist() == []


def test_bytes_pass_through_without_copy() -> None:
    assert int32_bytes(EXPECTED) is EXPECTED


@pytest.mark.parametrize("bad, exc", [
    pytest.param(b"\x00\x01\x02", ValueError, id="bytes-not-multiple-of-4"),
    pytest.param(bytearray(5), ValueError, id="bytearray-not-multiple-of-4"),
    pytest.param([1.5], TypeError, id="list-float"),
    pytest.param("1234", TypeError, id="str"),
    pytest.param([2**31], OverflowError, id="list-overflow"),
    pytest.param([-(2**31) - 1], OverflowError, id="list-underflow"),
    pytest.param(array("q", [2**40]), OverflowError, id="array-q-overflow"),
    pytest.param(array("f", [1.0]), TypeError, id="array-float"),
    pytest.param(np.array([1.0, 2.0], dtype=np.float32), TypeError, id="numpy-float32"),
    pytest.param(np.array([True]), TypeError, id="numpy-bool"),
    pytest.param(np.array([2**31], dtype=np.int64), OverflowError, id="numpy-overflow"),
    pytest.param(np.array([2**32 - 1], dtype=np.uint32), OverflowError, id="numpy-uint32-big"),
    pytest.param(np.zeros((2, 2), dtype=np.int32), ValueError, id="numpy-2d"),
    pytest.param(np.int32(3), ValueError, id="numpy-scalar"),
])
def test_refused_inputs(bad: Any, exc: type[Exception]) -> None:
    with pytest.raises(exc):
        int32_bytes(bad)


def test_pages_helper_accepts_any_buffer() -> None:
    a = pages(bytearray(EXPECTED))
    assert isinstance(a, array) and a.typecode == "i" and a.tolist() == VALUES
    assert pages(memoryview(EXPECTED)).tolist() == VALUES
    # numpy and torch can view it without a copy
    assert np.frombuffer(a, dtype=np.int32).tolist() == VALUES


# ---------------------------------------------------------------------------- torch

def test_torch_tensors() -> None:
    torch = pytest.importorskip("torch")
    t32 = torch.tensor(VALUES, dtype=torch.int32)
    assert int32_bytes(t32) == EXPECTED
    assert int32_bytes(torch.tensor(VALUES, dtype=torch.int64)) == EXPECTED
    assert int32_bytes(torch.tensor([1, 2], dtype=torch.int16)) == struct.pack("<2i", 1, 2)
    wide = torch.zeros(2 * len(VALUES), dtype=torch.int32)
    wide[::2] = t32
    assert int32_bytes(wide[::2]) == EXPECTED  # non-contiguous view
    assert int32_bytes(torch.tensor([], dtype=torch.int32)) == b""
    assert torch.frombuffer(bytearray(int32_bytes(t32)), dtype=torch.int32).tolist() == VALUES


@pytest.mark.parametrize("make, exc", [
    pytest.param(lambda torch: torch.tensor([1.0]), TypeError, id="float"),
    pytest.param(lambda torch: torch.tensor([True]), TypeError, id="bool"),
    pytest.param(lambda torch: torch.zeros(2, 2, dtype=torch.int32), ValueError, id="2d"),
    pytest.param(lambda torch: torch.tensor([2**31], dtype=torch.int64), OverflowError,
                 id="overflow"),
])
def test_torch_refused(make: Any, exc: type[Exception]) -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(exc):
        int32_bytes(make(torch))


@pytest.mark.gpu
def test_torch_cuda_tensor() -> None:
    import torch

    t = torch.tensor(VALUES, dtype=torch.int32, device="cuda")
    assert int32_bytes(t) == EXPECTED
