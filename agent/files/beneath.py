"""Root's file operations in directories a user controls, safe against links and races.

A restore runs as root and changes files in the job's working directory and wherever else the
job held a file open for writing: it puts files back, cuts them back, makes their lost
directories and moves entries aside.  The job's user owns those directories and may rename
anything in them at any moment (``renameat2(RENAME_EXCHANGE)`` swaps a directory for a link to
``/root`` between any two system calls), so a path that was checked is no guarantee for the next
call that uses it.

The one mechanism used everywhere: every path is walked from ``/`` one component at a time,
each opened relative to the descriptor of the one before with ``O_NOFOLLOW | O_DIRECTORY``, so
a link anywhere on the way is refused (ELOOP or ENOTDIR) instead of followed, whenever it was
swapped in; the last component is opened with ``O_NOFOLLOW`` too.  Everything after that goes
through descriptors: ``fchown``, ``fchmod``, ``fstat``, ``mkdirat``, ``renameat`` and
``unlinkat`` relative to the directory's descriptor, never by path.  A swap can then only put
another real directory in the place of one; and only a directory that the user could move there,
which lies in the user's own tree.  Paths are absolute and normal (no ``.``, ``..``, ``//``).

Blocking: run in a worker thread.
"""

from __future__ import annotations

import errno
import os
import stat

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Unsafe(OSError):
    """A path that leads through a link, or is not what it must be."""


def _parts(path: str) -> list[str]:
    if not path.startswith("/") or os.path.normpath(path) != path or path.startswith("//"):
        raise Unsafe(errno.EINVAL, "not an absolute, normal path", path)
    return [p for p in path.split("/") if p]


def _open_in(dir_fd: int, name: str, path: str) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise Unsafe(exc.errno, f"{name} on its path is a link or not a directory", path) from None
        raise


def walk(dir_fd: int, names: list[str], path: str, make: tuple[int, int, int] | None = None) -> int:
    """A new descriptor of the directory ``names`` below ``dir_fd`` (which stays open), each
    component opened without following a link; with ``make`` (uid, gid, mode) the missing ones are
    made, and given that owner and mode through their descriptors."""
    fd = os.dup(dir_fd)
    try:
        for name in names:
            try:
                nxt = _open_in(fd, name, path)
            except FileNotFoundError:
                if make is None:
                    raise
                try:
                    os.mkdir(name, 0o700, dir_fd=fd)
                    made = True
                except FileExistsError:  # made meanwhile, by someone else: never given away
                    made = False
                nxt = _open_in(fd, name, path)
                if made:
                    uid, gid, mode = make
                    os.fchown(nxt, uid, gid)
                    os.fchmod(nxt, mode)
            os.close(fd)
            fd = nxt
        return fd
    except BaseException:
        os.close(fd)
        raise


def open_dir(path: str, make: tuple[int, int, int] | None = None) -> int:
    """A descriptor of the directory ``path``, reached from ``/`` without following a link."""
    root = os.open("/", _DIR_FLAGS)
    try:
        return walk(root, _parts(path), path, make)
    finally:
        os.close(root)


def open_parent(path: str) -> tuple[int, str]:
    """(a descriptor of ``path``'s directory, its last component), reached without following a link."""
    parts = _parts(path)
    if not parts:
        raise Unsafe(errno.EINVAL, "the root has no parent", path)
    head, _, name = path.rpartition("/")
    return open_dir(head or "/"), name


def lstat_in(dir_fd: int, name: str) -> os.stat_result | None:
    """The entry ``name`` of ``dir_fd`` itself (a link is not followed); None if it is missing."""
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def open_file(dir_fd: int, name: str, flags: int, mode: int = 0o600) -> int:
    """Open the regular file ``name`` of ``dir_fd``: never through a link, never blocking on a FIFO
    (``O_NONBLOCK``, cleared once it is known to be a regular file)."""
    fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode, dir_fd=dir_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise Unsafe(errno.EINVAL, "not a regular file", name)
        os.set_blocking(fd, True)
        return fd
    except BaseException:
        os.close(fd)
        raise


def changeable(path: str, root_fd: int, private: frozenset[int] | set[int] = frozenset()) -> str | None:
    """The first directory on the way to ``path``'s parent (from ``root_fd``, the root its holder
    sees) whose entries someone other than root could rename or replace, or that is a link or
    missing; None if there is none, or once the way enters a filesystem of ``private`` (devices
    only the job's mount namespace has, which nobody else reaches while criu restores it as
    root).  A directory is safe when root owns it and no one else may write to it; on the way, a
    sticky one (``/tmp``) too, as no one else may move root's entry in it (checked next).  Not as
    the last: once criu has given the entry it makes there to the user, the user may replace
    it, and criu goes on by path (unless fs.protected_symlinks, which a node may not set)."""
    names = _parts(path)[:-1]
    fd = os.dup(root_fd)
    try:
        for depth in range(len(names) + 1):
            st = os.fstat(fd)
            where = "/" + "/".join(names[:depth])
            if st.st_dev in private:
                return None
            if st.st_uid != 0 or (st.st_mode & 0o022 and not (st.st_mode & stat.S_ISVTX and depth < len(names))):
                return where
            if depth == len(names):
                return None
            try:
                nxt = os.open(names[depth], _DIR_FLAGS, dir_fd=fd)
            except OSError:  # a link, not a directory, or gone: nothing to rely on
                return where.rstrip("/") + "/" + names[depth]
            os.close(fd)
            fd = nxt
        return None
    finally:
        os.close(fd)


class Dirs:
    """Descriptors of a tree's directories by relative path ("" the top), each walked to from the
    top without following a link, and a few kept open: the agent's descriptors never grow with
    the tree (the most recently used are kept; a walk again costs one ``openat`` a component)."""

    KEEP = 128

    def __init__(self, top: str) -> None:
        self.top = top
        self._top = open_dir(top)
        self._open: dict[str, int] = {}

    def get(self, head: str) -> int:
        """A descriptor of ``head`` (the tree's, not the caller's to close)."""
        if not head:
            return self._top
        fd = self._open.pop(head, None)
        if fd is None:
            parts = head.split("/")
            base, k = self._top, 0
            for k in range(len(parts) - 1, 0, -1):  # from the nearest open ancestor
                near = self._open.get("/".join(parts[:k]))
                if near is not None:
                    base = near
                    break
            else:
                k = 0
            path = os.path.join(self.top, head)
            fd = _open_in(base, parts[k], path) if k == len(parts) - 1 else walk(base, parts[k:], path)
            if len(self._open) >= self.KEEP:
                os.close(self._open.pop(next(iter(self._open))))
        self._open[head] = fd  # the newest last
        return fd

    def close(self) -> None:
        for fd in self._open.values():
            os.close(fd)
        self._open.clear()
        os.close(self._top)
