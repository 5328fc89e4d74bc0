"""Model profiles: the KV layout of one model and the capacity of its pools.

A profile is the contract between the daemon and every engine serving that model: engines map the
pools it describes and run their kernels on them, L2/L3 pages are only interchangeable between
identical layouts, and the tree's page size comes from here. So a profile is validated once, on
construction, with errors that name the offending field, and is immutable afterwards.

This module must not import torch at import time: the CLI, the config loader and the tree tests
use profiles without wanting a multi-second torch import. Torch is imported lazily by the few
functions that need it (dtype mapping, device resolution).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

__all__ = [
    "DTYPE_ITEMSIZE",
    "ModelProfile",
    "ProfileError",
    "dtype_itemsize",
    "torch_dtype",
]


class ProfileError(ValueError):
    """An invalid model profile; the message names the field and the bad value."""


#: Supported KV dtypes and their size in bytes. Kept as plain strings so that sizes can be
#: computed (and profiles validated) without importing torch.
DTYPE_ITEMSIZE: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}

#: Bytes per token id in a page's token array (tokens are int32, docs/design.md).
TOKEN_BYTES = 4

_DEVICE_RE = re.compile(r"^(cpu|auto|cuda|cuda:(0|[1-9][0-9]*))$")
_MAX_NAME_LEN = 200
# Bumped whenever the canonical encoding below changes, so old fingerprints never match new ones.
_FINGERPRINT_VERSION = 1


def dtype_itemsize(dtype: str) -> int:
    """Size in bytes of one element of a supported KV dtype name."""
    try:
        return DTYPE_ITEMSIZE[dtype]
    except KeyError:
        raise ProfileError(
            f"dtype: unsupported value {dtype!r}; expected one of {sorted(DTYPE_ITEMSIZE)}"
        ) from None


def torch_dtype(dtype: str) -> torch.dtype:
    """Map a supported dtype name to the torch dtype (imports torch on first use)."""
    dtype_itemsize(dtype)  # validates the name with the usual message
    import torch

    result = getattr(torch, dtype, None)
    if not isinstance(result, torch.dtype):
        raise ProfileError(f"dtype: {dtype!r} is not supported by torch {torch.__version__}")
    return result


def _is_int(value: object) -> bool:
    # bool is an int subclass, but `page_size=True` is a bug, not a page size of 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _require_int(field: str, value: object, minimum: int) -> int:
    if not _is_int(value):
        raise ProfileError(f"{field}: expected an int, got {value!r} ({type(value).__name__})")
    assert isinstance(value, int)
    if value < minimum:
        raise ProfileError(f"{field}: must be >= {minimum}, got {value!r}")
    return value


#: device nodes of the GPU drivers torch's CUDA (or ROCm) builds talk to: NVIDIA's, Jetson's,
#: AMD's, WSL's. With none of them torch cannot see a GPU, and importing it (1-2 s) only to hear
#: so slowed every ``radixd status`` on a CPU host
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/nvhost-ctrl", "/dev/nvmap",
                    "/dev/kfd", "/dev/dxg")


def cuda_available() -> bool:
    """Whether device "auto" means CUDA: the one answer for where pools go and for what
    depends on it (memory isolation), so that the two cannot disagree."""
    if not any(os.path.exists(node) for node in GPU_DEVICE_NODES):
        return False
    import torch

    return bool(torch.cuda.is_available())


@dataclass(frozen=True, kw_only=True)
class ModelProfile:
    """KV layout of one model plus the capacity of its device pools.

    Capacities count pages *including* the reserved padding page 0, which engines point unused
    slots at and which is never handed out; hence a usable pool has at least 2 pages. Use
    :meth:`from_bytes` to size pools by memory instead of by page count.
    """

    name: str
    page_size: int
    num_full_layers: int
    num_kv_heads: int
    head_dim: int
    full_pages: int
    sliding_window: int | None = None
    num_swa_layers: int = 0
    swa_pages: int = 0
    dtype: str = "bfloat16"
    device: str = "auto"

    def __post_init__(self) -> None:
        self._validate()

    # -- validation ---------------------------------------------------------------------------

    def _validate(self) -> None:
        if not isinstance(self.name, str):
            raise ProfileError(f"name: expected a str, got {self.name!r}")
        if not self.name or self.name.strip() != self.name:
            raise ProfileError(
                f"name: must be non-empty without leading/trailing whitespace, got {self.name!r}"
            )
        if len(self.name) > _MAX_NAME_LEN or not self.name.isprintable():
            raise ProfileError(
                f"name: must be printable and at most {_MAX_NAME_LEN} characters, "
                f"got {self.name!r}"
            )
        _require_int("page_size", self.page_size, 1)
        if self.sliding_window is not None:
            _require_int("sliding_window", self.sliding_window, 1)
        _require_int("num_full_layers", self.num_full_layers, 1)
        _require_int("num_swa_layers", self.num_swa_layers, 0)
        if self.sliding_window is None and self.num_swa_layers != 0:
            raise ProfileError(
                f"num_swa_layers: must be 0 when sliding_window is None, got {self.num_swa_layers}"
            )
        if self.sliding_window is not None and self.num_swa_layers == 0:
            raise ProfileError(
                "num_swa_layers: must be >= 1 when sliding_window is set "
                f"(sliding_window={self.sliding_window}), got 0"
            )
        _require_int("num_kv_heads", self.num_kv_heads, 1)
        _require_int("head_dim", self.head_dim, 1)
        if not isinstance(self.dtype, str) or self.dtype not in DTYPE_ITEMSIZE:
            raise ProfileError(
                f"dtype: unsupported value {self.dtype!r}; expected one of {sorted(DTYPE_ITEMSIZE)}"
            )
        if not isinstance(self.device, str) or not _DEVICE_RE.match(self.device):
            raise ProfileError(
                f"device: expected 'cpu', 'cuda', 'cuda:N' or 'auto', got {self.device!r}"
            )
        _require_int("full_pages", self.full_pages, 2)
        if self.has_swa:
            _require_int("swa_pages", self.swa_pages, 2)
        elif not _is_int(self.swa_pages) or self.swa_pages != 0:
            raise ProfileError(
                f"swa_pages: must be 0 when the model has no SWA layers, got {self.swa_pages!r}"
            )

    # -- derived sizes ------------------------------------------------------------------------

    @property
    def has_swa(self) -> bool:
        """Whether the model has sliding-window layers (and so an SWA pool)."""
        return self.sliding_window is not None

    @property
    def dtype_itemsize(self) -> int:
        """Bytes per KV element."""
        return DTYPE_ITEMSIZE[self.dtype]

    def _page_bytes(self, layers: int) -> int:
        # K and V, for every layer of the pool, for every token of the page.
        return 2 * layers * self.page_size * self.num_kv_heads * self.head_dim * self.dtype_itemsize

    @property
    def full_page_bytes(self) -> int:
        """Bytes of one full-pool page across all full-attention layers (K and V)."""
        return self._page_bytes(self.num_full_layers)

    @property
    def swa_page_bytes(self) -> int:
        """Bytes of one SWA-pool page across all SWA layers (K and V); 0 without SWA."""
        return self._page_bytes(self.num_swa_layers)

    @property
    def page_token_bytes(self) -> int:
        """Bytes of one page's token ids (int32)."""
        return self.page_size * TOKEN_BYTES

    @property
    def window_pages(self) -> int:
        """Pages needed to cover the sliding window (ceil(W / page_size)); 0 without SWA."""
        if self.sliding_window is None:
            return 0
        return math.ceil(self.sliding_window / self.page_size)

    @property
    def full_pool_bytes(self) -> int:
        """Size of the whole full pool, padding page included."""
        return self.full_pages * self.full_page_bytes

    @property
    def swa_pool_bytes(self) -> int:
        """Size of the whole SWA pool, padding page included; 0 without SWA."""
        return self.swa_pages * self.swa_page_bytes

    # -- identity -----------------------------------------------------------------------------

    def layout_fingerprint(self) -> bytes:
        """SHA-256 over the fields that decide what a page's bytes mean.

        Two profiles with the same fingerprint can exchange pages (L2/L3) and seed the same page
        hashes; the model name, the device and the pool capacities are deliberately left out,
        since they do not change the meaning of a stored page.
        """
        canonical = {
            "v": _FINGERPRINT_VERSION,
            "page_size": self.page_size,
            "sliding_window": self.sliding_window,
            "num_full_layers": self.num_full_layers,
            "num_swa_layers": self.num_swa_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
        }
        encoded = json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode("ascii")
        return hashlib.sha256(b"radixd-layout\x00" + encoded).digest()

    # -- torch-facing helpers (lazy torch import) ----------------------------------------------

    def torch_dtype(self) -> torch.dtype:
        """The torch dtype of the KV pools."""
        return torch_dtype(self.dtype)

    def resolve_device(self) -> torch.device:
        """The concrete device for the pools: 'auto' is cuda:0 when CUDA is available, else cpu.

        'cuda' is normalised to 'cuda:0' so that everything downstream sees one spelling. A CUDA
        device that does not exist is a :class:`ProfileError` here, before any allocation.
        """
        import torch

        if self.device == "cpu":
            return torch.device("cpu")
        if self.device == "auto":
            return torch.device("cuda:0" if cuda_available() else "cpu")
        index = int(self.device.partition(":")[2] or 0)
        if not torch.cuda.is_available():
            raise ProfileError(f"device: {self.device!r} requested but CUDA is not available")
        count = torch.cuda.device_count()
        if index >= count:
            raise ProfileError(
                f"device: {self.device!r} requested but only {count} CUDA device(s) exist"
            )
        return torch.device("cuda", index)

    # -- construction from sizes and dicts -----------------------------------------------------

    @classmethod
    def from_bytes(
        cls,
        *,
        full_bytes: int,
        swa_bytes: int | None = None,
        **layout: Any,
    ) -> ModelProfile:
        """Build a profile whose pool capacities are given in bytes instead of pages.

        Pages = bytes // page bytes (rounded down, so a pool never exceeds its budget); each pool
        must still hold at least 2 pages (the padding page and one usable page).
        """
        for key in ("full_pages", "swa_pages"):
            if key in layout:
                raise ProfileError(f"{key}: not accepted by from_bytes; give the capacity in bytes")
        return cls._build(layout, full_bytes=full_bytes, swa_bytes=swa_bytes)

    @classmethod
    def _build(
        cls,
        layout: Mapping[str, Any],
        *,
        full_pages: int | None = None,
        full_bytes: int | None = None,
        swa_pages: int | None = None,
        swa_bytes: int | None = None,
    ) -> ModelProfile:
        """Resolve each capacity pair (exactly one of pages/bytes) and build the profile."""
        # Validate the layout first, with placeholder capacities, so that a bad layout field is
        # reported as itself rather than as a confusing capacity error.
        has_swa = layout.get("sliding_window") is not None
        probe = cls(**layout, full_pages=2, swa_pages=2 if has_swa else 0)
        if (full_pages is None) == (full_bytes is None):
            raise ProfileError(
                "full_pages: give exactly one of full_pages or full_bytes, "
                f"got full_pages={full_pages!r}, full_bytes={full_bytes!r}"
            )
        if full_bytes is not None:
            full_pages = _pages_from_bytes("full_bytes", full_bytes, probe.full_page_bytes)
        if has_swa:
            if (swa_pages is None) == (swa_bytes is None):
                raise ProfileError(
                    "swa_pages: give exactly one of swa_pages or swa_bytes when sliding_window "
                    f"is set, got swa_pages={swa_pages!r}, swa_bytes={swa_bytes!r}"
                )
            if swa_bytes is not None:
                swa_pages = _pages_from_bytes("swa_bytes", swa_bytes, probe.swa_page_bytes)
        else:
            if swa_bytes not in (None, 0):
                raise ProfileError(
                    "swa_bytes: must be omitted when the model has no SWA layers, "
                    f"got {swa_bytes!r}"
                )
            if swa_pages is None:
                swa_pages = 0
        return dataclasses.replace(probe, full_pages=full_pages, swa_pages=swa_pages)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict that :meth:`from_dict` turns back into an equal profile."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelProfile:
        """Build a profile from a config mapping.

        Capacities may be given as pages (``full_pages``/``swa_pages``) or as bytes
        (``full_bytes``/``swa_bytes``), exactly one of each pair. Unknown keys are an error: a
        typo such as ``page_szie`` must not silently fall back to a default.
        """
        if not isinstance(data, Mapping):
            raise ProfileError(f"profile: expected a mapping, got {type(data).__name__}")
        capacity_keys = ("full_pages", "full_bytes", "swa_pages", "swa_bytes")
        layout_keys = {f.name for f in dataclasses.fields(cls)} - set(capacity_keys)
        unknown = sorted(str(k) for k in data if k not in layout_keys and k not in capacity_keys)
        if unknown:
            raise ProfileError(f"unknown profile key(s): {', '.join(unknown)}")
        required = {
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.name in layout_keys
        }
        missing = sorted(required - data.keys())
        if missing:
            raise ProfileError(f"missing profile key(s): {', '.join(missing)}")
        layout = {k: v for k, v in data.items() if k in layout_keys}
        capacities = {k: data[k] for k in capacity_keys if k in data}
        if layout.get("sliding_window") is None and capacities.get("swa_pages") == 0:
            # to_dict() writes swa_pages=0 for models without SWA; that is "not given".
            del capacities["swa_pages"]
        return cls._build(layout, **capacities)


def _pages_from_bytes(field: str, nbytes: object, page_bytes: int) -> int:
    if not _is_int(nbytes):
        raise ProfileError(f"{field}: expected an int, got {nbytes!r} ({type(nbytes).__name__})")
    assert isinstance(nbytes, int)
    pages = nbytes // page_bytes
    if pages < 2:
        raise ProfileError(
            f"{field}: {nbytes} bytes is too small; need at least {2 * page_bytes} "
            f"(2 pages of {page_bytes} bytes, page 0 being the reserved padding page)"
        )
    return pages
