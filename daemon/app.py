"""The composition root: every long-lived object of the daemon is built here, from the Config.

Nothing below this module constructs its own collaborators: the device pools, the host and L3
storage, the tier managers, the service, the checker, the server and the admin endpoint are made
here and handed to whoever uses them. So the layers only point downward (server and admin ->
service -> tiers -> model cache -> tree, gpu, storage), a test builds exactly the pieces it needs
(``build_service(config, create_pools=False)``), and docs/design.md has one place to point at.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from radixd_client import protocol as P

from .admin import AdminHandle, TokenFileError, start_admin
from .checker import Checker
from .config import Config, ConfigError, ModelConfig
from .entities import ModelEntry, Tenant, build_tenants, namespace_quotas
from .gpu.shared_memory import hide_descriptors
from .model_cache import ModelCache
from .open_files import raise_soft_limit
from .process_memory import tune_gc
from .sdnotify import Notifier, fdstore_enabled, fdstore_max, passed_fds
from .server import Server
from .service import Service
from .sockets import (
    ConfiguredAddressError,
    SocketPathError,
    check_socket_owner,
    check_socket_path,
    refuse_served_socket,
)

log = logging.getLogger("radixd.app")

#: what to change when the admin endpoint's TCP port is taken
ADMIN_PORT_FIX = "set admin.port (0 picks a free port) or admin.unix_socket"


def _gib(n: int) -> str:
    """Bytes as an operator reads them (GiB, MiB or KiB, one decimal)."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"


def preflight(config: Config, serving: bool = False) -> str:
    """Every check ``radixd serve`` makes before it allocates or binds anything: each model's
    device exists, and its pools fit in the memory that is free (device pools on the GPU or in
    host memory, host tiers in host memory, all models together), and the socket paths can hold
    a socket. Raises ConfigError (or SocketPathError) with one line naming the model and the
    key to change; returns a one-line summary of what start would allocate. ``radixd config
    check`` runs it so that an operator learns this before a restart, while the daemon runs,
    perhaps as another user: it touches nothing. ``run`` runs it first, ``serving``, so that
    start fails the same way (no traceback) before the pools are allocated, and also as the
    daemon's user: the state directory is created and must be writable, the socket's directory
    must be no one else's to replace (:func:`check_socket_owner`), and no daemon may serve on
    the socket already (OSError, exit 1), unless systemd passed it (then it is systemd's: a
    probe would start a socket-activated daemon)."""
    from .gpu.profile import ProfileError
    from .gpu.shared_memory import available_host_bytes

    check_socket_path(config.server.socket)
    if serving and not passed_fds()[0]:
        check_socket_owner(config.server.socket)
        refuse_served_socket(config.server.socket)
    if config.server.state_dir:
        from .storage.host_snapshot import check_state_dir

        problem = check_state_dir(config.server.state_dir, create=serving)
        if problem:
            raise ConfigError(f"server.state_dir: {problem}")
    if config.admin.enabled and config.admin.unix_socket:
        try:
            check_socket_path(config.admin.unix_socket)
        except SocketPathError as exc:
            exc.key = "admin.unix_socket"
            raise

    host_need, device_need = 0, dict[str, int]()
    parts: list[str] = []
    for mc in config.models:
        where = f'models["{mc.name}"]'
        if not mc.export_pools:
            parts.append(f"{mc.name}: bookkeeping only (export_pools = false)")
            continue
        profile = mc.profile()
        try:
            device = profile.resolve_device()
        except ProfileError as exc:
            raise ConfigError(f"{where}.{exc}") from None
        pools = profile.full_pool_bytes + profile.swa_pool_bytes
        host = 0
        if mc.host_pages:
            host = mc.host_pages * profile.full_page_bytes + (
                mc.host_swa_pages * profile.swa_page_bytes if profile.has_swa else 0)
        if device.type == "cpu":
            host_need += pools
            available = available_host_bytes()
            if available is not None and host_need > available:
                raise ConfigError(
                    f"{where}.full_pages: the pools (on the CPU) need {_gib(pools)} but only "
                    f"{_gib(max(0, available - host_need + pools))} of host memory is free; "
                    "lower full_pages/swa_pages (or full_bytes/swa_bytes)")
        else:
            import torch

            device_need[str(device)] = device_need.get(str(device), 0) + pools
            free, _total = torch.cuda.mem_get_info(device)
            if device_need[str(device)] > free:
                raise ConfigError(
                    f"{where}.full_pages: the pools need {_gib(pools)} but only "
                    f"{_gib(max(0, free - device_need[str(device)] + pools))} is free on "
                    f"{device}; lower full_pages/swa_pages (or full_bytes/swa_bytes)")
        host_need += host
        available = available_host_bytes()
        if host and available is not None and host_need > available:
            raise ConfigError(
                f"{where}.host_pages: the host tier needs {_gib(host)} but only "
                f"{_gib(max(0, available - host_need + host))} of host memory is free; lower "
                "host_pages/host_swa_pages (0: no host tier)")
        parts.append(f"{mc.name}: {_gib(pools)} of pools on {device}"
                     + (f", {_gib(host)} host tier" if host else ""))
    return f"{len(config.models)} model(s): " + "; ".join(parts)


