"""Which physical tier a path lives on.

The key of a tier is its block device: ``st_dev`` of the path's realpath, with a partition mapped to
its whole disk (two partitions of one NVMe share its bandwidth). tmpfs and other virtual file
systems get an anonymous device per mount, so each such mount is its own tier. The same key names
the tier's token files (so every process of the node that uses the device coordinates, whatever its
job) and its calibration entry.
"""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceInfo:
    """Where a path lives. ``key`` is 'MAJOR-MINOR' of the (whole-disk) device."""

    key: str
    st_dev: int
    fs_type: str
    mount_point: str
    realpath: str


def existing_ancestor(path: str) -> str:
    """The path itself if it exists, else its nearest existing parent (a path may be created later)."""
    p = os.path.realpath(os.path.abspath(path))
    while not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return p


def _whole_disk(major: int, minor: int) -> tuple[int, int]:
    """Map a partition to its disk through sysfs; anything else maps to itself."""
    sys_path = f"/sys/dev/block/{major}:{minor}"
    try:
        if not os.path.exists(os.path.join(sys_path, "partition")):
            return major, minor
        parent = os.path.dirname(os.path.realpath(sys_path))
        with open(os.path.join(parent, "dev")) as f:
            ma, mi = f.read().strip().split(":")
        return int(ma), int(mi)
    except (OSError, ValueError):
        return major, minor


def _mount_of(realpath: str) -> tuple[str, str]:
    """(mount point, fs type) of the longest mount prefix of ``realpath`` (from /proc/self/mountinfo)."""
    best, fstype = "/", "unknown"
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                parts = line.split()
                if " - " not in line or len(parts) < 5:
                    continue
                mnt = parts[4].replace("\\040", " ")
                after = line.split(" - ", 1)[1].split()
                inside = realpath == mnt or realpath.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best):
                    best, fstype = mnt, after[0]
    except OSError:
        pass
    return best, fstype


def device_info(path: str) -> DeviceInfo:
    """Describe the physical tier of ``path`` (which need not exist yet)."""
    real = existing_ancestor(path)
    st = os.stat(real)
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    if major != 0:  # a real block device; 0 = anonymous (tmpfs, overlay, NFS, ...)
        major, minor = _whole_disk(major, minor)
    mount, fstype = _mount_of(real)
    return DeviceInfo(key=f"{major}-{minor}", st_dev=st.st_dev, fs_type=fstype, mount_point=mount,
                      realpath=os.path.realpath(os.path.abspath(path)))


def device_key(path: str) -> str:
    """The tier key of ``path``: 'MAJOR-MINOR' of its whole-disk device."""
    return device_info(path).key
