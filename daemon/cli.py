"""The ``radixd`` command line.

Subcommands import their implementation lazily, so ``radixd --help`` stays fast and does not pull
in torch.

Exit codes: 0 success; 1 runtime failure (e.g. the socket is taken, the daemon is unreachable);
2 usage or configuration error; 3 the daemon stopped on an invariant violation (strict mode);
4 ``radixd check`` found invariant violations; 130 interrupted (SIGINT) before serving; 141 the
reader of stdout went away (``radixd status | head -1``).

``status`` and ``check`` talk to the admin HTTP endpoint with the standard library only (TCP, or
a Unix socket when ``admin.unix_socket`` is set), so they work without aiohttp and start fast.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import logging
import os
import socket
import sys
import time
import urllib.parse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from daemon import __version__
from radixd_bench.unix_http import UnixHTTPConnection

from .status_summary import format_status

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_INVARIANT, EXIT_VIOLATIONS = 0, 1, 2, 3, 4
#: stdout closed by its reader (``radixd status | head -1``): what a shell reports for a command
#: that SIGPIPE ended (128 + 13), as ``cat`` or ``grep`` would end there, so ``set -o pipefail``
#: treats radixd like any other filter; 1 would claim a runtime failure that did not happen
EXIT_BROKEN_PIPE = 141
#: SIGINT (Ctrl-C) before the daemon serves, or during a command: 128 + 2, as the shell expects
EXIT_INTERRUPTED = 130

_ADMIN_EXIT_CODES = ("exit codes: 0 ok; 1 the admin endpoint is unreachable, refused the token, "
                     "or answered an error; 2 usage or configuration error")


def build_parser() -> argparse.ArgumentParser:
    """Build the argument parser (separate from ``main`` so tests can inspect it)."""
    parser = argparse.ArgumentParser(
        prog="radixd",
        description="KV-cache and prefix radix tree daemon for LLM inference engines.",
        epilog="exit codes: 0 ok, 1 runtime failure, 2 usage or configuration error, "
               "3 stopped on an invariant violation (strict mode), 4 radixd check found "
               "invariant violations",
    )
    parser.add_argument("--version", action="version", version=f"radixd {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    serve = sub.add_parser(
        "serve", help="run the daemon",
        description="Run the daemon until SIGTERM/SIGINT. Without --config it serves a small "
                    "default model on the CPU (or the first GPU), with one tenant that needs no "
                    "token, on a socket in the per-user runtime directory "
                    "(/run/radixd/radixd.sock for root). Settings: built-in defaults < the TOML "
                    "file < RADIXD_<SECTION>_<KEY> environment variables < these flags.")
    _config_args(serve)
    serve.add_argument("--strict", action="store_true", default=None,
                       help="stop the daemon (exit 3) on the first invariant violation")
    serve.add_argument("--check-interval", type=float, metavar="SECONDS",
                       help="seconds between background invariant checks")
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    serve.set_defaults(handler=_serve)

    status = sub.add_parser(
        "status", help="a summary of a running daemon (from its admin endpoint)",
        description="Ask a running daemon's admin endpoint (GET /v1/stats) and print models, "
                    "pool usage, hit rates, sessions, tenants and the last invariant check. The "
                    "endpoint and token come from the configuration unless given.",
        epilog=_ADMIN_EXIT_CODES)
    _admin_args(status)
    status.add_argument("--json", action="store_true",
                        help="print the raw /v1/stats JSON instead of the summary")
    status.set_defaults(handler=_status)

    check = sub.add_parser(
        "check", help="run the full invariant check in a running daemon now",
        description="POST /v1/check on the admin endpoint: the daemon walks its whole tree and "
                    "pools and reports every violated invariant.",
        epilog="exit codes: 0 clean; 4 violations found (each printed); 1 the admin endpoint "
               "is unreachable, refused the token, or answered an error; 2 usage or "
               "configuration error")
    _admin_args(check)
    check.set_defaults(handler=_check)

    config = sub.add_parser("config", help="check or show the effective configuration, or print "
                                           "an example")
    csub = config.add_subparsers(dest="config_command", metavar="ACTION")
    config.set_defaults(handler=lambda _: (config.print_help(sys.stderr), EXIT_USAGE)[1])
    show = csub.add_parser("show", help="print the effective configuration as JSON "
                                        "(tokens redacted)")
    _config_args(show)
    show.set_defaults(handler=_config_show)
    check_cfg = csub.add_parser(
        "check", help="validate the configuration and every start-up check without starting",
        description="Load the configuration and run every check radixd serve makes before it "
                    "binds anything: each key's value, each model's device, whether the "
                    "pools and host tiers fit in the memory that is free. Binds and touches "
                    "nothing, so it may run while the daemon serves (a daemon already serving "
                    "on the socket or holding the state_dir is serve's to refuse).",
        epilog="exit codes: 0 the daemon would start (a one-line summary is printed, and a "
               "warning for a setting it would ignore); 2 the configuration is invalid or "
               "does not fit this machine (the error names the key)")
    _config_args(check_cfg)
    check_cfg.set_defaults(handler=_config_check)
    example = csub.add_parser(
        "example", help="print an example /etc/radixd/radixd.toml, every key documented",
        description="Print the documented example configuration: every key with its default, "
                    "for a GPU server (a model on cuda:0, 27 GiB of device pools, 30 GiB of "
                    "pinned host memory; tenants to fill in). --cpu prints a short one that "
                    "starts on any machine: a small model in host memory, no tokens.")
    example.add_argument("--cpu", action="store_true",
                         help="a configuration that starts without a GPU (under 1 GiB of memory)")
    example.set_defaults(handler=_config_example)

    bench = sub.add_parser("bench", help="benchmarks against a running daemon")
    from radixd_bench.cli import add_bench_commands  # argparse only: the bench loads when run

    add_bench_commands(bench, _socket_from_config)
    return parser


def _socket_from_config(path: str | None) -> str | None:
    """The daemon's socket from its configuration (None, with the reason printed, when the
    configuration is invalid): the bench talks to the daemon the operator configured."""
    from .config import ConfigError, load_config

    try:
        return load_config(path).server.socket
    except ConfigError as exc:
        print(f"radixd: {exc}", file=sys.stderr)
        return None


def _admin_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML configuration file of the daemon "
                                                    "(default: $RADIXD_CONFIG if set)")
    p.add_argument("--socket", metavar="PATH",
                   help="the daemon's engine socket: talk to the daemon on it (its admin "
                        "endpoint and token are found beside it), or fail if none answers there")
    p.add_argument("--admin", metavar="URL",
                   help="admin endpoint: http://HOST:PORT or unix:/PATH (default: from the "
                        "configuration's [admin] section)")
    tok = p.add_mutually_exclusive_group()
    tok.add_argument("--token", metavar="TOKEN", help="admin bearer token (default: admin.token "
                                                      "if configured, else the token file)")
    tok.add_argument("--token-file", metavar="FILE",
                     help="file holding the admin token (default: admin.token_file, or "
                          "admin.token beside the engine socket, which the daemon writes)")
    p.add_argument("--timeout", type=_seconds, default=10.0, metavar="SECONDS",
                   help="seconds to wait for the answer (default 10)")


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML configuration file "
                                                    "(default: $RADIXD_CONFIG if set)")
    p.add_argument("--socket", metavar="PATH", help="Unix socket path engines connect to")


def _load(args: argparse.Namespace):
    from .config import ConfigError, load_config

    overrides: dict = {}
    if getattr(args, "socket", None) is not None:  # '' too: refused, not the default
        overrides.setdefault("server", {})["socket"] = args.socket
    if getattr(args, "strict", None):
        overrides.setdefault("checker", {})["strict"] = True
    if getattr(args, "check_interval", None) is not None:
        overrides.setdefault("checker", {})["interval_s"] = args.check_interval
    if getattr(args, "log_level", None):
        overrides["log_level"] = args.log_level
    try:
        return load_config(args.config, overrides=overrides)
    except ConfigError as exc:
        print(f"radixd: {exc}", file=sys.stderr)
        return None


def _quiet_openmp() -> None:
    """Have torch's OpenMP workers sleep as soon as a parallel region ends, unless the operator
    chose otherwise: by default they spin for about 3 ms each first (GOMP_SPINCOUNT 300,000)
    whenever cores are idle, so on a many-core host every small CPU copy on the daemon's loop
    kept a core per worker busy doing nothing. OpenMP reads this once, when torch loads it: this
    runs before anything of the daemon imports torch."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _seconds(text: str) -> float:
    """A positive, finite number of seconds (argparse's type for --timeout)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value <= 86_400:
        raise argparse.ArgumentTypeError(f"seconds between 0 and 86400 (a day), got {text}")
    return value


def readable_tokens(args: argparse.Namespace) -> str:
    """The warning to give (empty: none) when the configuration file holds secrets in clear
    and every user of the host can read it: any of them could then open sessions as a tenant,
    drive the admin endpoint or reach Redis. Not refused: mode 0644 is many tools' default."""
    import tomllib

    from .storage.redis_urls import has_password

    path = args.config or os.environ.get("RADIXD_CONFIG")
    try:
        everyone = bool(path) and os.stat(path).st_mode & 0o004 and all(
            os.stat(d).st_mode & 0o001 for d in Path(path).resolve().parents)
        data = tomllib.loads(Path(path).read_text(encoding="utf-8")) if everyone else {}
    except (OSError, ValueError):
        return ""
    admin = data.get("admin") if isinstance(data.get("admin"), dict) else {}
    tenants = data.get("tenants") if isinstance(data.get("tenants"), list) else []
    l3 = data.get("l3") if isinstance(data.get("l3"), dict) else {}
    keys = ["admin.token"] if admin.get("token") else []
    keys += [f"tenants[\"{t.get('name')}\"].token" for t in tenants
             if isinstance(t, dict) and t.get("token")]
    if isinstance(l3.get("url"), str) and has_password(l3["url"]):
        keys.append("the password in l3.url")
    if not keys:
        return ""
    return (f"{path} can be read by every user and holds secrets in clear ({', '.join(keys)}):"
            f" chmod o-r {path} (tokens can be given as token_sha256 instead)")


