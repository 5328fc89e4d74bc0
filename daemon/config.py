"""Configuration: a TOML file, environment overrides, validated with pydantic at start.

Precedence: built-in defaults < the TOML file < ``RADIXD_<SECTION>_<KEY>`` environment variables
< command-line flags. A bad value stops the daemon before it binds anything, with a message that
names the key. Every key is documented in docs/operations.md (and ``radixd config example``).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import os
import sys
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .gpu.profile import ModelProfile, ProfileError
from .gpu.segments import (
    pool_page_multiple,
    resolve_host_segment_pages,
    resolve_segment_pages,
)
from .storage.redis_urls import redact_url, url_problem
from .tree.policy import POLICIES

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


class ConfigError(ValueError):
    """The configuration is invalid; the message names the key."""


#: a uid or gid: (uid_t) -1 is "no id", never a peer's
PosixId = Annotated[int, Field(ge=0, le=2**32 - 2)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True,
                              allow_inf_nan=False)


#: The socket of the shipped systemd unit (RuntimeDirectory=radixd), and root's default.
SERVICE_SOCKET = "/run/radixd/radixd.sock"


def default_socket_path() -> str:
    """Under systemd with ``RuntimeDirectory=`` (the shipped unit), ``radixd.sock`` in it: a
    service user's own fallback would be under /tmp, which ``PrivateTmp=`` hides from engines.
    Else /run/radixd/radixd.sock for root; a per-user runtime directory otherwise."""
    service = os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0]
    if service:
        return str(Path(service) / "radixd.sock")
    if os.geteuid() == 0:
        return SERVICE_SOCKET
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) if runtime else Path(f"/tmp/radixd-{os.geteuid()}")
    return str(base / "radixd" / "radixd.sock")


class ServerConfig(_Section):
    socket: str = Field(default_factory=default_socket_path,
                        description="path of the Unix socket engines connect to")
    socket_mode: str = Field("0660", description="octal file mode of the socket")
    allowed_uids: list[PosixId] = Field(default_factory=list,
                                        description="peer uids allowed to connect (empty: any)")
    allowed_gids: list[PosixId] = Field(default_factory=list,
                                        description="peer gids allowed to connect (empty: any)")
    max_frame_bytes: int = Field(16 * 1024 * 1024, ge=1024, le=1 << 31,
                                 description="largest frame body accepted")
    max_tokens: int = Field(1 << 20, ge=1, description="most tokens in one request")
    max_inflight: int = Field(256, ge=1,
                              description="most operations a session may have pending: the "
                                          "largest batch, and the unsent responses before the "
                                          "daemon stops reading from it")
    max_sessions: int = Field(1024, ge=1, description="most concurrent sessions")
    max_locks_per_session: int = Field(65536, ge=1,
                                       description="most lock receipts one session may hold "
                                                   "(per model)")
    hello_timeout_s: float = Field(10.0, gt=0,
                                   description="seconds a connection may stay without a "
                                               "successful hello before it is closed")
    max_auth_failures: int = Field(3, ge=1,
                                   description="failed hellos before the connection is closed")
    malloc_trim_interval_s: float = Field(60.0, ge=0,
                                          description="seconds between malloc_trim(0) calls that "
                                                      "hand memory glibc freed back to the "
                                                      "kernel, so RSS does not creep (0: never)")
    idle_compaction: bool = Field(True, description="while no request waits, keep the page ids "
                                                    "of cold tree nodes as their runs (less "
                                                    "memory at small pages, for CPU the daemon "
                                                    "would otherwise leave idle)")
    long_runs_in_use: bool = Field(True, description="a tree node keeps device page ids of "
                                                     "1,024 pages or more that are one to four "
                                                     "ascending runs as their runs while in use "
                                                     "too (7.6 instead of 10.7 B/token of "
                                                     "metadata at page 1, for a few microseconds "
                                                     "more per match there); false: a node "
                                                     "takes them as arrays, kept as runs once "
                                                     "cold (idle_compaction)")
    state_dir: str | None = Field(None, description="directory (tmpfs: /run or /dev/shm) where a "
                                                    "graceful stop saves the host tier and the "
                                                    "next start restores it (warm restart); "
                                                    "unset: the host tier starts empty")

    @field_validator("socket_mode")
    @classmethod
    def _mode(cls, v: str) -> str:
        try:
            mode = int(v, 8)
        except ValueError:
            raise ValueError(f"must be an octal string like '0660', got {v!r}") from None
        if not 0 <= mode <= 0o777:
            raise ValueError(f"must be between 0000 and 0777, got {v!r}")
        return v

    @field_validator("socket", "state_dir")
    @classmethod
    def _absolute(cls, v: str | None) -> str | None:
        if v is not None and (not v or not os.path.isabs(v)):
            raise ValueError(f"{v!r} is not an absolute path (the daemon, its engines and "
                             "radixd status each have their own working directory)")
        return v

    @property
    def socket_mode_int(self) -> int:
        return int(self.socket_mode, 8)


_LOOPBACK = ("127.0.0.1", "::1", "localhost")


class AdminConfig(_Section):
    enabled: bool = Field(True, description="serve the admin HTTP endpoint")
    host: str = Field("127.0.0.1", description="loopback address to bind (127.0.0.1, ::1)")
    port: int = Field(8471, ge=0, le=65535, description="TCP port (0: any free port, logged)")
    unix_socket: str | None = Field(None, description="serve on this Unix socket instead of TCP")
    token: str | None = Field(None, description="bearer token for everything but /healthz "
                                                "(prefer token_sha256)")
    token_sha256: str | None = Field(None, description="hex SHA-256 of the bearer token")
    token_file: str | None = Field(None, description="with no token configured, a random one is "
                                                     "generated and written here (mode 0600); "
                                                     "default: admin.token beside the socket")
    max_connections: int = Field(64, ge=1, le=4096, description="most connections open at "
                                                              "once; more get a 503")
    tree_dump_max_nodes: int = Field(10_000, ge=1, description="most nodes /v1/tree returns")
    tenant_label_limit: int = Field(64, ge=1, description="most tenants given their own metric "
                                                          "labels; the rest are summed as _other")

    @model_validator(mode="after")
    def _one_token(self) -> AdminConfig:
        if self.token is not None and self.token_sha256 is not None:
            raise ValueError("give token or token_sha256, not both (with both, the digest was "
                             "ignored)")
        if self.token == "":
            raise ValueError("token is empty: no request could authenticate with it")
        return self

    @field_validator("host")
    @classmethod
    def _loopback(cls, v: str) -> str:
        if v not in _LOOPBACK:
            raise ValueError(f"the admin endpoint binds loopback only ({', '.join(_LOOPBACK)}), "
                             f"got {v!r}")
        return v

    @field_validator("token_sha256")
    @classmethod
    def _hex(cls, v: str | None) -> str | None:
        return _hex_digest(v)

    @field_validator("token_file")
    @classmethod
    def _absolute(cls, v: str | None) -> str | None:
        if v is not None and not os.path.isabs(v):
            raise ValueError(f"must be an absolute path (the daemon's working directory is not "
                             f"the shell's), got {v!r}")
        return v


def _hex_digest(v: str | None) -> str | None:
    if v is not None:
        v = v.lower()
        if len(v) != 64 or any(c not in "0123456789abcdef" for c in v):
            raise ValueError("must be 64 hex digits (sha256 of the token)")
    return v


class CheckerConfig(_Section):
    interval_s: float = Field(5.0, gt=0, description="seconds between background checks")
    strict: bool = Field(False, description="stop the daemon on the first violation (tests)")
    deep: bool = Field(True, description="re-hash every page in full checks")
    slice_ms: float = Field(0.5, gt=0, le=100, description="the longest the background full "
                            "check holds the event loop at once when no request is waiting (it "
                            "gives way after its current step as soon as one is)")
    share: float = Field(0.25, gt=0, le=1, description="the most of the event loop's time the "
                         "background full check takes: after each slice it sleeps long enough "
                         "to keep to it")


class ModelConfig(_Section):
    name: str = Field("default", min_length=1, description="what engines name the model by; "
                                                           "not '*' (tenants' 'all models')")
    page_size: int = 16
    sliding_window: int | None = 128
    num_full_layers: int = 2
    num_swa_layers: int = 2
    num_kv_heads: int = 2
    head_dim: int = 64
    dtype: str = "float16"
    device: str = "auto"
    full_pages: int = Field(2048, description="full pool capacity in pages, page 0 (padding) "
                                              "included")
    swa_pages: int = Field(512, description="SWA pool capacity in pages")
    full_bytes: int | None = Field(None, ge=1, description="full pool capacity in bytes instead "
                                                           "of pages (rounded down to whole "
                                                           "pages); not with full_pages")
    swa_bytes: int | None = Field(None, ge=1, description="SWA pool capacity in bytes instead of "
                                                          "pages; not with swa_pages")
    eviction_policy: str = Field("lru-depth", description="lru-depth (default) or lru")
    export_pools: bool = Field(True, description="allocate the KV pools and share them with "
                                                 "engines (off: bookkeeping only)")
    host_pages: int = Field(4096, ge=0, description="host (L2) pages for the full pool, each one "
                                                    "page of every full layer; 0: no host tier "
                                                    "(nor with export_pools = false)")
    host_swa_pages: int = Field(1024, ge=0, description="host (L2) pages for the SWA pool (only "
                                                        "the trailing window of a path is kept)")
    write_policy: Literal["write_through", "write_through_selective", "write_back"] = Field(
        "write_through", description="when device pages are copied to host: on insert, once a "
                                     "node was hit write_through_threshold times, or when "
                                     "evicted from device")
    write_through_threshold: int = Field(2, ge=1, description="hits before a node is copied to "
                                                              "host (write_through_selective)")
    l3: bool = Field(True, description="use the L3 (Redis) tier for this model when l3.url is set")
    memory_isolation: Literal["auto", "segments", "none"] = Field(
        "auto", description="segments: each namespace's pages come from its own segments "
                            "and an engine maps only its tenant's; none: one pool every "
                            "tenant maps whole (no memory isolation); auto: segments on the "
                            "CPU device, none on CUDA (not built there yet; logged)")
    segment_pages: int = Field(0, ge=0, description="pages per segment (memory_isolation = "
                                                    "segments); 0: automatic, about 128 "
                                                    "segments per model")
    host_segment_pages: int = Field(0, ge=0, description="host (L2) slots per segment when the "
                                                         "model is isolated; 0: automatic, "
                                                         "about 128 segments over the host "
                                                         "pools")

    @field_validator("name")
    @classmethod
    def _not_all(cls, v: str) -> str:
        if v == "*":
            raise ValueError("'*' means every model in a tenant's models: name the model "
                             "otherwise")
        return v

    @field_validator("sliding_window")
    @classmethod
    def _window(cls, v: int | None) -> int | None:
        return None if v == 0 else v  # TOML has no null: 0 means "no sliding-window layers"

    @field_validator("eviction_policy")
    @classmethod
    def _policy(cls, v: str) -> str:
        if v not in POLICIES:
            raise ValueError(f"unknown policy {v!r}; choose one of {sorted(POLICIES)}")
        return v

    @model_validator(mode="after")
    def _profile(self) -> ModelConfig:
        for pages, nbytes in (("full_pages", "full_bytes"), ("swa_pages", "swa_bytes")):
            if getattr(self, nbytes) is not None and pages in self.model_fields_set:
                raise ValueError(f"{nbytes}: give {pages} or {nbytes}, not both")
        if self.sliding_window is None and "num_swa_layers" not in self.model_fields_set:
            self.__dict__["num_swa_layers"] = 0  # no window: no SWA layers, unless told otherwise
        if self.sliding_window is None and self.num_swa_layers:
            raise ValueError("num_swa_layers: must be 0 when sliding_window = 0 (a model "
                             f"without sliding-window layers), got {self.num_swa_layers}")
        profile = self.profile()  # raises ProfileError naming the field
        # the byte sizes resolved to pages once, so every reader of full_pages sees the capacity
        # (written around validate_assignment, which would run this validator again)
        self.__dict__["full_pages"] = profile.full_pages
        if profile.sliding_window is not None:
            self.__dict__["swa_pages"] = profile.swa_pages
            window_pages = -(-profile.sliding_window // profile.page_size)
            if window_pages + 1 > profile.swa_pages - 1:  # (page 0 is reserved)
                raise ValueError(
                    f"sliding_window: {profile.sliding_window} tokens are {window_pages} pages "
                    f"of {profile.page_size}, and a request past the window holds them and one "
                    f"more: more than the SWA pool's {profile.swa_pages - 1} usable pages "
                    "(swa_pages); give it at least a window and a page per request served at "
                    "once")
        self.segments(profile)  # raises naming segment_pages
        if self.host_pages == 1 or self.host_swa_pages == 1:
            raise ValueError("host_pages and host_swa_pages: 0 (off) or at least 2 (page 0 is "
                             "reserved)")
        self.host_segments(profile)  # raises naming host_segment_pages
        return self

    def host_segments(self, profile: ModelProfile | None = None) -> int | None:
        """Slots per host segment, or None for shared host pools (no memory isolation)."""
        return resolve_host_segment_pages(profile or self.profile(), self.memory_isolation,
                                          self.host_segment_pages, self.host_pages,
                                          self.host_swa_pages)

    def segments(self, profile: ModelProfile | None = None) -> int | None:
        """Pages per segment, or None for the single shared pool (memory_isolation = none)."""
        return resolve_segment_pages(profile or self.profile(), self.memory_isolation,
                                     self.segment_pages, mapped=self.export_pools)

    def profile(self) -> ModelProfile:
        """The model's KV layout; pool sizes from ``full_bytes``/``swa_bytes`` when given."""
        window = self.sliding_window if self.num_swa_layers else None
        data: dict[str, Any] = dict(
            name=self.name, page_size=self.page_size, sliding_window=window,
            num_full_layers=self.num_full_layers, num_swa_layers=self.num_swa_layers,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype=self.dtype,
            device=self.device)
        if self.full_bytes is not None:
            data["full_bytes"] = self.full_bytes
        else:
            data["full_pages"] = self.full_pages
        if window is not None:
            if self.swa_bytes is not None:
                data["swa_bytes"] = self.swa_bytes
            else:
                data["swa_pages"] = self.swa_pages
        elif self.swa_bytes is not None:
            data["swa_bytes"] = self.swa_bytes  # refused: the model has no SWA layers
        try:
            profile = ModelProfile.from_dict(data)
        except ProfileError as exc:
            raise ValueError(str(exc)) from None
        multiple = pool_page_multiple(profile, self.memory_isolation, self.export_pools)
        if multiple == 1 or (self.full_bytes is None and self.swa_bytes is None):
            return profile
        # sized in bytes: rounded down to pages that segments can be mapped apart at (the page
        # count given outright is the operator's to choose: a misfit is an error naming it)
        down: dict[str, int] = {}
        for kind, given in (("full", self.full_bytes), ("swa", self.swa_bytes)):
            if given is None or (kind == "swa" and not profile.has_swa):
                continue
            pages = getattr(profile, f"{kind}_pages") // multiple * multiple
            if not pages:
                raise ValueError(f"{kind}_bytes: {given} bytes are fewer than the {multiple} "
                                 f"pages the pool's segments need at least (or "
                                 f"memory_isolation = \"none\")")
            down[f"{kind}_pages"] = pages
        return dataclasses.replace(profile, **down)


