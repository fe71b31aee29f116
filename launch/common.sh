# shellcheck shell=bash
# Sourced first by each launch script, as `. common.sh SCRIPT MIN_ARGS USAGE "$@"`: moves to the
# repository root, checks the script got MIN_ARGS arguments, and finds the interpreter. Everything
# the scripts read from a hostfile or the config goes through `pretrain`, which validates it first.

script=launch/$(basename "$1")
die() { echo "$script: $*" >&2; exit 2; }

# python: the venv's interpreter (PYTHON, or .venv/bin/python of this checkout).
use_python() {
    python=${PYTHON:-$PWD/.venv/bin/python}
    [ -x "$python" ] || die "no interpreter at $python: run ./setup.sh or set PYTHON"
}

# master, port: rank 0's address (MASTER_ADDR, or the hostfile's first host) and the rendezvous
# port (MASTER_PORT, default 29500). Reading the hostfile validates every line of it, always: a
# MASTER_ADDR in the environment must not skip that check.
use_master() {
    local first
    first=$("$python" -m pretrain hostfile "$1" --first) || exit 2
    master=${MASTER_ADDR:-$first}
    port=${MASTER_PORT:-29500}
    [[ $master =~ ^[A-Za-z0-9._-]+$ ]] || die "MASTER_ADDR='$master' is not a host name or address"
    [[ $port =~ ^[0-9]+$ ]] || die "MASTER_PORT='$port' is not a port number"
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
