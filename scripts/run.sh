#!/usr/bin/env bash
# The README's run command: on a fresh Debian machine it installs what the example needs
# (scripts/common.sh says what and where), then runs examples/engine_loop.py with this
# script's arguments (./scripts/run.sh --workers 4; --help says more).
set -euo pipefail
# shellcheck source=scripts/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
# No Debian packages beyond the build's: --remote URL talks to a server the user names.
# [test] brings redis-py along, which --remote needs.
hostkv_setup test
exec python examples/engine_loop.py "$@"
