#!/usr/bin/env bash
# Train across the hosts of a hostfile without ssh: run this on every host, each with its node rank
# (its line in the hostfile, from 0), and `deepspeed --no_ssh` starts that host's ranks.
#
#   launch/no_ssh.sh HOSTFILE NODE_RANK [pretrain train args...]
#   node-01$ launch/no_ssh.sh hostfiles/a100x16 0 --ds ds_configs/zero2_offload.json --preset gpt-6.7b
#   node-02$ launch/no_ssh.sh hostfiles/a100x16 1 --ds ds_configs/zero2_offload.json --preset gpt-6.7b
#
#   MASTER_ADDR  rank 0's address as every host reaches it (default: the hostfile's first host)
#   MASTER_PORT  rendezvous port (default 29500)
#   PYTHON       the venv's interpreter (default: .venv/bin/python of this checkout)
# The config's `launch` section (NCCL_SOCKET_IFNAME, NCCL_DEBUG, ...) is exported to the ranks.
# Before DeepSpeed starts (pretrain launch-check): NODE_RANK is a line of the hostfile and that line
# names this machine; node 0 runs rank 0, so the master (MASTER_ADDR) must be this machine too, and
# its port free; every other node checks that the master's name resolves.
set -euo pipefail
# shellcheck source=common.sh
. "$(dirname "$0")/common.sh" "$0" 2 "HOSTFILE NODE_RANK [pretrain train args...]" "$@"
hostfile=$1
node_rank=$2
shift 2
[[ $node_rank =~ ^[0-9]+$ ]] || die "NODE_RANK='$node_rank' is not a number (this host's line in $hostfile, from 0)"
use_master "$hostfile"  # validates every line; launch-check below says whether NODE_RANK is this host's

# DeepSpeed reads .deepspeed_env only when it launches over ssh; export the variables here.
export_launch_env "$@"
check_launch "$hostfile" --launcher no-ssh --node-rank "$node_rank"
exec "$python" -m deepspeed.launcher.runner --hostfile "$hostfile" --no_ssh --node_rank "$node_rank" \
    --master_addr "$master" --master_port "$port" pretrain/main.py "$@"
