"""Past one node, on one machine: two simulated nodes through the real launchers.

Each "node" is a torchrun agent (``--nnodes 2``, c10d rendezvous on 127.0.0.1) or, under a
stand-in Slurm, a local process group with the SLURM_* variables a cluster sets. Each node has
its own node-local tier directory and its own tier-token directory (``MLP_OFFLOAD_RUNTIME_DIR``);
one directory shared by both stands in for the parallel file system. The ranks run
``megatron_mlp.launch`` on the stand-in Megatron-LM checkout (megatron_mlp/testing/
megatron_lm_standin: Megatron-Core's tiny GPT, its optimizer factory and dist_checkpointing),
so what is tested is the launcher, the hooks and MLP-Offload's optimizer over both tiers.

Checks: two nodes of two ranks train bit for bit like one node of four; scratch on the shared
directory is per job and rank and removed at the end; a node's tokens block only its own ranks;
a checkpoint of two nodes resumes on one node of two ranks (DP 4 -> 2) with the optimizer state
bit-equal; a rank SIGKILLed on node 1 brings node 0 down within a bounded time, the next start
removes the stale scratch and resuming reproduces the uninterrupted run; the rendered two-node
Slurm script runs end to end with its calibration used.
"""
from __future__ import annotations

import json
import os
import re
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
pytest.importorskip("megatron_mlp._C", reason="the C++ core is not built")
pytestmark = [pytest.mark.megatron, pytest.mark.slow,
              pytest.mark.skipif(torch.cuda.is_available(), reason="runs under the CPU harness (no CUDA)")]

REPO = Path(__file__).resolve().parents[2]
STANDIN = REPO / "megatron_mlp" / "testing" / "megatron_lm_standin"
SCRIPT = STANDIN / "pretrain_gpt.py"
ITERS, SAVE_EVERY = 6, 3
TRAIN = ["--use-distributed-optimizer", "--bf16", "--train-iters", str(ITERS), "--log-interval", "2"]
# Subgroups of 4096 params: every rank's shard (~30k params at DP 4) spans several, on both tiers.
OFFLOAD = ["--mlp-offload", "--mlp-offload-subgroup-size", "4096", "--mlp-offload-calibration", "off"]
NODE_EXIT_TIMEOUT_S = 180   # "no hang": generous on a busy two-core machine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_dirs(root: Path, node: int) -> tuple[Path, Path]:
    local, run = root / f"node{node}" / "nvme", root / f"node{node}" / "run"
    local.mkdir(parents=True, exist_ok=True)
    return local, run


def _env(extra: dict | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("MLP_OFFLOAD_RUNTIME_DIR", None)
    env.update(extra or {})
    return env


def _torchrun_nodes(root: Path, nodes: int, nproc: int, job: str, args: list[str], results: Path,
                    per_node_args: dict[int, list[str]] | None = None, timeout: float = 600):
    """Start one torchrun agent per node (each its own process group); wait for all.

    Returns:
        (return codes, outputs, seconds from start until each agent exited)
    """
    results.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    pfs = root / "pfs"
    pfs.mkdir(exist_ok=True)
    procs, logs, t0 = [], [], time.monotonic()
    for node in range(nodes):
        local, run = _node_dirs(root, node)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node-rank", str(node),
               "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", job, "--max-restarts", "0", "-m", "megatron_mlp.launch", str(SCRIPT)]
        # The PFS is declared for the job (shared=job): each node plans with its share of 4 GB/s.
        cmd += TRAIN + OFFLOAD + ["--mlp-offload-paths", f"{local}:bw=2GB/s;{pfs}:bw=4GB/s,shared=job",
                                  "--standin-result-dir", str(results)]
        cmd += args + (per_node_args or {}).get(node, [])
        # Output to a file, not a pipe: an agent blocked on a full pipe would look like a hang.
        logs.append(open(results / f"{job}-node{node}.log", "w+"))
        procs.append(subprocess.Popen(cmd, cwd=root, env=_env({"MLP_OFFLOAD_RUNTIME_DIR": str(run)}),
                                      stdout=logs[-1], stderr=subprocess.STDOUT, start_new_session=True))
    rcs, ended = [None] * nodes, [None] * nodes
    while None in rcs:
        for i, p in enumerate(procs):
            if rcs[i] is None and p.poll() is not None:
                rcs[i], ended[i] = p.returncode, time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
            raise AssertionError(f"torchrun agents still running after {timeout} s (a hang)")
        time.sleep(0.2)
    outs = []
    for f in logs:
        f.seek(0)
        outs.append(f.read())
        f.close()
    return rcs, outs, ended


