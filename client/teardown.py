"""A PeerBuffer's teardown: wait for this rank's kernels, unmap, release; never where it breaks a graph capture.

Releasing a CUDA buffer first synchronizes its device (no kernel of this
rank may write into a range the daemon zeroes for reuse), and a buffer that
is its whole chunk is unmapped. A device synchronize while any thread of the
process captures a CUDA graph fails and breaks that capture, in every
capture mode of the calling thread (measured on an H100: torch's
synchronize, and cudaDeviceSynchronize in the relaxed mode too, both get
cudaErrorStreamCaptureUnsupported and the capture ends invalidated), and no
call tells whether another thread captures. So a teardown runs only where
the process's own code asked for it outside a capture on its thread: an
explicit ``close()`` (or ``with`` exit) does it at once; a garbage
collector's finalizer, which runs in whatever thread and moment it runs,
inside an engine's capture of its all-reduce too, and a ``close()`` inside
a capture on its own thread leave it waiting, the set still held, for this
process's next PeerBuffer or ``close()`` outside a capture, or for its exit,
after which the daemon frees what the dead rank held. Host buffers need no
synchronize: theirs is done at once, wherever.
"""

from __future__ import annotations

import collections
import logging
import os
from dataclasses import dataclass

from .connection import Connection, undelivered
from .errors import DaemonUnavailable, MonoUnsupported
from .mappings import ChunkKey, mappings
from .views import require_torch

log = logging.getLogger("peerd_client")

#: the longest close() waits for the daemon to answer a release: nobody needs the answer, and a second
#: release of the set is harmless (answered NOT_FOUND), so one the daemon's loop is too busy or stuck to
#: answer by then is left to be sent again in the background (``undelivered``) instead of stalling the
#: teardown of every buffer behind it
RELEASE_WAIT_S = 1.0


@dataclass
class Teardown:
    """What a closed PeerBuffer still owes: its chunks unmapped (where whole), and its set released."""

    device: object  # torch.device
    chunks: list[ChunkKey]
    conn: Connection
    slot: dict | None  # the release's body; None: the set was released already, or never joined
    label: str

    def run(self, wait: bool, collected: bool = False) -> None:
        """Now, unless it would synchronize a CUDA device from a finalizer (``collected``) or inside a
        capture on this thread: then at this process's next safe point."""
        if self.device.type == "cuda" and (collected or require_torch().cuda.is_current_stream_capturing()):
            log.info("%s: %s: its release waits for this process's next PeerBuffer or close() outside a CUDA "
                     "graph capture (or its exit)", self.label,
                     "collected without close()" if collected else "closed inside a CUDA graph capture")
            _waiting.append(self)
            return
        try:
            self._synchronize()
        except BaseException:  # interrupted (Ctrl-C): the next safe point does it again
            _waiting.append(self)
            raise
        for key in self.chunks:
            try:
                mappings.close(key)
            except Exception as err:
                log.warning("%s: unmapping a peer buffer failed: %s", self.label, err)
        if self.slot is not None:
            self._release(wait)

    def _synchronize(self) -> None:
        if self.slot is None or self.device.type != "cuda":
            return
        try:
            require_torch().cuda.synchronize(self.device)
        except Exception as err:  # a broken context must not keep the set held
            log.warning("%s: synchronising %s before the release failed: %s", self.label, self.device, err)

    def _release(self, wait: bool) -> None:
        slot = self.slot
        try:
            if wait:
                self.conn.call_unless_busy("release", slot, RELEASE_WAIT_S)
            else:
                self.conn.send_later("release", slot)
        except DaemonUnavailable as err:
            log.warning("%s: the release waits for the daemon: %s", self.label, err)
            undelivered.add("release", slot)
        except MonoUnsupported as err:
            log.warning("%s: release: %s", self.label, err)
        except BaseException:  # interrupted (Ctrl-C) before the answer: maybe sent, so sent again (a second
            self.conn.send_later("release", slot)  # release of the set is answered NOT_FOUND, and skipped)
            raise


#: teardowns waiting for a safe point, oldest first; a deque: a finalizer may add to it anywhere
_waiting: collections.deque[Teardown] = collections.deque()
os.register_at_fork(after_in_child=_waiting.clear)  # a forked child holds none of its parent's ranks


def finish_waiting() -> None:
    """Do the teardowns that waited for a safe point: called outside any capture (each checks again)."""
    for _ in range(len(_waiting)):
        try:
            teardown = _waiting.popleft()
        except IndexError:  # another thread took the last one
            return
        teardown.run(wait=True)

