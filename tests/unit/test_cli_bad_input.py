"""Bad input to any ``megatron-mlp`` sub-command: a non-zero exit, exactly one line on stderr,
``megatron-mlp <cmd>: error: ...`` naming the flag or path, no traceback, and nothing created -- in
the working directory, the tier directory, the calibration cache or at the paths named. Every
refusal here happens before anything is measured or started, so the whole corpus runs in seconds."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from megatron_mlp import cli

DEEP = "[" * 100_000 + "]" * 100_000


def _events(events) -> str:
    return json.dumps({"traceEvents": events})


# name -> contents, written into the input directory before each case
INPUTS = {
    "no-ts.json": _events([{"ph": "X", "name": "fetch", "pid": 0, "tid": 1, "dur": 5}]),
    "string-ts.json": _events([{"ph": "X", "name": "fetch", "pid": 0, "tid": 1, "ts": "soon", "dur": 5}]),
    "not-dicts.json": _events([1, "two", None]),
    "null-args.json": _events([{"ph": "M", "name": "thread_name", "pid": 0, "tid": 1, "args": None},
                               {"ph": "X", "name": "fetch", "pid": 0, "tid": 1, "ts": 0, "dur": 5}]),
    "nan-dur.json": '{"traceEvents": [{"ph": "X", "name": "a", "pid": 0, "tid": 1, "ts": 0, "dur": NaN}]}',
    "not-json.json": "{not json",
    "deep.json": DEEP,
    "empty-trace.json": _events([]),
    "good-trace.json": _events([{"ph": "X", "name": "fetch", "pid": 0, "tid": 1, "ts": 0, "dur": 5}]),
    "cal-fast.json": None,       # written from a valid calibration entry below
    "cal-missing.json": None,
    "cal-nan.json": None,
    "cal-unknown.json": None,
}

PLAN = ["plan", "--num-params", "1M", "--ranks-per-node", "1", "--paths", "{tier}"]
UPDATE = ["bench", "update", "--paths", "{tier}", "--num-params", "100000", "--calib-bytes", "1MB"]
SLURM = ["slurm", "--megatron-path", "/m", "--nvme-path", "/n"]
NEWLINE = "{tier}/a\nb"


def _paths(argv, flag, value):
    """``argv`` with the value of ``flag`` replaced."""
    i = argv.index(flag)
    return argv[:i + 1] + [value] + argv[i + 2:]


# (argv, what the one line must name -- the flag typed or the path --, paths that must not exist
# afterwards); {in} = the inputs, {tier} = a tier directory, relative paths are in the working directory.
CORPUS = [
    # the dispatcher and parsers: one line, not the usage
    (["nope"], "'nope'", []),
    (["bench", "nope"], "'nope'", []),
    (["plan"], "--paths", []),
    (PLAN + ["--ranks-per-node", "x"], "--ranks-per-node", []),
    (["demo", "--iters", "x"], "--iters", []),
    (["slurm", "--nvme-path", "/n"], "--megatron-path", []),
    (["timeline", "{in}/good-trace.json"], "-o", []),
    (["calibrate"], "--paths", []),
    # tier paths, everywhere: nothing left to expand, absolute, one line (never made in the cwd)
    *[(_paths(argv, flag, path), flag, absent)
      for argv, flag in ((PLAN, "--paths"), (["calibrate", "--paths", "{tier}"], "--paths"), (UPDATE, "--paths"),
                         (["bench", "io", "--path", "{tier}"], "--path"), (["demo", "--paths", "{tier}"], "--paths"),
                         (SLURM, "--nvme-path"))
      for path, absent in (("$NO_SUCH_VAR/x", ["$NO_SUCH_VAR"]), ("~nosuchuser/x", ["~nosuchuser"]),
                           ("relative/tier", ["relative"]), (NEWLINE, []))],
    # plan: bandwidths, counts, calibration files, plot targets
    (PLAN[:-1] + ["{tier}:bw=99999999999999999999TB/s"], "--paths", []),
    (PLAN + ["--num-params", "0"], "--num-params", []),
    (PLAN + ["--num-params", "99999999999999999999999"], "--num-params", []),
    (PLAN + ["--subgroup-params", "1"], "--subgroup-params", []),
    (PLAN + ["--ranks-per-node", "0"], "--ranks-per-node", []),
    (PLAN + ["--nodes", "0"], "--nodes", []),
    (PLAN + ["--data-parallel-size", "0"], "--data-parallel-size", []),
    (PLAN + ["--node-cores", "0"], "--node-cores", []),
    (PLAN + ["--host-cache-bytes", "-5"], "--host-cache-bytes", []),
    (PLAN + ["--working-buffers", "-1"], "--working-buffers", []),
    (PLAN + ["--cache-model", "nope"], "--cache-model", []),
    (PLAN + ["--calibration", "{in}/cal-fast.json"], "--calibration", []),
    (PLAN + ["--calibration", "{in}/cal-missing.json"], "--calibration", []),
    (PLAN + ["--calibration", "{in}/cal-nan.json"], "--calibration", []),
    (PLAN + ["--calibration", "{in}/cal-unknown.json"], "--calibration", []),
    (PLAN + ["--calibration", "{in}/deep.json"], "--calibration", []),
    (PLAN + ["--calibration", "{in}/not-json.json"], "--calibration", []),
    (PLAN + ["--calibration", "/dev/zero"], "--calibration", []),
    (PLAN + ["--calibration", "{in}/fifo.json"], "--calibration", []),
    (PLAN + ["--calibration", "{in}"], "--calibration", []),
    (PLAN + ["--calibration", "{in}/absent.json"], "--calibration", []),
    (PLAN + ["--calibration-cache", "{in}/dir.png"], "--calibration-cache", []),
    (PLAN + ["--no-probe", "--plot", "{in}/dir.png"], "--plot", []),
    (PLAN + ["--no-probe", "--plot", "{in}/fifo.png"], "--plot", []),
    (PLAN + ["--no-probe", "--plot", "{in}/link.png"], "--plot", []),
    (PLAN + ["--no-probe", "--plot", "/proc/mlp-x.png"], "--plot", ["/proc/mlp-x.png"]),
    (PLAN + ["--no-probe", "--plot", "/sys/mlp-x.png"], "--plot", ["/sys/mlp-x.png"]),
    (PLAN + ["--no-probe", "--plot", "{in}/no/such/dir/p.png"], "--plot", ["{in}/no"]),
    (PLAN + ["--no-probe", "--plot", "plan.txt"], "--plot", []),
    # calibrate: refused before anything is measured or cached (the cache's directory and lock included)
    (["calibrate", "--paths", "{tier}", "--size-bytes", "-1"], "--size-bytes", []),
    (["calibrate", "--paths", "{tier}", "--size-bytes", "4097"], "--size-bytes", []),
    (["calibrate", "--paths", "{tier}", "--size-bytes", "1TB", "--procs", "1"], "--size-bytes", []),
    (["calibrate", "--paths", "{tier}", "--procs", "0"], "--procs", []),
    (["calibrate", "--paths", "{tier}", "--procs", "100000"], "--procs", []),
    (["calibrate", "--paths", "{tier}", "--procs", "256", "--size-bytes", "1TB"], "--size-bytes", []),
    (["calibrate", "--paths", ""], "--paths", []),
    (["calibrate", "--paths", ";"], "--paths", []),
    (["calibrate", "--paths", "{tier};{tier}", "--size-bytes", "1MiB"], "--paths", []),
    (["calibrate", "--paths", "/proc", "--size-bytes", "1MiB"], "--paths", []),
    (["calibrate", "--paths", "{in}/not-json.json", "--size-bytes", "1MiB"], "--paths", []),
    (["calibrate", "--paths", "{tier}:bw=99999999999999999999TB/s"], "--paths", []),
    (["calibrate", "--paths", "{tier}/no/such", "--size-bytes", "1MiB"], "--paths", ["{tier}/no"]),
    (["calibrate", "--paths", "{tier}", "--size-bytes", "1MiB", "--cache", "/proc/mlp-c.json"], "--cache",
     ["/proc/mlp-c.json"]),
    (["calibrate", "--paths", "{tier}", "--size-bytes", "1MiB", "--cache", "{in}/dir.png"], "--cache", []),
    (["calibrate", "--paths", "{tier}", "--size-bytes", "1MiB", "--cache", "{in}/not-json.json/c.json"], "--cache",
     []),
    # bench update: every flag checked before measuring, named as this command spells it
    (UPDATE + ["--host-memory", "1KB"], "--host-memory", []),
    (UPDATE + ["--host-memory", "-1"], "--host-memory", []),
    (UPDATE + ["--host-memory", ","], "--host-memory", []),
    (UPDATE + ["--num-params", "0"], "--num-params", []),
    (UPDATE + ["--num-params", "999999999999999999999"], "--num-params", []),
    (UPDATE + ["--subgroup-params", "1"], "--subgroup-params", []),
    (UPDATE + ["--subgroup-params", "0"], "--subgroup-params", []),
    (UPDATE + ["--steps", "0"], "--steps", []),
    (UPDATE + ["--steps", "99999999999"], "--steps", []),
    (UPDATE + ["--ranks", "0"], "--ranks", []),
    (UPDATE + ["--ranks", "100000"], "--ranks", []),
    (UPDATE + ["--prefetch-depth", "-1"], "--prefetch-depth", []),
    (UPDATE + ["--prefetch-depth", "99999999"], "--prefetch-depth", []),
    (UPDATE + ["--flush-depth", "0"], "--flush-depth", []),
    (UPDATE + ["--flush-depth", "99999999"], "--flush-depth", []),
    (UPDATE + ["--adam-threads", "-1"], "--adam-threads", []),
    (UPDATE + ["--adam-threads", "99999"], "--adam-threads", []),
    (UPDATE + ["--io-block-size", "3"], "--io-block-size", []),
    (UPDATE + ["--io-block-size", "99999TB"], "--io-block-size", []),
    (UPDATE + ["--io-queue-depth", "100000000"], "--io-queue-depth", []),
    (UPDATE + ["--grad-dtype", "int8"], "--grad-dtype", []),
    (UPDATE + ["--paths", "{tier}/missing"], "--paths", ["{tier}/missing"]),
    (UPDATE + ["--calib-bytes", "99999999999999999999TB"], "--calib-bytes", []),
    (UPDATE + ["--calib-bytes", "lots"], "--calib-bytes", []),
    (UPDATE + ["--trace-steps", "3-4"], "--trace-steps", []),
    (UPDATE + ["--trace", "{in}/t.json", "--trace-steps", "99-100"], "--trace-steps", ["{in}/t.json"]),
    (UPDATE + ["--trace", "{in}/dir.png"], "--trace", []),
    (UPDATE + ["--plot", "{in}/dir.png"], "--plot", []),
    (UPDATE + ["--plot", "/proc/mlp-u.png"], "--plot", ["/proc/mlp-u.png"]),
    (UPDATE + ["--plot", "/sys/mlp-u.png"], "--plot", ["/sys/mlp-u.png"]),
    # bench io, bench adam: the engine's limits named by this command's flags
    (["bench", "io", "--path", "{tier}/missing"], "--path", ["{tier}/missing"]),
    (["bench", "io", "--path", "{in}/not-json.json"], "--path", []),
    (["bench", "io", "--path", "{tier}", "--block-bytes", "3"], "--block-bytes", []),
    (["bench", "io", "--path", "{tier}", "--block-bytes", "2147483648"], "--block-bytes", []),
    (["bench", "io", "--path", "{tier}", "--size-bytes", "0"], "--size-bytes", []),
    (["bench", "io", "--path", "{tier}", "--size-bytes", "999999999999999999"], "--size-bytes", []),
    (["bench", "io", "--path", "{tier}", "--queue-depth", "100000000"], "--queue-depth", []),
    (["bench", "io", "--path", "{tier}", "--num-threads", "100000"], "--num-threads", []),
    (["bench", "io", "--path", "{tier}", "--buffer-bytes", "99999999999999"], "--buffer-bytes", []),
    (["bench", "io", "--path", "{tier}", "--repeats", "0"], "--repeats", []),
    (["bench", "adam", "--num-params", "0"], "--num-params", []),
    (["bench", "adam", "--num-params", "99999999999999999"], "--num-params", []),
    (["bench", "adam", "--repeats", "0"], "--repeats", []),
    (["bench", "adam", "--threads", "100000"], "--threads", []),
    (["bench", "adam", "--grad-dtype", "int8"], "--grad-dtype", []),
    # demo: every flag checked before torch starts; nothing made at a path that is not there
    (["demo", "--iters", "0"], "--iters", []),
    (["demo", "--iters", "-3"], "--iters", []),
    (["demo", "--hidden-size", "-1"], "--hidden-size", []),
    (["demo", "--hidden-size", "12"], "--hidden-size", []),
    (["demo", "--hidden-size", "1048576"], "--hidden-size", []),
    (["demo", "--num-layers", "0"], "--num-layers", []),
    (["demo", "--vocab-size", "0"], "--vocab-size", []),
    (["demo", "--subgroup-size", "0"], "--subgroup-size", []),
    (["demo", "--subgroup-size", "1"], "--subgroup-size", []),
    (["demo", "--paths", "{in}/nope/x"], "--paths", ["{in}/nope"]),
    (["demo", "--paths", "{tier};{tier}"], "--paths", []),
    (["demo", "--workdir", "{in}/no/such"], "--workdir", ["{in}/no"]),
    (["demo", "--workdir", "{in}/not-json.json"], "--workdir", []),
    (["demo", "--workdir", "{in}/a\nb"], "--workdir", []),
    # timeline: bad events, unbounded input, bad outputs
    (["timeline", "{in}/no-ts.json", "-o", "t.png"], "TRACE.json", ["t.png"]),
    (["timeline", "{in}/string-ts.json", "-o", "t.png"], "TRACE.json", ["t.png"]),
    (["timeline", "{in}/not-dicts.json", "-o", "t.png"], "TRACE.json", ["t.png"]),
    (["timeline", "{in}/null-args.json", "-o", "t.png"], "TRACE.json", ["t.png"]),
    (["timeline", "{in}/nan-dur.json", "-o", "t.png"], "TRACE.json", ["t.png"]),
    (["timeline", "{in}/not-json.json", "-o", "t.png"], "TRACE.json", ["t.png"]),
    (["timeline", "{in}/deep.json", "-o", "t.png"], "TRACE.json", ["t.png"]),
    (["timeline", "{in}/empty-trace.json", "-o", "t.png"], "TRACE.json", ["t.png"]),
    (["timeline", "{in}/absent.json", "-o", "t.png"], "TRACE.json", ["t.png"]),
    (["timeline", "/dev/zero", "-o", "t.png"], "TRACE.json", ["t.png"]),
    (["timeline", "{in}/fifo.json", "-o", "t.png"], "TRACE.json", ["t.png"]),
    (["timeline", "{in}", "-o", "t.png"], "TRACE.json", ["t.png"]),
    (["timeline", "{in}/good-trace.json", "-o", "{in}/dir.png"], "-o", []),
    (["timeline", "{in}/good-trace.json", "-o", "{in}/fifo.png"], "-o", []),
    (["timeline", "{in}/good-trace.json", "-o", "{in}/link.png"], "-o", []),
    (["timeline", "{in}/good-trace.json", "-o", "/proc/mlp-t.png"], "-o", ["/proc/mlp-t.png"]),
    (["timeline", "{in}/good-trace.json", "-o", "/sys/mlp-t.png"], "-o", ["/sys/mlp-t.png"]),
    (["timeline", "{in}/good-trace.json", "-o", "t.bmp"], "-o", ["t.bmp"]),
    (["timeline", "{in}/good-trace.json", "-o", "relative/t.png"], "-o", ["relative"]),
    # slurm
    (SLURM + ["--nodes", "0"], "--nodes", []),
    (SLURM + ["--gpus-per-node", "0"], "--gpus-per-node", []),
    (SLURM + ["--master-port", "99999"], "--master-port", []),
    (SLURM + ["--time", "soon"], "--time", []),
    (SLURM + ["--job-name", "a b"], "--job-name", []),
    (SLURM + ["--nvme-bw", "99999999999999999999TB/s"], "--nvme-bw", []),
    (SLURM + ["--submit"], "--submit", []),
    (SLURM + ["-o", "{in}/dir.png"], "{in}/dir.png", []),
    (SLURM + ["-o", "/proc/mlp-s.sh"], "/proc/mlp-s.sh", ["/proc/mlp-s.sh"]),
]


def _tree(root) -> list:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        out += [os.path.join(dirpath, n) for n in sorted(dirnames + filenames)]
    return sorted(out)


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    base = tmp_path_factory.mktemp("corpus")
    inputs, tier, cwd, cache = base / "in", base / "tier", base / "cwd", base / "xdg"
    for d in (inputs, tier, cwd, cache):
        d.mkdir()
    (inputs / "dir.png").mkdir()
    from megatron_mlp.tier.calibration import calibrate_paths
    from megatron_mlp.tier.calibration_cache import load_cache
    from tests.unit.test_calibration_files import FakeMeasure
    calibrate_paths([str(tier)], str(inputs / "valid.json"), measure=FakeMeasure())
    (key, entry), = load_cache(str(inputs / "valid.json")).items()
    bad = {"cal-fast.json": dict(entry, read_bytes_per_s="fast"),
           "cal-missing.json": {k: v for k, v in entry.items() if k != "write_bytes_per_s"},
           "cal-nan.json": dict(entry, mixed_bytes_per_s=float("nan")),
           "cal-unknown.json": dict(entry, surprise=1)}
    for name, text in INPUTS.items():
        text = text if text is not None else json.dumps({"version": 1, "entries": {key: bad[name]}})
        (inputs / name).write_text(text)
    os.mkfifo(inputs / "fifo.json")   # opened for reading, a FIFO without a writer blocks for ever
    os.mkfifo(inputs / "fifo.png")
    (inputs / "link.png").symlink_to(base / "victim.png")   # an output through a link is refused
    return {"in": str(inputs), "tier": str(tier), "cwd": str(cwd), "cache": str(cache), "base": str(base)}


def _fill(args, places):
    return [a.replace("{in}", places["in"]).replace("{tier}", places["tier"]) for a in args]


def _command(argv) -> str:
    """The sub-command the error line must name: ``plan``, ``bench update``; '' for the dispatcher."""
    if argv[0] == "bench":
        return "bench " + argv[1] if len(argv) > 1 and argv[1] in cli.BENCHMARKS else "bench"
    return argv[0] if argv[0] in cli.COMMANDS else ""


class _Hung(Exception):
    pass


def _hung(signum, frame):
    raise _Hung("a bad input made the command wait: it must be refused at once")


@pytest.mark.parametrize("argv, names, absent", CORPUS,
                         ids=[" ".join(a[:4]) + f" #{i}" for i, (a, _, _) in enumerate(CORPUS)])
def test_bad_input_exits_non_zero_with_one_line_naming_the_flag_and_creates_nothing(places, argv, names, absent,
                                                                                     capsys, monkeypatch):
    argv, absent = _fill(argv, places), _fill(absent, places)
    names = _fill([names], places)[0]
    monkeypatch.chdir(places["cwd"])
    monkeypatch.setenv("XDG_CACHE_HOME", places["cache"])
    monkeypatch.delenv("NO_SUCH_VAR", raising=False)
    before = _tree(places["base"])
    previous = signal.signal(signal.SIGALRM, _hung)
    signal.alarm(120)   # a refusal takes a second; a hang fails this case instead of the whole run
    try:
        rc = cli.main(argv)    # an exception escaping here is the traceback the user would see
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    out, err = capsys.readouterr()
    assert rc != 0, (argv, out)
    lines = err.splitlines()
    assert len(lines) == 1, (argv, err)
    command = _command(argv)
    prefix = f"megatron-mlp {command}: error: " if command else "megatron-mlp: error: "
    assert lines[0].startswith(prefix) and "Traceback" not in err, err
    assert names in lines[0][len(prefix):], (names, err)
    assert _tree(places["base"]) == before, f"{argv} created or removed files"
    for path in absent:
        assert not os.path.lexists(os.path.join(places["cwd"], path)), path


def test_an_unexpected_exception_keeps_its_traceback(monkeypatch):
    import megatron_mlp.observe.timeline_cli as timeline_cli

    def bug(argv):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(timeline_cli, "main", bug)
    with pytest.raises(ZeroDivisionError):
        cli.main(["timeline", "x.json", "-o", "x.png"])


def test_the_installed_entry_point_prints_one_line_for_a_project_error(places, tmp_path):
    r = subprocess.run([sys.executable, "-m", "megatron_mlp", "timeline", os.path.join(places["in"], "no-ts.json"),
                        "-o", str(tmp_path / "t.png")], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=os.getcwd()), cwd=str(tmp_path))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("megatron-mlp timeline: error: TRACE.json: ") and "traceEvents[0] has no ts" in r.stderr
    assert os.listdir(tmp_path) == []
