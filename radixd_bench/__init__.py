"""Workloads that drive a running radixd the way inference engines do (``radixd bench``).

Shipped with the daemon so that ``radixd bench multiturn`` works from an installed daemon, but
kept out of the ``daemon`` package: it is a client of the daemon (it speaks only the socket
protocol, through ``radixd_client``), and nothing in the daemon imports it except the thin
``bench`` entry of the command line. :mod:`radixd_bench.multiturn` is its public API.
"""
