"""Multi-node for real: a two-host cluster in network namespaces (tests/cluster.py), with sshd.

Every launch path trains the same tiny GPT at ZeRO-2 across the two hosts, one rank each, and must
give the per-step losses of a 2-rank run on one host:
- launch/pdsh.sh: `deepspeed --hostfile` over pdsh and ssh;
- launch/no_ssh.sh: one `deepspeed --no_ssh --node_rank K` per host;
- launch/mpirun.sh: Open MPI's mpirun, ranks discovered through mpi4py.
pdsh.sh and mpirun.sh stop before any rank starts when a host's sshd is down, naming it.
Model parallelism across hosts: two ranks per host, a pipeline stage on each host with tensor
parallelism inside it (launch/pdsh.sh), must give the losses of the same layout on one host.
Then `pretrain preflight` passes on the healthy cluster and names each seeded fault with its host.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pretrain.config.tree import DataConfig
from pretrain.data.prepare import prepare
from pretrain.data.tasks import FAULT_KILL
from tests.cluster import IFNAME, Cluster, slurm_unavailable, unavailable
from tests.conftest import ROOT, TINY_SHAKESPEARE, subprocess_env
from tests.test_data_tasks import data_config, dataset_files, write_corpus

pytestmark = pytest.mark.distributed

PY = sys.executable
STEPS = 6


def train_args(data: Path, run_dir: Path) -> list[str]:
    return [
        f"--set=data.corpus={TINY_SHAKESPEARE}", f"--set=data.dataset_dir={data}",
        f"--set=logging.run_dir={run_dir}", "--set", "model.n_layer=1", "--set", "model.n_embd=32", "--set", "model.n_head=2",
        "--set", "model.block_size=32", "--set", "batch.micro_batch_size=4", "--set", "zero.stage=2",
        "--set", f"schedule.max_steps={STEPS}", "--set", "schedule.warmup_steps=1",
        "--set", "logging.log_interval=1", "--set", "logging.eval_interval=1000",
        "--set", "logging.eval_batches=1", "--set", "logging.sample_tokens=0",
        "--set", "checkpoint.interval=1000",
    ]  # fmt: skip


def launch_args(cluster: Cluster) -> list[str]:
    """The launch section for this cluster: its interface, one thread per rank, and the suite's PATH
    and op cache on every host, so DeepSpeed's JIT-built ops load instead of rebuilding."""
    env = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PATH": cluster.path}
    if "TORCH_EXTENSIONS_DIR" in os.environ:
        env["TORCH_EXTENSIONS_DIR"] = os.environ["TORCH_EXTENSIONS_DIR"]
    return [
        "--set", f"launch.socket_ifname={IFNAME}", "--set", "launch.nccl_debug=WARN",
        *(a for k, v in env.items() for a in ("--set", f"launch.env.{k}={v}")),
    ]  # fmt: skip