def build_pools(mc: ModelConfig) -> Any:
    """The device KV pools of one model (torch is imported only when pools are wanted)."""
    from .gpu.pools import KVPools

    segments = mc.segments()
    if segments is None and mc.memory_isolation == "auto":
        log.warning("model %r: its pools are on CUDA, where memory isolation between tenants is "
                    "not built yet: every tenant allowed on the model can map all of its pages "
                    "(docs/operations.md, memory isolation)", mc.name)
    return KVPools(mc.profile(), segments)


def l3_models(config: Config) -> list[str]:
    """The models whose host tier uses L3: those with a host tier and exported pools (the tiers
    exist only then) that ask for L3 (``l3``, the default)."""
    return [m.name for m in config.models if m.l3 and m.host_pages and m.export_pools]


def l3_unused(config: Config) -> str:
    """Why ``l3.url`` is set but no model uses it (empty when it is unset or used): L3 holds
    what a host tier evicts, so it is off where there is none, which nothing else would tell an
    operator who set the URL. ``run`` logs it, ``radixd config check`` prints it."""
    if not config.l3.url or l3_models(config):
        return ""
    if not any(m.host_pages for m in config.models):
        why = "no model has a host tier (host_pages = 0 everywhere)"
    else:
        why = "every model with a host tier has l3 = false or export_pools = false"
    return (f"l3.url is set but L3 is off: {why}, and L3 sits below the host tier (it holds "
            "what the host tier evicts); give a model host_pages > 0 (with l3 = true and "
            "export_pools = true), or remove l3.url")


def build_l3(config: Config) -> Any:
    """The shared Redis client, when some model's host tier uses L3 (:func:`l3_models`)."""
    if not config.l3.url or not l3_models(config):
        return None
    from .storage.redis_tier import RedisTier

    c = config.l3
    return RedisTier(c.url, key_prefix=c.key_prefix + ":", ttl_seconds=c.ttl_s,
                     op_timeout=c.op_timeout_ms / 1000, breaker_threshold=c.breaker_threshold,
                     breaker_open_seconds=c.breaker_open_s, max_connections=c.max_connections)


def build_model(config: Config, mc: ModelConfig, pools: Any) -> ModelEntry:
    """A model's cache and the description engines get in hello; ``pools`` None: not exported."""
    profile = mc.profile()
    info = P.ModelInfo(
        name=profile.name, page_size=profile.page_size, sliding_window=profile.sliding_window,
        num_full_layers=profile.num_full_layers, num_swa_layers=profile.num_swa_layers,
        num_kv_heads=profile.num_kv_heads, head_dim=profile.head_dim, dtype=profile.dtype,
        device=str(pools.device) if pools is not None else profile.device,
        full_pages=profile.full_pages, swa_pages=profile.swa_pages,
        host_pages=mc.host_pages if pools is not None else 0,
        l3=bool(pools is not None and mc.host_pages and mc.l3 and config.l3.url))
    cache = ModelCache(profile, pools=pools, policy=mc.eviction_policy,
                       segment_pages=mc.segments(profile),
                       long_runs_in_use=config.server.long_runs_in_use)
    return ModelEntry(mc.name, cache, info, pools)


def build_tiers(config: Config, models: dict[str, ModelEntry], tenants: list[Tenant],
                l3: Any) -> None:
    """A host tier and its manager for every model with exported pools and a host tier (the
    manager copies between the two)."""
    from .keyed_tier import KeyedTier
    from .storage.host_tier import HostTier
    from .tiers import TierManager

    host_quotas = namespace_quotas(tenants, "quota_host")
    l3_quotas = namespace_quotas(tenants, "quota_l3")
    for mc in config.models:
        entry = models[mc.name]
        if entry.pools is not None and mc.host_pages:
            host = HostTier(entry.cache.profile, mc.host_pages, mc.host_swa_pages,
                            segment_pages=mc.host_segments())
            entry.tiers = TierManager(entry.cache, entry.pools, host, mc,
                                      l3 if mc.l3 else None, config.l3, host_quotas, l3_quotas)
            # keyed pages written to Redis count against the same L3 ledger as the tree's
            entry.keyed = KeyedTier(entry.cache, host, host_quotas, mc.name,
                                    l3 if mc.l3 else None, config.l3.write_policy,
                                    l3_charge=entry.tiers.charge_l3,
                                    l3_forget=entry.tiers.l3_ledger.forget)


