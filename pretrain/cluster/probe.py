"""What `pretrain preflight` runs on each host: standard library only, sent over ssh on stdin.

    ssh HOST 'cd REPO && PYTHON - MODE JSON' < pretrain/cluster/probe.py

It must run under any interpreter a host may have, even one without torch, so that preflight can
report a broken environment instead of crashing in it. Two modes:

- `inspect`: versions, accelerators, the DeepSpeed ops the config needs, the dataset, the checkpoint
  directory and (on the master host) the rendezvous port; prints one JSON object;
- `allreduce`: forks one process per slot, joins the job-wide process group (NCCL on CUDA, gloo
  otherwise) and times an all-reduce; global rank 0 prints one JSON object.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import signal
import socket
import sys
import tempfile
import time
from datetime import timedelta
from importlib import metadata
from typing import Any

PACKAGES = ("torch", "deepspeed", "numpy", "pydantic", "mpi4py")
# DeepSpeed's C++ ops that preflight asks about, by op name: the builder class each accelerator has.
OP_BUILDERS = {"fused_adam": "FusedAdamBuilder", "cpu_adam": "CPUAdamBuilder"}


def versions() -> dict[str, Any]:
    out: dict[str, Any] = {"python": platform.python_version(), "executable": sys.executable}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    out["cuda"] = out["nccl"] = "-"
    out["accelerator"], out["accelerators"] = "cpu", len(os.sched_getaffinity(0))
    try:
        import torch  # this module runs on other hosts on the standard library; torch if it is there
    except ImportError:
        return out
    out["torch"] = torch.__version__
    out["cuda"] = str(torch.version.cuda or "-")
    if torch.cuda.is_available():
        out["accelerator"], out["accelerators"] = "cuda", torch.cuda.device_count()
        try:
            out["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
        except (RuntimeError, AttributeError):
            out["nccl"] = "unavailable"
    return out


def check_ops(names: list[str]) -> dict[str, dict[str, str]]:
    """Each DeepSpeed op in `names` as the ranks here will find it, DeepSpeed's own way (OpBuilder.load):
    "installed" (built into DeepSpeed at install, for this accelerator), "cached" (JIT-built before, in
    the torch extensions directory), "buildable" (DeepSpeed's compatibility check passes and ninja and
    the compilers are here: JIT-built on first use), or "missing", with `why`."""
    if not names:
        return {}
    try:
        import torch  # DeepSpeed needs torch; without either, every op is missing

        # The accelerator the engine will pick (ranks.init_distributed), before DeepSpeed picks one.
        os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
        from deepspeed.accelerator import get_accelerator
        from deepspeed.git_version_info import accelerator_name, installed_ops
        from deepspeed.ops.op_builder.builder import CUDAOpBuilder
        from torch.utils import cpp_extension
    except Exception as e:  # an environment broken any way at all is a finding, not a crash
        return {
            n: {"state": "missing", "why": f"cannot import DeepSpeed: {type(e).__name__}: {e}"} for n in names
        }
    accel = get_accelerator()
    cache = _extensions_dir(torch)
    out: dict[str, dict[str, str]] = {}
    for name in names:
        if installed_ops.get(name) and accelerator_name == accel._name:
            out[name] = {"state": "installed"}
            continue
        if os.path.isfile(os.path.join(cache, name, f"{name}.so")):
            out[name] = {"state": "cached", "path": os.path.join(cache, name)}
            continue
        why = []
        builder = accel.create_op_builder(OP_BUILDERS[name])
        if builder is None:
            why.append(f"DeepSpeed has no {name} op for the {accel._name} accelerator")
        else:
            try:
                compatible = builder.is_compatible(verbose=False)
            except Exception as e:  # DeepSpeed's own report treats a failing probe the same way
                compatible, builder.error_log = False, f"{type(e).__name__}: {e}"
            if not compatible:
                why.append(
                    f"DeepSpeed's compatibility check fails on {accel._name}: {builder.error_log or 'no reason given'}"
                )
        if not cpp_extension.is_ninja_available():
            why.append("ninja is not on PATH")
        cxx = os.environ.get("CXX", "c++")  # what torch's extension build compiles with
        if shutil.which(cxx) is None:
            why.append(f"no C++ compiler ({cxx} is not on PATH)")
        if isinstance(builder, CUDAOpBuilder) and torch.cuda.is_available():
            home = cpp_extension.CUDA_HOME
            if home is None or not os.path.isfile(os.path.join(home, "bin", "nvcc")):
                why.append(f"no CUDA toolkit (nvcc) for torch's CUDA {torch.version.cuda}: set CUDA_HOME")
        out[name] = (
            {"state": "missing", "why": "; ".join(why)} if why else {"state": "buildable", "path": cache}
        )
    return out


def _extensions_dir(torch: Any) -> str:
    """Where torch's JIT extension build puts (and finds) an op, as cpp_extension._get_build_directory
    decides: TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions/py311_cu128 (or _cpu, _rocm62)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return root
    from torch.utils.cpp_extension import get_default_build_root

    if torch.version.hip is not None:
        kind = "rocm" + torch.version.hip.replace(".", "")
    elif torch.version.cuda is not None:
        kind = "cu" + torch.version.cuda.replace(".", "")
    else:
        kind = "cpu"
    py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return os.path.join(get_default_build_root(), f"{py}_{kind}")