class L3Config(_Section):
    url: str = Field("", description="Redis URL: redis://[user:password@]host:port/db, rediss:// "
                                     "for TLS, redis+cluster:// for Redis Cluster; empty: no L3")
    key_prefix: str = Field("radixd", description="prefix of every key (keys are "
                                                  "<prefix>:<page hash>[:swa])")
    ttl_s: int = Field(0, ge=0, description="expiry of stored pages in seconds; 0: none (leave "
                                            "eviction to Redis maxmemory-policy allkeys-lru)")
    write_policy: Literal["write_through", "write_back"] = Field(
        "write_through", description="pages go to Redis when they reach host (write_through) or "
                                     "when host evicts them (write_back)")
    op_timeout_ms: int = Field(500, ge=1, description="bound on every Redis pipeline")
    breaker_threshold: int = Field(3, ge=1, description="consecutive failed calls that open the "
                                                        "circuit breaker")
    breaker_open_s: float = Field(5.0, gt=0, description="seconds the breaker stays open before "
                                                         "one half-open probe")
    prefetch_timeout_ms: int = Field(200, ge=1, description="the wait of a prefetch with policy "
                                                            "'timeout' and no timeout_ms")
    max_connections: int = Field(32, ge=1, description="Redis connections in the pool")
    drain_timeout_s: float = Field(5.0, ge=0, description="at shutdown, the longest wait for "
                                                          "copies in flight and the host and L3 "
                                                          "writes the policies owe")

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        problem = url_problem(v) if v else None
        if problem is not None:
            raise ValueError(redact_url(problem))
        return v

    @field_validator("key_prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        if not v or "{" in v or "}" in v:
            raise ValueError("must be non-empty and without braces (a Redis Cluster hash tag "
                             "would put every page in one slot)")
        return v


#: the tenant label value the tenants past ``admin.tenant_label_limit`` are summed under in
#: /metrics: no tenant may be named so
OTHER_TENANT = "_other"


class TenantConfig(_Section):
    name: str = Field(min_length=1)
    token: str | None = Field(None, description="the tenant's token (prefer token_sha256)")
    token_sha256: str | None = Field(None, description="hex SHA-256 of the tenant's token")
    namespace: str | None = Field(None, min_length=1,
                                  description="prefix namespace (default: the name); "
                                              "tenants may share one")
    models: list[str] = Field(default_factory=lambda: ["*"],
                              description="models the tenant may use ('*': all)")
    quota_full_pages: int = Field(0, ge=0, description="per model; 0: unlimited")
    quota_swa_pages: int = Field(0, ge=0, description="per model; 0: unlimited")
    quota_host_pages: int = Field(0, ge=0, description="host (L2) pages of the tenant's "
                                                       "namespace, per model; 0: unlimited")
    quota_l3_bytes: int = Field(0, ge=0, description="bytes this daemon keeps in L3 for the "
                                                     "tenant's namespace, per model; 0: unlimited")

    @field_validator("token_sha256")
    @classmethod
    def _hex(cls, v: str | None) -> str | None:
        return _hex_digest(v)

    @field_validator("name")
    @classmethod
    def _not_the_others(cls, v: str) -> str:
        if v == OTHER_TENANT:
            raise ValueError(f"{OTHER_TENANT!r} is the metrics' label of the tenants past "
                             "admin.tenant_label_limit: choose another name")
        return v

    @model_validator(mode="after")
    def _one_token(self) -> TenantConfig:
        if self.token is not None and self.token_sha256 is not None:
            raise ValueError("give token or token_sha256, not both")
        if self.token == "":
            raise ValueError("token is empty: no session could authenticate with it")
        return self

    def token_digest(self) -> bytes | None:
        if self.token is not None:
            return hashlib.sha256(self.token.encode()).digest()
        if self.token_sha256 is not None:
            return bytes.fromhex(self.token_sha256)
        return None


class Config(_Section):
    server: ServerConfig = Field(default_factory=ServerConfig)
    admin: AdminConfig = Field(default_factory=AdminConfig)
    checker: CheckerConfig = Field(default_factory=CheckerConfig)
    l3: L3Config = Field(default_factory=L3Config)
    models: list[ModelConfig] = Field(default_factory=lambda: [ModelConfig()])
    tenants: list[TenantConfig] = Field(default_factory=list)
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @model_validator(mode="after")
    def _consistent(self) -> Config:
        if not self.models:
            raise ValueError("models: at least one model is needed")
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"models: duplicate model names {names}")
        tnames = [t.name for t in self.tenants]
        if len(set(tnames)) != len(tnames):
            raise ValueError(f"tenants: duplicate tenant names {tnames}")
        seen: dict[bytes, str] = {}
        for t in self.tenants:
            if (first := seen.setdefault(t.token_digest(), t.name)) != t.name:
                raise ValueError(f"tenants: {first!r} and {t.name!r} have the same token (the "
                                 "second could never authenticate)")
        if self.admin.unix_socket is not None and os.path.abspath(
                self.admin.unix_socket) == os.path.abspath(self.server.socket):
            raise ValueError("admin: unix_socket is the engines' socket (server.socket); give the "
                             "admin endpoint a path of its own")
        for t in self.tenants:
            if t.token is None and t.token_sha256 is None:
                raise ValueError(f"tenants: tenant {t.name!r} needs token or token_sha256 "
                                 "(only the built-in default tenant has none)")
            for m in t.models:
                if m != "*" and m not in names:
                    raise ValueError(f"tenants: tenant {t.name!r} names unknown model {m!r}")
        return self


