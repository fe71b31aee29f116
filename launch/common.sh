# shellcheck shell=bash
# Sourced first by each launch script, as `. common.sh SCRIPT MIN_ARGS USAGE "$@"`: moves to the
# repository root, checks the script got MIN_ARGS arguments, and finds the interpreter. Everything
# the scripts read from a hostfile or the config goes through `pretrain`, which validates it first.

script=launch/$(basename "$1")
die() { echo "$script: $*" >&2; exit 2; }

# python: the venv's interpreter (PYTHON, or .venv/bin/python of this checkout).
use_python() {
    python=${PYTHON:-$PWD/.venv/bin/python}
    if [ ! -f "$python" ] || [ ! -x "$python" ]; then die "no interpreter at $python: run ./setup.sh or set PYTHON"; fi
}

# port_number NAME VALUE: stop unless VALUE is a TCP port, 1..65535.
port_number() {
    if ! [[ $2 =~ ^[0-9]{1,5}$ ]] || ((10#$2 < 1 || 10#$2 > 65535)); then
        die "$1='$2' is not a port number (1..65535)"
    fi
}

# master, port: rank 0's address (MASTER_ADDR, or the first host of HOSTFILE that the launch uses:
# `use_master HOSTFILE [--include S | --exclude S]`) and the rendezvous port (MASTER_PORT, default
# 29500). Reading the hostfile validates every line of it, always: a MASTER_ADDR in the environment
# must not skip that check.
use_master() {
    local first
    first=$("$python" -m pretrain hostfile "$@" --first) || exit 2
    master=${MASTER_ADDR:-$first}
    port=${MASTER_PORT:-29500}
    # A name or IPv4 address as a hostfile takes it: no shell characters, no leading '-' (an option).
    [[ $master =~ ^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$ && $master != *..* ]] ||
        die "MASTER_ADDR='$master' is not a host name or address"
    port_number MASTER_PORT "$port"
}

# Before anything starts: every host the launcher ssh'es to answers, as DeepSpeed's launcher runs
# ssh, and rank 0 can listen on the master port where that is this machine (`pretrain launch-check
# HOSTFILE --launcher L [...]`). Each problem is one line naming the host or the port and the fix.
check_launch() {
    "$python" -m pretrain launch-check "$@" --master-addr "$master" --master-port "$port" --script "$script" ||
        exit 2
}

# Export the config's `launch` section (`pretrain launch-env` of the train arguments) here, and
# list its names in `launch_keys`. A config error stops the script. Values are checked by the config
# (no spaces, quotes or '$'), and nothing in them is evaluated.
export_launch_env() {
    local env_text key value
    env_text=$("$python" -m pretrain launch-env "$@")
    launch_keys=()
    while IFS='=' read -r key value; do
        [ -n "$key" ] || continue
        export "$key=$value"
        launch_keys+=("$key")
    done <<< "$env_text"
}

cd "$(dirname "$1")/.." || die "cannot enter the repository root"
[ $(($# - 3)) -ge "$2" ] || die "usage: $script $3"
use_python
