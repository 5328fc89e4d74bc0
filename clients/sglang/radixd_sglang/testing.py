"""Real SGLang 0.5.23 objects on the CPU: an MHA host pool (``MHATokenToKVPoolHost``, page_first)
and the ``HiCacheStorageConfig`` SGLang's cache controller would build. Part of the package (not of
tests/) so that tests/sglang and bench/sglang_bench.py share one copy and the bench does not depend
on the test tree; the backend itself never imports it."""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost


def host_pool(layers: int, heads: int, head_dim: int, page_size: int, pages: int,
              dtype: torch.dtype = torch.float32, layout: str = "page_first"
              ) -> MHATokenToKVPoolHost:
    """SGLang's own host KV pool of ``pages`` pages (plus SGLang's padding page), over a tiny
    device pool on the CPU (the storage path never touches the device side)."""
    dev_tokens = page_size * 2
    k = tuple(torch.zeros(dev_tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
    v = tuple(torch.zeros(dev_tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
    ptrs = torch.tensor([t.data_ptr() for t in k], dtype=torch.uint64)
    vptrs = torch.tensor([t.data_ptr() for t in v], dtype=torch.uint64)
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs, v_data_ptrs=vptrs,
                          layout=list(KVBufferLayout)[0]),
        page_size=page_size, head_num=heads, head_dim=head_dim, v_head_dim=head_dim,
        dtype=dtype, device=torch.device("cpu"))
    return MHATokenToKVPoolHost(
        info, host_to_device_ratio=2.0, host_size=0, page_size=page_size, layout=layout,
        pin_memory=False, device="cpu", device_capacity_tokens=dev_tokens, start_layer=0,
        end_layer=layers - 1, host_token_capacity=pages * page_size)


def storage_config(extra: dict[str, Any] | None, model: str = "org/model", tp_rank: int = 0,
                   tp_size: int = 1, metrics: bool = True, dp_rank: int = 0
                   ) -> HiCacheStorageConfig:
    """The config SGLang's cache controller hands a storage backend, for a single-node MHA model
    (page_first layout); ``extra``: ``--hicache-storage-backend-extra-config``; ``metrics``:
    SGLang's ``--enable-metrics``."""
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=metrics, is_page_first_layout=True,
        model_name=model, dp_rank=dp_rank, extra_config=extra)
