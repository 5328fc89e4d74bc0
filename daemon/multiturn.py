"""Moved to :mod:`radixd_bench.multiturn` (the bench is a client of the daemon, not part of it).

This alias stays only while bench/tier_bench.py still imports ``daemon.multiturn``; nothing in
the daemon uses it.
"""

from radixd_bench.multiturn import *  # noqa: F403
from radixd_bench.multiturn import __all__  # noqa: F401
