#!/usr/bin/env bash
# Train on every host of a hostfile through DeepSpeed's launcher, which starts the ranks over pdsh/ssh.
#
#   launch/pdsh.sh HOSTFILE [pretrain train args...]
#   launch/pdsh.sh hostfiles/a100x16 --ds ds_configs/zero2_offload.json --preset gpt-6.7b
#
# Needs passwordless ssh from this host to every host (check first: pretrain preflight --hostfile
# HOSTFILE ...), and the repository and its venv at the same paths everywhere.
#   MASTER_ADDR  rank 0's address as every host reaches it (default: the hostfile's first host)
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
use_master "$hostfile"  # validates every line (host names included) before any of them reaches pdsh
filters=()
for name in INCLUDE EXCLUDE; do
    value=${!name:-}
    [ -z "$value" ] && continue
    [[ $value =~ ^[A-Za-z0-9._:,@-]+$ ]] || die "$name='$value': host names, ':' slots, ',' and '@' only"
    filters+=("--${name,,}" "$value")
done
ssh_port=()
if [ -n "${SSH_PORT:-}" ]; then
    [[ $SSH_PORT =~ ^[0-9]+$ ]] || die "SSH_PORT='$SSH_PORT' is not a port number"
    ssh_port=(--ssh_port "$SSH_PORT")
fi

env_file=$(mktemp "${TMPDIR:-/tmp}/pretrain-env.XXXXXX")
trap 'rm -f "$env_file"' EXIT
"$python" -m pretrain launch-env "$@" > "$env_file"
# DeepSpeed reads this file instead of ./.deepspeed_env or ~/.deepspeed_env, which may be stale.
export DS_ENV_FILE=$env_file
"$python" -m deepspeed.launcher.runner --hostfile "$hostfile" "${filters[@]}" "${ssh_port[@]}" \
    --master_addr "$master" --master_port "$port" pretrain/main.py "$@"
