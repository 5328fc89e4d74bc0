"""Instance B of the sharing test: another process, another SGLang host pool, same radixd."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from conftest import GEOMETRY  # noqa: E402
from radixd_sglang.testing import host_pool, storage_config  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402


def main() -> None:
    socket, path = sys.argv[1], sys.argv[2]
    data = torch.load(path)
    keys, want = data["keys"], data["want"]
    pool = host_pool(pages=16, **GEOMETRY)
    pool.alloc(3 * pool.page_size)  # B's free pages are not A's
    extra = {"backend_name": "radixd", "module_path": "radixd_sglang",
             "class_name": "RadixdHiCacheStorage", "interface_v1": 1, "socket": socket,
             "model": "m"}
    b = StorageBackendFactory.create_backend("dynamic", storage_config(extra), pool)
    b.register_mem_pool_host(pool)
    found = b.batch_exists(keys)
    dst = pool.alloc(len(keys) * pool.page_size)
    ok = b.batch_get_v1(keys, dst)
    for i in range(len(keys)):
        got = pool.get_data_page(int(dst[i * pool.page_size]), flat=True)
        assert torch.equal(got, want[i]), f"page {i} differs"
    b.close()
    print(f"B: {found} pages found, {sum(ok)} fetched, byte-exact")


if __name__ == "__main__":
    main()
