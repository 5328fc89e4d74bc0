"""Moved to :mod:`radixd_bench.workload`; this alias stays only while bench/tier_bench.py still
imports ``daemon.workload``. Nothing in the daemon uses it."""

from radixd_bench.workload import Workload

__all__ = ["Workload"]