REDACTED = "<redacted>"


def admin_token_file(config: Config, socket_path: str | None = None) -> str:
    """Where a generated admin token is written: ``admin.token_file``, else ``admin.token``
    beside the engines' socket. The daemon (writing it) and ``radixd status`` (reading it) must
    agree, so both ask here."""
    return config.admin.token_file or str(
        Path(socket_path or config.server.socket).parent / "admin.token")


def admin_endpoint_file(socket_path: str) -> str:
    """Where a running daemon says which admin endpoint answers for its engine socket (JSON:
    url, instance, pid, started, token_file), so that ``radixd status --socket PATH`` talks to
    the daemon on PATH, not to whatever listens on the configured port: ``<socket>.admin``."""
    return f"{socket_path}.admin"


def redacted(config: Config) -> dict[str, Any]:
    """The effective configuration as JSON with every secret replaced: tokens, token digests
    and the password of the Redis URL (an ACL password travels in it)."""
    data = config.model_dump(mode="json")
    for section in (data.get("admin", {}), *data.get("tenants", [])):
        for key in ("token", "token_sha256"):
            if section.get(key) is not None:
                section[key] = REDACTED
    l3 = data.get("l3", {})
    if l3.get("url"):
        l3["url"] = redact_url(l3["url"], REDACTED)
    return data