def _results(results: Path) -> dict[int, dict]:
    out = {}
    for f in results.glob("rank*.json"):
        r = json.loads(f.read_text())
        out[r["rank"]] = r
    return out


def _scratch(path: Path) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.startswith("mlp-offload-")) if path.exists() else []


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """The uninterrupted two-node run (2 x 2 ranks), saving every SAVE_EVERY iterations, with the
    token witness; and one node of four ranks on the same model and batches."""
    root = tmp_path_factory.mktemp("two-nodes")
    rcs, outs, _ = _torchrun_nodes(root, 2, 2, "job2n", ["--save", str(root / "ckpt"), "--save-interval",
                                                       str(SAVE_EVERY), "--standin-token-witness"], root / "res")
    assert rcs == [0, 0], "\n".join(o[-4000:] for o in outs)
    one = tmp_path_factory.mktemp("one-node")
    rcs1, outs1, _ = _torchrun_nodes(one, 1, 4, "job1n", [], one / "res")
    assert rcs1 == [0], outs1[0][-4000:]
    return {"root": root, "res": _results(root / "res"), "one": _results(one / "res"), "outs": outs,
            "outs_one": outs1}


def test_two_nodes_train_bit_for_bit_like_one_node_of_four_ranks_when_launched_by_torchrun(two_nodes):
    two, one = two_nodes["res"], two_nodes["one"]
    assert sorted(two) == sorted(one) == [0, 1, 2, 3]
    assert sorted(tuple(r["node_and_local_rank"]) for r in two.values()) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert list(two[0]["losses"]) == [str(i) for i in range(1, ITERS + 1)]
    for rank in two:
        assert two[rank]["losses"] == one[rank]["losses"], f"rank {rank}: losses differ"
        assert two[rank]["grad_norms"] == one[rank]["grad_norms"], f"rank {rank}: grad norms differ"


def test_optimizer_plans_with_its_nodes_share_of_the_shared_tier_when_torchrun_runs_two_nodes(two_nodes):
    share = "shared by the job's 2 nodes: this node's share read 2.00 GB/s, write 2.00 GB/s"
    assert share in "".join(two_nodes["outs"]), "the first rank prints each tier's figures"
    assert "this node's share" not in two_nodes["outs_one"][0], "one node has the whole PFS"


def test_scratch_on_the_shared_dir_is_unique_per_job_and_rank_and_removed_when_the_job_ends(two_nodes):
    root, res = two_nodes["root"], two_nodes["res"]
    pfs = str(root / "pfs")
    seen = res[0]["tiers"][pfs]
    assert all(r["tiers"][pfs] == seen for r in res.values()), "every rank sees the same shared directory"
    # One directory per rank of the job, whichever node it runs on, named by job and global rank.
    assert len(seen) == 4 and len({re.sub(r"-p\d+-.*", "", n) for n in seen}) == 4, seen
    assert sorted(re.match(r"mlp-offload-job2n-r(\d)-p\d+-", n).group(1) for n in seen) == ["0", "1", "2", "3"]
    for rank, r in res.items():
        node = r["node_and_local_rank"][0]
        local = [p for p in r["tiers"] if p != pfs]
        assert len(local) == 1 and local[0].endswith(f"node{node}/nvme")   # node-local dirs stay local
        assert len(r["tiers"][local[0]]) == 2, "each node's local tier holds its two ranks' scratch"
    assert _scratch(root / "pfs") == [] and _scratch(root / "node0" / "nvme") == [] \
        and _scratch(root / "node1" / "nvme") == [], "scratch must be removed when the ranks exit"


