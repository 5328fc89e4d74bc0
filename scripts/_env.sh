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
# Read once and taken out of the environment: a switch of this script's, not the tests' own.
_RADIXD_NO_APT="${RADIXD_NO_APT:-0}"
unset RADIXD_NO_APT

_radixd_apt_install() {
    local why="$1"
    shift
    if [[ "${_RADIXD_NO_APT}" == "1" ]]; then
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

# SGLang 0.5.23 on the CPU, in a venv of its own (.venv-sglang): the HiCache storage backend's tests
# (tests/sglang) and bench (bench/sglang_bench.py) run SGLang's real classes. torch first (the local
# CPU wheel), then SGLang and the packages its cache path's import chain touches, all with --no-deps
# (SGLang's own requirements would pull torch 2.14 and CUDA packages); then the client, the daemon
# (the tests start a real radixd in this venv) and radixd-sglang, editable, and the test tools.
RADIXD_SGLANG_VENV="${RADIXD_ROOT}/.venv-sglang"
RADIXD_SGLANG_PY="${RADIXD_SGLANG_VENV}/bin/python"
RADIXD_SGLANG_STAMP="${RADIXD_SGLANG_VENV}/.radixd-sglang-install-stamp"
RADIXD_SGLANG_REQS="${RADIXD_ROOT}/clients/sglang/requirements-sglang-cpu.txt"
# The daemon's and the test tools' own small dependencies (pip resolves none of them here).
RADIXD_SGLANG_EXTRA=(uvloop==0.23.0 "redis==8.1.0" hiredis==3.5.0 prometheus_client==0.26.0
    pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pytest-timeout==2.4.0 hypothesis==6.170.15
    sortedcontainers==2.4.0)

radixd_sglang_venv() {
    if [[ -x "${RADIXD_SGLANG_PY}" ]] && ! "${RADIXD_SGLANG_PY}" -c "" >/dev/null 2>&1; then
        _radixd_log "broken venv at ${RADIXD_SGLANG_VENV}; recreating"
        rm -rf "${RADIXD_SGLANG_VENV}"
    fi
    local want
    want="$(cat "${RADIXD_SGLANG_REQS}" "${RADIXD_ROOT}/pyproject.toml" \
        "${RADIXD_ROOT}/clients/python/pyproject.toml" "${RADIXD_ROOT}/clients/sglang/pyproject.toml" \
        | sha256sum | cut -d' ' -f1) ${RADIXD_TORCH_SPEC} ${RADIXD_SGLANG_EXTRA[*]}"
    if [[ -f "${RADIXD_SGLANG_STAMP}" ]] && [[ "$(cat "${RADIXD_SGLANG_STAMP}")" == "${want}" ]]; then
        return 0
    fi
    if [[ ! -x "${RADIXD_SGLANG_PY}" ]]; then
        _radixd_log "creating ${RADIXD_SGLANG_VENV}"
        python3 -m venv "${RADIXD_SGLANG_VENV}"
    fi
    local pip=("${RADIXD_SGLANG_PY}" -m pip install --quiet --no-deps)
    if ! "${RADIXD_SGLANG_PY}" -c 'import importlib.metadata as m, sys
sys.exit(m.version("torch").split("+")[0] != "2.13.0")' >/dev/null 2>&1; then
        _radixd_log "installing ${RADIXD_TORCH_SPEC} into ${RADIXD_SGLANG_VENV}"
        # with its dependencies (sympy, networkx, ...): the CPU wheel's, all small
        "${RADIXD_SGLANG_PY}" -m pip install --quiet "${RADIXD_TORCH_SPEC}"
    fi
    _radixd_log "installing sglang and its cache path's imports (--no-deps, ${RADIXD_SGLANG_REQS})"
    "${pip[@]}" -r "${RADIXD_SGLANG_REQS}" "${RADIXD_SGLANG_EXTRA[@]}"
    _radixd_log "installing radixd-client, radixd and radixd-sglang (editable, --no-deps)"
    "${pip[@]}" -e "${RADIXD_ROOT}/clients/python" -e "${RADIXD_ROOT}" \
        -e "${RADIXD_ROOT}/clients/sglang"
    # The CPU stand-ins (clients/sglang/cpu/sglang_cpu_shim.py), loaded at interpreter start in this
    # venv only, before anything imports torchvision.
    local site
    site="$("${RADIXD_SGLANG_PY}" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    printf '%s\nimport sglang_cpu_shim\n' "${RADIXD_ROOT}/clients/sglang/cpu" \
        >"${site}/radixd-sglang-cpu-shim.pth"
    "${RADIXD_SGLANG_PY}" -c 'import sglang.srt.mem_cache.storage.backend_factory, radixd_sglang' \
        || { _radixd_log "the SGLang venv does not import; see above"; return 1; }
    echo "${want}" >"${RADIXD_SGLANG_STAMP}"
}
