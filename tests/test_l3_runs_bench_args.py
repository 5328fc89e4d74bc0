"""bench/l3_runs_bench.py's options: values it has no workload for are a usage error naming the
option, before anything is exported, started or written to Redis; the workload and the pools it
sizes."""

from __future__ import annotations

import pytest

from bench import l3_runs_bench as lrb


@pytest.mark.parametrize("argv", [
    ["--page-sizes", "0"], ["--page-sizes", "16,-4"], ["--page-sizes", "2048"],
    ["--page-sizes", "x"], ["--page-sizes", ""], ["--page-sizes", "4,,16"],
    ["--requests", "0"], ["--request-tokens", "32"],  # below the largest page size, 64
    ["--request-tokens", "131072"], ["--shared-tokens", "4096"], ["--shared-tokens", "-1"],
    ["--rounds", "0"]])
def test_a_workload_it_cannot_build_is_a_usage_error_naming_the_option(argv, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        lrb.main(["--baseline", "HEAD", *argv])
    assert exc.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_page_sizes_parse() -> None:
    assert lrb.parse_page_sizes("1,4,16,64") == [1, 4, 16, 64]
    assert lrb.parse_page_sizes("48") == [48]  # not a divisor of 64: blocks of 2 pages


def test_the_first_half_share_a_prefix_and_the_rest_are_distinct() -> None:
    reqs = lrb.workload(3, 4, 256, 100)
    assert [len(r) for r in reqs] == [256] * 4
    assert reqs[0][:100] == reqs[1][:100] and reqs[0][100:] != reqs[1][100:]
    assert reqs[2][:100] != reqs[0][:100] and reqs[3][:100] != reqs[2][:100]
    assert reqs == lrb.workload(3, 4, 256, 100)  # the same on both sides


@pytest.mark.parametrize("page", [1, 16, 64])
def test_the_pools_hold_every_request(page) -> None:
    conf = lrb.config("redis://127.0.0.1:6379", "p", page, 16, 4096)
    pages = 16 * 4096 // page + 64
    for key in ("full_pages", "swa_pages", "host_pages", "host_swa_pages"):
        assert f"\n{key} = {pages}\n" in conf
    assert f"page_size = {page}\n" in conf and 'key_prefix = "p"' in conf
    # DaemonProcess fills in the sockets
    assert "{socket}" in conf and "{admin}" in conf