def _serve(args: argparse.Namespace) -> int:
    _quiet_openmp()
    config = _load(args)
    if config is None:
        return EXIT_USAGE
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    exposed = readable_tokens(args)
    if exposed:
        logging.getLogger("radixd").warning("%s", exposed)
    from .app import run
    from .config import ConfigError

    try:
        return run(config)
    except (ConfigError, OSError) as exc:
        return _cannot_start(exc)


def _cannot_start(exc: ValueError | OSError) -> int:
    """Say in one line why the daemon cannot start (no traceback: the operator's to fix, or a
    runtime failure such as a socket another daemon serves on); returns the exit code ``serve``
    gives, which ``config check`` gives too."""
    from .sockets import ConfiguredAddressError

    if isinstance(exc, ConfiguredAddressError):
        print(f"radixd: {exc.key}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE
    if isinstance(exc, OSError):  # (without "[Errno N]" where the text says it all)
        why = exc.strerror if exc.strerror and exc.filename is None else exc
        print(f"radixd: cannot serve: {why}", file=sys.stderr)
        return EXIT_FAILURE
    print(f"radixd: {exc}", file=sys.stderr)  # a ConfigError: it names the key
    return EXIT_USAGE


def _preflight(config: Any) -> str | int:
    """What start would allocate (one line), or the exit code ``serve`` would give, its error
    printed: the checks of ``radixd serve`` before it binds anything (values, devices, memory,
    the paths), touching nothing."""
    from .app import preflight
    from .config import ConfigError

    try:
        return preflight(config)
    except (ConfigError, OSError) as exc:
        return _cannot_start(exc)


def _config_show(args: argparse.Namespace) -> int:
    config = _load(args)
    if config is None:
        return EXIT_USAGE
    from .config import redacted

    print(json.dumps(redacted(config), indent=2))
    summary = _preflight(config)
    return EXIT_OK if isinstance(summary, str) else summary


def _config_check(args: argparse.Namespace) -> int:
    config = _load(args)
    if config is None:
        return EXIT_USAGE
    summary = _preflight(config)
    if not isinstance(summary, str):
        return summary
    from .app import l3_unused

    for warning in (l3_unused(config), readable_tokens(args)):
        if warning:  # it starts, but not as the operator meant it to
            print(f"radixd: warning: {warning}", file=sys.stderr)
    print(f"ok: configuration valid; {summary}; socket {config.server.socket}")
    return EXIT_OK


def _config_example(args: argparse.Namespace) -> int:
    import importlib.resources

    name = "radixd.cpu.toml" if getattr(args, "cpu", False) else "radixd.example.toml"
    res = importlib.resources.files("daemon").joinpath("data").joinpath(name)
    try:
        text = res.read_text(encoding="utf-8")
    except OSError:
        print(f"radixd: the example configuration (daemon/data/{name}) is not "
              "installed with this radixd", file=sys.stderr)
        return EXIT_FAILURE
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    return EXIT_OK


# ---------------------------------------------------------------------------- the admin client

class AdminError(Exception):
    """The admin endpoint could not be reached or refused the request; the message says why."""


class TokenRefused(AdminError):
    """The endpoint answered 401: the token is not its daemon's, or the endpoint is not the
    daemon's that was meant."""


class AdminClient:
    """A small blocking client of the admin endpoint: ``http://host:port`` or ``unix:/path``.

    ``refused_hint`` is added to the message of a 401 (where the token came from, and whether it
    is a leftover of an earlier daemon); ``expect_instance`` / ``expect_socket`` make
    :meth:`verify` refuse an endpoint that answers for another daemon than the one named."""

    def __init__(self, url: str, token: str | None, timeout: float = 10.0):
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self.refused_hint = ("pass --token or --token-file (the daemon writes a generated token "
                             "to admin.token beside its socket)")
        self.expect_instance: str | None = None
        self.expect_socket: str | None = None
        #: the daemon on expect_socket wrote no endpoint file: the endpoint was only configured
        self.unconfirmed = False
        if self.url.startswith("unix:"):
            self._unix: str | None = self.url[len("unix:"):]
            if not self._unix:
                raise AdminError(f"admin URL {url!r}: no socket path after unix:")
        else:
            self._unix = None
            parts = urllib.parse.urlsplit(self.url)
            if parts.scheme != "http" or not parts.hostname:
                raise AdminError(f"admin URL {url!r}: give http://HOST:PORT or unix:/PATH")
            try:
                self._host, self._port = parts.hostname, parts.port or 80
            except ValueError as exc:
                raise AdminError(f"admin URL {url!r}: {exc}") from None

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, dict[str, str],
                                                                          bytes]:
        """(status, headers, body); raises AdminError when the endpoint cannot be reached."""
        if self._unix is not None:
            conn: http.client.HTTPConnection = UnixHTTPConnection(self._unix, self.timeout)
        else:
            conn = http.client.HTTPConnection(self._host, self._port, timeout=self.timeout)
        headers = {"Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        try:
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        except (OSError, http.client.HTTPException) as exc:
            why = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
            raise AdminError(f"cannot reach the radixd admin endpoint at {self.url}: {why} (is "
                             "the daemon running, with the admin endpoint enabled? see --admin)"
                             ) from None
        finally:
            conn.close()

    def json(self, method: str, path: str, body: Any = None) -> Any:
        """The decoded JSON answer of a 2xx; AdminError with the daemon's message otherwise."""
        status, _, raw = self.request(method, path, body)
        try:
            data = json.loads(raw) if raw else None
        except ValueError:
            data = None
        if 200 <= status < 300 and data is not None:
            return data
        message = ""
        if isinstance(data, dict) and isinstance(data.get("error"), dict):
            message = str(data["error"].get("message", ""))
        if status == 401:
            raise TokenRefused(f"the admin endpoint at {self.url} refused the token ({message}); "
                               + self.refused_hint)
        raise AdminError(f"{method} {path} at {self.url}: HTTP {status}"
                         + (f": {message}" if message else ""))


    def verify(self) -> None:
        """AdminError unless the endpoint answers for the daemon the command named (its
        instance, from the endpoint file beside its socket, or its socket path)."""
        if self.expect_instance is not None:
            got = self.json("GET", "/v1/stats").get("instance")
            if got != self.expect_instance:
                raise AdminError(f"the admin endpoint at {self.url} answers for daemon instance "
                                 f"{got}, not {self.expect_instance} (the one on "
                                 f"{self.expect_socket}); pass --admin")
        elif self.expect_socket is not None:
            try:
                server = self.json("GET", "/v1/config").get("server") or {}
            except TokenRefused:
                if not self.unconfirmed:
                    raise
                raise AdminError(
                    f"the admin endpoint at {self.url} refused the token, and the daemon on "
                    f"{self.expect_socket} wrote no endpoint file ({self.expect_socket}.admin) "
                    "to say which endpoint is its own: this one may be another daemon's (is "
                    "that daemon's admin endpoint up? its log says); pass --admin URL for its "
                    "endpoint, or --token") from None
            theirs = str(server.get("socket", ""))
            if os.path.realpath(theirs) != os.path.realpath(self.expect_socket):
                raise AdminError(f"the admin endpoint at {self.url} answers for the daemon on "
                                 f"{theirs}, not {self.expect_socket} (is that daemon running, "
                                 "with its admin endpoint up?); pass --socket or --config for "
                                 "the daemon you mean, or --admin URL")


def admin_url(config: Any) -> str:
    """The admin endpoint's URL per the configuration."""
    a = config.admin
    if not a.enabled:
        raise AdminError("the configuration turns the admin endpoint off (admin.enabled = "
                         "false): status and check need it; pass --admin URL if another "
                         "configuration runs this daemon")
    if a.unix_socket:
        return f"unix:{a.unix_socket}"
    if a.port == 0:
        raise AdminError("admin.port is 0 (the daemon picks a free port and logs it as "
                         "'admin endpoint on URL'): pass --admin URL")
    host = f"[{a.host}]" if ":" in a.host else a.host
    return f"http://{host}:{a.port}"


def _admin_token(args: argparse.Namespace, config: Any,
                 info: dict[str, Any] | None = None) -> tuple[str | None, str | None]:
    """The token, and the file it was read from (None: given on the command line or
    configured). The daemon's endpoint file (``info``) names the token file it wrote."""
    if args.token:
        return str(args.token), None
    path = args.token_file
    if path is None:
        if config.admin.token:
            return str(config.admin.token), None
        from .config import admin_token_file

        path = (info or {}).get("token_file") or admin_token_file(config)
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise AdminError(f"cannot read the admin token from {path}: {exc.strerror or exc} (the "
                         "daemon writes it at start when no admin token is configured; pass "
                         "--token or --token-file, or run as the daemon's user)") from None
    if not token:
        raise AdminError(f"the admin token file {path} is empty")
    return token, str(path)


def _probe_socket(path: str) -> None:
    """AdminError "no daemon at PATH" unless a daemon accepts connections on that socket."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(2.0)
    try:
        sock.connect(path)
    except OSError as exc:
        why = exc.strerror or str(exc) or type(exc).__name__
        raise AdminError(f"no daemon at {path} ({why}): is it running, with this socket "
                         "(server.socket)?") from None
    finally:
        sock.close()


def _daemon_socket(config: Any, named: bool) -> str:
    """The configured socket, where a daemon answers. A configuration that names no socket
    means the daemon's default, which under the shipped systemd unit is its runtime directory's
    (the daemon reads ``$RUNTIME_DIRECTORY``, an operator's shell has none): that one is tried
    when nothing answers on this user's default."""
    from .config import SERVICE_SOCKET

    sock = config.server.socket
    try:
        _probe_socket(sock)
    except AdminError:
        if named or "socket" in config.server.model_fields_set or sock == SERVICE_SOCKET:
            raise
        try:
            _probe_socket(SERVICE_SOCKET)
        except AdminError:
            pass
        else:
            return SERVICE_SOCKET
        raise
    return sock


def _endpoint_info(socket_path: str) -> dict[str, Any] | None:
    """What the daemon on ``socket_path`` wrote about its admin endpoint, if that daemon still
    runs (a daemon killed without a clean stop leaves the file behind)."""
    from .config import admin_endpoint_file

    info = None
    try:
        info = json.loads(Path(admin_endpoint_file(socket_path)).read_text(encoding="utf-8"))
        os.kill(int(info["pid"]), 0)
    except PermissionError:  # alive, another user's (None: the file is not ours to read)
        return info if isinstance(info, dict) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return info if isinstance(info, dict) and isinstance(info.get("url"), str) else None


def _refused_hint(path: str | None, info: dict[str, Any] | None) -> str:
    """Why a token may have been refused: a leftover of an earlier daemon (the file is older
    than this daemon's start, or is not the file this daemon wrote), or simply not its token."""
    if path is None:
        return ("the token given (--token or admin.token) is not this daemon's; pass the right "
                "one, or --token-file")
    try:
        written = Path(path).stat().st_mtime
    except OSError:
        written = None
    started = (info or {}).get("started")
    theirs = (info or {}).get("token_file")
    where = (f"this daemon wrote its token to {theirs}" if theirs else
             "this daemon uses a configured token (admin.token or admin.token_sha256): pass "
             "--token")
    if isinstance(started, (int, float)) and written is not None and written < started - 1:
        return (f"the token in {path} is stale: the file was written "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(written))}, before this "
                "daemon started "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(started))} (by an earlier "
                f"daemon); {where}")
    if info is not None and (theirs is None or
                             os.path.realpath(theirs) != os.path.realpath(path)):
        return f"the token in {path} is not this daemon's; {where}"
    return (f"the token in {path} is not this daemon's (the file is not older than the daemon, "
            "so not a leftover); pass --token or --token-file")


