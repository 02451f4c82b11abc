"""peerd_client: peer-mapped buffers for TP workers, brokered by the peerd daemon.

Drop-in for the seeds' peer_memory module::

    from peerd_client import PeerBuffer, MonoUnsupported, tp_agree

torch is imported only when a PeerBuffer is built, so tp_agree and the CLI
work without it.
"""

from .agree import tp_agree
from .buffer import PeerBuffer
from .errors import DaemonUnavailable, ForkedProcessError, MonoUnsupported

__all__ = ["PeerBuffer", "tp_agree", "MonoUnsupported", "DaemonUnavailable", "ForkedProcessError"]