ENV_PREFIX = "RADIXD_"
#: RADIXD_* variables of the project's other programs that look like the daemon's own: the
#: client examples' tenant token (examples/*.py), not RADIXD_ADMIN_TOKEN
_OTHER_PROGRAMS = frozenset({"TOKEN"})
_ENV_SECTIONS = {"SERVER": "server", "ADMIN": "admin", "CHECKER": "checker", "L3": "l3"}


def _env_overrides(env: dict[str, str]) -> tuple[dict[str, Any], dict[tuple[str, str], str]]:
    """``RADIXD_SERVER_SOCKET=/x`` -> {"server": {"socket": "/x"}}; ``RADIXD_LOG_LEVEL`` too.

    Values are parsed as TOML scalars when they parse (numbers, booleans, arrays), else strings.
    Also returns which variable set which (section, key), so that an error about a value that
    came from the environment names the variable the operator has to fix, not a TOML key.
    """
    out: dict[str, Any] = {}
    origin: dict[tuple[str, str], str] = {}
    for key, raw in env.items():
        if not key.startswith(ENV_PREFIX):
            continue
        rest = key[len(ENV_PREFIX):]
        if rest == "LOG_LEVEL":
            out["log_level"] = raw
            origin[("log_level", "")] = key
            continue
        if rest == "CONFIG":
            continue
        section, _, name = rest.partition("_")
        if section in ("MODELS", "TENANTS"):  # (tables of the file; a typo must not pass)
            raise ConfigError(f"{key}: [[{section.lower()}]] are set in the configuration file "
                              "only, not in the environment")
        if section not in _ENV_SECTIONS or not name:
            # another program's (a client's RADIXD_TOKEN, the test scripts'), unless it names a
            # section, is close to one of the daemon's, or names one of their keys without it
            # (RADIXD_SOCKET): a mistake for one of the daemon's
            names = _env_names()
            homes = [f"{ENV_PREFIX}{upper}_{rest}" for upper in _ENV_SECTIONS
                     if f"{upper}_{rest}" in names]
            hint = (_suggest(rest, names, ENV_PREFIX)
                    or (f"; did you mean {' or '.join(homes)}?" if homes else ""))
            if (hint or section in _ENV_SECTIONS) and rest not in _OTHER_PROGRAMS:
                raise ConfigError(f"{key}: unknown setting (sections: "
                                  f"{', '.join(ENV_PREFIX + s + '_<KEY>' for s in _ENV_SECTIONS)})"
                                  + hint)
            continue
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        if not isinstance(value, str) and _is_text(_ENV_SECTIONS[section], name.lower()):
            value = raw  # a token or path of digits: text all the same
        out.setdefault(_ENV_SECTIONS[section], {})[name.lower()] = value
        origin[(_ENV_SECTIONS[section], name.lower())] = key
    return out, origin


