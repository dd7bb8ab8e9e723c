"""bench update's token runtime dir: named by host and pid, and a killed run's is removed by the next."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

from megatron_mlp.bench.update import RUNTIME_PREFIX, runtime_dir


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_killed_runs_dir_is_removed_and_a_live_or_foreign_one_is_kept(tmp_path):
    host = socket.gethostname()
    dead = tmp_path / f"{RUNTIME_PREFIX}{host}-{_dead_pid()}-abc123"
    live = tmp_path / f"{RUNTIME_PREFIX}{host}-{os.getpid()}-def456"
    other_host = tmp_path / f"{RUNTIME_PREFIX}not-{host}-{_dead_pid()}-ghi789"
    unrelated = tmp_path / "mlp-bench-tokens-old-style"
    for d in (dead, live, other_host, unrelated):
        d.mkdir()
        (d / "token").write_text("")
    with runtime_dir(str(tmp_path)) as mine:
        assert os.path.basename(mine).startswith(f"{RUNTIME_PREFIX}{host}-{os.getpid()}-")
        assert not dead.exists()
        assert live.exists() and other_host.exists() and unrelated.exists()
    assert not os.path.exists(mine), "the run removes its own at the end"


def test_a_symlink_with_a_dead_runs_name_is_left_alone(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep").write_text("")
    link = tmp_path / f"{RUNTIME_PREFIX}{socket.gethostname()}-{_dead_pid()}-abc123"
    link.symlink_to(target)
    with runtime_dir(str(tmp_path)):
        pass
    assert link.is_symlink() and (target / "keep").exists()