def test_a_nodes_tier_token_blocks_only_that_nodes_ranks_when_nodes_share_a_tier(two_nodes):
    res = two_nodes["res"]
    where = [tuple(w) for w in res[0]["witness"]["where"]]
    tried: dict[str, dict[str, bool]] = {}
    for r in res.values():
        for holder_node, attempts in r["witness"]["tried"].items():
            tried.setdefault(holder_node, {}).update(attempts)
    assert sorted(tried) == ["0", "1"]
    for holder_node, attempts in tried.items():
        assert sorted(map(int, attempts)) == [i for i, w in enumerate(where) if w != (int(holder_node), 0)]
        for rank, got in attempts.items():
            same_node = where[int(rank)][0] == int(holder_node)
            assert got is (not same_node), f"rank {rank} (node {where[int(rank)][0]}) while node " \
                                           f"{holder_node} holds the shared tier's token: got={got}"


def test_checkpoint_of_two_nodes_resumes_on_one_node_of_two_ranks_with_optimizer_state_bit_equal(two_nodes,
                                                                                                tmp_path):
    root = two_nodes["root"]
    rcs, outs, _ = _torchrun_nodes(tmp_path, 1, 2, "job-resume", ["--load", str(root / "ckpt")], tmp_path / "res")
    assert rcs == [0], outs[0][-4000:]
    saved = torch.load(root / "res" / f"state-saved-{ITERS}.pt")
    loaded = torch.load(tmp_path / "res" / f"state-loaded-{ITERS}.pt")
    assert saved.keys() == loaded.keys() and saved
    for name in saved:
        for k in ("param", "exp_avg", "exp_avg_sq"):
            assert not saved[name][k].isnan().any(), f"{name}.{k}: the saved shards do not cover it"
            assert torch.equal(saved[name][k], loaded[name][k]), f"{name}.{k} differs after DP 4 -> 2"


def test_node_death_ends_the_other_node_in_bounded_time_and_resume_reproduces_the_run(two_nodes, tmp_path):
    ref = two_nodes["res"][0]
    # Node 1's first rank SIGKILLs itself in the middle of iteration 4's update (checkpoint at 2).
    rcs, outs, ended = _torchrun_nodes(tmp_path, 2, 2, "job-dies", ["--save", str(tmp_path / "ckpt"),
                                       "--save-interval", "2"], tmp_path / "res-dies",
                                       per_node_args={1: ["--standin-kill-local-rank", "0",
                                                          "--standin-kill-iteration", "4"]},
                                       timeout=NODE_EXIT_TIMEOUT_S)
    assert rcs[0] != 0 and rcs[1] != 0, "both nodes must report the failure"
    assert max(ended) < NODE_EXIT_TIMEOUT_S
    left = {p: _scratch(tmp_path / p) for p in ("pfs", "node1/nvme")}
    assert left["pfs"] and left["node1/nvme"], "the killed rank leaves its scratch behind"
    # The next start, on both nodes, from the last checkpoint.
    rcs, outs, _ = _torchrun_nodes(tmp_path, 2, 2, "job-again", ["--load", str(tmp_path / "ckpt")],
                                   tmp_path / "res-again")
    assert rcs == [0, 0], "\n".join(o[-4000:] for o in outs)
    res = _results(tmp_path / "res-again")
    removed = {n for r in res.values() for n in r["stale_scratch_removed"]}
    assert set(left["pfs"]) | set(left["node1/nvme"]) <= removed, (left, removed)
    assert res[0]["start"] == 2
    assert res[0]["losses"] == {i: ref["losses"][i] for i in map(str, range(3, ITERS + 1))}
    assert res[0]["grad_norms"] == {i: ref["grad_norms"][i] for i in map(str, range(3, ITERS + 1))}
    for p in ("pfs", "node0/nvme", "node1/nvme"):
        assert _scratch(tmp_path / p) == [], p