def _is_text(section: str, key: str) -> bool:
    """Whether the key takes a string (``str`` or ``str | None``)."""
    model = Config.model_fields[section].annotation
    field = getattr(model, "model_fields", {}).get(key)
    return field is not None and field.annotation in (str, str | None)


def _env_names() -> list[str]:
    """Every ``<SECTION>_<KEY>`` an environment variable may name (after ``RADIXD_``)."""
    names = ["LOG_LEVEL", "CONFIG"]
    for upper, section in _ENV_SECTIONS.items():
        model = Config.model_fields[section].annotation
        assert isinstance(model, type) and issubclass(model, BaseModel)
        names += [f"{upper}_{key.upper()}" for key in model.model_fields]
    return names


def _suggest(word: str, choices: list[str], prefix: str = "") -> str:
    """'; did you mean X?' for the closest valid name, or nothing when none is close."""
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.75)
    return f"; did you mean {prefix}{close[0]}?" if close else ""


def _section_fields(loc: tuple[Any, ...]) -> list[str]:
    """The keys valid where ``loc`` (a pydantic error location, minus its last part) points."""
    model: Any = Config
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part) if isinstance(model, type) else None
        if field is None:
            return []
        ann = field.annotation
        model = typing.get_args(ann)[0] if typing.get_origin(ann) is list else ann
    return list(model.model_fields) if isinstance(model, type) and issubclass(
        model, BaseModel) else []


