"""`megatron-mlp slurm`: the rendered job script, against golden files and run with mocked Slurm.

Slurm's commands (srun, sbatch, scontrol), torchrun, `megatron-mlp calibrate` and the training
python are fake executables put first on PATH; they record their argv and environment, so the
script's own logic (scratch dirs, calibration cache, rank environment, SIGTERM, cleanup) runs in CI.
Regenerate the golden files deliberately with MLP_REGEN_GOLDEN=1.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from megatron_mlp import slurm
from megatron_mlp.errors import ConfigError
from megatron_mlp.shell_words import walltime_seconds
from megatron_mlp.slurm import SlurmJob, render_job_script

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "golden"
MODEL_ARGS = ("--tensor-model-parallel-size 1 --num-layers 32 --hidden-size 4096 --num-attention-heads 32 "
              "--seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 64 "
              "--lr 1.5e-4 --train-iters 1000 --bf16 --data-path $DATA/my-gpt_text_document "
              "--tokenizer-type GPT2BPETokenizer --vocab-file $DATA/vocab.json --merge-file $DATA/merges.txt "
              "--save $CKPT --load $CKPT --save-interval 200 --log-interval 10")
# name -> options of a golden file (also the examples shipped in scripts/slurm/).
GOLDEN_JOBS = {
    "slurm_1node.sbatch": SlurmJob(
        megatron_path="$HOME/Megatron-LM", nvme_path="/local/nvme", pfs_path="$SCRATCH/mlp-offload",
        model_args=MODEL_ARGS, mlp_args="--mlp-offload-host-memory 64GB --mlp-offload-subgroup-size 100M",
        nodes=1, gpus_per_node=4, time="02:00:00", partition="gpu", account="myproj", cpus_per_gpu=8,
        setup=("source $HOME/venv/bin/activate",)),
    "slurm_4node.sbatch": SlurmJob(
        megatron_path="$HOME/Megatron-LM", nvme_path="/local/nvme", pfs_path="$SCRATCH/mlp-offload",
        model_args=MODEL_ARGS, mlp_args="--mlp-offload-host-memory 64GB", nodes=4, gpus_per_node=8,
        time="1-00:00:00", partition="gpu", account="myproj", cpus_per_gpu=8, nvme_bw="6GB/s",
        setup=("source $HOME/venv/bin/activate",)),
    "slurm_2node_torchrun.sbatch": SlurmJob(
        megatron_path="$HOME/Megatron-LM", nvme_path="/local/nvme", pfs_path="$SCRATCH/mlp-offload",
        model_args=MODEL_ARGS, nodes=2, gpus_per_node=8, launcher="torchrun", partition="gpu"),
}
EXAMPLES = {"slurm_1node.sbatch": "single_node.sbatch", "slurm_4node.sbatch": "multi_node.sbatch"}


@pytest.mark.parametrize("name", sorted(GOLDEN_JOBS))
def test_rendered_script_matches_golden_file(name):
    text = render_job_script(GOLDEN_JOBS[name])
    path = GOLDEN / name
    if os.environ.get("MLP_REGEN_GOLDEN") == "1":
        path.write_text(text)
        if name in EXAMPLES:
            (REPO / "scripts" / "slurm" / EXAMPLES[name]).write_text(text)
    assert path.read_text() == text, f"{name} differs from the renderer; MLP_REGEN_GOLDEN=1 to update deliberately"


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_shipped_examples_are_rendered_goldens(name):
    assert (REPO / "scripts" / "slurm" / EXAMPLES[name]).read_text() == (GOLDEN / name).read_text()


@pytest.mark.parametrize("name", sorted(GOLDEN_JOBS))
def test_rendered_script_passes_bash_syntax_check(name, tmp_path):
    script = tmp_path / name
    script.write_text(render_job_script(GOLDEN_JOBS[name]))
    subprocess.run(["bash", "-n", str(script)], check=True)


def test_script_uses_megatron_exit_signal_handler_and_sigterm_before_limit():
    text = render_job_script(SlurmJob(megatron_path="/m", nvme_path="/n", signal_seconds=300))
    assert "#SBATCH --signal=SIGTERM@300" in text
    assert "--exit-signal-handler" in text and "--use-distributed-optimizer" in text


@pytest.mark.parametrize("kwargs,flag", [
    (dict(nodes=0), "--nodes"), (dict(gpus_per_node=-1), "--gpus-per-node"),
    (dict(launcher="mpirun"), "--launcher"), (dict(time="two hours"), "--time"),
    (dict(nvme_path=""), "--nvme-path"), (dict(mlp_args="--mlp-offload-paths /x"), "--mlp-offload-paths"),
])
def test_invalid_option_names_the_cli_flag(kwargs, flag):
    base = dict(megatron_path="/m", nvme_path="/n")
    base.update(kwargs)
    with pytest.raises(ConfigError, match=flag):
        SlurmJob(**base)


def test_cli_writes_executable_script_and_submits_with_sbatch(tmp_path, monkeypatch):
    bin_dir = _fake_bin(tmp_path)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_LOG", str(tmp_path / "log.jsonl"))
    out = tmp_path / "job.sbatch"
    rc = slurm.main(["--megatron-path", "/m", "--nvme-path", "/n", "--nodes", "2", "-o", str(out), "--submit"])
    assert rc == 0 and os.access(out, os.X_OK)
    assert out.read_text() == render_job_script(SlurmJob(megatron_path="/m", nvme_path="/n", nodes=2))
    assert [r["argv"] for r in _records(tmp_path) if r["cmd"] == "sbatch"] == [[str(out)]]


def test_cli_reports_bad_option_with_exit_status_2(capsys):
    assert slurm.main(["--megatron-path", "/m", "--nvme-path", "/n", "--nodes", "0"]) == 2
    assert "--nodes" in capsys.readouterr().err



def test_help_shows_no_misleading_default_for_switches_and_explains_every_option(capsys):
    with pytest.raises(SystemExit):
        slurm.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: True)" not in out and "(default: False)" not in out
    assert "by default each node measures them once" in out
    for action in slurm._parser()._actions:
        assert action.help, f"{action.option_strings} has no help"
    assert "--nodes NODES nodes of the job" in out and "--time TIME time limit" in out


@pytest.mark.parametrize("render", [render_job_script, slurm.render_pbs_script])
def test_megatron_flags_are_given_once_when_model_args_already_carry_them(render):
    job = SlurmJob(megatron_path="/m", nvme_path="/n",
                   model_args="--use-distributed-optimizer --num-layers 2 --exit-signal-handler")
    train = next(line for line in render(job).splitlines() if line.startswith("TRAIN_ARGS=("))
    assert train.count("--use-distributed-optimizer") == 1 and train.count("--exit-signal-handler") == 1
    plain = next(line for line in render(SlurmJob(megatron_path="/m", nvme_path="/n")).splitlines()
                 if line.startswith("TRAIN_ARGS=("))
    assert "--use-distributed-optimizer" in plain and "--exit-signal-handler" in plain


@pytest.mark.parametrize("render", [render_job_script, slurm.render_pbs_script])
def test_scripts_export_one_cuda_connection_when_megatron_may_use_tensor_parallelism(render, tmp_path):
    text = render(SlurmJob(megatron_path="/m", nvme_path="/n"))
    script = tmp_path / "job.sh"
    # Only the exports: what a rank inherits, with and without a value set by the user.
    script.write_text("\n".join(line for line in text.splitlines() if "CUDA_DEVICE_MAX_CONNECTIONS" in line)
                      + "\necho \"$CUDA_DEVICE_MAX_CONNECTIONS\"\n")
    env = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}
    assert subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True).stdout == "1\n"
    env["CUDA_DEVICE_MAX_CONNECTIONS"] = "4"
    assert subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True).stdout == "4\n"


def test_declared_pfs_bandwidth_is_the_jobs_and_shared_by_its_nodes_when_rendered():
    from megatron_mlp.tier.shared import node_share
    from megatron_mlp.tier.spec import parse_tier_paths
    job = SlurmJob(megatron_path="/m", nvme_path="/n", pfs_path="/p", nodes=4, nvme_bw="6GB/s", pfs_bw="100GB/s")
    spec = slurm._paths_spec(job)
    nvme, pfs = parse_tier_paths(spec.replace("$MLP_NVME_DIR", "/n/j").replace("$MLP_PFS_DIR", "/p/j"))
    assert node_share(nvme, 4).read_bytes_per_s == 6e9 and node_share(pfs, 4).read_bytes_per_s == 25e9

# ---------------------------------------------------------------- running with mocked Slurm

FAKE_SRUN = r'''
import os, signal, subprocess, sys, json
args = sys.argv[1:]
nodes = int(os.environ["SLURM_JOB_NUM_NODES"]); per_node = int(os.environ["SLURM_NTASKS_PER_NODE"])
while args and args[0].startswith("-"):
    a = args.pop(0)
    if a.startswith("--nodes="): nodes = int(a.split("=", 1)[1])
    elif a.startswith("--ntasks-per-node="): per_node = int(a.split("=", 1)[1])
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps({"cmd": "srun", "argv": sys.argv[1:]}) + "\n")
procs = []
for node in range(nodes):
    for local in range(per_node):
        env = dict(os.environ, SLURM_NODEID=str(node), SLURMD_NODENAME=f"node{node}",
                   SLURM_PROCID=str(node * per_node + local), SLURM_LOCALID=str(local),
                   SLURM_NTASKS=str(nodes * per_node))
        procs.append(subprocess.Popen(args, env=env))
signal.signal(signal.SIGTERM, lambda *a: [p.send_signal(signal.SIGTERM) for p in procs])
sys.exit(max(p.wait() for p in procs))
'''

FAKE_RECORDER = r'''
import os, sys, json
name = os.path.basename(sys.argv[0])
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps({"cmd": name, "argv": sys.argv[1:]}) + "\n")
if name == "scontrol":
    print("\n".join(f"node{i}" for i in range(int(os.environ["SLURM_JOB_NUM_NODES"]))))
if name == "sbatch":
    print("Submitted batch job 4242")
'''

# The training python: records its rank environment and tier paths; with FAKE_WAIT_TERM it
# waits for SIGTERM (Megatron's exit-signal handler) and then "saves" from its tier paths.
FAKE_PYTHON = r'''
import os, sys, json, signal, subprocess, time
argv = sys.argv[1:]
if argv[:3] == ["-m", "megatron_mlp", "calibrate"]:
    cache = argv[argv.index("--cache") + 1]
    with open(os.environ["FAKE_LOG"], "a") as f:
        f.write(json.dumps({"cmd": "calibrate", "argv": argv[3:], "node": os.environ["SLURMD_NODENAME"],
                            # calibrate expands $VARS in --paths itself, as the training does
                            "paths": os.path.expandvars(argv[argv.index("--paths") + 1])}) + "\n")
    if not os.path.exists(cache):  # the real command measures once, then reuses its cache
        open(cache, "w").write(json.dumps({"node": os.environ["SLURMD_NODENAME"]}))
    sys.exit(0)
if argv[:2] == ["-m", "torch.distributed.run"]:
    opts = dict(a.split("=", 1) for a in argv if a.startswith("--") and "=" in a)
    rest = argv[argv.index("-m", 2):]
    nproc = int(opts["--nproc-per-node"]); node = int(os.environ["SLURM_NODEID"])
    procs = [subprocess.Popen([sys.argv[0]] + rest, env=dict(os.environ, LOCAL_RANK=str(j),
             RANK=str(node * nproc + j), WORLD_SIZE=str(int(opts["--nnodes"]) * nproc))) for j in range(nproc)]
    signal.signal(signal.SIGTERM, lambda *a: [p.send_signal(signal.SIGTERM) for p in procs])
    with open(os.environ["FAKE_LOG"], "a") as f:
        f.write(json.dumps({"cmd": "torchrun", "argv": argv, "node": node}) + "\n")
    sys.exit(max(p.wait() for p in procs))
paths = argv[argv.index("--mlp-offload-paths") + 1]
calib = os.path.expandvars(argv[argv.index("--mlp-offload-calibration") + 1])
# as parse_tier_paths: split at ';' and ':' first, then expand, so the values are data
dirs = [os.path.expandvars(p.split(":")[0]) for p in paths.split(";")]
rec = {"cmd": "train", "argv": argv, "rank": os.environ["RANK"], "local_rank": os.environ["LOCAL_RANK"],
       "world_size": os.environ["WORLD_SIZE"], "master": os.environ.get("MASTER_ADDR"), "dirs": dirs,
       "modes": [oct(os.stat(d).st_mode & 0o777) for d in dirs], "calibration": calib,
       "calibration_exists": os.path.isfile(calib)}
if os.environ.get("FAKE_WAIT_TERM"):
    got = []
    signal.signal(signal.SIGTERM, lambda *a: got.append(1))
    open(os.path.join(os.environ["FAKE_READY_DIR"], os.environ["RANK"]), "w").close()
    while not got:
        time.sleep(0.02)
    time.sleep(0.3)  # saving a checkpoint takes a while; scratch must still be there afterwards
    rec["dirs_exist_at_save"] = all(os.path.isdir(d) for d in dirs)
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps(rec) + "\n")
'''


def _fake_bin(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in (("srun", FAKE_SRUN), ("scontrol", FAKE_RECORDER), ("sbatch", FAKE_RECORDER),
                       ("fakepython", FAKE_PYTHON)):
        exe = bin_dir / name
        exe.write_text(f"#!{sys.executable}\n{body}")
        exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return bin_dir


def _records(tmp_path: Path) -> list[dict]:
    log = tmp_path / "log.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _run_job(tmp_path: Path, job_id: str, extra_env: dict | None = None, **overrides) -> tuple[SlurmJob, dict, subprocess.Popen]:
    bin_dir = _fake_bin(tmp_path)
    opts = dict(megatron_path=str(tmp_path / "Megatron-LM"), nvme_path=str(tmp_path / "nvme"),
                pfs_path=str(tmp_path / "pfs"), model_args="--num-layers 2 --save $CKPT",
                nodes=2, gpus_per_node=2, python=str(bin_dir / "fakepython"),
                calibration_cache=str(tmp_path / "calib"))
    opts.update(overrides)
    job = SlurmJob(**opts)
    script = tmp_path / f"job{job_id}.sbatch"
    script.write_text(render_job_script(job))
    (tmp_path / "nvme").mkdir(exist_ok=True)
    (tmp_path / "pfs").mkdir(exist_ok=True)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_LOG=str(tmp_path / "log.jsonl"),
               SLURM_JOB_ID=job_id, SLURM_JOB_NUM_NODES=str(job.nodes),
               SLURM_NTASKS_PER_NODE=str(job.gpus_per_node if job.launcher == "srun" else 1),
               SLURM_JOB_NODELIST="node[0-1]", CKPT=str(tmp_path / "ckpt"), FAKE_READY_DIR=str(tmp_path))
    env.pop("FAKE_WAIT_TERM", None)
    env.update(extra_env or {})
    return job, env, subprocess.Popen(["bash", str(script)], env=env, cwd=tmp_path,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.parametrize("launcher", ["srun", "torchrun"])
def test_job_gives_each_rank_private_scratch_and_removes_it_when_training_ends(tmp_path, launcher):
    job, env, proc = _run_job(tmp_path, "101", launcher=launcher)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    trains = sorted((r for r in _records(tmp_path) if r["cmd"] == "train"), key=lambda r: int(r["rank"]))
    assert [r["rank"] for r in trains] == ["0", "1", "2", "3"]
    assert {r["world_size"] for r in trains} == {"4"} and {r["master"] for r in trains} == {"node0"}
    nvme, pfs = tmp_path / "nvme" / "megatron-mlp-101", tmp_path / "pfs" / "megatron-mlp-101"
    for r in trains:
        assert r["dirs"] == [str(nvme), str(pfs)]  # each rank's optimizer makes its own dir inside
        assert r["modes"] == ["0o700", "0o700"]
        assert "--exit-signal-handler" in r["argv"] and "--mlp-offload" in r["argv"]
        assert r["argv"][0:2] == ["-m", "megatron_mlp.launch"]
        assert r["argv"][2] == f"{job.megatron_path}/pretrain_gpt.py"
        assert r["argv"][r["argv"].index("--save") + 1] == str(tmp_path / "ckpt")
        assert r["calibration_exists"]
    assert not nvme.exists() and not pfs.exists(), "scratch must be removed at the end of the job"
    assert "training step exited with status 0" in out
    if launcher == "torchrun":
        runs = [r for r in _records(tmp_path) if r["cmd"] == "torchrun"]
        assert len(runs) == 2 and "--rdzv-endpoint=node0:29500" in runs[0]["argv"]


def test_calibration_runs_per_node_into_a_cache_kept_across_jobs(tmp_path):
    for job_id in ("201", "202"):
        _, _, proc = _run_job(tmp_path, job_id)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out
    calibrations = [r for r in _records(tmp_path) if r["cmd"] == "calibrate"]
    assert sorted(r["node"] for r in calibrations) == ["node0", "node0", "node1", "node1"]
    for r in calibrations:
        # the node's base directories, not the job's: the figures stay valid for later jobs
        assert r["paths"] == f"{tmp_path / 'nvme'};{tmp_path / 'pfs'}"
        assert r["argv"][r["argv"].index("--cache") + 1] == str(tmp_path / "calib" / f"{r['node']}.json")
        assert r["argv"][r["argv"].index("--procs") + 1] == "2"
    assert sorted(os.listdir(tmp_path / "calib")) == ["node0.json", "node1.json"]
    trains = [r for r in _records(tmp_path) if r["cmd"] == "train"]
    assert {r["calibration"] for r in trains} == {str(tmp_path / "calib" / f"node{i}.json") for i in (0, 1)}
    assert all(r["calibration_exists"] for r in trains)


def test_job_keeps_scratch_until_ranks_have_saved_when_cancelled_with_sigterm(tmp_path):
    _, _, proc = _run_job(tmp_path, "301", extra_env={"FAKE_WAIT_TERM": "1"}, nodes=1)
    deadline = time.time() + 60
    while not all((tmp_path / r).exists() for r in ("0", "1")):
        assert time.time() < deadline and proc.poll() is None, "training ranks never started"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # scancel --batch --signal=TERM: the batch shell forwards it
    out, _ = proc.communicate(timeout=60)
    trains = [r for r in _records(tmp_path) if r["cmd"] == "train"]
    assert len(trains) == 2 and all(r["dirs_exist_at_save"] for r in trains), out
    assert "waiting for the training step to save" in out
    assert not (tmp_path / "nvme" / "megatron-mlp-301").exists()
    assert not (tmp_path / "pfs" / "megatron-mlp-301").exists()


def test_job_without_pfs_uses_nvme_only_and_no_calibration_when_disabled(tmp_path):
    _, _, proc = _run_job(tmp_path, "401", pfs_path=None, calibrate=False)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    trains = [r for r in _records(tmp_path) if r["cmd"] == "train"]
    assert all(len(r["dirs"]) == 1 for r in trains) and len(trains) == 4
    assert not [r for r in _records(tmp_path) if r["cmd"] == "calibrate"]
    assert all(r["argv"][r["argv"].index("--mlp-offload-calibration") + 1] == "off" for r in trains)


# ---------------------------------------------------------------- PBS variant

PBS_GOLDEN = {"pbs_2node.pbs": SlurmJob(
    megatron_path="$HOME/Megatron-LM", nvme_path="/local/scratch", pfs_path="/lus/grand/projects/myproj/mlp",
    model_args=MODEL_ARGS, mlp_args="--mlp-offload-host-memory 64GB", nodes=2, gpus_per_node=4,
    time="06:00:00", partition="prod", account="myproj", cpus_per_gpu=8,
    setup=("module load conda", "conda activate megatron"))}

FAKE_MPIEXEC = r'''
import os, signal, subprocess, sys, json
args = sys.argv[1:]
n = int(args[args.index("-n") + 1]); ppn = int(args[args.index("--ppn") + 1])
cmd = args[args.index("--ppn") + 2:]
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps({"cmd": "mpiexec", "argv": args}) + "\n")
procs = [subprocess.Popen(cmd, env=dict(os.environ, PMI_RANK=str(r), PALS_RANKID=str(r),
                                        PALS_LOCAL_RANKID=str(r % ppn), SLURMD_NODENAME=f"node{r // ppn}"))
         for r in range(n)]
signal.signal(signal.SIGTERM, lambda *a: [p.send_signal(signal.SIGTERM) for p in procs])
sys.exit(max(p.wait() for p in procs))
'''


@pytest.mark.parametrize("name", sorted(PBS_GOLDEN))
def test_pbs_script_matches_golden_file_and_passes_bash_syntax_check(name, tmp_path):
    text = slurm.render_pbs_script(PBS_GOLDEN[name])
    if os.environ.get("MLP_REGEN_GOLDEN") == "1":
        (GOLDEN / name).write_text(text)
    assert (GOLDEN / name).read_text() == text, f"{name} differs; MLP_REGEN_GOLDEN=1 to update deliberately"
    script = tmp_path / name
    script.write_text(text)
    subprocess.run(["bash", "-n", str(script)], check=True)
    assert "#PBS -l select=2:ngpus=4:mpiprocs=4:ncpus=32" in text and "#PBS -l walltime=06:00:00" in text


@pytest.mark.parametrize("time,seconds", [("06:00:00", 21600), ("1-00:00:00", 86400), ("90", 5400),
                                          ("10:30", 630)])
def test_slurm_times_convert_to_pbs_walltime(time, seconds):
    assert walltime_seconds(time) == seconds


def test_pbs_job_runs_ranks_with_private_scratch_and_exits_before_walltime(tmp_path):
    bin_dir = _fake_bin(tmp_path)
    mpiexec = bin_dir / "mpiexec"
    mpiexec.write_text(f"#!{sys.executable}\n{FAKE_MPIEXEC}")
    mpiexec.chmod(0o755)
    job = SlurmJob(megatron_path=str(tmp_path / "Megatron-LM"), nvme_path=str(tmp_path / "nvme"),
                   pfs_path=str(tmp_path / "pfs"), model_args="--num-layers 2", nodes=2, gpus_per_node=2,
                   time="01:00:00", python=str(bin_dir / "fakepython"), calibration_cache=str(tmp_path / "calib"))
    script = tmp_path / "job.pbs"
    script.write_text(slurm.render_pbs_script(job))
    (tmp_path / "nvme").mkdir()
    (tmp_path / "pfs").mkdir()
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("node0\nnode0\nnode1\nnode1\n")
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_LOG=str(tmp_path / "log.jsonl"),
               PBS_JOBID="5151.pbs01", PBS_NODEFILE=str(nodefile), PBS_O_WORKDIR=str(tmp_path))
    env.pop("FAKE_WAIT_TERM", None)
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    trains = sorted((r for r in _records(tmp_path) if r["cmd"] == "train"), key=lambda r: int(r["rank"]))
    assert [(r["rank"], r["local_rank"], r["world_size"]) for r in trains] == [
        ("0", "0", "4"), ("1", "1", "4"), ("2", "0", "4"), ("3", "1", "4")]
    nvme, pfs = tmp_path / "nvme" / "megatron-mlp-5151", tmp_path / "pfs" / "megatron-mlp-5151"
    for r in trains:
        assert r["dirs"] == [str(nvme), str(pfs)] and r["modes"] == ["0o700", "0o700"] and r["master"] == "node0"
        minutes = int(r["argv"][r["argv"].index("--exit-duration-in-mins") + 1])
        assert 55 <= minutes <= 58, "walltime less the margin and the set-up time"
        assert r["calibration_exists"]
    assert not nvme.exists() and not pfs.exists()