# ---------------------------------------------------------------- the rendered Slurm script, end to end

# A stand-in Slurm: the commands the job script calls, as scripts put first on PATH. Nodes are
# named by loopback addresses so that the first one, the rendezvous host, resolves. Each node's
# tasks form one process group and get the variables Slurm gives a task (SLURM_PROCID, _LOCALID,
# _NODEID, SLURMD_NODENAME, ...) and, as pam_systemd does on a node, their own XDG_RUNTIME_DIR:
# the default home of the node's tier tokens. A path is the same directory on both "nodes" here
# (one machine), so the node-local directory is shared; its scratch names are per rank anyway.
STANDIN_SBATCH = r'''
import os, re, subprocess, sys
script = sys.argv[-1]
text = open(script).read()
opt = lambda name, default: int((re.findall(rf"^#SBATCH --{name}=(\d+)", text, re.M) or [default])[0])
nodes = opt("nodes", 1)
env = dict(os.environ, SLURM_JOB_ID=os.environ["STANDIN_JOB_ID"], SLURM_JOBID=os.environ["STANDIN_JOB_ID"],
           SLURM_JOB_NODELIST=",".join(f"127.0.0.{i + 1}" for i in range(nodes)), SLURM_JOB_NUM_NODES=str(nodes),
           SLURM_NNODES=str(nodes), SLURM_NTASKS_PER_NODE=str(opt("ntasks-per-node", 1)),
           SLURM_NODEID="0", SLURMD_NODENAME="127.0.0.1", SLURM_SUBMIT_DIR=os.getcwd())
print(f"Submitted batch job {env['SLURM_JOB_ID']}", flush=True)
# Like `sbatch --wait`: the test waits for the job; its output goes where --output says.
out = open(re.findall(r"^#SBATCH --output=(.*)$", text, re.M)[0].replace("%x", "job").replace("%j", env["SLURM_JOB_ID"]), "w")
sys.exit(subprocess.call(["bash", script], env=env, stdout=out, stderr=subprocess.STDOUT))
'''

STANDIN_SRUN = r'''
import os, signal, subprocess, sys, time
args = sys.argv[1:]
nodes = int(os.environ["SLURM_JOB_NUM_NODES"]); per_node = int(os.environ["SLURM_NTASKS_PER_NODE"])
kill_on_bad_exit = False
while args and args[0].startswith("-"):
    a = args.pop(0)
    if a.startswith("--nodes="): nodes = int(a.split("=", 1)[1])
    elif a.startswith("--ntasks-per-node="): per_node = int(a.split("=", 1)[1])
    elif a.startswith("--kill-on-bad-exit="): kill_on_bad_exit = a.endswith("=1")
names = os.environ["SLURM_JOB_NODELIST"].split(",")
groups, procs = [], []
for node in range(nodes):
    run_dir = os.path.join(os.environ["STANDIN_NODES"], names[node], "run")
    os.makedirs(run_dir, mode=0o700, exist_ok=True)
    leader = None
    for local in range(per_node):
        env = dict(os.environ, SLURM_NODEID=str(node), SLURMD_NODENAME=names[node],
                   SLURM_PROCID=str(node * per_node + local), SLURM_LOCALID=str(local),
                   SLURM_NTASKS=str(nodes * per_node), SLURM_STEP_NUM_NODES=str(nodes),
                   SLURM_STEP_NUM_TASKS=str(nodes * per_node), XDG_RUNTIME_DIR=run_dir)
        p = subprocess.Popen(args, env=env, process_group=0 if leader is None else leader)
        leader = p.pid if leader is None else leader
        procs.append(p)
    groups.append(leader)
def signal_all(sig):
    for g in groups:
        try:
            os.killpg(g, sig)
        except ProcessLookupError:
            pass
signal.signal(signal.SIGTERM, lambda *a: signal_all(signal.SIGTERM))
while any(p.poll() is None for p in procs):
    if kill_on_bad_exit and any(p.poll() not in (None, 0) for p in procs):
        signal_all(signal.SIGKILL)
    time.sleep(0.1)
sys.exit(max(abs(p.returncode) for p in procs))
'''