def _admin_client(args: argparse.Namespace) -> AdminClient | None:
    """The client per the flags, the configuration filling in what they leave out; None when
    the configuration is invalid (already reported).

    With ``--socket`` it talks to the daemon on that socket or to none: nothing listening there
    is "no daemon at PATH", and its endpoint is found in the file it wrote beside the socket.
    Unless ``--admin`` alone names the endpoint, one that answers for another daemon than the
    one on the named or configured socket is refused (see :meth:`AdminClient.verify`)."""
    named = getattr(args, "socket", None) is not None  # '' too: the configuration refuses it
    if args.admin and args.token and not named:  # nothing left to look up
        return AdminClient(args.admin, args.token, timeout=args.timeout)
    config = _load(args)
    if config is None:
        return None
    sock = config.server.socket
    if named or not args.admin:  # "no daemon" is the news, not a token file that is missing
        sock = _daemon_socket(config, bool(named))
    info = None if args.admin else _endpoint_info(sock)
    url = args.admin or (info["url"] if info else admin_url(config))
    try:
        token, path = _admin_token(args, config, info)
    except AdminError as exc:
        if info is None and not args.admin:
            raise AdminError(f"{exc}. The daemon on {sock} wrote no endpoint file "
                             f"({sock}.admin): its admin endpoint may not be up (its log says "
                             "why)") from None
        raise
    client = AdminClient(url, token, timeout=args.timeout)
    client.refused_hint = _refused_hint(path, info)
    if named or not args.admin:  # the endpoint found must answer for the daemon meant, not
        # for another one that holds the configured port (another daemon's configuration)
        client.expect_socket = sock
        client.expect_instance = info.get("instance") if info else None
        client.unconfirmed = info is None and not args.admin  # (may be any daemon's endpoint)
    return client