def check_data(
    data_dirs: list[str], manifest_name: str, splits: list[str], header_size: int, checksums: bool
) -> dict[str, Any]:
    """Each dataset's manifest, hashed; each shard it lists present (and matching its checksum)."""
    digest, n_shards = hashlib.sha256(), 0
    for data_dir in data_dirs:
        manifest = os.path.join(data_dir, manifest_name)
        try:
            with open(manifest, "rb") as f:
                raw = f.read()
            m = json.loads(raw)
            entries = [e for split in splits for e in m[split]]
        except FileNotFoundError:
            return {"ok": False, "problem": f"{manifest}: not found"}
        except (OSError, ValueError, KeyError, TypeError) as err:
            return {"ok": False, "problem": f"{manifest}: unreadable ({type(err).__name__}: {err})"}
        digest.update(raw)
        for entry in entries:
            path = os.path.join(data_dir, entry["path"])
            if not os.path.isfile(path):
                return {"ok": False, "problem": f"{path}: listed in the manifest but missing"}
            if checksums:  # the manifest's sha256 is that of the payload, after the header
                h = hashlib.sha256()
                with open(path, "rb") as f:
                    f.seek(header_size)
                    while chunk := f.read(16 << 20):
                        h.update(chunk)
                if h.hexdigest() != entry["sha256"]:
                    return {"ok": False, "problem": f"{path}: checksum differs from the manifest's"}
        n_shards += len(entries)
    return {"ok": True, "manifest_sha256": digest.hexdigest(), "shards": n_shards}


def check_dir(path: str, need_bytes: int) -> dict[str, Any]:
    """Writable (tried, not guessed from permissions) and its free space, at the nearest existing parent."""
    probe = os.path.abspath(path)
    while not os.path.isdir(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    out: dict[str, Any] = {"path": probe, "free": shutil.disk_usage(probe).free, "need": need_bytes}
    try:
        fd, name = tempfile.mkstemp(dir=probe, prefix=".pretrain-preflight-")
        os.close(fd)
        os.unlink(name)
        out["writable"] = True
    except OSError as e:
        out["writable"], out["error"] = False, str(e)
    return out


def check_port(port: int) -> dict[str, Any]:
    """Free if this host could listen on it now, as rank 0's TCP store will."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers are fine
        try:
            s.bind(("", port))
            s.listen(1)
        except OSError as e:
            return {"free": False, "error": e.strerror or str(e)}
    return {"free": True}


def inspect(args: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"hostname": socket.gethostname(), "versions": versions()}
    if args.get("ops"):
        out["ops"] = check_ops(args["ops"])
    if args.get("data_dirs"):
        out["data"] = check_data(
            args["data_dirs"], args["manifest"], args["splits"], args["header_size"], args["checksums"]
        )
    if args.get("ckpt_dir"):
        out["ckpt"] = check_dir(args["ckpt_dir"], args["ckpt_bytes"])
    if args.get("port"):
        out["port"] = check_port(args["port"])
    return out


def _allreduce_rank(args: dict[str, Any], local_rank: int) -> None:
    """One rank: join the group, time the all-reduce; global rank 0 prints the result."""
    signal.alarm(int(args["timeout"]))  # never outlive preflight, whatever the network does
    rank = args["rank_base"] + local_rank
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(args["world"]),
        LOCAL_RANK=str(local_rank),
        MASTER_ADDR=args["master_addr"],
        MASTER_PORT=str(args["master_port"]),
        OMP_NUM_THREADS="1",
    )
    import torch  # the all-reduce needs torch; inspect() does not
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=args["timeout"]))
    n = args["bytes"] // 4
    x = torch.ones(n, dtype=torch.float32, device="cuda" if cuda else "cpu")
    dist.all_reduce(x)  # warm-up: connections, rings, NCCL's buffers
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(args["iters"]):
        dist.all_reduce(x)
    if cuda:
        torch.cuda.synchronize()  # the all-reduces are queued asynchronously; wait for them
    dt = (time.perf_counter() - t0) / args["iters"]
    ok = bool(x[0].item() == float(args["world"]) ** (args["iters"] + 1))
    if rank == 0:
        w = args["world"]
        alg = n * 4 / dt
        print(
            json.dumps(
                {
                    "world": w,
                    "bytes": n * 4,
                    "seconds": dt,
                    "algbw": alg,
                    "busbw": alg * 2 * (w - 1) / w,  # as nccl-tests report it: each rank's link load
                    "backend": "nccl" if cuda else "gloo",
                    "correct": ok,
                }
            ),
            flush=True,
        )
    dist.destroy_process_group()


def allreduce(args: dict[str, Any]) -> int:
    """Fork one rank per slot before anything imports torch; exit non-zero if any rank failed."""
    pids = []
    for local_rank in range(args["slots"]):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                _allreduce_rank(args, local_rank)
                code = 0
            except BaseException as e:
                print(f"rank {args['rank_base'] + local_rank}: {type(e).__name__}: {e}", file=sys.stderr)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    failed = 0
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        failed += os.waitstatus_to_exitcode(status) != 0
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    mode, args = argv[0], json.loads(argv[1])
    if mode == "inspect":
        print(json.dumps(inspect(args)), flush=True)
        return 0
    if mode == "allreduce":
        return allreduce(args)
    print(f"probe: unknown mode {mode!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
