"""A control-page area: a sealed memfd of fixed-size page slots, and its mapping.

The daemon makes one per (owner uid, page size) and hands its fd to the
members of the sets placed in it (peerd.pages); a member maps it once for its whole life
(peerd_client.pagelink) and reads each set's page as a view at area base +
offset (peerd.controlpage.ControlPage, whose Note says what a page holds).
Standard library only, as peerd.controlpage.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os

from .atomics import MADV_DONTFORK, PageError, atomics
from .punch import punch_out
from .controlpage import MAGIC, OFF_MAGIC, OFF_SLOTS, SLOT_BYTES, VERSION, ControlPage, page_bytes

#: slots per area: one fd and one mapping (and, on a GPU, one registration, which pins the whole area) serve
#: the first 8 sets of a uid alive at once; an area of pages for up to 48 ranks is 32 KiB
AREA_PAGES = 8
#: /proc shows an area as /memfd:controlpage, apart from the host backend's buffers (/memfd:peerd...)
MEMFD_NAME = "controlpage"


def _mmap(fd: int, size: int) -> int:
    """Map the area, for this process only: a forked child that kept it would keep its memory and could
    write into its group's votes."""
    address = atomics().mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if address in (None, ctypes.c_void_p(-1).value):
        raise PageError(f"mmap of the control page area failed: {os.strerror(ctypes.get_errno())}")
    atomics().madvise(address, size, MADV_DONTFORK)  # it fails only for a range that is not this mapping
    return address


class Area:
    """A sealed memfd of ``slots`` control pages of ``page_size`` bytes each, mapped here.

    ``Area.create`` (the daemon) makes it and keeps ``fd`` to hand out;
    ``Area.attach(fd)`` (a member) maps it and closes the fd: the mapping
    keeps the memory alive, so a member holds no fd of it.
    """

    def __init__(self, fd: int, size: int):
        self.size = size
        self.address = _mmap(fd, size)
        self.fd = fd

    @classmethod
    def create(cls, page_size: int, slots: int = AREA_PAGES) -> "Area":
        """A zero-filled area; PageError where the memfd or its mapping cannot be made."""
        try:
            fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as err:
            raise PageError(f"memfd_create failed: {err}") from None
        try:
            os.ftruncate(fd, page_size * slots)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            return cls(fd, page_size * slots)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, fd: int) -> "Area":
        """Map an area received as ``fd``, which is closed whatever happens."""
        try:
            size = os.fstat(fd).st_size
            if size < OFF_SLOTS + SLOT_BYTES:
                raise PageError(f"fd {fd} is {size} bytes, too small for a control page area")
            area = cls(fd, size)
        finally:
            os.close(fd)
        area.fd = -1
        return area

    def page_at(self, offset: int, size: int) -> "ControlPage":
        """The raw page at ``offset`` (the daemon formats it)."""
        if offset < 0 or offset % mmap.PAGESIZE or offset + size > self.size:
            raise PageError(f"a control page at offset {offset} of {size} bytes is not inside the "
                            f"{self.size}-byte area")
        return ControlPage(self.address + offset, size)

    def page(self, offset: int, npes: int, instance: int | None = None,
             generation: int | None = None) -> "ControlPage":
        """The page at ``offset``, checked: a control page of this layout, of
        ``npes`` ranks, made by daemon run ``instance`` (StaleInstance
        otherwise) for set ``generation``, each where given."""
        page = self.page_at(offset, page_bytes(npes))
        magic = page.word(OFF_MAGIC).value
        atomics().acquire_fence()
        if magic != MAGIC or page.version != VERSION:
            raise PageError(f"offset {offset} of the area holds no version-{VERSION} control page (magic {magic:#x})")
        if page.npes != npes:
            raise PageError(f"the control page is for npes={page.npes}, this group has npes={npes}")
        if instance is not None:
            page.check_instance(instance)
        if generation is not None and page.generation != generation:
            raise PageError(f"the control page is for set generation {page.generation}, not {generation}")
        page.hold(npes)
        return page

    def give_back(self) -> None:
        """Punch the pages out (the daemon, for an area no set uses any more): the members' mappings,
        which outlive it, keep none of the memory the daemon filled, and read zero after."""
        with contextlib.suppress(OSError):
            punch_out(self.fd, 0, self.size)

    def close(self) -> None:
        """Unmap, and close the fd where this process holds it; no view of a page may be used after."""
        if self.address:
            atomics().munmap(self.address, self.size)
            self.address = 0
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