def _where(loc: tuple[Any, ...], data: dict[str, Any]) -> str:
    """A location as the operator knows it: ``models["llama"].full_pages``, not
    ``models.0.full_pages`` (a model or tenant is named by its name, not its position)."""
    out = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            items = data.get(str(loc[i - 1])) if i == 1 else None
            item = items[part] if isinstance(items, list) and part < len(items) else None
            name = item.get("name") if isinstance(item, dict) else None
            if name is None and i == 1 and loc[0] == "models" and isinstance(item, dict):
                name = "default"
            out += f"[{name!r}]".replace("'", '"') if isinstance(name, str) else f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def _describe(err: Any, data: dict[str, Any], origin: dict[tuple[str, str], str]) -> str:
    """One pydantic error as one line naming the key (or the environment variable)."""
    loc = tuple(err["loc"])
    msg = str(err["msg"]).removeprefix("Value error, ")
    var = origin.get((str(loc[0]), str(loc[1]) if len(loc) > 1 else "")) if loc else None
    if err["type"] == "extra_forbidden":
        key = str(loc[-1])
        if var is not None:
            return (f"{var}: no such setting ({'.'.join(map(str, loc))} is not a key)"
                    + _suggest(var[len(ENV_PREFIX):], _env_names(), ENV_PREFIX))
        hint = _suggest(key, _section_fields(loc[:-1]))
        if not hint and len(loc) == 1:  # a section's key written above every section
            homes = [f"[[{name}]]" if typing.get_origin(f.annotation) is list else f"[{name}]"
                     for name, f in Config.model_fields.items()
                     if key in _section_fields((name,))]
            hint = f"; it is a key of {' and '.join(homes)}" if homes else ""
        return f"{_where(loc, data)}: not a configuration key" + hint
    field, sep, rest = msg.partition(": ")
    if sep and field.isidentifier() and field in _section_fields(loc):
        loc, msg = (*loc, field), rest  # "models.0: full_pages: ..." -> the key itself
    where = _where(loc, data)
    if var is not None:
        return f"{var} (setting {where}): {msg}"
    return f"{where}: {msg}"


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_config(path: str | os.PathLike | None = None, *, env: dict[str, str] | None = None,
                overrides: dict[str, Any] | None = None) -> Config:
    """Load and validate; raises ConfigError with every problem, each naming its key."""
    env = dict(os.environ) if env is None else env
    data: dict[str, Any] = {}
    if path is None:
        path = env.get(ENV_PREFIX + "CONFIG")
        if path == "":
            raise ConfigError(f"{ENV_PREFIX}CONFIG is empty: unset it, or name a file")
    if path is not None:
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            with open(path, "rb") as fh:
                bom = (" (it starts with a byte-order mark: save it without one)"
                       if fh.read(3) == b"\xef\xbb\xbf" else "")
            raise ConfigError(f"config file {path}: not valid TOML: {exc}{bom}") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"config file {path}: not UTF-8 text: {exc}") from None
        except OSError as exc:  # a directory, no permission to read it, ...
            raise ConfigError(f"config file {path} cannot be read: {exc.strerror or exc}"
                              ) from None
    env_data, origin = _env_overrides(env)
    data = _merge(data, env_data)
    data = _merge(data, overrides or {})
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        lines = [_describe(err, data, origin) for err in exc.errors()]
        if len(lines) == 1:
            raise ConfigError(f"invalid configuration: {lines[0]}") from None
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(lines)) from None
