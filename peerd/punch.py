"""Giving a memfd's pages back, whoever still holds the fd or maps it.

The kernel frees a memfd's pages at its last close and last unmapping, and a
process that was handed the fd may keep either for as long as it lives: the
pages stay charged to the daemon that filled them, outside every cap. Punched
out (``FALLOC_FL_PUNCH_HOLE``), the pages go at once; a mapping left reads
zero, and a page it writes again is charged to the process that writes it.
Standard library only: the control page areas (peerd.pagearea) use it too.
"""

from __future__ import annotations

import ctypes
import os

#: fallocate(2) mode that frees a range's pages, keeping the file's size (allowed on a memfd sealed against
#: resizing)
PUNCH_HOLE = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def punch_out(fd: int, offset: int, nbytes: int) -> None:
    """Free the pages of ``nbytes`` at ``offset`` of the memfd ``fd`` (they read zero after); OSError on failure."""
    if _libc.fallocate(fd, PUNCH_HOLE, offset, nbytes) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))
