"""A string group key's membership: what tp_agree takes rank and npes from when a call names neither."""

from __future__ import annotations

import pytest

from peerd_client import groupkey
from peerd_client.groupkey import Membership, remember, resolve


def test_a_lone_rank_or_npes_must_match_the_membership_this_process_joined(monkeypatch):
    """tp_agree(True, key, rank=1) from the process holding rank 0 voted as rank 0: the value was ignored."""
    monkeypatch.setattr(groupkey, "_joined", {})
    remember(Membership("k", 0, 2))
    assert resolve("k", None, None, 1) == resolve("k", 0, None, 1) == resolve("k", None, 2, 1) == Membership("k", 0, 2)
    for rank, npes in ((1, None), (None, 4)):
        with pytest.raises(ValueError, match=r"contradict this process's place in group 'k' \(rank 0 of 2\)"):
            resolve("k", rank, npes, 1)


def test_integers_of_any_kind_count_and_other_values_are_left_for_the_protocols_check():
    """Engines compute sizes and ranks with numpy and torch; their integers were refused as not int."""
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    assert resolve("numpy-key", np.int64(1), np.int32(2), 1) == Membership("numpy-key", 1, 2)
    assert type(resolve("torch-key", torch.tensor(0), 2, 1).rank) is int
    for other in (1.0, True, "1", torch.tensor(1.5), torch.tensor(True)):  # the join's check refuses them (BAD_REQUEST, naming the field)
        assert resolve("k", other, 2, 1).rank is other


def test_group_none_is_a_single_rank_of_a_key_of_its_own(monkeypatch):
    """The seeds' TP=1 form: group None raised TypeError, which no engine's fallback catches."""
    monkeypatch.setattr(groupkey, "_joined", {})
    first, second = resolve(None, None, None, 1), resolve(None, 0, 1, 1)
    remember(first)
    assert groupkey._joined == {}, "a key nobody names again is not remembered: one entry per buffer, for life"
    assert (first.rank, first.npes) == (second.rank, second.npes) == (0, 1)
    assert first.key != second.key and first.key.startswith("single-"), (first, second)
    for rank, npes in ((1, None), (None, 2)):
        with pytest.raises(ValueError, match="group None is a single rank"):
            resolve(None, rank, npes, 1)


def test_a_gpu_device_against_a_daemon_serving_host_memory_says_so():
    """The worker was told to install cuda-bindings, which only moved the failure to the daemon."""
    torch = pytest.importorskip("torch")
    from peerd.backends import BackendUnavailable
    from peerd_client.views import backend_for

    with pytest.raises(BackendUnavailable, match=r"the daemon serves host memory \(--backend host\), no GPU memory "
                                                 r"for cuda:0: pass device=torch.device\('cpu'\)"):
        backend_for(torch.device("cuda", 0), "host")
    assert backend_for(torch.device("cuda", 0), "cuda") == "cuda" and backend_for(torch.device("cpu"), "cuda") == "host"


def test_a_process_outside_a_process_group_is_told_so_not_that_its_group_is_an_int():
    """dist.new_group gives a process outside the group GroupMember.NON_GROUP_MEMBER (an int)."""
    import torch.distributed as dist

    with pytest.raises(ValueError, match="this process is not a member of that process group"):
        resolve(dist.GroupMember.NON_GROUP_MEMBER, None, None, 1.0)
    with pytest.raises(TypeError, match="not int"):
        resolve(5, None, None, 1.0)


def _keys_of_a_group_made_twice(rank: int, port: int, out) -> None:
    """One rank: the key of a process group, then of the group made again over the same store (after
    destroy_process_group and init_process_group), where rank 0 comes after its peer gave up once."""
    import datetime
    import time

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=30))
    c10d._get_process_group_store = lambda pg: store  # both groups' store: the same prefix, so the same keys

    class Group:
        group_name = "0"  # torch names the default group "0" each time it is made

    keys = []
    for again in (False, True):
        if again and rank == 0:
            time.sleep(1.5)
        elif again:  # gives up on rank 0 once, then asks again: counted out, it counts itself in again
            with pytest.raises(groupkey.MonoUnsupported, match="rank 0 of process group '0' did not give"):
                groupkey._process_group_key(Group(), rank, 2, 0.5)
        keys.append(groupkey._process_group_key(Group(), rank, 2, 20.0))
    out.put((rank, keys))


def test_a_process_group_made_again_over_its_store_gets_a_key_of_its_own_on_every_rank():
    """The earlier group's key still lies in the store: a rank that came before rank 0 read it back and
    waited alone in the old group's sets (real processes, a real TCPStore; gloo itself is not needed)."""
    import multiprocessing
    import socket

    pytest.importorskip("torch")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    ranks = [ctx.Process(target=_keys_of_a_group_made_twice, args=(r, port, out)) for r in (0, 1)]
    for p in ranks:
        p.start()
    try:
        keys = dict(out.get(timeout=60) for _ in ranks)
    finally:
        for p in ranks:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert keys[0] == keys[1] and keys[0][0] != keys[0][1], keys


def test_a_rank_that_contradicts_its_process_group_is_told_its_place_or_the_plain_error_where_rank_0_never_came(
        monkeypatch):
    """Contradicted carries the place the group names, for the peers to be told (its key needs rank 0's
    token); where rank 0 never gives it, the mistake is the error, not a TIMEOUT that hid it."""
    import datetime
    import socket
    import time

    pytest.importorskip("torch")
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=30))
    monkeypatch.setattr(c10d, "_get_process_group_store", lambda pg: store)
    monkeypatch.setattr(groupkey, "_pg_keys", {})

    class Group:  # a process group as resolve() reads one: its rank and size from torch.distributed
        group_name, rank, size = "7", None, None

    place = {"rank": 1}
    monkeypatch.setattr(dist, "get_rank", lambda group: place["rank"])
    monkeypatch.setattr(dist, "get_world_size", lambda group: 2)
    began = time.monotonic()
    with pytest.raises(ValueError, match=r"rank=0, npes=2 contradict the process group \(rank 1 of 2\)") as plain:
        resolve(Group(), 0, 2, 0.5)
    assert type(plain.value) is ValueError and time.monotonic() - began >= 0.5, "waited for the key, then the error"
    place["rank"] = 0  # rank 0 gives the key itself
    with pytest.raises(groupkey.Contradicted) as told:
        resolve(Group(), 1, None, 5.0)
    assert told.value.member.rank == 0 and told.value.member.npes == 2 and told.value.member.key.startswith("pg-7-")
