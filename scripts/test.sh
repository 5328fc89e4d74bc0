#!/usr/bin/env bash
# Run the test suite on a fresh or an already set-up machine: venv, deps, Redis, Chromium, then
# pytest.
# Arguments are passed to pytest, e.g. `./scripts/test.sh tests/gpu -k pools`.
set -euo pipefail
# shellcheck source=scripts/_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"

radixd_venv
radixd_redis
radixd_chromium
radixd_systemd_tools
cd "${RADIXD_ROOT}"
exec "${RADIXD_PY}" -m pytest "$@"