def losses(run_dir: Path, column: str = "loss") -> list[float]:
    """Per step, as metrics.csv has it (6 significant digits): the loss, or another column."""
    with (run_dir / "metrics.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if r.get("loss")]
    return [float(r[column]) for r in rows]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    reason = unavailable()
    if reason:
        pytest.skip(f"two-host namespace cluster: {reason}")
    with Cluster(tmp_path_factory.mktemp("cluster")) as c:
        yield c


@pytest.fixture(scope="module")
def single_host_losses(char_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The reference: 2 ranks on one host, on loopback."""
    run_dir = tmp_path_factory.mktemp("single") / "run"
    cmd = [
        PY, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_addr", "127.0.0.1",
        "--master_port", "29571", "pretrain/main.py", *train_args(char_dataset, run_dir),
    ]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=480)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    got = losses(run_dir)
    assert len(got) == STEPS
    return got


def check_two_hosts(out: subprocess.CompletedProcess[str], run_dir: Path, reference: list[float]) -> None:
    assert out.returncode == 0, out.stdout[-6000:]
    got = losses(run_dir)
    assert len(got) == STEPS, out.stdout[-3000:]
    assert got == pytest.approx(reference, abs=1e-6), (got, reference)
    assert "world size 2" in out.stdout


def test_pdsh_hostfile_launch_matches_one_host(cluster, char_dataset, single_host_losses, tmp_path):
    run_dir = tmp_path / "run"
    out = cluster.run(
        0,
        [str(ROOT / "launch" / "pdsh.sh"), str(cluster.hostfile()),
         *train_args(char_dataset, run_dir), *launch_args(cluster)],
        timeout=480,
        env=cluster.env(MASTER_PORT="29572"),
    )  # fmt: skip
    check_two_hosts(out, run_dir, single_host_losses)
    # pdsh started node2's rank over ssh, with the environment rendered from the config.
    assert "pdsh" in out.stdout and "node2" in out.stdout


def test_no_ssh_one_launcher_per_host_matches_one_host(cluster, char_dataset, single_host_losses, tmp_path):
    run_dir = tmp_path / "run"
    hostfile = cluster.hostfile()
    args = [*train_args(char_dataset, run_dir), *launch_args(cluster)]
    env = cluster.env(MASTER_PORT="29573")
    script = str(ROOT / "launch" / "no_ssh.sh")
    second = subprocess.Popen(
        cluster.hosts[1].argv([script, str(hostfile), "1", *args]),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        first = cluster.run(0, [script, str(hostfile), "0", *args], timeout=480, env=env)
        second_out, _ = second.communicate(timeout=120)
    finally:
        if second.poll() is None:
            second.kill()
            second.wait()
    assert second.returncode == 0, second_out[-4000:]
    check_two_hosts(first, run_dir, single_host_losses)


def test_mpirun_with_mpi4py_discovery_matches_one_host(cluster, char_dataset, single_host_losses, tmp_path):
    run_dir = tmp_path / "run"
    out = cluster.run(
        0,
        [str(ROOT / "launch" / "mpirun.sh"), str(cluster.hostfile()),
         *train_args(char_dataset, run_dir), *launch_args(cluster)],
        timeout=480,
        env=cluster.env(MASTER_PORT="29574"),
    )  # fmt: skip
    check_two_hosts(out, run_dir, single_host_losses)


def test_slurm_sbatch_on_a_real_two_node_slurm(cluster, char_dataset, single_host_losses, tmp_path):
    """launch/slurm.sbatch under slurmctld + a slurmd per host: the hostfile comes from the
    allocation through scontrol, and srun starts one rank per node."""
    reason = slurm_unavailable()
    if reason:
        pytest.skip(f"real Slurm: {reason}")
    conf = cluster.start_slurm()
    run_dir = tmp_path / "run"
    out = cluster.run(
        0,
        ["sbatch", "--wait", "--nodes=2", "--ntasks-per-node=1", f"--output={tmp_path}/job-%j.out",
         str(ROOT / "launch" / "slurm.sbatch"), *train_args(char_dataset, run_dir), *launch_args(cluster)],
        timeout=480,
        cwd=ROOT,
        env=cluster.env(SLURM_CONF=str(conf), TMPDIR=str(tmp_path), MASTER_PORT="29576"),
    )  # fmt: skip
    logs = list(tmp_path.glob("job-*.out"))
    job = logs[0].read_text() if logs else "(no job output)"
    check_two_hosts(
        subprocess.CompletedProcess(out.args, out.returncode, out.stdout + job), run_dir, single_host_losses
    )
    job_id = logs[0].stem.removeprefix("job-")
    assert (tmp_path / f"pretrain-slurm-{job_id}.hostfile").read_text() == (
        f"# launch/slurm.sbatch: the nodes of Slurm job {job_id}\nnode1 slots=1\nnode2 slots=1\n"
    )


@pytest.mark.parametrize("script", ["pdsh.sh", "mpirun.sh"])
def test_a_launch_stops_at_a_host_ssh_cannot_reach(cluster, char_dataset, tmp_path, script):
    """node2's sshd stopped: the script's check (real ssh, as DeepSpeed's launcher runs it) names
    node2 and the fix in one line and exits 2; no rank starts, so no run dir appears."""
    run_dir = tmp_path / "run"
    node2 = cluster.hosts[1]
    node2.stop_sshd()
    try:
        out = cluster.run(
            0,
            [str(ROOT / "launch" / script), str(cluster.hostfile()), *train_args(char_dataset, run_dir),
             *launch_args(cluster)],
            timeout=120,
            env=cluster.env(MASTER_PORT="29578"),
        )  # fmt: skip
    finally:
        node2.start_sshd()
    assert out.returncode == 2, out.stdout[-3000:]
    lines = out.stdout.splitlines()
    assert len(lines) == 1, out.stdout
    assert lines[0].startswith(
        f"launch/{script}: host node2 is not reachable over ssh (`ssh -o PasswordAuthentication=no node2 "
        "hostname` failed: ssh: connect to host node2 port 22: Connection refused): start sshd on node2"
    ), lines[0]
    assert not run_dir.exists()


# ---------------------------------------------------------------------------------------------
# pipeline across the hosts, tensor parallelism inside each

# Two blocks so each pipeline stage holds one, two heads so each tensor-parallel rank holds one, and
# two micro batches so the pipeline has something to overlap. Later --set values override train_args'.
PP2_TP2 = [
    "--set", "parallel.pipeline=2", "--set", "parallel.tensor=2", "--set", "zero.stage=1",
    "--set", "model.n_layer=2", "--set", "batch.micro_batch_size=2",
    "--set", "batch.gradient_accumulation_steps=2",
]  # fmt: skip
LAYOUT = "tensor 2 x pipeline 2 x data 1 = world size 4"


def test_pipeline_across_hosts_tensor_within_matches_one_host(cluster, char_dataset, tmp_path):
    """PP2 x TP2 on 2 hosts x 2 ranks: ranks are laid out pipeline-major, so stage 0 (ranks 0, 1, a
    tensor-parallel pair) is node1 and stage 1 (ranks 2, 3) is node2. Activations and their gradients
    cross the hosts between the stages, the tensor-parallel all-reduces stay on each host, and the
    tied embedding's gradient is all-reduced between the first and the last stage, across them.

    The losses and gradient norms must equal those of the same 4 ranks on one host as metrics.csv
    writes them (6 significant digits), with no tolerance: the ranks, their groups and so gloo's
    algorithm for each collective are the same on one host and on two (TCP either way, over loopback
    or the veth pair), so every sum is taken in the same order and the arithmetic is identical."""
    single_dir = tmp_path / "single"
    one_host = subprocess.run(
        [PY, "-m", "pretrain", "train", "--nproc-per-node", "4", *train_args(char_dataset, single_dir), *PP2_TP2],
        cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=480,
    )  # fmt: skip
    assert one_host.returncode == 0, one_host.stdout[-4000:] + one_host.stderr[-4000:]
    assert LAYOUT in one_host.stdout
    reference = losses(single_dir), losses(single_dir, "grad_norm")
    assert len(reference[0]) == STEPS

    run_dir = tmp_path / "run"
    out = cluster.run(
        0,
        [str(ROOT / "launch" / "pdsh.sh"), str(cluster.hostfile((2, 2))),
         *train_args(char_dataset, run_dir), *PP2_TP2, *launch_args(cluster)],
        timeout=480,
        env=cluster.env(MASTER_PORT="29577"),
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-6000:]
    assert LAYOUT in out.stdout
    got = losses(run_dir), losses(run_dir, "grad_norm")
    assert len(got[0]) == STEPS, out.stdout[-3000:]
    assert got == reference
    # node2's ranks were started over ssh (pdsh prefixes their output with the host) as ranks 2 and 3,
    # and those are the second pipeline stage in DeepSpeed's topology.
    assert "node2: " in out.stdout
    assert "global_rank_mapping=defaultdict(<class 'list'>, {'node1': [0, 1], 'node2': [2, 3]})" in out.stdout
    assert "ProcessCoord(pipe=1, data=0, model=0): 2, ProcessCoord(pipe=1, data=0, model=1): 3}" in out.stdout


# ---------------------------------------------------------------------------------------------
# preflight


def preflight(cluster: Cluster, data: Path, hostfile: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        PY, "-m", "pretrain", "preflight", "--hostfile", str(hostfile), "--master-port", "29575",
        "--timeout", "60", f"--set=data.corpus={TINY_SHAKESPEARE}", f"--set=data.dataset_dir={data}",
        f"--set=logging.run_dir={hostfile.parent / 'run'}",
        *launch_args(cluster), *extra,
    ]  # fmt: skip
    return cluster.run(0, cmd, timeout=120, cwd=ROOT)


def test_preflight_passes_and_times_an_allreduce(cluster, char_dataset):
    out = preflight(cluster, char_dataset, cluster.hostfile())
    assert out.returncode == 0, out.stdout
    table = out.stdout.splitlines()
    assert table[0].split()[:3] == ["host", "slots", "ssh"]
    assert table[1].startswith("node1") and table[2].startswith("node2")
    assert "all-reduce: 2 ranks (gloo)" in out.stdout and "bus bandwidth" in out.stdout
    assert "all 2 host(s) ready" in out.stdout


def _empty_venv(where: Path) -> Path:
    base = getattr(sys, "_base_executable", None) or "python3"
    subprocess.run([base, "-m", "venv", "--without-pip", str(where)], check=True, capture_output=True)
    return where


@pytest.mark.parametrize("fault", ["unreachable", "versions", "data", "port", "slots"])
def test_preflight_names_the_host_and_the_fix(cluster, char_dataset, tmp_path, fault):
    node2 = cluster.hosts[1]
    hostfile = cluster.hostfile((1, 3) if fault == "slots" else (1, 1))
    listener = None
    try:
        if fault == "unreachable":
            node2.stop_sshd()
        elif fault == "versions":  # node2's venv is another interpreter's, without torch or DeepSpeed
            node2.start_sshd(binds=[(_empty_venv(tmp_path / "venv"), Path(PY).parents[1])])
        elif fault == "data":  # node2 sees an empty directory where the dataset is
            (tmp_path / "empty").mkdir()
            node2.start_sshd(binds=[(tmp_path / "empty", char_dataset)])
        elif fault == "port":  # something on node1 already listens on the master port
            listener = cluster.start(
                0,
                [PY, "-c", "import socket, time; s = socket.create_server(('', 29575)); print('up', flush=True);"
                 " time.sleep(120)"],
            )  # fmt: skip
            assert listener.stdout is not None and listener.stdout.readline().strip() == "up"
        out = preflight(cluster, char_dataset, hostfile)
    finally:
        if listener is not None:
            listener.kill()
            listener.wait()
        if fault in ("unreachable", "versions", "data"):
            node2.start_sshd()
    assert out.returncode == 1, out.stdout
    fails = [line for line in out.stdout.splitlines() if line.startswith("FAIL ")]
    expected = {
        "unreachable": ("FAIL node2: ssh: not reachable over ssh", "ssh-copy-id node2"),
        "versions": ("FAIL node2: versions: torch not installed", "same environment on every host"),
        "data": ("FAIL node2: data:", "rsync -a"),
        "port": ("FAIL node1: master port: port 29575 is in use", "pick a free port"),
        "slots": ("FAIL node2: accelerators: 3 slots", "slots=2"),
    }[fault]
    assert any(line.startswith(expected[0]) for line in fails), out.stdout
    assert expected[1] in out.stdout, out.stdout
    assert "all-reduce:" not in out.stdout  # nothing is launched on a cluster that failed its checks
    if fault != "port":
        assert all(line.startswith("FAIL node2") for line in fails), out.stdout


# ---------------------------------------------------------------------------------------------
# a prepare stage's tasks on Slurm and on Ray (pretrain/data/executors.py)

STAGE_TASKS = 4


def run_stage_on(
    cluster: Cluster, host: int, data: dict, logs: Path, out: Path, env: dict[str, str], step_args: str = ""
):
    """run_stage from `host` in a process of its own, with the toy step of tests/stage_steps.py."""
    code = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from pretrain.config.tree import DataConfig\n"
        "from pretrain.data.executors import run_stage\n"
        "from tests.stage_steps import ToyStep\n"
        "data = DataConfig.model_validate(json.loads(sys.argv[1]))\n"
        f"run_stage(data, Path({str(logs)!r}), 'encode', ToyStep({str(out)!r}, sleep=1.0{step_args}), {STAGE_TASKS},"
        " log=print)\n"
    )
    return cluster.run(host, [PY, "-c", code, json.dumps(data)], timeout=120, cwd=ROOT, env=env)


def prepare_on(cluster: Cluster, host: int, corpus: Path, out: Path, env: dict[str, str], **over: object):
    """`pretrain data prepare` of the test corpus on `host`, with these data settings."""

    def sets(prefix: str, values: dict) -> Iterator[str]:
        for k, v in values.items():
            text = json.dumps(v) if isinstance(v, str) and ":" in v else v  # 5:00 is a time, not YAML's 300
            yield from sets(f"{prefix}{k}.", v) if isinstance(v, dict) else [f"{prefix}{k}={text}"]

    argv = [str(Path(PY).parent / "pretrain"), "data", "prepare"]
    for item in sets("data.", data_config(corpus, out, tasks=STAGE_TASKS, **over)):
        argv += ["--set", item]
    return cluster.run(host, argv, timeout=240, cwd=ROOT, env=env)


@pytest.fixture(scope="module")
def local_tasks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The test corpus (near and exact copies across tasks) and its dataset, prepared as
    STAGE_TASKS tasks by the local executor: what Slurm and Ray must give, byte for byte."""
    d = tmp_path_factory.mktemp("engine")
    (d / "corpus").mkdir()
    write_corpus(d / "corpus")
    out = prepare(
        DataConfig.model_validate(data_config(d / "corpus", d / "local", tasks=STAGE_TASKS, workers=2))
    )
    return d / "corpus", out


def check_stage(out: Path, logs: Path, res: subprocess.CompletedProcess[str]) -> set[str]:
    """Every rank's output and completion marker; returns the hosts that ran them."""
    assert res.returncode == 0, res.stdout[-4000:]
    assert sorted(p.name for p in (logs / "completions").iterdir()) == [
        f"{r:05d}" for r in range(STAGE_TASKS)
    ]
    rows = [(out / f"rank{r}.txt").read_text().split() for r in range(STAGE_TASKS)]
    assert [row[:2] for row in rows] == [[str(r), str(STAGE_TASKS)] for r in range(STAGE_TASKS)]
    return {row[2] for row in rows}


def batch_jobs(cluster: Cluster) -> dict[str, int]:
    """How many batch jobs (array tasks) each host's slurmd has launched so far."""
    log = cluster.dir / "slurm"
    return {
        h.name: (log / f"slurmd-{h.name}.log").read_text().count("Launching batch job") for h in cluster.hosts
    }


def test_data_prepare_on_a_real_two_node_slurm(cluster, local_tasks, tmp_path):
    """`data prepare` with data.executor 'slurm' from node1, every stage a job array over both nodes.
    A task killed mid-way is named with its log and Slurm's output, and nothing is left under the
    dataset's name; the same command again runs that task alone, then the other stages, and gives
    the local executor's dataset, byte for byte."""
    reason = slurm_unavailable()
    if reason:
        pytest.skip(f"real Slurm: {reason}")
    env = cluster.env(SLURM_CONF=str(cluster.start_slurm()))
    corpus, local = local_tasks
    slurm = {"time": "5:00", "mem_per_cpu_gb": 0.001}
    before = batch_jobs(cluster)
    killed = prepare_on(cluster, 0, corpus, tmp_path / "ds", {**env, FAULT_KILL: "encode:1"}, executor="slurm",
                        slurm=slurm)  # fmt: skip
    assert killed.returncode == 2, killed.stdout[-4000:]
    assert (
        "data prepare stage 'encode' (data.executor 'slurm'): 1 of 4 tasks did not complete: rank 1 (log "
    ) in killed.stdout and "Slurm's output in" in killed.stdout, killed.stdout[-3000:]
    assert not (tmp_path / "ds").exists()
    res = prepare_on(cluster, 0, corpus, tmp_path / "ds", env, executor="slurm", slurm=slurm)
    assert res.returncode == 0, res.stdout[-4000:]
    assert "stage encode: 1 of 4 tasks to run on Slurm (3 done before)" in res.stdout
    assert dataset_files(tmp_path / "ds") == dataset_files(local)
    after = batch_jobs(cluster)
    assert all(after[h] > before[h] for h in after), (before, after)  # both nodes took tasks


def netns_pids(cluster: Cluster) -> set[int]:
    pids: set[int] = set()
    for h in cluster.hosts:
        res = subprocess.run(["ip", "netns", "pids", h.ns], capture_output=True, text=True)
        pids.update(int(p) for p in res.stdout.split())
    return pids


def test_data_stage_on_ray_with_two_nodes(cluster, local_tasks, tmp_path):
    """data.executor 'ray' on a two-node Ray cluster (a head on node1, a worker node on node2, one CPU
    each), from node1: a stage's tasks run on both nodes; a prepare whose task is killed in its Ray
    worker names it, and the same command again runs it alone and gives the local executor's dataset,
    byte for byte. Ray's processes are stopped by PID at the end (`ray stop` would stop every Ray on
    this machine)."""
    ray = str(Path(PY).parent / "ray")
    # Ray's unix sockets live under its temp dir, whose path must stay short (108 bytes a socket path).
    temp = Path(tempfile.mkdtemp(prefix="ptray", dir="/tmp"))
    env = cluster.env(RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled", HOME=str(tmp_path))
    common = ["--num-cpus", "1", "--object-store-memory", str(80 << 20), "--disable-usage-stats"]
    before = netns_pids(cluster)
    try:
        head = cluster.run(
            0,
            [ray, "start", "--head", "--node-ip-address", "10.77.0.1", "--port", "6390",
             "--include-dashboard=false", "--temp-dir", str(temp / "head"), *common],
            timeout=60, env=env,
        )  # fmt: skip
        assert head.returncode == 0, head.stdout[-3000:]
        node = cluster.run(
            1,
            [ray, "start", "--address", "10.77.0.1:6390", "--node-ip-address", "10.77.0.2",
             "--temp-dir", str(temp / "node2"), *common],
            timeout=60, env=env,
        )  # fmt: skip
        assert node.returncode == 0, node.stdout[-3000:]
        out, logs = tmp_path / "out", tmp_path / "logs"
        out.mkdir()
        data = {"executor": "ray", "tasks": STAGE_TASKS, "ray": {"address": "10.77.0.1:6390"}}
        res = run_stage_on(cluster, 0, data, logs, out, env)
        assert check_stage(out, logs, res) == {"node1", "node2"}
        assert res.stdout.splitlines()[-1] == f"stage encode: {STAGE_TASKS}/{STAGE_TASKS} tasks done"
        # A whole prepare, a task killed by SIGKILL in its Ray worker: named, without a hang; the same
        # command again runs it alone and gives the local executor's dataset, byte for byte.
        corpus, local = local_tasks
        address = {"address": "10.77.0.1:6390"}
        killed = prepare_on(cluster, 0, corpus, tmp_path / "ds", {**env, FAULT_KILL: "encode:1"}, executor="ray",
                            ray=address)  # fmt: skip
        assert killed.returncode == 2, killed.stdout[-4000:]
        assert "1 of 4 tasks did not complete: rank 1 (its Ray worker died" in killed.stdout, killed.stdout[
            -3000:
        ]
        res = prepare_on(cluster, 0, corpus, tmp_path / "ds", env, executor="ray", ray=address)
        assert res.returncode == 0, res.stdout[-4000:]
        assert "stage encode: 1 of 4 tasks to run on Ray (3 done before)" in res.stdout
        assert dataset_files(tmp_path / "ds") == dataset_files(local)
    finally:
        for _ in range(3):
            left = netns_pids(cluster) - before
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if not left:
                break
            time.sleep(0.2)
        shutil.rmtree(temp, ignore_errors=True)
