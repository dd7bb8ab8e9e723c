"""Up-front validation of tier paths: errors name the path and the flag."""
from __future__ import annotations

import os

import pytest

from megatron_mlp.errors import ConfigError
from megatron_mlp.tier.device import device_key
from megatron_mlp.tier.spec import TierSpec, parse_tier_paths
from megatron_mlp.tier.validation import probe_o_direct, validate_tier_paths


def test_missing_directory_created_private_when_creatable(tmp_path):
    target = tmp_path / "a" / "b"
    v = validate_tier_paths((TierSpec(str(target)),))
    assert target.is_dir() and v.checks[0].created
    assert os.stat(target).st_mode & 0o777 == 0o700


def test_error_names_path_and_flag_when_directory_cannot_be_created(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError) as e:
        validate_tier_paths((TierSpec(str(blocker / "sub")),))
    assert "--mlp-offload-paths" in str(e.value) and str(blocker / "sub") in str(e.value)


def test_error_names_path_and_flag_when_path_is_a_file(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(ConfigError, match=f"--mlp-offload-paths: {f} is not a directory"):
        validate_tier_paths((TierSpec(str(f)),))


@pytest.mark.skipif(os.getuid() == 0, reason="root writes into read-only directories")
def test_error_names_path_and_flag_when_directory_is_not_writable(tmp_path):
    d = tmp_path / "ro"
    d.mkdir(mode=0o500)
    with pytest.raises(ConfigError, match=f"--mlp-offload-paths: {d} is not writable"):
        validate_tier_paths((TierSpec(str(d)),))


def test_error_says_proc_is_a_kernel_interface_when_a_tier_is_on_procfs(tmp_path):
    if not os.path.isdir("/proc/self"):
        pytest.skip("needs procfs mounted at /proc")
    with pytest.raises(ConfigError, match="--mlp-offload-paths: /proc/self is on a proc file system, a kernel "
                                          "interface, not storage"):
        validate_tier_paths((TierSpec("/proc/self"),))


def test_same_directory_twice_rejected_with_both_names(tmp_path):
    a = tmp_path / "a"
    a.mkdir()
    (tmp_path / "link").symlink_to(a)
    with pytest.raises(ConfigError, match="same directory"):
        validate_tier_paths((TierSpec(str(a)), TierSpec(str(tmp_path / "link"))))


def test_warning_names_both_paths_when_two_paths_share_a_device(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    v = validate_tier_paths(parse_tier_paths(f"{a};{b}"))
    same = [w for w in v.warnings if "same device" in w]
    assert len(same) == 1 and str(a) in same[0] and str(b) in same[0] and "no bandwidth gain" in same[0]
    assert v.checks[0].device.key == v.checks[1].device.key == device_key(str(a))


def test_no_same_device_warning_when_paths_on_disk_and_tmpfs(disk_dir, shm_dir):
    v = validate_tier_paths(parse_tier_paths(f"{disk_dir};{shm_dir}"))
    assert not [w for w in v.warnings if "same device" in w]
    assert v.checks[0].device.key != v.checks[1].device.key
    assert v.checks[1].device.fs_type == "tmpfs"


def test_o_direct_probe_succeeds_when_directory_is_on_a_block_device(disk_dir):
    ok, reason = probe_o_direct(disk_dir)
    assert ok, reason
    assert os.listdir(disk_dir) == []  # the probe file is removed


def test_free_space_reported_and_cap_bounds_usable_bytes(tmp_path):
    v = validate_tier_paths((TierSpec(str(tmp_path), capacity_bytes=4096),))
    c = v.checks[0]
    assert c.free_bytes > 0 and c.usable_bytes == 4096


def test_warning_when_cap_exceeds_free_space(tmp_path):
    v = validate_tier_paths((TierSpec(str(tmp_path), capacity_bytes=10**18),))
    assert any("exceeds the free space" in w for w in v.warnings)
    assert v.checks[0].usable_bytes == v.checks[0].free_bytes


def test_rw_option_parsed_when_declared():
    a, b, c = parse_tier_paths("/a:rw=shared;/b:rw=separate,bw=2GB/s;/c")
    assert a.shared_rw_limit is True and b.shared_rw_limit is False and c.shared_rw_limit is None
    assert b.read_bytes_per_s == 2e9


def test_rw_option_rejected_with_flag_when_value_unknown():
    with pytest.raises(ConfigError, match="--mlp-offload-paths: rw='both'"):
        parse_tier_paths("/a:rw=both")


def test_warning_and_buffered_when_file_system_refuses_o_direct(tmp_path, monkeypatch):
    # Older kernels refuse O_DIRECT on tmpfs with EINVAL at open(); emulate that file system.
    import errno

    from megatron_mlp.tier import validation

    real_fcntl = validation.fcntl.fcntl

    def refusing_fcntl(fd, cmd, *args):
        # As a file system without O_DIRECT answers F_SETFL with O_DIRECT.
        if cmd == validation.fcntl.F_SETFL and args and args[0] & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_fcntl(fd, cmd, *args)

    monkeypatch.setattr(validation.fcntl, "fcntl", refusing_fcntl)
    v = validate_tier_paths((TierSpec(str(tmp_path)),))
    c = v.checks[0]
    assert c.o_direct is False and "EINVAL" in c.o_direct_reason
    assert any(str(tmp_path) in w and "buffered" in w for w in v.warnings)
    assert os.listdir(tmp_path) == []


def test_a_colon_in_a_path_is_written_escaped_when_it_belongs_to_the_path():
    specs = parse_tier_paths(r"/data/run\:1:bw=2GB/s;/plain")
    assert [s.path for s in specs] == ["/data/run:1", "/plain"]
    assert specs[0].read_bytes_per_s == 2e9 and specs[1].read_bytes_per_s is None


def test_error_says_colon_starts_options_when_a_path_with_a_colon_is_not_escaped():
    with pytest.raises(ConfigError) as e:
        parse_tier_paths("/x/a:b")
    msg = str(e.value)
    assert "':' starts the options of path /x/a" in msg and "'b' is not key=value" in msg and r"'\:'" in msg
