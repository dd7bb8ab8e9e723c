"""Safe file access in directories other users may write: the one place to audit.

A tier directory may be shared (a group scratch, a world-writable and not sticky directory many
sites have). Two rules, as OpenSSH's StrictModes and PostgreSQL's data-directory checks have them:

* **Who controls the path.** A tier path is resolved component by component from ``/`` with
  ``openat(O_NOFOLLOW|O_DIRECTORY)`` (:func:`open_dir`). Every component, and every symlink on the
  way, must be owned by this user or by root; a directory that others can write (mode ``022``)
  without the sticky bit is refused, except the last one when this user owns it (what we make in it
  is then protected by the next rule). The error names the component and its owner.
* **What we make there is reached only through descriptors.** A private directory is made with
  ``mkdirat`` and held as a descriptor opened O_NOFOLLOW|O_DIRECTORY whose owner and mode (0700)
  ``fstat`` confirms (:func:`make_private_dir`); every file, lock, listing and unlink is relative to
  that descriptor and never reopened by path. Every create is ``O_CREAT|O_EXCL|O_NOFOLLOW``
  (:func:`create_file`); every other open is ``O_NOFOLLOW|O_NONBLOCK`` and accepts only a regular
  file (:func:`open_regular`), so a FIFO or device planted at an expected name can neither hang nor
  redirect us. Clean-up unlinks by name relative to the held descriptor (which never follows a
  symlink) and removes a directory only while its name still holds the inode it was made as
  (:func:`remove_dir_entry`).
"""
from __future__ import annotations

import errno
import os
import stat

from megatron_mlp.errors import ConfigError

OPEN_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
CREATE_FLAGS = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_SYMLINKS = 40   # as the kernel's own path walk (ELOOP beyond)

# Test seam: called as ``hook(parent_fd, name)`` between the ``mkdirat`` of a private directory and
# its open, where another user's swap would land (tests make the race deterministic with it).
after_mkdir_hook = None


class UnsafePathError(ConfigError):
    """A path component is controlled by another user (or could be replaced by one)."""


class NotARegularFile(OSError):
    """An expected regular file is something else (a FIFO, a device, a directory)."""


def user_name(uid: int) -> str:
    try:
        import pwd
        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return "no such user"


def trusted_owner(uid: int) -> bool:
    """Who may own a component of a path we use: this user, or root (who can do anything anyway)."""
    return uid in (os.geteuid(), 0)


def _owner(st) -> str:
    return f"uid {st.st_uid} ({user_name(st.st_uid)})"


def check_component(st, shown: str, *, last: bool, flag: str, path: str) -> None:
    """Refuse a directory ``shown`` (its ``fstat``) that another user controls (see the module doc).

    Raises:
        UnsafePathError: names ``flag``, ``path``, the component and its owner.
    """
    head = f"{flag}: {path}: " if shown != path else f"{flag}: "
    if not trusted_owner(st.st_uid):
        raise UnsafePathError(f"{head}{shown} is owned by {_owner(st)}, not by you or root: that user could "
                              "replace what lies below it. Use a directory whose every component is yours or root's")
    others_write = st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX
    if others_write and not (last and st.st_uid == os.geteuid()):
        where = "the tier directory" if last else "a component of the path"
        raise UnsafePathError(
            f"{head}{shown} ({where}, owned by {_owner(st)}, mode {stat.S_IMODE(st.st_mode):04o}) can be written "
            "by other users and is not sticky: they could rename or replace what is made in it. Make a directory "
            f"of your own inside it (mkdir -m 700 {os.path.join(shown, '$USER')}) and give that")


def open_dir(path: str, *, flag: str = "--mlp-offload-paths", create: bool = False) -> int:
    """Open directory ``path`` safely, component by component from ``/``; return its descriptor.

    Each component is opened with ``openat(parent, name, O_NOFOLLOW|O_DIRECTORY)`` and checked with
    ``fstat`` (:func:`check_component`). A symlink is followed only when owned by this user or root
    (its directory has been checked already); its target is resolved the same way. With ``create``,
    a missing component is made with ``mkdirat(parent, name, 0700)`` in its checked parent.

    Raises:
        UnsafePathError: a component is controlled by another user (names it and its owner).
        ConfigError: ``path`` is not absolute.
        OSError: a component is missing (without ``create``), not a directory, or unreadable.
    """
    if not os.path.isabs(path):
        raise ConfigError(f"{flag}: {path} is not an absolute path")
    stack = [(os.open("/", OPEN_DIR_FLAGS), "/")]
    parts = [p for p in path.split("/") if p not in ("", ".")]
    hops = 0
    try:
        check_component(os.fstat(stack[0][0]), "/", last=not parts, flag=flag, path=path)
        while parts:
            name = parts.pop(0)
            fd, shown = stack[-1]
            if name == "..":
                if len(stack) > 1:
                    os.close(stack.pop()[0])
                continue
            here = os.path.join(shown, name)
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                if not create:
                    raise FileNotFoundError(errno.ENOENT, f"{flag}: {here} does not exist", path) from None
                try:
                    os.mkdir(name, 0o700, dir_fd=fd)
                except FileExistsError:
                    pass
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                if not trusted_owner(st.st_uid):
                    raise UnsafePathError(f"{flag}: {path}: {here} is a symlink owned by {_owner(st)}, not by you "
                                          "or root; refusing to follow it")
                hops += 1
                if hops > _MAX_SYMLINKS:
                    raise OSError(errno.ELOOP, f"{flag}: too many symlinks resolving {path}", path)
                target = os.readlink(name, dir_fd=fd)
                if target.startswith("/"):
                    while len(stack) > 1:
                        os.close(stack.pop()[0])
                parts = [p for p in target.split("/") if p not in ("", ".")] + parts
                continue
            try:
                nfd = os.open(name, OPEN_DIR_FLAGS, dir_fd=fd)
            except OSError as e:
                if e.errno == errno.ELOOP:   # swapped for a symlink since the lstat: look again
                    parts.insert(0, name)
                    hops += 1
                    if hops <= _MAX_SYMLINKS:
                        continue
                raise OSError(e.errno, f"{flag}: cannot open {here} as a directory: {e.strerror}", path) from None
            stack.append((nfd, here))
            check_component(os.fstat(nfd), here, last=not parts, flag=flag, path=path)
        fd = stack.pop()[0]
        return fd
    finally:
        for fd, _ in stack:
            os.close(fd)


