"""The L3 page value format: byte-exact round trips and detection of every kind of corruption."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.storage import codec
from daemon.storage.codec import HEADER_BYTES, CorruptPage, decode_page, encode_page

FP = bytes(range(32))
H = bytes(range(100, 132))


def _value(pool: str = "full", page_size: int = 16, payload_len: int = 4096, seed: int = 0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(-(2**31), 2**31 - 1, size=page_size, dtype=np.int64).tolist()
    payload = rng.integers(0, 256, size=payload_len, dtype=np.uint8).tobytes()
    return encode_page(pool=pool, page_hash=H, fingerprint=FP, tokens=tokens,
                       payload=payload), tokens, payload


@pytest.mark.parametrize("pool", ["full", "swa"])
@pytest.mark.parametrize("page_size", [1, 16, 64, 256])
def test_round_trip_byte_exact(pool: str, page_size: int) -> None:
    value, tokens, payload = _value(pool, page_size, payload_len=page_size * 512 + 3)
    assert len(value) == HEADER_BYTES + 4 * page_size + len(payload)
    page = decode_page(value, H, FP, pool)
    assert page.pool == pool and page.token_count == page_size
    assert page.page_hash == H and page.fingerprint == FP
    assert page.token_ids() == tokens
    assert page.tokens == np.asarray(tokens, dtype="<i4").tobytes()
    assert bytes(page.payload) == payload
    # the payload is a view into the stored value, not a copy
    assert page.payload.obj is value


def test_encode_accepts_buffers() -> None:
    arr = np.arange(3 * 1024, dtype=np.float16).reshape(3, 1024)  # a host page, any dtype/shape
    tok = np.arange(16, dtype="<i4").tobytes()
    value = encode_page(pool="swa", page_hash=H, fingerprint=FP, tokens=tok, payload=arr)
    page = decode_page(memoryview(value), H, FP, "swa")
    assert bytes(page.payload) == arr.tobytes()
    assert page.tokens == tok
    with pytest.raises(ValueError):
        encode_page(pool="swa", page_hash=H, fingerprint=FP, tokens=tok, payload=arr[:, ::2])
    with pytest.raises(ValueError):
        encode_page(pool="mamba", page_hash=H, fingerprint=FP, tokens=tok, payload=b"x")
    with pytest.raises(ValueError):
        encode_page(pool="full", page_hash=H[:31], fingerprint=FP, tokens=tok, payload=b"x")
    with pytest.raises(ValueError):
        encode_page(pool="full", page_hash=H, fingerprint=FP, tokens=[2**31], payload=b"x")


def _corrupt(value: bytes, offset: int, xor: int = 0xFF) -> bytes:
    b = bytearray(value)
    b[offset] ^= xor
    return bytes(b)


def _reason(value: bytes, **kw) -> str:
    args = dict(expect_hash=H, expect_fingerprint=FP, expect_pool="full")
    args.update(kw)
    with pytest.raises(CorruptPage) as info:
        decode_page(value, **args)
    return info.value.reason


def test_every_corruption_kind_detected() -> None:
    value, _, _ = _value("full", 16, 4096)
    assert _reason(value[:40]).startswith("truncated")
    assert _reason(value[:-1]).startswith("truncated")
    assert _reason(value + b"\0").startswith("length mismatch")
    assert _reason(b"XXXX" + value[4:]) == "bad magic"
    assert _reason(_corrupt(value, 4, 0x02)).startswith("unsupported version")
    assert _reason(_corrupt(value, 7, 0x02)).startswith("unknown flags")
    assert _reason(_corrupt(value, 7, 0x01)).startswith("wrong page kind")
    assert _reason(value, expect_pool="swa").startswith("wrong pool")
    assert _reason(_corrupt(value, 6, 0x01)).startswith("wrong pool")
    assert _reason(value, expect_fingerprint=bytes(32)) == "wrong layout fingerprint"
    assert _reason(value, expect_hash=bytes(32)) == "wrong page hash"
    assert _reason(_corrupt(value, 8, 0x01)).startswith(("truncated", "length mismatch"))
    assert _reason(_corrupt(value, 12, 0x01)).startswith(("truncated", "length mismatch"))
    assert _reason(_corrupt(value, 84)) == "checksum mismatch"  # the checksum itself
    assert _reason(_corrupt(value, HEADER_BYTES + 5)) == "checksum mismatch"  # a token
    assert _reason(_corrupt(value, len(value) - 1, 0x01)) == "checksum mismatch"  # payload
    assert _reason(b"") == "truncated"


@settings(max_examples=400, deadline=None)
@given(
    pool=st.sampled_from(["full", "swa"]),
    page_size=st.integers(1, 64),
    payload_len=st.integers(0, 3000),
    data=st.data(),
)
def test_any_single_byte_change_is_detected(pool, page_size, payload_len, data) -> None:
    value = encode_page(pool=pool, page_hash=H, fingerprint=FP,
                        tokens=list(range(page_size)), payload=os.urandom(payload_len))
    offset = data.draw(st.integers(0, len(value) - 1), label="offset")
    xor = data.draw(st.integers(1, 255), label="xor")
    bad = _corrupt(value, offset, xor)
    with pytest.raises(CorruptPage) as info:
        decode_page(bad, H, FP, pool)
    if offset >= HEADER_BYTES:  # tokens and payload are covered by the checksum alone
        assert info.value.reason == "checksum mismatch"


@settings(max_examples=100, deadline=None)
@given(cut=st.integers(0, HEADER_BYTES + 64 + 999), extra=st.binary(min_size=0, max_size=8))
def test_truncation_and_trailing_bytes_detected(cut: int, extra: bytes) -> None:
    value = encode_page(pool="full", page_hash=H, fingerprint=FP, tokens=list(range(16)),
                        payload=bytes(1000))
    bad = value[:cut] + extra
    if bad == value:
        return
    with pytest.raises(CorruptPage):
        decode_page(bad, H, FP, "full")


def test_peek_header() -> None:
    value, _, _ = _value("swa", 8, 100)
    assert codec.peek_header(value) == ("swa", H)
    with pytest.raises(CorruptPage):
        codec.peek_header(value[:10])


def test_bench_runs(capsys) -> None:
    out = codec.bench(payload_bytes=1 << 16, seconds=0.01)
    assert out["encode_gbps"] > 0 and out["decode_gbps"] > 0
    assert "encode_gbps" in capsys.readouterr().out


def test_keyed_page_round_trip_and_every_mismatch_is_refused() -> None:
    """A keyed page carries its key where a tree page carries tokens; the key is verified."""
    h, fp, key = os.urandom(32), os.urandom(32), b"sha256hex-key_tp0"
    payload = os.urandom(1000)
    value = encode_page(pool="swa", page_hash=h, fingerprint=fp, key=key, payload=payload)
    got = decode_page(value, h, fp, "swa", expect_key=key)
    assert got.keyed and got.tokens == key and bytes(got.payload) == payload
    assert len(value) == HEADER_BYTES + len(key) + len(payload)
    assert _reason(value, expect_hash=h, expect_fingerprint=fp, expect_pool="swa",
                   expect_key=b"sha256hex-key_tp1") == "wrong key"
    # a keyed value read as a tree page, and a tree page read as a keyed one
    assert _reason(value, expect_hash=h, expect_fingerprint=fp,
                   expect_pool="swa").startswith("wrong page kind")
    tree, _, _ = _value("full", 16, 4096)
    assert _reason(tree, expect_key=b"k").startswith("wrong page kind")
    # a flipped key byte is caught by the checksum before the key comparison
    assert _reason(_corrupt(value, HEADER_BYTES + 3), expect_hash=h, expect_fingerprint=fp,
                   expect_pool="swa", expect_key=key) == "checksum mismatch"
    with pytest.raises(ValueError):
        encode_page(pool="full", page_hash=h, fingerprint=fp, key=b"", payload=payload)
