"""CPU stand-ins for what SGLang 0.5.23's import chain touches but its HiCache storage path never
calls; loaded at interpreter start in the test venv only (scripts/_env.sh writes a .pth for it).

PyPI's torchvision beside the CPU torch wheel cannot load its C extension, so the operators it
registers meta kernels for at import (``torchvision::nms``, ``torchvision::qnms`` ... only their
schemas are needed) do not exist and ``import torchvision`` fails. SGLang imports torchvision (via
transformers' image utilities) but never runs a vision op on the cache path. Here the schemas are
defined, and every kernel raises: any call would fail the test that made it
(tests/sglang/test_cpu_shim.py shows the cache path makes none). Does nothing when torchvision's own
extension loads (a GPU machine).
"""

from __future__ import annotations

CALLS: list[str] = []

SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}


def _install() -> None:
    import importlib.util

    if importlib.util.find_spec("torchvision") is None:
        return
    import torch

    try:
        torch.ops.torchvision.nms  # noqa: B018 - present when torchvision's extension loaded
        return
    except (AttributeError, RuntimeError):
        pass
    lib = torch.library.Library("torchvision", "DEF")  # noqa: TOR901 - kept alive below
    for name, schema in SCHEMAS.items():
        lib.define(schema)

        def kernel(*args, _name=name, **kwargs):
            CALLS.append(_name)
            raise RuntimeError(f"torchvision::{_name} is a CPU stand-in (sglang_cpu_shim): "
                               "SGLang's cache path must not call it")

        lib.impl(name, kernel, "CompositeExplicitAutograd")
    globals()["LIBRARY"] = lib


_install()
