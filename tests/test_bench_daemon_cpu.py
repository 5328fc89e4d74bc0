"""The benchmarks' daemon CPU readings: the event loop's thread is read apart from the whole
process, so that a benchmark can tell the loop's own work from its other threads' (a figure
that grew only in those threads on a many-core host is not the loop doing more)."""

from __future__ import annotations

from radixd_client import Client

from bench import daemon_cpu_bench as dcb
from bench._common import DaemonProcess


def test_the_loop_thread_is_read_apart_from_the_process_and_counts_the_requests() -> None:
    d = DaemonProcess(dcb.config(dcb.model_keys(), dcb.PAGE) + dcb.ADMIN_ANY_PORT)
    try:
        loop0, cpu0 = d.loop_cpu_s(), d.cpu_s()
        with Client(d.socket) as c:
            for _ in range(20_000):
                c.ping(b"x" * 8)
        loop1, cpu1 = d.loop_cpu_s(), d.cpu_s()
    finally:
        d.stop()
    assert loop1 > loop0  # 20,000 requests are tens of ticks of the loop's CPU
    assert cpu1 - cpu0 >= loop1 - loop0 - 0.02  # a part of the whole (two ticks of slack)
    assert loop0 <= cpu0  # the start-up's threads count in the process, not in the loop
