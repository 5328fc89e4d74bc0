"""Redis URLs: what the configuration may name (checked when it is read), how logs show them
(without the password), and the redis-py client each one builds."""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.connection import parse_url
from redis.exceptions import RedisClusterException, RedisError

#: the cluster schemes, and the plain scheme redis-py takes for each
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
#: query options of a URL that name files (TLS): they must exist when the config is read
_FILE_OPTIONS = ("ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile")


def url_problem(url: str) -> str | None:
    """What is wrong with a Redis URL (its scheme, port, database, query options, the files they
    name), or None: what building the client or its first connection would raise only once the
    daemon's pools exist (a cluster client at the start, a plain one at every connection, which
    left L3 off for good), said when the config is read. Builds the client, connecting to
    nothing."""
    parts = urlsplit(url)
    scheme = CLUSTER_SCHEMES.get(parts.scheme, parts.scheme)
    if scheme not in ("redis", "rediss", "unix"):
        return (f"must start with redis://, rediss://, unix://, redis+cluster:// or "
                f"rediss+cluster://, got {parts.scheme!r}")
    try:
        parse_url(url if scheme == parts.scheme else url.replace(parts.scheme, scheme, 1))
    except ValueError as exc:
        return str(exc)
    if scheme != "unix" and parts.path not in ("", "/") and not parts.path[1:].isdigit():
        return f"the database must be a number (redis://host:port/0), got {parts.path[1:]!r}"
    for key, value in parse_qsl(parts.query):
        if key in _FILE_OPTIONS and not os.path.exists(value):
            return f"{key}: no such file {value!r}"
    try:
        client = client_for_url(url, max_connections=1, op_timeout=1.0, common={})
        if not isinstance(client, RedisCluster):  # (a connection object; nothing is dialled)
            client.connection_pool.make_connection()
    except TypeError as exc:  # an option no client or connection takes (a typo)
        name = str(exc).rpartition(" ")[2]
        return (f"unknown query option {name} (they are redis-py's connection arguments, "
                f"such as ssl_ca_certs: docs/operations.md, [l3])")
    except RedisClusterException as exc:  # (a cluster has one database: no /N, no db=)
        return str(exc)
    except (ValueError, RedisError) as exc:
        return str(exc)
    return None


def client_for_url(url: str, max_connections: int, op_timeout: float,
                   common: dict[str, Any]) -> Any:
    """The redis-py client of a URL: a cluster client for a ``+cluster`` scheme, else one over a
    blocking pool, where a burst waits (bounded by ``op_timeout``) for a free connection
    instead of failing with "too many connections"."""
    parts = urlsplit(url)
    if parts.scheme in CLUSTER_SCHEMES:
        url = urlunsplit((CLUSTER_SCHEMES[parts.scheme],) + tuple(parts)[1:])
        return RedisCluster.from_url(url, max_connections=max_connections, **common)
    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=op_timeout, **common)
    return aioredis.Redis.from_pool(pool)  # the client owns (closes) its pool


def has_password(url: str) -> bool:
    """Whether ``url`` carries a password where :func:`redact_url` would hide one (a URL that
    does not parse carries none)."""
    try:
        parts = urlsplit(url)
        return bool(parts.password) or any(
            k.lower() == "password" for k, _ in parse_qsl(parts.query, keep_blank_values=True))
    except ValueError:
        return False


def redact_url(url: str, mask: str = "***") -> str:
    """``url`` with its password (in the user info or a ``password=`` query parameter) replaced
    by ``mask``: Redis URLs carry credentials, and logs are read by more people than configs."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        if ":" in userinfo:
            userinfo = userinfo.split(":", 1)[0] + ":" + mask
        netloc = f"{userinfo}@{host}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([(k, mask if k.lower() == "password" else v) for k, v in pairs],
                          safe="*<>")
    out = urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
    if "://" in url and "://" not in out:  # unix:///path: urlunsplit drops the empty netloc
        out = out.replace(":", "://", 1)
    return out
