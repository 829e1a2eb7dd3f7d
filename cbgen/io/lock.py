"""One run per output: an exclusive OS lock on a file in the output's staging folder.

    prompts.out.partial/.lock    flock(LOCK_EX | LOCK_NB), held from before the model loads
                                 until the process exits; it holds {pid, host, started} of
                                 its holder so that a refused run can say who has the output

The kernel drops the lock when its holder exits in any way (kill -9 included), so a stale lock
never blocks a rerun. Each shard part has its own staging folder and so its own lock: the
tasks of a Slurm job array never wait for each other.

The staging folder is removed when a run finishes, while its lock is still held. A run that
opened the old file just before that could take the lock on the removed file after the holder
exits, at the same time as a third run locks a new file at the same path; so after taking the
lock we check that the path still names the file we locked, and start again if it does not.

Network filesystems: on Linux, flock on NFS is carried out as a POSIX byte-range lock on the
server, so it excludes runs on other nodes when the server supports locking (NFSv4, or NFSv3
with lockd). A filesystem mounted without cross-node locking (Lustre with `localflock`, NFS
with `nolock`, some FUSE filesystems) excludes only runs on the same node; one that refuses
locks outright (ENOLCK, EOPNOTSUPP) leaves the run unlocked, with a warning.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

LOCK_NAME = ".lock"
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class OutputLockedError(Exception):
    """Another live process holds the output."""


class OutputLock:
    """`acquire()` takes the lock or raises OutputLockedError naming the holder; the lock is
    released by `release()` or when the process exits."""

    def __init__(self, staging: Path) -> None:
        self.path = staging / LOCK_NAME
        self.fd: int | None = None
        self.unsupported: str | None = None
        """Why the filesystem could not lock, when it could not (the run goes on unlocked)."""

    def acquire(self) -> None:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise OutputLockedError(self._held_message()) from None
                if e.errno in _UNSUPPORTED:
                    self.unsupported = os.strerror(e.errno or 0)
                    return
                raise
            if _same_file(fd, self.path):
                break
            os.close(fd)  # the folder was removed and made anew under us: lock the new file
        self.fd = fd
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "started": _now()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)

    def check(self) -> None:
        """Held until this process exits: nothing to check (a lease may be lost)."""

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the last descriptor drops the flock
            self.fd = None

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _held_message(self) -> str:
        holder = read_holder(self.path)
        who = (
            f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, "
            f"started {holder.get('started', '?')}"
            if holder
            else "a process that has not written its name yet"
        )
        return (
            f"another run is writing this output ({who}; lock {self.path}): wait for it to "
            "finish or stop it, then rerun to resume"
        )


def read_holder(path: Path) -> dict[str, Any]:
    """What the holder wrote into the lock file; {} when unreadable or not written yet."""
    try:
        data = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime())
