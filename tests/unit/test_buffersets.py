"""A buffer set's state changes only along its life: joining, opening, live, failed."""

from __future__ import annotations

import pytest

from peerd.buffersets import BufferSet, IllegalTransition, State
from peerd.protocol import ErrorCode, ProtocolError

VERDICT = ProtocolError(ErrorCode.GROUP_FAILED, "rank 1 voted no")


def fresh() -> BufferSet:
    return BufferSet(1, "g", "n", 2, 64, 0, 0.0, None)


def test_a_set_moves_along_its_life_and_keeps_its_verdict():
    bset = fresh()
    bset.move(State.OPENING)
    bset.move(State.LIVE)
    bset.move(State.FAILED, VERDICT)
    assert bset.state is State.FAILED and bset.failure is VERDICT


@pytest.mark.parametrize("path", [
    [State.LIVE],  # live before its handles went out
    [State.OPENING, State.JOINING],  # back to joining
    [State.FAILED, State.OPENING],  # a failed set opens again
])
def test_an_illegal_state_change_raises_and_changes_nothing(path):
    bset = fresh()
    for to in path[:-1]:
        bset.move(to, VERDICT if to is State.FAILED else None)
    before = bset.state
    with pytest.raises(IllegalTransition, match=f"{before.value} -> {path[-1].value}"):
        bset.move(path[-1])
    assert bset.state is before


def test_a_set_fails_only_with_a_verdict():
    with pytest.raises(IllegalTransition):
        fresh().move(State.FAILED)
