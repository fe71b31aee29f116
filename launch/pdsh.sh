#!/usr/bin/env bash
# Train on every host of a hostfile through DeepSpeed's launcher, which starts the ranks over pdsh/ssh.
#
#   launch/pdsh.sh HOSTFILE [pretrain train args...]
#   launch/pdsh.sh hostfiles/a100x16 --ds ds_configs/zero2_offload.json --preset gpt-6.7b
#
# Needs passwordless ssh from this host to every host, and the repository and its venv at the same
# paths everywhere. Before DeepSpeed starts, it ssh'es to every host as DeepSpeed will and tries the
# master port if rank 0 is this machine (pretrain launch-check); `pretrain preflight --hostfile
# HOSTFILE ...` checks the rest.
#   MASTER_ADDR  rank 0's address as every host reaches it (default: the first host INCLUDE/EXCLUDE leave)
#   MASTER_PORT  rendezvous port (default 29500)
#   INCLUDE      deepspeed --include, e.g. "node-01@node-02:0,1" (hosts, and slots on a host)
#   EXCLUDE      deepspeed --exclude, same syntax
#   SSH_PORT     ssh port, if not 22
#   PYTHON       the venv's interpreter (default: .venv/bin/python of this checkout)
# The config's `launch` section (NCCL_SOCKET_IFNAME, NCCL_IB_HCA, NCCL_DEBUG, ...) is rendered (as
# `pretrain launch-env` prints it) and exported to every rank through DS_ENV_FILE.
set -euo pipefail
# shellcheck source=common.sh
. "$(dirname "$0")/common.sh" "$0" 1 "HOSTFILE [pretrain train args...]" "$@"
hostfile=$1
shift
filters=()
for name in INCLUDE EXCLUDE; do
    value=${!name:-}
    [ -z "$value" ] && continue
    [[ $value =~ ^[A-Za-z0-9._:,@-]+$ ]] || die "$name='$value': host names, ':' slots, ',' and '@' only"
    filters+=("--${name,,}" "$value")
done
# Validates every line (host names included) before any of them reaches pdsh; rank 0 is on the first
# host the filters leave.
use_master "$hostfile" "${filters[@]}"
ssh_port=() check_ssh_port=()
if [ -n "${SSH_PORT:-}" ]; then
    port_number SSH_PORT "$SSH_PORT"
    ssh_port=(--ssh_port "$SSH_PORT") check_ssh_port=(--ssh-port "$SSH_PORT")
fi

env_file=$(mktemp "${TMPDIR:-/tmp}/pretrain-env.XXXXXX")
trap 'rm -f "$env_file"' EXIT
"$python" -m pretrain launch-env "$@" > "$env_file"
# DeepSpeed reads this file instead of ./.deepspeed_env or ~/.deepspeed_env, which may be stale.
export DS_ENV_FILE=$env_file
check_launch "$hostfile" --launcher deepspeed "${filters[@]}" "${check_ssh_port[@]}"
"$python" -m deepspeed.launcher.runner --hostfile "$hostfile" "${filters[@]}" "${ssh_port[@]}" \
    --master_addr "$master" --master_port "$port" pretrain/main.py "$@"
