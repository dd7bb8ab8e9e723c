"""`megatron-mlp slurm` with hostile values: every option is data, never shell code.

Each payload of an adversarial run (a newline in a header value, a quote or a command substitution
in a path, a quote in a bandwidth) is either refused with one line naming the flag, or rendered so
that the script -- run here with bash under the stand-in Slurm and PBS of test_slurm -- never runs
it: the marker file the payload would create never appears, and the value reaches the training
process literally. Golden files hold the rendering of accepted hostile values.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_mlp import slurm
from megatron_mlp.errors import ConfigError
from megatron_mlp.shell_words import SHELL_REFERENCES, shell_word
from megatron_mlp.slurm import SlurmJob, render_job_script, render_pbs_script
from test_slurm import FAKE_MPIEXEC, GOLDEN, _fake_bin, _records

MARK = "@MARK@"   # replaced by the path of the marker file of each test
# (flag, value): the payloads of the adversarial run, and a few more of the same kinds.
PAYLOADS = [
    ("--job-name", f"job\ntouch {MARK}"),
    ("--partition", f"gpu\ntouch {MARK}"),
    ("--account", f"acct\ntouch {MARK}"),
    ("--script", f'pretrain_gpt.py"; touch {MARK}; echo "'),
    ("--script", f"pretrain_$(touch {MARK}).py"),
    ("--nvme-bw", f"6GB/s'$(touch {MARK})'"),
    ("--pfs-bw", f"100GB/s'$(touch {MARK})'"),
    ("--nvme-path", f"@TMP@/nvme$(touch {MARK})"),
    ("--pfs-path", f"@TMP@/pfs`touch {MARK}`"),
    ("--megatron-path", f"@TMP@/Megatron-LM$(touch {MARK})"),
    ("--calibration-cache", f"@TMP@/calib$(touch {MARK})"),
    ("--calibration-cache", f"@TMP@/calib${{X:-$(touch {MARK})}}"),
    ("--python", f"$(touch {MARK})"),
    ("--time", f"01:00:00\ntouch {MARK}"),
]


def _base(tmp_path: Path, bin_dir: Path) -> dict[str, str]:
    return {"--megatron-path": str(tmp_path / "Megatron-LM"), "--nvme-path": str(tmp_path / "nvme"),
            "--pfs-path": str(tmp_path / "pfs"), "--python": str(bin_dir / "fakepython"),
            "--calibration-cache": str(tmp_path / "calib"), "--nodes": "1", "--gpus-per-node": "1",
            "--time": "01:00:00", "--model-args": "--num-layers 2"}


def _run(script: Path, tmp_path: Path, bin_dir: Path, scheduler: str, **extra_env) -> subprocess.CompletedProcess:
    """Run the job script with bash under the stand-in scheduler (one node, one rank)."""
    (tmp_path / "nvme").mkdir(exist_ok=True)
    (tmp_path / "pfs").mkdir(exist_ok=True)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_LOG=str(tmp_path / "log.jsonl"),
               **extra_env)
    env.pop("FAKE_WAIT_TERM", None)
    if scheduler == "pbs":
        (bin_dir / "mpiexec").write_text(f"#!{sys.executable}\n{FAKE_MPIEXEC}")
        (bin_dir / "mpiexec").chmod(0o755)
        (tmp_path / "nodefile").write_text("node0\n")
        env.update(PBS_JOBID="77.pbs", PBS_NODEFILE=str(tmp_path / "nodefile"), PBS_O_WORKDIR=str(tmp_path))
    else:
        env.update(SLURM_JOB_ID="77", SLURM_JOB_NUM_NODES="1", SLURM_NTASKS_PER_NODE="1",
                   SLURM_JOB_NODELIST="node0")
    return subprocess.run(["bash", str(script)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("scheduler", ["slurm", "pbs"])
@pytest.mark.parametrize("flag,payload", PAYLOADS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(PAYLOADS)])
def test_payload_is_refused_naming_its_flag_or_never_runs_when_the_script_runs(flag, payload, scheduler, tmp_path,
                                                                             capsys):
    marker = tmp_path / "marker"
    bin_dir = _fake_bin(tmp_path)
    opts = _base(tmp_path, bin_dir)
    opts[flag] = payload.replace(MARK, str(marker)).replace("@TMP@", str(tmp_path))
    if flag == "--pfs-bw":
        opts["--pfs-path"] = str(tmp_path / "pfs")
    script = tmp_path / "job.sh"
    argv = [a for kv in opts.items() for a in kv] + ["--scheduler", scheduler, "-o", str(script)]
    rc = slurm.main(argv)
    err = capsys.readouterr().err
    if rc != 0:
        assert rc == 2 and err.count("\n") == 1 and err.startswith(f"megatron-mlp slurm: error: {flag}: "), err
        assert not script.exists()
    else:
        proc = _run(script, tmp_path, bin_dir, scheduler)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        trains = [r for r in _records(tmp_path) if r["cmd"] == "train"]
        assert len(trains) == 1, proc.stdout + proc.stderr
        if flag == "--script":   # a quoted value reaches the training process as it was given
            assert trains[0]["argv"][2] == f"{opts['--megatron-path']}/{opts['--script']}"
    assert not marker.exists(), f"{flag} {payload!r} ran as shell code"


def test_accepted_hostile_paths_reach_every_step_of_the_job_literally(tmp_path, capsys):
    """Quotes, blanks, ';', ':' and an allowed reference in paths: each step sees the path as given."""
    bin_dir = _fake_bin(tmp_path)
    odd = tmp_path / "it's \"odd\"; a:b  c"
    tmpdir = tmp_path / "tmpdir"
    opts = _base(tmp_path, bin_dir)
    opts.update({"--nvme-path": f"{odd}/nvme", "--pfs-path": "$TMPDIR/pfs", "--calibration-cache": f"{odd}/calib",
                 "--megatron-path": f"{odd}/Megatron-LM"})
    script = tmp_path / "job.sh"
    assert slurm.main([a for kv in opts.items() for a in kv] + ["-o", str(script)]) == 0, capsys.readouterr().err
    (odd / "nvme").mkdir(parents=True)
    (tmpdir / "pfs").mkdir(parents=True)
    proc = _run(script, tmp_path, bin_dir, "slurm", TMPDIR=str(tmpdir))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (train,) = [r for r in _records(tmp_path) if r["cmd"] == "train"]
    assert train["dirs"] == [f"{odd}/nvme/megatron-mlp-77", f"{tmpdir}/pfs/megatron-mlp-77"]
    assert train["argv"][2] == f"{odd}/Megatron-LM/pretrain_gpt.py"
    assert train["calibration"] == f"{odd}/calib/node0.json" and train["calibration_exists"]
    (calibration,) = [r for r in _records(tmp_path) if r["cmd"] == "calibrate"]
    assert calibration["paths"] == f"{odd}/nvme;{tmpdir}/pfs"


# ---------------------------------------------------------------- the rules, one by one

@pytest.mark.parametrize("value,word", [
    ("/local/nvme", "/local/nvme"),
    ("$SCRATCH/mlp", '"${SCRATCH}"/mlp'),
    ("/local/nvme/${USER}/x y", "/local/nvme/\"${USER}\"'/x y'"),
    ("it's", "'it'\"'\"'s'"),
    ("/a;b:c", "'/a;b:c'"),
])
def test_shell_word_quotes_literals_and_keeps_only_allowed_references_live(value, word, tmp_path):
    assert shell_word(value, "--x") == word
    env = dict(os.environ, SCRATCH="/s", USER="u")
    out = subprocess.run(["bash", "-c", f"printf %s {word}"], env=env, capture_output=True, text=True).stdout
    assert out == value.replace("$SCRATCH", "/s").replace("${USER}", "u")


@pytest.mark.parametrize("value,said", [
    ("$(id)", "'$'"), ("/a/$(id)", "'$'"), ("${HOME:-/x}", "'$'"), ("/a/$", "'$'"), ("$OTHER/x", "$OTHER"),
    ("/a/`id`", "backtick"), ("/a\nb", "control character"), ("/a\rb", "control character"), ("", "empty"),
    ("-rf", "option"), ("~/x", "'~'"),
])
def test_shell_word_refuses_what_the_shell_would_run_naming_the_flag(value, said):
    with pytest.raises(ConfigError) as exc:
        shell_word(value, "--some-flag")
    assert str(exc.value).startswith("--some-flag: ") and said in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize("flag,value", [("--nvme-path", "relative/nvme"), ("--nvme-path", "$USER/nvme"),
                                        ("--pfs-path", "~nosuchuser/pfs"), ("--nvme-path", "/a\nb"),
                                        ("--pfs-path", "$NO_SUCH_VAR/x")])
def test_tier_paths_of_the_job_are_absolute_printable_and_expand_only_allowed_references(flag, value, capsys):
    argv = ["--megatron-path", "/m", "--nvme-path", "/n", "--pfs-path", "/p", flag, value]
    assert slurm.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"megatron-mlp slurm: error: {flag}: ") and err.count("\n") == 1, err


@pytest.mark.parametrize("flag,value", [("--nvme-bw", "fast"), ("--nvme-bw", "6GB/s'"), ("--nvme-bw", "11TB/s"),
                                        ("--pfs-bw", "101TB/s"), ("--pfs-bw", "1e9")])
def test_bandwidth_is_refused_naming_its_flag_when_not_a_bandwidth_or_beyond_any_device(flag, value):
    with pytest.raises(ConfigError, match=f"^{flag}: "):
        SlurmJob(megatron_path="/m", nvme_path="/n", pfs_path="/p", **{flag[2:].replace("-", "_"): value})


def test_pfs_bandwidth_is_the_jobs_total_and_may_exceed_one_nodes_ceiling():
    assert "bw=11TB/s,shared=job" in slurm._paths_spec(SlurmJob(megatron_path="/m", nvme_path="/n", pfs_path="/p",
                                                                pfs_bw="11TB"))


def test_bandwidths_are_rendered_in_their_canonical_spelling():
    job = SlurmJob(megatron_path="/m", nvme_path="/n", pfs_path="/p", nvme_bw=" 6 gb/S", pfs_bw="1.5TB")
    assert slurm._paths_spec(job) == "$MLP_NVME_DIR:bw=6GB/s;$MLP_PFS_DIR:bw=1500GB/s,shared=job"


@pytest.mark.parametrize("kwargs,flag", [
    (dict(partition="gpu,gpu-large"), None), (dict(account="proj_1.x"), None), (dict(job_name="run-7b.v2"), None),
    (dict(partition="gpu;x"), "--partition"), (dict(account="a b"), "--account"), (dict(job_name=""), "--job-name"),
    (dict(job_name="-x"), "--job-name"), (dict(master_port=70000), "--master-port"),
    (dict(cpus_per_gpu=-1), "--cpus-per-gpu"), (dict(nodes=True), "--nodes"), (dict(time="1:00\n"), "--time"),
    (dict(script="/abs/pretrain.py"), "--script"),
])
def test_header_values_and_numbers_follow_strict_patterns(kwargs, flag):
    if flag is None:
        SlurmJob(megatron_path="/m", nvme_path="/n", **kwargs)
        return
    with pytest.raises(ConfigError, match=f"^{flag}: "):
        SlurmJob(megatron_path="/m", nvme_path="/n", **kwargs)


def test_allowed_references_are_the_documented_ones():
    text = (Path(__file__).resolve().parents[2] / "docs" / "usage.md").read_text()
    for name in SHELL_REFERENCES:
        assert f"`${name}`" in text, f"docs/usage.md does not list ${name}"


# ---------------------------------------------------------------- golden files with hostile values

HOSTILE = dict(
    megatron_path="/opt/it's \"Megatron\"/LM", nvme_path="${SLURM_TMPDIR}/mlp;x", pfs_path="$SCRATCH/$USER/a b:c",
    calibration_cache="$HOME/.cache/calib $USER", python="/opt/py env/bin/python3", script="pretrain gpt's.py",
    nvme_bw="6.5GB/s", pfs_bw="100GB", job_name="run_1.a-b", partition="gpu,gpu-large", account="proj@x",
    model_args="--num-layers 2", setup=("module load cuda",))
HOSTILE_GOLDEN = {"slurm_hostile.sbatch": render_job_script, "pbs_hostile.pbs": render_pbs_script}


@pytest.mark.parametrize("name", sorted(HOSTILE_GOLDEN))
def test_hostile_values_render_as_the_golden_file_and_pass_bash_syntax_check(name, tmp_path):
    text = HOSTILE_GOLDEN[name](SlurmJob(**HOSTILE))
    if os.environ.get("MLP_REGEN_GOLDEN") == "1":
        (GOLDEN / name).write_text(text)
    assert (GOLDEN / name).read_text() == text, f"{name} differs; MLP_REGEN_GOLDEN=1 to update deliberately"
    (tmp_path / name).write_text(text)
    subprocess.run(["bash", "-n", str(tmp_path / name)], check=True)


def test_hostile_values_are_assigned_literally_when_the_golden_scripts_exports_run(tmp_path):
    text = render_job_script(SlurmJob(**HOSTILE))
    lines = [line for line in text.splitlines() if line.split("=", 1)[0] in (
        "MEGATRON_LM_PATH", "PYTHON", "export MLP_NVME_BASE", "export MLP_PFS_BASE", "export MLP_CALIBRATION_CACHE")]
    names = ("MEGATRON_LM_PATH", "PYTHON", "MLP_NVME_BASE", "MLP_PFS_BASE", "MLP_CALIBRATION_CACHE")
    body = "\n".join(lines + ["printf '%s\\0' " + " ".join(f'"${n}"' for n in names)])
    env = dict(os.environ, SLURM_TMPDIR="/tmp/j", SCRATCH="/s", USER="u", HOME="/h")
    out = subprocess.run(["bash", "-c", body], env=env, capture_output=True, text=True, cwd=tmp_path).stdout
    assert out.split("\0")[:-1] == ["/opt/it's \"Megatron\"/LM", "/opt/py env/bin/python3", "/tmp/j/mlp;x",
                                    "/s/u/a b:c", "/h/.cache/calib u"]
    assert os.listdir(tmp_path) == []
