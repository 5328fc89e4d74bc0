"""bench/daemon_cpu_bench.py's --page-size and --request-tokens: values it has no workload for
are a usage error naming the option, before anything is exported or measured; the request keeps
its shape in tokens at every page size, and the pools hold the same tokens."""

from __future__ import annotations

import random

import pytest

from bench import daemon_cpu_bench as dcb
from bench import rpc_bench


@pytest.mark.parametrize("argv", [["--page-size", "0"], ["--page-size", "3"],
                                  ["--page-size", "128"], ["--page-size", "x"]])
def test_a_page_size_it_has_no_workload_for_is_a_usage_error(argv, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        dcb.main(["--baseline", "HEAD", *argv])
    assert exc.value.code == 2
    assert "--page-size" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--request-tokens", "0"], ["--request-tokens", "-64"],
                                  ["--request-tokens", "100"],  # not a multiple of 4 * 16
                                  ["--request-tokens", "16384"], ["--request-tokens", "4k"]])
def test_request_tokens_it_cannot_shape_or_fit_are_a_usage_error(argv, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        dcb.main(["--baseline", "HEAD", "--page-size", "16", *argv])
    assert exc.value.code == 2
    assert "--request-tokens" in capsys.readouterr().err


@pytest.mark.parametrize("device", ["tpu", "gpu", "", "cudax", "cuda:"])
def test_a_device_that_is_not_cpu_or_cuda_is_a_usage_error(device, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        dcb.main(["--baseline", "HEAD", "--device", device])
    assert exc.value.code == 2
    assert "--device" in capsys.readouterr().err


@pytest.mark.parametrize("page", [1, 16, 64])
def test_the_request_keeps_its_shape_in_tokens(page) -> None:
    assert dcb.request_shape(page) == (256, 128)  # 4 + 2 pages of 64
    assert dcb.request_shape(page, 4096) == (3072, 1024)
    rng = random.Random(1)
    prefixes = rpc_bench._prefixes(rng, 3072)
    assert len(prefixes) == 8 and all(len(p) == 3072 for p in prefixes)
    reqs = rpc_bench._requests(rng, prefixes, fresh=1024)
    assert len(reqs) == 64  # 512 * 128 / 1024: the tree gets about as many tokens as by default
    assert all(len(r) == 4096 * 4 and list(memoryview(r).cast("i")[:3072]) in prefixes
               for r in reqs)


@pytest.mark.parametrize("page", [1, 16, 64])
def test_the_pools_hold_the_same_tokens_at_every_page_size(page) -> None:
    conf = rpc_bench.config(dcb.model_keys(page), page)
    k = 64 // page
    assert f"page_size = {page}\n" in conf
    assert f"full_pages = {40000 * k}\n" in conf and f"swa_pages = {20000 * k}\n" in conf
    if page != 64:
        assert f"host_pages = {4096 * k}\n" in conf and f"host_swa_pages = {1024 * k}\n" in conf
    assert "host_pages = 0\n" in rpc_bench.config(dcb.model_keys(page, host_off=True), page)


def test_the_default_is_rpc_bench_workload_unchanged() -> None:
    assert rpc_bench.config(dcb.model_keys(), 64) == rpc_bench.config()
    assert "host_pages" not in rpc_bench.config()
    assert len(rpc_bench._requests(random.Random(1), rpc_bench._prefixes(random.Random(1)))) \
        == 512


def test_fresh_requests_are_new_past_the_prefix_every_time() -> None:
    rng = random.Random(1)
    prefixes = rpc_bench._prefixes(rng, 48)
    reqs = rpc_bench._requests(rng, prefixes, n=4, fresh=16)
    fresh = dcb.FreshRequests(reqs, 48, seed=3)
    assert len(fresh) == 4
    seen = set()
    for i in range(12):
        r = fresh[i % len(fresh)]
        ids, base = list(memoryview(r).cast("i")), list(memoryview(reqs[i % 4]).cast("i"))
        assert len(ids) == 64 and ids[:48] == base[:48] and ids[49:] == base[49:]
        assert ids[48] > 100_000 and ids[48] not in seen  # never a drawn id, never repeated
        seen.add(ids[48])


@pytest.mark.parametrize("batch", ["0", "-1", "65", "x"])
def test_a_batch_it_cannot_send_is_a_usage_error(batch, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        dcb.main(["--baseline", "HEAD", "--batch", batch])
    assert exc.value.code == 2
    assert "--batch" in capsys.readouterr().err
