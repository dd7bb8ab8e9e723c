"""Files in a tier directory: never through a symlink, never reopened by name, never someone else's.

A tier directory may be writable by other users (a group project directory, a shared /tmp). If a
file we create there were reopened by name, another user could swap the name for a symlink in
between and redirect our writes to any file we can write. So every open inside a tier directory
carries O_NOFOLLOW, new files are created with O_EXCL, and the O_DIRECT descriptor is derived from
the first one rather than from the name; a tier path controlled by another user is refused.
"""
from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys

import pytest

from megatron_mlp.engine import Engine
from megatron_mlp.errors import ConfigError, TierIOError
from megatron_mlp.tier import validation
from megatron_mlp.tier.spec import TierSpec
from megatron_mlp.tier.validation import probe_o_direct, validate_tier_paths

OTHER_UID = 4242   # a uid no test file belongs to


def _victim(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious" * 512)
    return victim


def test_engine_open_refuses_to_follow_a_symlink_when_the_name_was_swapped_for_one(tmp_path):
    victim = _victim(tmp_path)
    link = tmp_path / "tier-file"
    link.symlink_to(victim)
    with Engine() as eng:
        with pytest.raises(TierIOError) as e:
            eng.open(str(link), create=True, direct=True)
    assert e.value.errno == errno.ELOOP and "symlink" in str(e.value)
    assert victim.read_bytes() == b"precious" * 512


def test_engine_exclusive_open_refuses_a_name_that_already_exists_when_asked_to_create_it(tmp_path):
    victim = _victim(tmp_path)
    with Engine() as eng:
        with pytest.raises(TierIOError) as e:
            eng.open(str(victim), create=True, direct=True, exclusive=True)
    assert e.value.errno == errno.EEXIST
    assert victim.read_bytes() == b"precious" * 512


def test_engine_direct_descriptor_is_the_same_file_when_o_direct_is_in_use(disk_dir):
    path = os.path.join(disk_dir, "f")
    with Engine() as eng:
        f = eng.open(path, create=True, direct=True, exclusive=True)
        buf = eng.alloc(1 << 20)
        buf.numpy("uint8")[:] = 7
        eng.write(f, buf, 0)     # aligned: goes through the O_DIRECT descriptor
        eng.wait_all()
        f.allocate(2 << 20)      # through the open descriptor, not the name
        f.drop_page_cache()
        assert f.direct and f.size() == 2 << 20
        f.close()
    with open(path, "rb") as fh:
        assert fh.read(1 << 20) == b"\x07" * (1 << 20)


def test_o_direct_probe_opens_nothing_by_name_without_o_nofollow_when_probing_a_directory(disk_dir, monkeypatch):
    opened = []
    real_open = os.open

    def recording_open(path, flags, *args, **kwargs):
        opened.append((path, flags, kwargs.get("dir_fd")))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(validation.os, "open", recording_open)
    ok, reason = probe_o_direct(disk_dir)
    monkeypatch.undo()
    assert ok, reason
    assert opened and all(flags & os.O_NOFOLLOW for _, flags, _ in opened), opened
    names = [p for p, _, _ in opened if str(p).startswith(".mlp-probe-") or "/.mlp-probe-" in str(p)]
    assert len(names) == 1 and len(set(names)) == 1, "the probe file is looked up by name once"
    assert all(flags & os.O_EXCL for p, flags, _ in opened if p in names)
    assert os.listdir(disk_dir) == []


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace to watch the system calls")
def test_every_open_inside_the_tier_carries_o_nofollow_when_calibrate_plan_and_bench_io_run_under_strace(disk_dir, tmp_path):
    log = tmp_path / "strace.log"
    cache = tmp_path / "cal.json"
    runs = [["calibrate", "--paths", disk_dir, "--size-bytes", "1MiB", "--procs", "1", "--force",
             "--cache", str(cache)],
            ["plan", "--paths", disk_dir, "--num-params", "1000000", "--ranks-per-node", "1",
             "--calibration-cache", str(cache)],
            ["bench", "io", "--path", disk_dir, "--size-bytes", str(1 << 20), "--block-bytes", str(64 << 10),
             "--buffer-bytes", str(1 << 20), "--repeats", "1", "--no-fio", "--backend", "threads"]]
    for argv in runs:
        r = subprocess.run(["strace", "-f", "-qq", "-e", "trace=open,openat,openat2,creat", "-o", str(log),
                            sys.executable, "-m", "megatron_mlp", *argv], capture_output=True, text=True, timeout=300)
        if r.returncode != 0 and "ptrace" in r.stderr:
            pytest.skip(f"strace cannot trace here: {r.stderr.strip()[:200]}")
        assert r.returncode == 0, r.stderr
        lines = log.read_text().splitlines()
        # Inside the tier: by path, or relative to its descriptor by one of the names made there.
        inside = [ln for ln in lines if disk_dir in ln or any(
            n in ln for n in (".mlp-probe-", ".mlp-calibrate-", "mlp-bench-io-", "mlp-offload-"))]
        assert inside, "nothing was opened inside the tier: the check would prove nothing"
        assert [ln for ln in inside if "O_NOFOLLOW" not in ln] == []
        assert [ln for ln in inside if "O_CREAT" in ln and "O_EXCL" not in ln] == []
    assert os.listdir(disk_dir) == []


# ------------------------------------------------------------------ tier paths of another user

@pytest.fixture
def foreign(monkeypatch):
    """Make ``path`` (and a symlink itself, with ``follow=False``) belong to another user: by chown
    as root; otherwise by making this process look like another, non-root user to the check."""
    def make(path, follow=True):
        if os.geteuid() == 0:
            (os.chown if follow else os.lchown)(path, OTHER_UID, OTHER_UID)
        else:
            monkeypatch.setattr(validation.os, "geteuid", lambda: os.getuid() + 1)
    return make


def test_a_tier_path_that_is_another_users_symlink_is_refused_naming_path_and_owner(tmp_path, foreign):
    target = tmp_path / "elsewhere"
    target.mkdir()
    link = tmp_path / "tier"
    link.symlink_to(target)
    foreign(link, follow=False)
    with pytest.raises(ConfigError) as e:
        validate_tier_paths((TierSpec(str(link)),))
    msg = str(e.value)
    assert f"--mlp-offload-paths: {link} is a symlink owned by uid" in msg and "refusing to follow" in msg
    assert os.listdir(target) == []


def test_a_tier_path_that_is_another_users_directory_is_refused_naming_path_and_owner(tmp_path, foreign):
    d = tmp_path / "theirs"
    d.mkdir()
    foreign(d)
    with pytest.raises(ConfigError) as e:
        validate_tier_paths((TierSpec(str(d)),))
    msg = str(e.value)
    assert f"--mlp-offload-paths: {d} is a directory owned by uid" in msg and "mkdir" in msg
    assert os.listdir(d) == []


def test_a_tier_path_that_is_the_users_own_symlink_is_followed(tmp_path):
    target = tmp_path / "mine"
    target.mkdir()
    link = tmp_path / "tier"
    link.symlink_to(target)
    v = validate_tier_paths((TierSpec(str(link)),))
    assert v.checks[0].realpath == str(target.resolve())


def test_a_dangling_symlink_as_tier_path_is_named_with_its_target(tmp_path):
    link = tmp_path / "tier"
    link.symlink_to(tmp_path / "gone")
    with pytest.raises(ConfigError, match=f"{link} is a symlink to .*gone, which does not exist"):
        validate_tier_paths((TierSpec(str(link)),))
