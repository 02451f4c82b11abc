"""Who a reply goes to: the ZeroMQ routing id of the connection that asked.

Note [Routing ids]
~~~~~~~~~~~~~~~~~~
The daemon's ROUTER sends each reply to a routing id, and libzmq lets a
connecting peer choose its own (ZMQ_ROUTING_ID), any bytes it likes,
before the daemon sees a message of it. Two attacks follow, open to any
user who can connect, the allowlist notwithstanding:

- A connection that names no id gets one libzmq makes up: a zero byte and
  a counter, started at a value of C's ``rand()``, which nobody seeded, so
  the first id of every daemon run was the same, 00 6b8b4567, and the next
  ones followed it. libzmq never checks a made-up id against those peers
  chose, and aborts the process (an assertion) when one is taken: a user
  who claimed the next ids took the daemon down with the next connection of
  anyone.
- A reply owed to a connection that went away (its process lives on) goes
  to whoever holds that id now: a user who claimed it received another
  user's join reply, whose CUDA or HIP handles open that user's buffers.

So the daemon seeds ``rand()`` from the kernel's randomness before it makes
its ROUTER (``unpredictable_made_up_ids``): where the counter starts is
then one of 2^32 values nobody can read, and claiming ids ahead of it is a
guess. And it answers only connections that named themselves with an id of
at least ``MIN_ID_BYTES`` random bytes (``new_routing_id``, which every
peerd client uses): nobody can claim a name they cannot guess, so no reply
of the daemon goes astray. A connection with a made-up id, or a short one,
hears BAD_REQUEST and nothing else.

What stays: a user who can connect may probe for live made-up ids (a
connection claiming a taken id is ignored), about 2^32 / (the made-up ids
alive) connections to find one, and then claim the next. Only libzmq can
close that (refusing peer ids in the zero-led range it keeps for itself);
docs/security.md says so.
"""

from __future__ import annotations

import ctypes
import secrets

#: the shortest routing id the daemon answers: 15 random bytes after a marker byte (120 bits)
MIN_ID_BYTES = 16
#: the first byte of every id a peerd client makes: libzmq makes up ids that start with a zero byte
MARKER = b"p"


def new_routing_id() -> bytes:
    """A routing id for one client connection, which no other process can guess."""
    return MARKER + secrets.token_bytes(MIN_ID_BYTES - len(MARKER))


def self_named(routing_id: bytes) -> bool:
    """Whether a connection named itself with an id long enough to be unguessable: the daemon answers no
    other (a made-up id starts with a zero byte and is 5 bytes long)."""
    return len(routing_id) >= MIN_ID_BYTES and routing_id[0] != 0


def unpredictable_made_up_ids() -> None:
    """Seed C's ``rand()``, where libzmq starts the counter of the ids it makes up: called before the
    daemon makes its ROUTER, so the ids it makes up cannot be claimed ahead of it."""
    libc = ctypes.CDLL(None)
    libc.srand(ctypes.c_uint(secrets.randbits(32)))
