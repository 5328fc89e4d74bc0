#!/usr/bin/env bash
# Run the `radixd` command from the project venv, setting it up first if needed.
# With no arguments it runs `radixd serve` on the built-in default configuration.
set -euo pipefail
# shellcheck source=scripts/_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"

radixd_venv
cd "${RADIXD_ROOT}"
if [[ $# -eq 0 ]]; then
    set -- serve
fi
exec "${RADIXD_VENV}/bin/radixd" "$@"