def check_dir(path: str, *, flag: str = "--mlp-offload-paths", create: bool = False) -> None:
    """:func:`open_dir` for its checks alone (creating what is missing with ``create``)."""
    os.close(open_dir(path, flag=flag, create=create))


def make_private_dir(parent_fd: int, name: str, *, shown: str = "") -> tuple[int, os.stat_result]:
    """Make directory ``name`` (0700) in ``parent_fd`` and open it; return (descriptor, its fstat).

    The descriptor is opened O_NOFOLLOW|O_DIRECTORY and accepted only when ``fstat`` says it is a
    directory of this user with mode 0700: another user who swapped the new name for a symlink or
    their own directory in between is refused, and nothing is made through the swapped name.

    Raises:
        FileExistsError: the name is taken. UnsafePathError: the name no longer holds our directory.
    """
    os.mkdir(name, 0o700, dir_fd=parent_fd)
    if after_mkdir_hook is not None:
        after_mkdir_hook(parent_fd, name)
    shown = shown or name
    try:
        fd = os.open(name, OPEN_DIR_FLAGS, dir_fd=parent_fd)
    except OSError as e:
        raise UnsafePathError(f"{shown}: the directory just made is no longer there as made ({e.strerror}): "
                              "another user replaced it; refusing to use it") from e
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) != 0o700:
        os.close(fd)
        raise UnsafePathError(f"{shown}: the directory just made is owned by {_owner(st)} with mode "
                              f"{stat.S_IMODE(st.st_mode):04o}, not ours with 0700: another user replaced it; "
                              "refusing to use it")
    return fd, st


def create_file(dir_fd: int, name: str, flags: int = os.O_RDWR, mode: int = 0o600) -> int:
    """Create ``name`` in ``dir_fd`` exclusively (never an existing name, never through a symlink).

    Raises:
        FileExistsError: anything -- a file, a (dangling) symlink, a FIFO -- is already there.
    """
    return os.open(name, flags | CREATE_FLAGS, mode, dir_fd=dir_fd)


def open_regular(dir_fd: int | None, name: str, flags: int = os.O_RDONLY) -> int:
    """Open an existing regular file ``name`` (relative to ``dir_fd``, or a path when None).

    O_NOFOLLOW and O_NONBLOCK: a symlink is refused (ELOOP) and a FIFO or device opens without
    waiting for a peer; anything but a regular file is then closed and refused.

    Raises:
        NotARegularFile: names what it is. OSError: the open failed.
    """
    kw = {} if dir_fd is None else {"dir_fd": dir_fd}
    fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, **kw)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        kind = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode)
                else "a socket" if stat.S_ISSOCK(st.st_mode) else "a device or special file")
        raise NotARegularFile(errno.EINVAL, f"{name} is {kind}, not a regular file; refusing to use it", name)
    return fd


def unlink_names(dir_fd: int, names) -> None:
    """Unlink each of ``names`` in ``dir_fd`` (never follows a symlink); missing names are fine."""
    for name in names:
        try:
            os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            pass


def remove_dir_entry(parent_fd: int, name: str, made) -> bool:
    """Remove the (empty) directory ``name`` from ``parent_fd`` only while it is still the inode
    ``made`` (an ``os.stat_result``). Returns False when the name is gone or holds something else:
    another user swapped it, and whatever it holds now is not ours to remove."""
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if (st.st_dev, st.st_ino) != (made.st_dev, made.st_ino) or not stat.S_ISDIR(st.st_mode):
        return False
    try:
        os.rmdir(name, dir_fd=parent_fd)
    except FileNotFoundError:
        return False
    return True
