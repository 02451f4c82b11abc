"""libatomic's lock-free 8-byte operations, the fences and the futex syscall, through ctypes.

What the control page (peerd.controlpage) needs from the machine to share
words between processes: Note [Control page layout] says which order each
access needs and why. Standard library only.
"""

from __future__ import annotations

import ctypes
import platform

_ACQUIRE, _RELEASE, SEQ_CST = 2, 3, 5  # C11 memory orders, as libatomic takes them
_FUTEX_WAKE = 1  # without FUTEX_PRIVATE_FLAG: shared between processes
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}
#: madvise(2): a forked child gets no copy of the mapping (the same number on x86_64 and aarch64)
MADV_DONTFORK = 10


class PageError(RuntimeError):
    """The page cannot be made, mapped or trusted; the caller falls back to the message path."""


class _Atomics:
    """libatomic's lock-free 8-byte operations, the fences, and the futex syscall."""

    def __init__(self) -> None:
        if platform.machine() not in _SYS_FUTEX:
            raise PageError(f"the control page supports x86_64 and aarch64, not {platform.machine()}")
        try:
            lib = ctypes.CDLL("libatomic.so.1")
        except OSError as err:
            raise PageError(f"libatomic.so.1 is not loadable ({err}); install libatomic1") from None
        u64, u32, vp, i = ctypes.c_uint64, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_int
        self.store = getattr(lib, "__atomic_store_8")
        self.store.argtypes, self.store.restype = [vp, u64, i], None
        self._cas = getattr(lib, "__atomic_compare_exchange_8")
        self._cas.argtypes, self._cas.restype = [vp, ctypes.POINTER(u64), u64, i, i], ctypes.c_bool
        self.add32 = getattr(lib, "__atomic_fetch_add_4")
        self.add32.argtypes, self.add32.restype = [vp, u32, i], u32
        self.fence = lib.atomic_thread_fence
        self.fence.argtypes, self.fence.restype = [i], None
        lock_free = getattr(lib, "__atomic_is_lock_free")
        lock_free.argtypes, lock_free.restype = [ctypes.c_size_t, vp], ctypes.c_bool
        if not (lock_free(8, None) and lock_free(4, None)):
            raise PageError("libatomic's 8-byte operations are not lock-free here: they cannot cross processes")
        self.tso = platform.machine() == "x86_64"
        libc = ctypes.CDLL(None, use_errno=True)
        self.syscall = libc.syscall
        self.syscall.restype = ctypes.c_long
        self.sys_futex = _SYS_FUTEX[platform.machine()]
        self.mmap = libc.mmap
        self.mmap.restype, self.mmap.argtypes = vp, [vp, ctypes.c_size_t, i, i, i, ctypes.c_long]
        self.munmap = libc.munmap
        self.munmap.argtypes = [vp, ctypes.c_size_t]
        self.madvise = libc.madvise
        self.madvise.argtypes = [vp, ctypes.c_size_t, i]

    # The orders the page needs, each as cheap as the CPU allows. On x86-64 (TSO)
    # every plain aligned load is an acquire and every plain store a release, so
    # those cost one ctypes attribute access; only store-then-load needs a
    # barrier there (the sequentially consistent store is an xchg). On arm64
    # plain ldr/str order nothing, so libatomic's ldar/stlr and fences do it.

    def store_release(self, word: ctypes.c_uint64, value: int) -> None:
        if self.tso:
            word.value = value
        else:
            self.store(ctypes.addressof(word), value, _RELEASE)

    def store_seq_cst(self, word: ctypes.c_uint64, value: int) -> None:
        """A release store that no later load of this thread passes (the Dekker half):
        an xchg on x86-64; on arm64 stlr and a full fence, since plain loads follow."""
        self.store(ctypes.addressof(word), value, SEQ_CST)
        if not self.tso:
            self.fence(SEQ_CST)

    def compare_exchange(self, word: ctypes.c_uint64, expected: int, desired: int) -> int:
        """Store ``desired`` where the word holds ``expected`` (sequentially consistent); the value it held."""
        seen = ctypes.c_uint64(expected)
        self._cas(ctypes.addressof(word), ctypes.byref(seen), desired, SEQ_CST, SEQ_CST)
        return seen.value

    def acquire_fence(self) -> None:
        """Loads after it see what the stores before a release that earlier loads saw."""
        if not self.tso:
            self.fence(_ACQUIRE)

    def futex_wake(self, address: int) -> None:
        self.syscall(self.sys_futex, ctypes.c_void_p(address), _FUTEX_WAKE, ctypes.c_int(2**31 - 1), None, None, 0)


_atomics: _Atomics | None = None


def atomics() -> _Atomics:
    global _atomics
    if _atomics is None:
        _atomics = _Atomics()
    return _atomics
