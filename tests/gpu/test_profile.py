"""ModelProfile: validation (every error names its field), derived sizes, identity, round trips."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from daemon.gpu.profile import (
    DTYPE_ITEMSIZE,
    ModelProfile,
    ProfileError,
    dtype_itemsize,
    torch_dtype,
)

SWA_LAYOUT: dict[str, Any] = dict(
    name="gemma-tiny",
    page_size=16,
    sliding_window=100,
    num_full_layers=4,
    num_swa_layers=20,
    num_kv_heads=8,
    head_dim=128,
    dtype="bfloat16",
    device="cpu",
)
FULL_LAYOUT: dict[str, Any] = dict(
    name="llama-tiny",
    page_size=32,
    num_full_layers=16,
    num_kv_heads=4,
    head_dim=64,
    dtype="float16",
    device="cpu",
)


def swa_profile(**overrides: Any) -> ModelProfile:
    return ModelProfile(**{**SWA_LAYOUT, "full_pages": 64, "swa_pages": 16, **overrides})


def full_profile(**overrides: Any) -> ModelProfile:
    return ModelProfile(**{**FULL_LAYOUT, "full_pages": 64, **overrides})


# -- construction and derived sizes -----------------------------------------------------------


def test_swa_profile_sizes() -> None:
    p = swa_profile()
    assert p.has_swa
    # 2 (K,V) x layers x page_size x heads x head_dim x 2 bytes (bf16)
    assert p.full_page_bytes == 2 * 4 * 16 * 8 * 128 * 2 == 262144
    assert p.swa_page_bytes == 2 * 20 * 16 * 8 * 128 * 2 == 1310720
    assert p.page_token_bytes == 16 * 4
    assert p.window_pages == 7  # ceil(100 / 16)
    assert p.full_pool_bytes == 64 * p.full_page_bytes
    assert p.swa_pool_bytes == 16 * p.swa_page_bytes


def test_window_pages_exact_multiple() -> None:
    assert swa_profile(sliding_window=64).window_pages == 4
    assert swa_profile(sliding_window=1).window_pages == 1


def test_full_only_profile_defaults_and_sizes() -> None:
    p = full_profile()
    assert not p.has_swa
    assert p.sliding_window is None and p.num_swa_layers == 0 and p.swa_pages == 0
    assert p.swa_page_bytes == 0 and p.swa_pool_bytes == 0 and p.window_pages == 0
    assert p.full_page_bytes == 2 * 16 * 32 * 4 * 64 * 2


@pytest.mark.parametrize("dtype, size", sorted(DTYPE_ITEMSIZE.items()))
def test_dtype_itemsize_matches_torch(dtype: str, size: int) -> None:
    import torch

    assert dtype_itemsize(dtype) == size
    assert torch_dtype(dtype).itemsize == size
    assert full_profile(dtype=dtype).torch_dtype() is getattr(torch, dtype)
    assert full_profile(dtype=dtype).full_page_bytes == 2 * 16 * 32 * 4 * 64 * size


def test_profile_is_frozen() -> None:
    p = full_profile()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.page_size = 8  # type: ignore[misc]


def test_importing_profile_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "from daemon.gpu.profile import ModelProfile\n"
        f"p = ModelProfile(**{FULL_LAYOUT!r}, full_pages=4)\n"
        "p.layout_fingerprint(); p.to_dict(); p.full_page_bytes\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# -- validation: every error names the field ---------------------------------------------------

BAD_FIELDS: list[tuple[str, Any, dict[str, Any]]] = [
    ("name", "", {}),
    ("name", " padded", {}),
    ("name", 7, {}),
    ("name", "x" * 201, {}),
    ("name", "new\nline", {}),
    ("page_size", 0, {}),
    ("page_size", -16, {}),
    ("page_size", 16.0, {}),
    ("page_size", True, {}),
    ("page_size", "16", {}),
    ("sliding_window", 0, {}),
    ("sliding_window", 4.5, {}),
    ("num_full_layers", 0, {}),
    ("num_swa_layers", -1, {}),
    ("num_swa_layers", 0, {}),  # window set but no SWA layers
    ("num_kv_heads", 0, {}),
    ("head_dim", 0, {}),
    ("head_dim", None, {}),
    ("dtype", "int8", {}),
    ("dtype", "fp16", {}),
    ("dtype", None, {}),
    ("device", "gpu", {}),
    ("device", "CPU", {}),
    ("device", "cuda:", {}),
    ("device", "cuda:01", {}),
    ("device", "cuda:-1", {}),
    ("full_pages", 1, {}),
    ("full_pages", 0, {}),
    ("full_pages", 10.0, {}),
    ("swa_pages", 1, {}),
    ("swa_pages", 0, {}),
]


@pytest.mark.parametrize("field, value, extra", BAD_FIELDS)
def test_invalid_field_is_named(field: str, value: Any, extra: dict[str, Any]) -> None:
    with pytest.raises(ProfileError) as info:
        swa_profile(**{field: value}, **extra)
    message = str(info.value)
    assert message.startswith(f"{field}:"), message
    assert repr(value) in message or str(value) in message, message


def test_swa_layers_without_window_is_named() -> None:
    with pytest.raises(ProfileError, match=r"^num_swa_layers: .*sliding_window is None.*got 3"):
        full_profile(num_swa_layers=3)


def test_swa_pages_without_swa_is_named() -> None:
    with pytest.raises(ProfileError, match=r"^swa_pages: .*no SWA layers, got 4"):
        full_profile(swa_pages=4)


def test_profile_error_is_value_error() -> None:
    assert issubclass(ProfileError, ValueError)


def test_dtype_itemsize_rejects_unknown() -> None:
    with pytest.raises(ProfileError, match=r"^dtype: .*'int4'"):
        dtype_itemsize("int4")
    with pytest.raises(ProfileError, match=r"^dtype: .*'int4'"):
        torch_dtype("int4")


def test_missing_required_field_is_a_type_error() -> None:
    # The dataclass constructor itself names the missing argument.
    with pytest.raises(TypeError, match="full_pages"):
        ModelProfile(**FULL_LAYOUT)  # type: ignore[call-arg]


# -- capacities given in bytes -------------------------------------------------------------------


def test_from_bytes_rounds_down_to_whole_pages() -> None:
    ref = swa_profile(full_pages=10, swa_pages=5)
    p = ModelProfile.from_bytes(
        **SWA_LAYOUT,
        full_bytes=10 * ref.full_page_bytes + ref.full_page_bytes - 1,
        swa_bytes=5 * ref.swa_page_bytes,
    )
    assert p == ref
    assert p.full_pool_bytes <= 11 * ref.full_page_bytes - 1


def test_from_bytes_without_swa() -> None:
    ref = full_profile(full_pages=3)
    assert ModelProfile.from_bytes(**FULL_LAYOUT, full_bytes=3 * ref.full_page_bytes) == ref


def test_from_bytes_full_too_small_is_named() -> None:
    page = swa_profile().full_page_bytes
    with pytest.raises(ProfileError, match=rf"^full_bytes: {2 * page - 1} bytes is too small"):
        ModelProfile.from_bytes(**SWA_LAYOUT, full_bytes=2 * page - 1, swa_bytes=10**9)


def test_from_bytes_swa_too_small_is_named() -> None:
    with pytest.raises(ProfileError, match=r"^swa_bytes: 1000 bytes is too small"):
        ModelProfile.from_bytes(**SWA_LAYOUT, full_bytes=10**9, swa_bytes=1000)


def test_from_bytes_swa_required_with_window() -> None:
    with pytest.raises(ProfileError, match=r"^swa_pages: give exactly one of"):
        ModelProfile.from_bytes(**SWA_LAYOUT, full_bytes=10**9)


def test_from_bytes_swa_bytes_rejected_without_swa() -> None:
    with pytest.raises(ProfileError, match=r"^swa_bytes: must be omitted .* got 4096"):
        ModelProfile.from_bytes(**FULL_LAYOUT, full_bytes=10**9, swa_bytes=4096)


def test_from_bytes_rejects_page_counts() -> None:
    with pytest.raises(ProfileError, match=r"^full_pages: not accepted by from_bytes"):
        ModelProfile.from_bytes(**FULL_LAYOUT, full_bytes=10**9, full_pages=4)


def test_from_bytes_non_int_is_named() -> None:
    with pytest.raises(ProfileError, match=r"^full_bytes: expected an int, got '1G'"):
        ModelProfile.from_bytes(**FULL_LAYOUT, full_bytes="1G")


def test_from_bytes_reports_layout_errors_as_themselves() -> None:
    with pytest.raises(ProfileError, match=r"^head_dim: must be >= 1, got 0"):
        ModelProfile.from_bytes(**{**FULL_LAYOUT, "head_dim": 0}, full_bytes=10**9)


# -- identity --------------------------------------------------------------------------------


def test_fingerprint_is_32_bytes_and_pinned() -> None:
    fp = swa_profile().layout_fingerprint()
    assert isinstance(fp, bytes) and len(fp) == 32
    # Pinned: L2/L3 pages are keyed and verified with this value, so an accidental change to the
    # encoding would silently turn every stored page into a miss. Change it deliberately, with a
    # version bump, or not at all.
    assert fp.hex() == PINNED_FINGERPRINT


PINNED_FINGERPRINT = "11d568032c6d0bbad56b69fbeae906c7a822156372e097b8cf5acce0ca73c42e"


def test_fingerprint_ignores_name_device_and_capacities() -> None:
    a = swa_profile()
    b = swa_profile(name="other-model", device="auto", full_pages=2, swa_pages=1000)
    assert a.layout_fingerprint() == b.layout_fingerprint()


@pytest.mark.parametrize(
    "field, value",
    [
        ("page_size", 32),
        ("sliding_window", 128),
        ("num_full_layers", 5),
        ("num_swa_layers", 19),
        ("num_kv_heads", 4),
        ("head_dim", 64),
        ("dtype", "float16"),
    ],
)
def test_fingerprint_covers_every_layout_field(field: str, value: Any) -> None:
    assert swa_profile(**{field: value}).layout_fingerprint() != swa_profile().layout_fingerprint()


def test_fingerprint_distinguishes_swa_from_full_only() -> None:
    with_swa = ModelProfile(**{**FULL_LAYOUT, "sliding_window": 64, "num_swa_layers": 1},
                            full_pages=4, swa_pages=4)
    assert with_swa.layout_fingerprint() != full_profile().layout_fingerprint()


# -- dict round trips ------------------------------------------------------------------------


@pytest.mark.parametrize("make", [swa_profile, full_profile])
def test_dict_round_trip_through_json(make: Any) -> None:
    p = make()
    d = json.loads(json.dumps(p.to_dict()))
    assert ModelProfile.from_dict(d) == p


def test_from_dict_accepts_bytes() -> None:
    ref = swa_profile(full_pages=8, swa_pages=3)
    d = {**SWA_LAYOUT, "full_bytes": 8 * ref.full_page_bytes, "swa_bytes": 3 * ref.swa_page_bytes}
    assert ModelProfile.from_dict(d) == ref


def test_from_dict_mixes_pages_and_bytes() -> None:
    ref = swa_profile(full_pages=8, swa_pages=3)
    d = {**SWA_LAYOUT, "full_pages": 8, "swa_bytes": 3 * ref.swa_page_bytes + 1}
    assert ModelProfile.from_dict(d) == ref


def test_from_dict_defaults() -> None:
    p = ModelProfile.from_dict({**FULL_LAYOUT, "full_pages": 4, "device": "auto"})
    assert p.device == "auto" and p.swa_pages == 0


def test_from_dict_unknown_keys_are_named() -> None:
    d = {**swa_profile().to_dict(), "page_szie": 16, "colour": "red"}
    with pytest.raises(ProfileError, match=r"^unknown profile key\(s\): colour, page_szie$"):
        ModelProfile.from_dict(d)


def test_from_dict_missing_keys_are_named() -> None:
    d = {k: v for k, v in swa_profile().to_dict().items() if k not in ("head_dim", "name")}
    with pytest.raises(ProfileError, match=r"^missing profile key\(s\): head_dim, name$"):
        ModelProfile.from_dict(d)


def test_from_dict_missing_capacity_is_named() -> None:
    with pytest.raises(ProfileError, match=r"^full_pages: give exactly one of"):
        ModelProfile.from_dict({**FULL_LAYOUT})


def test_from_dict_pages_and_bytes_both_given_is_named() -> None:
    with pytest.raises(ProfileError, match=r"^full_pages: give exactly one of .*full_bytes=4096"):
        ModelProfile.from_dict({**FULL_LAYOUT, "full_pages": 4, "full_bytes": 4096})


def test_from_dict_bad_value_is_named() -> None:
    with pytest.raises(ProfileError, match=r"^dtype: unsupported value 'fp8'"):
        ModelProfile.from_dict({**FULL_LAYOUT, "full_pages": 4, "dtype": "fp8"})


def test_from_dict_rejects_non_mapping() -> None:
    with pytest.raises(ProfileError, match=r"^profile: expected a mapping, got list"):
        ModelProfile.from_dict([("name", "x")])  # type: ignore[arg-type]


layouts = st.fixed_dictionaries(
    {
        "name": st.text(alphabet="abcdefghij-_./0123456789", min_size=1, max_size=20),
        "page_size": st.integers(1, 128),
        "num_full_layers": st.integers(1, 64),
        "num_kv_heads": st.integers(1, 16),
        "head_dim": st.integers(1, 256),
        "dtype": st.sampled_from(sorted(DTYPE_ITEMSIZE)),
        "device": st.sampled_from(["cpu", "auto", "cuda", "cuda:3"]),
        "swa": st.none() | st.tuples(st.integers(1, 8192), st.integers(1, 64)),
    }
).filter(lambda d: d["name"].strip() == d["name"])


@given(layouts, st.integers(2, 10_000), st.integers(2, 10_000), st.data())
def test_property_bytes_pages_and_dict_agree(
    layout: dict[str, Any], full_pages: int, swa_pages: int, data: st.DataObject
) -> None:
    layout = dict(layout)
    swa = layout.pop("swa")
    if swa is not None:
        layout["sliding_window"], layout["num_swa_layers"] = swa
    else:
        swa_pages = 0
    p = ModelProfile(**layout, full_pages=full_pages, swa_pages=swa_pages)
    assert ModelProfile.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    slack_full = data.draw(st.integers(0, p.full_page_bytes - 1))
    slack_swa = data.draw(st.integers(0, max(0, p.swa_page_bytes - 1)))
    q = ModelProfile.from_bytes(
        **layout,
        full_bytes=p.full_pool_bytes + slack_full,
        swa_bytes=(p.swa_pool_bytes + slack_swa) if swa is not None else None,
    )
    assert q == p
    assert q.layout_fingerprint() == p.layout_fingerprint()
    if swa is not None:
        assert (q.window_pages - 1) * q.page_size < q.sliding_window <= q.window_pages * q.page_size


# -- device resolution -------------------------------------------------------------------------


def test_resolve_cpu() -> None:
    import torch

    assert full_profile(device="cpu").resolve_device() == torch.device("cpu")


def test_resolve_auto_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert full_profile(device="auto").resolve_device() == torch.device("cpu")


def test_resolve_cuda_without_cuda_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ProfileError, match=r"^device: 'cuda:1' requested but CUDA is not"):
        full_profile(device="cuda:1").resolve_device()


def test_resolve_cuda_indices(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    import daemon.gpu.profile as profile_module
    from daemon.gpu.segments import effective_isolation

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    # no GPU driver node: "auto" is the CPU, for the pools and for memory isolation alike
    monkeypatch.setattr(profile_module, "GPU_DEVICE_NODES", ("/nonexistent/nvidiactl",))
    assert full_profile(device="auto").resolve_device() == torch.device("cpu")
    assert effective_isolation("auto", "auto") == "segments"
    monkeypatch.setattr(profile_module, "GPU_DEVICE_NODES", ("/",))  # (a path that exists)
    assert full_profile(device="auto").resolve_device() == torch.device("cuda", 0)
    assert effective_isolation("auto", "auto") == "none"
    assert full_profile(device="cuda").resolve_device() == torch.device("cuda", 0)
    assert full_profile(device="cuda:1").resolve_device() == torch.device("cuda", 1)
    with pytest.raises(ProfileError, match=r"^device: 'cuda:2' requested but only 2 CUDA"):
        full_profile(device="cuda:2").resolve_device()
