"""Shared memory that dies with its owner: an anonymous memfd the owner maps, which another
process on this machine opens as `/proc/<pid>/fd/<fd>`.

POSIX `/dev/shm` segments outlive a process killed by SIGKILL (Python's resource tracker dies
with it), so each killed engine or trainer rank left its weights in /dev/shm. A memfd has no
name in any file system: the kernel frees it once the owner's descriptor and the last mapping
are gone, however the processes ended.

A peer's address is input: its path must be `/proc/<digits>/fd/<digits>`, and what is opened
there must be a memfd carrying the label the owner published (with a random token), so neither
an arbitrary file nor a descriptor number reused by another file is mapped.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
from typing import Any

_PATH = re.compile(r"/proc/[0-9]{1,10}/fd/[0-9]{1,10}")
_LABEL = re.compile(r"megatron-rl-[a-z-]{1,40}-[0-9a-f]{16}")


class ProcessMemory:
    """`size` bytes of shared memory owned by this process; `address` is what a peer needs."""

    def __init__(self, size: int, kind: str):
        self.label = f"megatron-rl-{kind}-{secrets.token_hex(8)}"
        self.fd = os.memfd_create(self.label, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, max(size, 1))
            self.map = mmap.mmap(self.fd, max(size, 1))
        except BaseException:
            os.close(self.fd)
            raise
        self.size = size
        self.path = f"/proc/{os.getpid()}/fd/{self.fd}"

    @property
    def address(self) -> dict[str, str]:
        return {"path": self.path, "label": self.label}

    def close(self) -> None:
        """Drop the descriptor (peers can no longer open it) and the mapping, unless views
        still use it: then the memory goes with the last of them."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            self.map.close()
        except BufferError:
            pass


def map_process_memory(address: Any, nbytes: int, *, writable: bool, what: str) -> mmap.mmap:
    """Map a peer's `ProcessMemory` (`address`: its `{"path", "label"}`) for `nbytes`;
    writable, or copy-on-write (the owner's pages never change). `what` names the source
    in errors. FileNotFoundError: the owner is gone or on another machine (or in another
    PID namespace); ValueError: the address is malformed or names other memory."""
    path = address.get("path") if isinstance(address, dict) else None
    label = address.get("label") if isinstance(address, dict) else None
    if not isinstance(path, str) or not _PATH.fullmatch(path):
        raise ValueError(f"{what}: 'path' must be /proc/<pid>/fd/<fd>")
    if not isinstance(label, str) or not _LABEL.fullmatch(label):
        raise ValueError(f"{what}: 'label' is not a megatron-rl shared-memory label")
    if not isinstance(nbytes, int) or nbytes <= 0:
        raise ValueError(f"{what}: 'nbytes' must be a positive integer")
    try:
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    except (FileNotFoundError, PermissionError):
        raise FileNotFoundError(f"{what}: {path} cannot be opened (the owner exited, or it "
                                "runs on another machine)") from None
    try:
        # the descriptor actually opened, not the path again: nothing can swap it in between
        if os.readlink(f"/proc/self/fd/{fd}") != f"/memfd:{label} (deleted)":
            raise ValueError(f"{what}: {path} is not the shared memory labelled {label!r}")
        if os.fstat(fd).st_size < nbytes:
            raise ValueError(f"{what}: the shared memory is smaller than {nbytes} bytes")
        return mmap.mmap(fd, nbytes, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_COPY)
    finally:
        os.close(fd)
