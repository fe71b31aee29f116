#!/usr/bin/env bash
# Train across the hosts of a hostfile with Open MPI's mpirun: one MPI process per slot, each rank
# learning its rank, world size and local rank through mpi4py (pretrain/training/distributed/engine.py, launch_env).
#
#   launch/mpirun.sh HOSTFILE [pretrain train args...]
#   launch/mpirun.sh hostfiles/a100x16 --ds ds_configs/zero2_offload.json --preset gpt-6.7b
#
# mpirun starts the ranks over ssh (passwordless, like pdsh) and needs the repository and venv at
# the same paths on every host. The venv also holds MPICH (pip's `mpich`, for single-host use):
# its `mpirun` is not this one, so this script runs Open MPI's and tells mpi4py to load Open MPI's
# library (MPI4PY_MPIABI=openmpi) on every rank.
#   MPIRUN       Open MPI's mpirun (default: mpirun.openmpi, else the first mpirun on PATH)
#   MASTER_ADDR  rank 0's address as every host reaches it (default: the hostfile's first host)
#   MASTER_PORT  rendezvous port (default 29500)
#   PYTHON       the venv's interpreter (default: .venv/bin/python of this checkout)
# The config's `launch` section is exported to every rank; with launch.socket_ifname set, Open MPI's
# own traffic uses that interface too. Ranks get this PATH as it is: Open MPI would put its own bin
# first (/usr/bin), whose `ninja` is not the venv's, and DeepSpeed would rebuild its ops.
set -euo pipefail
# shellcheck source=common.sh
. "$(dirname "$0")/common.sh" "$0" 1 "HOSTFILE [pretrain train args...]" "$@"
hostfile=$1
shift
mpirun=${MPIRUN:-$(command -v mpirun.openmpi || command -v mpirun || true)}
[ -n "$mpirun" ] || die "no mpirun: install Open MPI (apt-get install openmpi-bin) or set MPIRUN"
[[ $("$mpirun" --version 2>&1 || true) =~ Open\ MPI|OpenRTE ]] || die "$mpirun is not Open MPI's mpirun: set MPIRUN"
world=$("$python" -m pretrain hostfile "$hostfile" --world-size)  # also validates every line
use_master "$hostfile"

export MASTER_ADDR=$master MASTER_PORT=$port MPI4PY_MPIABI=openmpi
exports=(-x MASTER_ADDR -x MASTER_PORT -x MPI4PY_MPIABI)
export_launch_env "$@"
ifname=
for key in "${launch_keys[@]}"; do
    exports+=(-x "$key")
    if [ "$key" = GLOO_SOCKET_IFNAME ]; then ifname=$GLOO_SOCKET_IFNAME; fi
done
check_launch "$hostfile" --launcher mpirun  # ssh to every other host; the port, if rank 0 is here
mca=()
if [ -n "$ifname" ] && [[ $ifname != ^* && $ifname != =* ]]; then
    mca=(--mca btl_tcp_if_include "$ifname" --mca oob_tcp_if_include "$ifname")
fi
root=()
[ "$(id -u)" = 0 ] && root=(--allow-run-as-root)
exec "$mpirun" "${root[@]}" -np "$world" --hostfile "$hostfile" --map-by slot --bind-to none \
    --mca btl ^openib "${mca[@]}" "${exports[@]}" env PATH="$PATH" "$python" -u pretrain/main.py "$@"