def build_service(config: Config, *, create_pools: bool = True) -> Service:
    """The service and everything under it. Without pools (tests, tools) there are no tiers."""
    models = {mc.name: build_model(config, mc, build_pools(mc)
                                   if create_pools and mc.export_pools else None)
              for mc in config.models}
    tenants = build_tenants(config)
    l3 = build_l3(config)
    build_tiers(config, models, tenants, l3)
    service = Service(config, models, tenants, l3)
    if create_pools:
        from .warm_restart import (
            NO_INDEX,
            discard_host_state,
            restore_host_fdstore,
            restore_host_state,
        )

        stored = passed_fds()[1]
        notifier = Notifier.from_env()
        try:
            report = restore_host_fdstore(models, stored, notifier.remove_fds)
        finally:
            notifier.close()
        # a stop whose fd-store save failed half way saved to state_dir instead, and left
        # systemd holding some pools without the index: those are refused (and removed), and
        # the state directory is what that stop kept; after any other fd-store restore, what
        # state_dir holds is older than it
        state_dir = config.server.state_dir
        if (report is None or report.reason == NO_INDEX) and state_dir:
            saved = restore_host_state(models, state_dir)
            report = saved if report is None or saved.source != "none" else report
        elif report is not None and state_dir:
            discard_host_state(state_dir)
        if report is not None:
            service.restart = report
    return service


@dataclass
class Daemon:
    """The wired daemon: what ``radixd serve`` runs and what in-process tests drive."""

    config: Config
    service: Service
    checker: Checker
    server: Server

    async def start_admin(self) -> AdminHandle | None:
        """The admin endpoint, before READY. A port that was configured (file, environment)
        and cannot be bound stops the daemon (exit 2: the configuration must change); the
        built-in default port being taken (another daemon on this machine) only costs this one
        its admin endpoint, loudly."""
        cfg = self.config.admin
        if not cfg.enabled:
            log.info("admin endpoint disabled (admin.enabled = false)")
            return None
        try:
            return await start_admin(self.config, self.service, self.server, self.checker,
                                     str(self.server.socket_path))
        except TokenFileError as exc:  # (exit 2, as a configuration error: see cli)
            why = str(exc.strerror or exc).removeprefix("admin.token_file ")
            raise ConfigError(f"admin.token_file: {why}") from None
        except SocketPathError as exc:
            exc.key = "admin.unix_socket"
            raise
        except OSError as exc:
            why = exc.strerror or str(exc)
            if cfg.unix_socket is not None:
                raise OSError(exc.errno, f"admin endpoint {cfg.unix_socket}: {why}") from exc
            if "port" in cfg.model_fields_set:  # whoever holds it will hold it at the next try
                error = ConfiguredAddressError(
                    exc.errno, f"admin endpoint {cfg.host}:{cfg.port}: {why}; {ADMIN_PORT_FIX}")
                error.key = "admin.port"
                raise error from exc
            log.error("admin endpoint not started: cannot bind %s:%d (%s); %s", cfg.host,
                      cfg.port, why, ADMIN_PORT_FIX)
            return None


def build(config: Config, *, create_pools: bool = True,
          notifier: Notifier | None = None) -> Daemon:
    service = build_service(config, create_pools=create_pools)
    checker = Checker(service, config.checker)
    if fdstore_enabled() and create_pools:
        service.fd_store = (notifier or Notifier.from_env()).store_fd
        service.fd_store_max = fdstore_max()
    server = Server(config, service, notifier, checker)
    daemon = Daemon(config, service, checker, server)
    server.start_admin = daemon.start_admin
    return daemon


def run(config: Config) -> int:
    """Build the daemon and serve until SIGTERM/SIGINT; returns the process exit code.

    Raises ConfigError (a model's device or memory) and SocketPathError (the socket's path)
    before serving, ConfiguredAddressError (an admin port that is taken) once serving: the
    operator's to fix, exit 2."""
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop is a dependency; asyncio works too
        log.warning("uvloop not available; using the default asyncio loop")
    before, now = raise_soft_limit()
    if now > before:  # (engine connections and segments are descriptors)
        log.info("open files limit raised from %d to %d", before, now)
    notifier = Notifier.from_env()
    preflight(config, serving=True)  # ConfigError before anything is allocated or bound
    unused = l3_unused(config)
    if unused:
        log.warning("%s", unused)
    if config.server.state_dir:  # before its state is read: held until this process ends
        from .storage.host_snapshot import lock_state_dir

        problem = lock_state_dir(config.server.state_dir)
        if problem:
            raise ConfigError(f"server.state_dir: {problem}")
    hide_descriptors()  # the pools' memfds: not through /proc/<pid>/fd (memory isolation)
    notifier.status("allocating KV pools")
    with notifier.extending_timeout():  # large pools can take longer than TimeoutStartSec
        daemon = build(config, notifier=notifier)
    tune_gc()
    return asyncio.run(daemon.server.serve())
