#!/usr/bin/env bash
# Run the test suite on a fresh or an already set-up machine: venv, deps, Redis, Chromium, then
# pytest.
# Arguments are passed to pytest, e.g. `./scripts/test.sh tests/gpu -k pools`.
#
# Two pytest runs: first the SGLang backend's tests (tests/sglang) in .venv-sglang, where SGLang
# 0.5.23 is installed on the CPU (scripts/_env.sh radixd_sglang_venv), then the main suite in .venv
# (which ignores tests/sglang). The SGLang run happens when no arguments are given, or when an
# argument names tests/sglang (then only it runs, with the other arguments); RADIXD_SKIP_SGLANG=1
# leaves it out. Either run failing fails the script.
#
# The whole main suite (no arguments) runs in parallel workers (pytest-xdist), one per core, at
# most 4: on a 2-core machine that halves its time. RADIXD_TEST_WORKERS=N sets the count (1: one
# process, as `./scripts/test.sh ARGS` always runs).
set -euo pipefail
# shellcheck source=scripts/_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"

# refused before anything is installed
cores="$(nproc 2>/dev/null || echo 1)"
workers="${RADIXD_TEST_WORKERS:-$((cores < 4 ? cores : 4))}"
if ! [[ "${workers}" =~ ^[1-9][0-9]*$ ]]; then
    echo "RADIXD_TEST_WORKERS must be a whole number of workers, 1 or more (got '${workers}')" >&2
    exit 2
fi

radixd_venv
radixd_redis
cd "${RADIXD_ROOT}"

sglang_only=0
for arg in "$@"; do
    [[ "${arg}" == tests/sglang* ]] && sglang_only=1
done
skip_sglang="${RADIXD_SKIP_SGLANG:-0}"
unset RADIXD_SKIP_SGLANG RADIXD_TEST_WORKERS  # this script's switches, read above
if [[ "${skip_sglang}" != "1" ]] && { [[ $# -eq 0 ]] || [[ ${sglang_only} -eq 1 ]]; }; then
    radixd_sglang_venv
    sglang_args=("$@")
    [[ $# -eq 0 ]] && sglang_args=(tests/sglang)
    "${RADIXD_SGLANG_PY}" -m pytest -p no:cacheprovider \
        -o addopts="-ra --import-mode=importlib" -o asyncio_default_fixture_loop_scope= \
        "${sglang_args[@]}"
    if [[ ${sglang_only} -eq 1 ]]; then
        exit 0
    fi
fi

radixd_chromium
radixd_systemd_tools
if [[ $# -eq 0 ]] && [[ "${workers}" -gt 1 ]]; then
    exec "${RADIXD_PY}" -m pytest -n "${workers}"
fi
exec "${RADIXD_PY}" -m pytest "$@"