STANDIN_SCONTROL = r'''
import sys
if sys.argv[1:3] == ["show", "hostnames"]:
    print("\n".join(sys.argv[3].split(",")))
'''


@pytest.mark.parametrize("launcher,job_id", [("srun", "7001"), ("torchrun", "7002")])
def test_rendered_two_node_slurm_script_trains_end_to_end_with_its_calibration_used(two_nodes, tmp_path, launcher,
                                                                                   job_id):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("sbatch", STANDIN_SBATCH), ("srun", STANDIN_SRUN), ("scontrol", STANDIN_SCONTROL)):
        exe = bin_dir / name
        exe.write_text(f"#!{sys.executable}\n{body}")
        exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    nvme, pfs, calib, res = (tmp_path / d for d in ("nvme", "pfs", "calib", "res"))
    for d in (nvme, pfs, res):
        d.mkdir()
    env = _env({"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "STANDIN_JOB_ID": job_id,
                "STANDIN_NODES": str(tmp_path / "nodes")})
    # Measured by an earlier job (small, to keep CI short): the job's own calibration step finds
    # these figures for the base paths, and training in the job's directories below must use them.
    for node in ("127.0.0.1", "127.0.0.2"):
        cal = subprocess.run([sys.executable, "-m", "megatron_mlp", "calibrate", "--paths", f"{nvme};{pfs}",
                              "--size-bytes", "8MiB", "--procs", "2", "--cache", str(calib / f"{node}.json")],
                             env=env, capture_output=True, text=True, timeout=300)
        assert cal.returncode == 0, cal.stderr
    script = tmp_path / "job.sbatch"
    render = subprocess.run(
        [sys.executable, "-m", "megatron_mlp", "slurm", "--nodes", "2", "--gpus-per-node", "2",
         "--megatron-path", str(STANDIN), "--nvme-path", str(nvme), "--pfs-path", str(pfs),
         "--python", sys.executable, "--master-port", str(_free_port()), "--calibration-cache", str(calib),
         "--time", "00:10:00", "--launcher", launcher, "--setup", f"export PYTHONPATH={REPO}",
         "--model-args", f"--bf16 --train-iters 3 --standin-result-dir {res}",
         "--mlp-args", "--mlp-offload-cpu --mlp-offload-subgroup-size 4096", "-o", str(script), "--submit"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    out_file = tmp_path / f"job-{job_id}.out"
    log = out_file.read_text() if out_file.exists() else ""
    assert render.returncode == 0, render.stdout + render.stderr + log[-6000:]
    assert f"Submitted batch job {job_id}" in render.stdout and "training step exited with status 0" in log
    results = _results(res)
    assert sorted(results) == [0, 1, 2, 3]
    assert sorted(tuple(r["node_and_local_rank"]) for r in results.values()) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    ref = two_nodes["res"][0]
    assert results[0]["losses"] == {i: ref["losses"][i] for i in ("1", "2", "3")}
    # The calibration of the base paths served the job's directories below them: no tier fell
    # back to the default bandwidth.
    assert "WARNING: tier" not in log, log[-6000:]
    for d in (nvme, pfs):
        assert re.search(rf"tier \d \({re.escape(str(d))}/megatron-mlp-{job_id}\): read .* \(measured\)", log), log[-6000:]
    # Once per log interval, what each tier moved: the tiny model does offload.
    assert re.search(rf"megatron_mlp: last 1 iterations, this rank: {re.escape(str(nvme))}/megatron-mlp-{job_id} "
                     r"read [0-9.]+ [kM]B, wrote [0-9.]+ [kM]B", log), log[-6000:]
    assert sorted(os.listdir(tmp_path / "nodes")) == ["127.0.0.1", "127.0.0.2"]
    assert not (nvme / f"megatron-mlp-{job_id}").exists() and not (pfs / f"megatron-mlp-{job_id}").exists()