def _fail(exc: Exception) -> int:
    print(f"radixd: {exc}", file=sys.stderr)
    return EXIT_FAILURE


def _status(args: argparse.Namespace) -> int:
    try:
        client = _admin_client(args)
        if client is None:
            return EXIT_USAGE
        client.verify()
        stats = client.json("GET", "/v1/stats")
    except AdminError as exc:
        return _fail(exc)
    if args.json:
        print(json.dumps(stats, indent=2))
    else:
        print(format_status(stats, client.url))
    return EXIT_OK


def _check(args: argparse.Namespace) -> int:
    try:
        client = _admin_client(args)
        if client is None:
            return EXIT_USAGE
        client.verify()
        res = client.json("POST", "/v1/check")
    except AdminError as exc:
        return _fail(exc)
    violations = res.get("violations") or []
    seconds = float(res.get("seconds") or 0.0)
    if not violations:
        print(f"ok: no invariant violations (full check in {seconds:.3f}s)")
        return EXIT_OK
    print(f"{len(violations)} invariant violation(s) (full check in {seconds:.3f}s):")
    for v in violations:
        print(f"  - {v}")
    return EXIT_VIOLATIONS


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``radixd`` console script; returns the process exit status."""
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        code = int(handler(args))
        sys.stdout.flush()  # a reader that left shows here, not in the interpreter's exit
    except BrokenPipeError:
        # the reader had what it wanted; the interpreter's own flush at exit must not fail too
        with contextlib.suppress(OSError, ValueError):  # (ValueError: not a real file)
            stdout = sys.stdout.fileno()
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, stdout)
            os.close(devnull)
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:  # once serving, the daemon handles SIGINT itself (a clean stop)
        print("radixd: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return code


if __name__ == "__main__":
    sys.exit(main())
