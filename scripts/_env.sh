# shellcheck shell=bash
# Shared setup for scripts/test.sh and scripts/run.sh; sourced, not executed.
#
# Everything here is idempotent and cheap on a re-run: the venv is created once, torch is installed
# only when the exact version is missing, and the projects are reinstalled only when pyproject.toml,
# clients/python/pyproject.toml (or the torch spec) changed since the last install, tracked by a
# stamp file inside the venv.

RADIXD_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RADIXD_VENV="${RADIXD_ROOT}/.venv"
RADIXD_PY="${RADIXD_VENV}/bin/python"
# Exactly this spec: the machines carry a local CPU wheel for it. Anything looser lets pip pick
# the newest CUDA build from the registry and download gigabytes.
RADIXD_TORCH_SPEC="torch==2.13.0"
RADIXD_STAMP="${RADIXD_VENV}/.radixd-install-stamp"

_radixd_log() {
    echo "[radixd-env] $*" >&2
}

_radixd_as_root() {
    if [[ "$(id -u)" -eq 0 ]]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1; then
        sudo "$@"
    else
        _radixd_log "need root for: $*"
        return 1
    fi
}

# Debian packages the tests need, installed minimally: no recommended packages, and nothing that is
# already installed is upgraded. Each install is announced (what and why) before it runs.
# RADIXD_NO_APT=1 installs nothing: the tests that need the package then fail with a message that
# names it (deselect them with the marker the message gives).
_radixd_apt_install() {
    local why="$1"
    shift
    if [[ "${RADIXD_NO_APT:-0}" == "1" ]]; then
        _radixd_log "RADIXD_NO_APT=1: not installing $* (${why})"
        return 0
    fi
    _radixd_log "installing with apt-get, without recommended packages: $* (${why}); set" \
        "RADIXD_NO_APT=1 to skip"
    _radixd_as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    _radixd_as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends --no-upgrade "$@"
}

radixd_venv() {
    # A venv whose interpreter no longer runs (python upgraded or moved) is rebuilt, not patched.
    if [[ -x "${RADIXD_PY}" ]] && ! "${RADIXD_PY}" -c "" >/dev/null 2>&1; then
        _radixd_log "broken venv at ${RADIXD_VENV}; recreating"
        rm -rf "${RADIXD_VENV}"
    fi
    if [[ ! -x "${RADIXD_PY}" ]]; then
        _radixd_log "creating ${RADIXD_VENV}"
        python3 -m venv "${RADIXD_VENV}"
    fi

    # torch first, so the project's `torch>=2.4,<3` is already satisfied when pip resolves it.
    if ! "${RADIXD_PY}" - <<'PY' >/dev/null 2>&1
import importlib.metadata as md
import sys
sys.exit(0 if md.version("torch").split("+")[0] == "2.13.0" else 1)
PY
    then
        _radixd_log "installing ${RADIXD_TORCH_SPEC}"
        "${RADIXD_PY}" -m pip install --quiet "${RADIXD_TORCH_SPEC}"
    fi

    local want
    want="$(cat "${RADIXD_ROOT}/pyproject.toml" "${RADIXD_ROOT}/clients/python/pyproject.toml" \
        | sha256sum | cut -d' ' -f1) ${RADIXD_TORCH_SPEC}"
    if [[ ! -f "${RADIXD_STAMP}" ]] || [[ "$(cat "${RADIXD_STAMP}")" != "${want}" ]] \
        || [[ ! -x "${RADIXD_VENV}/bin/radixd" ]] \
        || ! compgen -G "${RADIXD_VENV}/lib/python*/site-packages/radixd_client-*.dist-info" \
            >/dev/null; then
        # The client distribution first: it holds the wire protocol the daemon imports, and the
        # daemon's `radixd-client` requirement must be met by this checkout, not by a registry.
        _radixd_log "installing radixd-client (editable, from clients/python)"
        "${RADIXD_PY}" -m pip install --quiet -e "${RADIXD_ROOT}/clients/python"
        _radixd_log "installing radixd (editable, with test extras)"
        "${RADIXD_PY}" -m pip install --quiet -e "${RADIXD_ROOT}[test]"
        echo "${want}" >"${RADIXD_STAMP}"
    fi
}

radixd_redis() {
    # The storage tests talk to a real Redis on 127.0.0.1:6379; start one when none answers.
    if command -v redis-cli >/dev/null 2>&1 \
        && redis-cli -h 127.0.0.1 -p 6379 ping 2>/dev/null | grep -q PONG; then
        return 0
    fi
    if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; then
        _radixd_apt_install "the storage and tier tests talk to a real Redis" redis-server
        command -v redis-server >/dev/null 2>&1 || return 0
    fi
    _radixd_log "starting redis-server on 127.0.0.1:6379"
    redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
        --dir /tmp >/dev/null
    local i
    for i in $(seq 1 50); do
        if redis-cli -h 127.0.0.1 -p 6379 ping 2>/dev/null | grep -q PONG; then
            return 0
        fi
        sleep 0.1
    done
    _radixd_log "redis-server did not answer on 127.0.0.1:6379"
    return 1
}

radixd_systemd_tools() {
    # The systemd tests verify the unit files and drive socket activation with the real tools.
    local tool
    for tool in systemd-analyze systemd-socket-activate systemd-sysusers systemd-tmpfiles; do
        if ! command -v "${tool}" >/dev/null 2>&1; then
            local why="the systemd tests verify the unit files and drive socket activation"
            _radixd_apt_install "${why} with systemd's own tools" systemd
            return 0
        fi
    done
}

radixd_chromium() {
    # The status-page test renders the admin page in headless Chromium (Debian's `chromium`).
    if [[ -x /usr/bin/chromium ]]; then
        return 0
    fi
    _radixd_apt_install "the status-page test renders the admin page in headless Chromium" \
        chromium
}
