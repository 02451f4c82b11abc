"""One worker rank, run as its own process by the integration tests.

    python tests/rank.py SCENARIO --rank R --npes N [options]

Prints one JSON line: what the rank saw, or the error it got (type, code,
message). Every scenario uses only the public peerd_client API.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time


def peek(address: int, offset: int) -> int:
    return ctypes.c_uint8.from_address(address + offset).value


def exchange(args) -> dict:
    """Each rank fills its buffer with rank+1; every rank reads every peer."""
    from peerd_client import PeerBuffer, tp_agree

    buf = PeerBuffer(args.nbytes, args.group, args.rank, args.npes, name=args.name)
    zero = bool((buf.bytes == 0).all())
    buf.bytes.fill_(args.rank + 1)
    assert tp_agree(True, args.group), "barrier failed"  # every rank has written
    seen = [[peek(p, 0), peek(p, args.nbytes - 1)] for p in buf.pointers]
    result = {
        "zero": zero,
        "seen": seen,
        "local_is_mine": buf.local == buf.pointers[args.rank],
        "addresses": buf.addresses.tolist(),
        "addresses_dtype": str(buf.addresses.dtype),
        "nbytes": buf.nbytes,
        "npes": buf.npes,
        "rank": buf.rank,
    }
    assert tp_agree(True, args.group), "barrier failed"  # every rank has read
    buf.close()
    buf.close()
    result["closed"] = buf.local == 0 and buf.bytes is None and buf.pointers == []
    return result


def agree(args) -> dict:
    from peerd_client import tp_agree

    votes = [v == "1" for v in args.votes.split(",")]
    return {
        "results": [
            tp_agree(v, args.group, args.rank, args.npes, timeout=args.timeout) for v in votes
        ]
    }


def agree_npes(args) -> dict:
    """Hold a set of the group, then two rounds: the first as one of --agree-npes (a wrong npes on one rank)
    and with --first-timeout (a bad one), the second as the group's npes with --timeout. Each round's verdict
    or error, and how long it took."""
    from peerd_client import MonoUnsupported, PeerBuffer, tp_agree

    rounds = []
    with PeerBuffer(args.nbytes, args.group, args.rank, args.npes):
        first_timeout = args.timeout if args.first_timeout is None else float(args.first_timeout)
        for npes, timeout in ((args.agree_npes or args.npes, first_timeout), (args.npes, args.timeout)):
            start = time.monotonic()
            try:
                verdict = tp_agree(True, args.group, args.rank, npes, timeout=timeout)
            except MonoUnsupported as err:
                verdict = {"code": err.code, "message": str(err)}
            rounds.append({"verdict": verdict, "seconds": time.monotonic() - start})
    return {"rounds": rounds}


def join(args) -> dict:
    """Join and hold the buffer set for --hold seconds (a negative hold: until a line on stdin)."""
    from peerd_client import PeerBuffer

    with PeerBuffer(args.nbytes, args.group, args.rank, args.npes, args.device, name=args.name,
                    timeout=args.timeout, flags=args.flags) as buf:
        if args.hold < 0:
            print("READY", flush=True)
            sys.stdin.readline()
        else:
            time.sleep(args.hold)
        return {"pointers": len(buf.pointers)}


def process_group(args) -> dict:
    """The seed-001 form: PeerBuffer(nbytes, process_group), over a gloo group."""
    import torch.distributed as dist

    from peerd_client import PeerBuffer, tp_agree

    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=args.rank, world_size=args.npes)
    group = dist.new_group(list(range(args.npes)), backend="gloo")
    a = PeerBuffer(args.nbytes, group)
    b = PeerBuffer(args.nbytes, group, name="second")
    a.bytes.fill_(args.rank + 1)
    b.bytes.fill_(100 + args.rank)
    ok = tp_agree(True, group)
    seen = [peek(p, 0) for p in a.pointers] + [peek(p, 0) for p in b.pointers]
    assert tp_agree(True, group)
    key = a.group_key
    a.close()
    b.close()
    dist.destroy_process_group()
    return {"agreed": ok, "seen": seen, "rank": a.rank, "npes": a.npes, "key": key}


def process_group_without_rank_0(args) -> dict:
    """Rank 0 makes the process group but never calls peerd: the others' PeerBuffer and tp_agree end at
    their timeout, with peerd's error and False, not torch's store error."""
    import torch.distributed as dist

    from peerd_client import MonoUnsupported, PeerBuffer, tp_agree

    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=args.rank, world_size=args.npes)
    if args.rank == 0:
        time.sleep(args.hold)
        return {}
    try:
        PeerBuffer(args.nbytes, dist.group.WORLD, device="cpu", timeout=args.timeout)
    except MonoUnsupported as err:
        raised = {"code": err.code, "message": str(err)}
    return {"raised": raised, "agreed": tp_agree(True, dist.group.WORLD, timeout=args.timeout)}


def _told_or_raised(args, group, claimed: dict, **buffer) -> dict:
    """A second rendezvous and a round in ``group`` with rank=/npes= as ``claimed``: what each raised or
    answered, and when."""
    from peerd_client import MonoUnsupported, PeerBuffer, tp_agree

    out = {}
    began = time.monotonic()
    try:
        PeerBuffer(args.nbytes, group, **claimed, **buffer, device="cpu", timeout=args.timeout)
    except (MonoUnsupported, ValueError) as err:
        out["buffer"] = {"value_error": isinstance(err, ValueError), "code": getattr(err, "code", None),
                         "message": str(err)}
    out["buffer_after_s"] = time.monotonic() - began
    began = time.monotonic()
    try:
        out["agreed"] = tp_agree(True, group, rank=claimed.get("rank"), npes=claimed.get("npes"),
                                 timeout=args.timeout)
    except ValueError as err:
        out["agree_raised"] = str(err)
    out["agree_after_s"] = time.monotonic() - began
    return out


def process_group_contradicted(args) -> dict:
    """The last rank passes a rank= that contradicts its process group, to PeerBuffer and to tp_agree: it
    raises ValueError each time, and its peer hears at once (GROUP_FAILED, then a False round)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=args.rank, world_size=args.npes)
    wrong = args.rank == args.npes - 1
    out = _told_or_raised(args, dist.group.WORLD, {"rank": 0, "npes": args.npes} if wrong else {})
    dist.destroy_process_group()
    return out


def string_key_contradicted(args) -> dict:
    """Both ranks hold a set of a string key; then the last rank passes a lone rank= that contradicts the
    place it holds, to a second set's PeerBuffer and to tp_agree: it raises ValueError each time, and its
    peer hears at once (GROUP_FAILED, then a False round)."""
    from peerd_client import PeerBuffer

    held = PeerBuffer(args.nbytes, args.group, args.rank, args.npes, device="cpu")
    wrong = args.rank == args.npes - 1
    out = _told_or_raised(args, args.group, {"rank": 0} if wrong else {"rank": args.rank, "npes": args.npes},
                          name="second")
    held.close()
    return out


def dropped(args) -> dict:
    """Build a buffer, then drop it without close(): collection must release it,
    even when the collection runs while this thread is inside a call (it holds
    the connection's lock then: a finalizer that waited for it would hang)."""
    import gc

    from peerd_client import PeerBuffer, tp_agree
    from peerd_client.connection import connection

    buf = PeerBuffer(args.nbytes, args.group, args.rank, args.npes)
    buf.cycle = buf  # only the cycle collector can free it
    del buf
    lock = connection()._lock
    assert lock.acquire()  # as if a garbage-collection pass ran inside call()
    try:
        gc.collect()
    finally:
        lock.release()
    assert tp_agree(True, args.group, args.rank, args.npes)  # every rank dropped its buffer
    listing = connection().call("ls", {})["groups"]
    return {"left": [g for g in listing if g["group"] == args.group]}


def kept(args) -> dict:
    """Fill a buffer, print READY, and read it back after a line on stdin (the test stops the daemon
    meanwhile): a daemon that stops leaves the memory of live workers as it is."""
    from peerd_client import PeerBuffer

    buf = PeerBuffer(args.nbytes, args.group, args.rank, args.npes)
    buf.bytes.fill_(args.rank + 7)
    print("READY", flush=True)
    sys.stdin.readline()
    return {"kept": bool((buf.bytes == args.rank + 7).all())}


def outlived(args) -> dict:
    """Keep only the buffer's bytes view: the buffer (and the mapping under the view) lives as long as
    the view, and is released once the view goes too."""
    import gc

    from peerd_client import PeerBuffer, tp_agree
    from peerd_client.connection import connection

    def listed() -> list:
        return [g for g in connection().call("ls", {})["groups"] if g["group"] == args.group]

    view = PeerBuffer(args.nbytes, args.group, args.rank, args.npes).bytes
    gc.collect()
    view.fill_(args.rank + 1)  # where collection had unmapped it: SIGSEGV
    filled = bool((view == args.rank + 1).all())
    assert tp_agree(True, args.group, args.rank, args.npes)  # every rank has looked
    held = listed()
    del view
    gc.collect()
    assert tp_agree(True, args.group, args.rank, args.npes)  # every rank dropped its view
    return {"filled": filled, "held": len(held), "left": listed()}


def close_race(args) -> dict:
    """One thread votes in a loop on a one-rank group while another closes its buffer, 100 times: whatever
    the voter meets is an answer or a MonoUnsupported (an AttributeError or a bare StopIteration was not)."""
    import threading

    from peerd_client import MonoUnsupported, PeerBuffer, tp_agree

    unexpected = []
    for i in range(100):
        group, stop = f"{args.group}-{i}", threading.Event()
        buf = PeerBuffer(4096, group, 0, 1)

        def vote() -> None:
            while not stop.is_set():
                try:
                    tp_agree(True, group, timeout=2)
                except MonoUnsupported:
                    return
                except Exception as err:
                    unexpected.append(f"{type(err).__name__}: {err}")
                    return

        voter = threading.Thread(target=vote)
        voter.start()
        time.sleep(0.002)
        buf.close()
        stop.set()
        voter.join()
    return {"unexpected": unexpected}


def no_torch(args) -> dict:
    """PeerBuffer where torch cannot be imported; tp_agree must still work."""
    sys.modules["torch"] = None  # makes `import torch` raise ImportError
    from peerd_client import PeerBuffer, tp_agree

    agreed = tp_agree(True, args.group, args.rank, args.npes)
    try:
        PeerBuffer(args.nbytes, args.group, args.rank, args.npes)
    except ImportError as err:
        return {"agreed": agreed, "import_error": str(err)}
    return {"agreed": agreed, "import_error": None}


def cache(args) -> dict:
    """Opening a chunk this process already mapped must reuse the mapping."""
    from peerd_client import PeerBuffer
    from peerd_client.mappings import mappings

    buf = PeerBuffer(args.nbytes, args.group, args.rank, args.npes)
    mapper, opened = buf._mapper, []
    real_open = mapper.open
    mapper.open = lambda handle, size, fd=None: opened.append(handle) or real_open(handle, size, fd)
    bases = [mappings.open(mapper, key, 0) for key in buf._chunks]
    span = mappings._open[buf._chunks[0]].size
    same = len(set(bases)) == 1 and all(0 <= p - bases[0] < span for p in buf.pointers)  # one chunk holds them
    for key in buf._chunks:
        mappings.close(key)
    mapped_while_open = len(mappings)
    buf.close()
    return {"same": same, "driver_opens": len(opened), "mapped_while_open": mapped_while_open,
            "mapped_after_close": len(mappings)}


def given_back(args) -> dict:
    """Build and close a one-rank buffer five times on a daemon that gives each emptied chunk back at once:
    how many chunks this process maps then, and how many host chunks its address space holds."""
    from peerd_client import PeerBuffer
    from peerd_client.mappings import mappings

    for i in range(5):
        PeerBuffer(args.nbytes, args.group, 0, 1, name=f"cycle-{i}").close()
    with open("/proc/self/maps") as maps:
        chunks = sum("/memfd:peerd " in line for line in maps)  # the host backend's chunks (peerd.backends.host)
    return {"mapped": len(mappings), "chunk_mappings": chunks}


def stale_release(args) -> dict:
    """A release of this rank's first set delivered again (a retry after a timeout, a restarted daemon)
    while it holds the next set of the same key: it must end nothing, and the new set's memory stays."""
    from peerd_client import MonoUnsupported, PeerBuffer
    from peerd_client.connection import connection

    first = PeerBuffer(args.nbytes, args.group, args.rank, args.npes, name=args.name)
    stale = {"group": first.group_key, "name": args.name, "rank": args.rank, "set": first._set}
    first.close()
    second = PeerBuffer(args.nbytes, args.group, args.rank, args.npes, name=args.name)
    second.bytes.fill_(7)
    try:
        connection().call("release", stale)
        refused = ""
    except MonoUnsupported as err:
        refused = err.code
    out = {"refused": refused, "kept": int(second.bytes[0]), "new_set": second._set != stale["set"]}
    second.close()
    return out


def numpy_sizes(args) -> dict:
    """A PeerBuffer sized and placed with numpy integers, as engines compute them."""
    import numpy as np

    from peerd_client import PeerBuffer, tp_agree

    with PeerBuffer(np.prod([args.nbytes // 8]) * np.dtype(np.float64).itemsize, args.group, np.int64(args.rank),
                    np.int32(args.npes), args.device) as buf:
        return {"nbytes": buf.nbytes, "types": [type(v).__name__ for v in (buf.nbytes, buf.rank, buf.npes)],
                "agreed": tp_agree(True, args.group)}


def single(args) -> dict:
    """The seeds' single rank (TP=1): group None, two buffers at once, and tp_agree of None."""
    from peerd_client import PeerBuffer, tp_agree

    with PeerBuffer(args.nbytes, None, device=args.device) as first, PeerBuffer(args.nbytes, None, 0, 1,
                                                                                args.device) as second:
        return {"keys": [first.group_key, second.group_key], "npes": [first.npes, second.npes],
                "zero": bool((first.bytes == 0).all() and (second.bytes == 0).all()),
                "apart": first.local != second.local, "agreed": tp_agree(True, None)}


def bad_timeouts(args) -> dict:
    """tp_agree with deadlines no wait can honour, on the page (a PeerBuffer of the group) and through
    the daemon (a group of explicit rank and npes): each path's refusal code, and a good round after."""
    from peerd_client import MonoUnsupported, PeerBuffer, tp_agree

    def codes(group, **where) -> list:
        out = []
        for bad in (float("nan"), float("inf"), -1.0, "5"):
            try:
                out.append(tp_agree(True, group, timeout=bad, **where))
            except MonoUnsupported as err:
                out.append(err.code)
        return out + [tp_agree(True, group, timeout=5, **where)]

    buf = PeerBuffer(args.nbytes, args.group, 0, 1)
    on_page = codes(args.group)
    buf.close()
    refused = []
    for bad in (float("nan"), float("inf"), -1.0, "5"):
        try:
            PeerBuffer(args.nbytes, args.group + "-buf", 0, 1, timeout=bad)
        except MonoUnsupported as err:
            refused.append(err.code)
    return {"page": on_page, "messages": codes(args.group + "-msg", rank=0, npes=1), "buffer": refused}


def queued(args) -> dict:
    """A set built while this rank's stream is busy: its address copy is still queued behind the work,
    and a kernel on another stream must still read every rank's address, not what the memory held."""
    import torch

    from peerd_client import PeerBuffer

    warm = PeerBuffer(args.nbytes, args.group, args.rank, args.npes, name="warm")  # chunk and page area mapped
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time on the current stream
    buf = PeerBuffer(args.nbytes, args.group, args.rank, args.npes, name="queued")
    pending = buf._addresses_copied is not None and not buf._addresses_copied.query()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        seen = buf.addresses.clone()
    side.synchronize()
    out = {"pending": pending, "seen": seen.tolist(), "pointers": buf.pointers}
    buf.close()
    captured = PeerBuffer(args.nbytes, args.group, args.rank, args.npes, name="captured")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # addresses first read inside a capture: no event call may run there
        copy = captured.addresses.clone()
    graph.replay()
    torch.cuda.synchronize()
    out.update(captured=copy.tolist(), captured_pointers=captured.pointers)
    captured.close()
    warm.close()
    return out


def captured_close(args) -> dict:
    """Drop buffers while this thread captures a CUDA graph in torch's default (global) mode: two
    collected inside the capture (one a whole chunk of its own, unmapped at close), one collected by
    another thread meanwhile, where a device synchronize would break the capture as well. The graph
    must replay, the sets stay held, and this rank's next PeerBuffer, outside the capture, releases them."""
    import gc
    import threading

    import torch

    from peerd_client import PeerBuffer, tp_agree
    from peerd_client.connection import connection

    names = ("small", "whole", "elsewhere")

    def held() -> list[list[int]]:
        listing = connection().call("ls", {})["groups"]
        return [next((g["held"] for g in listing if g["group"] == args.group and g["name"] == n), []) for n in names]

    small = PeerBuffer(args.nbytes, args.group, args.rank, args.npes, name="small")
    whole = PeerBuffer(args.big, args.group, args.rank, args.npes, name="whole")
    elsewhere = [PeerBuffer(args.nbytes, args.group, args.rank, args.npes, name="elsewhere")]
    small.cycle, whole.cycle = small, whole  # only the cycle collector frees them: inside the capture below
    capturing, collected = threading.Event(), threading.Event()

    def drop_elsewhere() -> None:
        capturing.wait(30)
        elsewhere.clear()  # its last reference: collected here, in this thread
        collected.set()

    dropper = threading.Thread(target=drop_elsewhere)
    dropper.start()
    x = torch.ones(1024, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x * 2
        del small, whole
        gc.collect()
        capturing.set()
        collected.wait(30)
        z = y + 1
    dropper.join()
    graph.replay()
    torch.cuda.synchronize()
    out = {"replayed": z[0].item(), "held_after_capture": held()}
    assert tp_agree(True, args.group, args.rank, args.npes)  # every rank's capture is over
    later = PeerBuffer(args.nbytes, args.group, args.rank, args.npes, name="later")
    out["held_after_next_buffer"] = held()
    later.close()
    return out


def beside_stopped(args) -> dict:
    """Hold a buffer on a control page and, after each line on stdin, vote once (``tp_agree``) and say
    whether the group is aborted and why; rank 1 is the one the test stops (SIGSTOP) meanwhile, and
    prints NEXT before it reads each line."""
    from peerd_client import MonoUnsupported, PeerBuffer, tp_agree

    buf = PeerBuffer(args.nbytes, args.group, args.rank, args.npes)
    print("READY", flush=True)
    out = {"page": buf.abort_source is not None, "pid": os.getpid()}
    for step in ("short", "long"):
        if args.rank == 1:
            print("NEXT", flush=True)
        sys.stdin.readline()
        started = time.monotonic()
        agreed = tp_agree(True, args.group, timeout=args.timeout)
        out[step] = {"agreed": agreed, "waited": round(time.monotonic() - started, 3), "ended_at": time.monotonic(),
                     "aborted": None}
        try:
            buf.check()
        except MonoUnsupported as err:
            out[step]["aborted"] = str(err)
    buf.close()
    return out


def stops_before_its_vote(args) -> dict:
    """Build a PeerBuffer; rank 1 stops itself (SIGSTOP) between its join's answer and its commit vote."""
    import signal

    import torch  # noqa: F401  (loaded before the clock starts: the grace, not imports, is measured)

    from peerd_client import MonoUnsupported, PeerBuffer, pagelink

    if args.rank == 1:
        vote = pagelink.GroupLink.commit

        def stopped_first(link, timeout):
            os.kill(os.getpid(), signal.SIGSTOP)
            return vote(link, timeout)
        pagelink.GroupLink.commit = stopped_first
    began = time.monotonic()
    try:
        PeerBuffer(args.nbytes, args.group, args.rank, args.npes, timeout=args.timeout)
    except MonoUnsupported as err:
        return {"raised": str(err), "code": err.code, "after_s": time.monotonic() - began}
    return {"raised": None}


def sealed(args) -> dict:
    """Hold a buffer, fetch the set's fds again as its member, and try to resize or reseal a peer's."""
    import errno
    import fcntl

    from peerd.fdchannel import fetch_fds
    from peerd.paths import fd_socket_path
    from peerd_client import PeerBuffer, tp_agree
    from peerd_client.connection import connection

    def refusal(attempt) -> str | None:
        try:
            attempt()
        except OSError as err:
            return errno.errorcode[err.errno]
        return None

    buf = PeerBuffer(args.nbytes, args.group, args.rank, args.npes, name=args.name)
    slot = {"group": args.group, "name": args.name, "rank": args.rank}
    handles, fds = fetch_fds(fd_socket_path(connection().path), slot, 10)
    peer = fds[(args.rank + 1) % args.npes]
    size = os.fstat(peer).st_size
    result = {
        "same_handles": handles == buf._handles,
        "shrink": refusal(lambda: os.ftruncate(peer, 0)),
        "grow": refusal(lambda: os.ftruncate(peer, size * 2)),
        "seal_writes": refusal(lambda: fcntl.fcntl(peer, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)),
        "size_kept": os.fstat(peer).st_size == size,
    }
    for fd in set(fds):  # ranks in one chunk share its fd
        os.close(fd)
    assert tp_agree(True, args.group), "barrier failed"  # every rank tried before any releases
    buf.close()
    return result


def call(args) -> dict:
    """One raw request through the client's connection: --op and --body (JSON), waiting --timeout if given."""
    from peerd_client.connection import connection

    deadline = {"timeout": args.timeout} if args.timeout else {}
    return {"reply": connection().call(args.op, json.loads(args.body), **deadline)}


STEPS = ("before_join", "in_rendezvous", "after_handles", "in_agreement", "after_ready", "in_close")
#: steps of the page path only: right after its commit vote on the set's control page
PAGE_STEPS = ("after_page_vote",)


def chaos(args) -> dict:
    """Join, agree, close; with --die-at STEP this rank SIGKILLs itself at that step.

    in_rendezvous is the test's to kill (it waits for the join to be logged);
    in_agreement dies while its peers already wait in tp_agree.
    """
    import signal
    import threading

    import torch  # noqa: F401  (imported here so its start-up is not timed below)

    import peerd_client.buffer as buffer_module
    from peerd_client import MonoUnsupported, PeerBuffer, tp_agree

    def die(*_):
        os.kill(os.getpid(), signal.SIGKILL)

    if args.die_at == "before_join":
        die()
    if args.die_at in ("after_handles", "in_close"):
        cache = buffer_module.mappings
        patched = "open" if args.die_at == "after_handles" else "close"
        setattr(cache, patched, die)
    if args.die_at == "after_page_vote":
        vote = buffer_module.GroupLink.commit

        def vote_then_die(link, timeout):
            vote(link, timeout)
            die()

        buffer_module.GroupLink.commit = vote_then_die
    start, stage, agreed = time.monotonic(), "join", None
    try:
        buf = PeerBuffer(args.nbytes, args.group, args.rank, args.npes, timeout=args.timeout)
        stage = "agree"
        if args.die_at == "in_agreement":
            threading.Timer(1.0, die).start()
            time.sleep(30)
        page = buf.abort_address != 0  # the group agrees on its control page
        agreed = tp_agree(True, args.group, timeout=args.timeout)
        if args.die_at == "after_ready":
            die()
        stage = "close"
        buf.close()
        stage = "done"
    except MonoUnsupported as err:
        return {"stage": stage, "code": err.code, "message": str(err), "elapsed": time.monotonic() - start}
    return {"stage": stage, "agreed": agreed, "page": page, "elapsed": time.monotonic() - start}


def restart(args) -> dict:
    """Agree, wait for the test to restart the daemon, then call again twice."""
    from peerd_client import DaemonUnavailable, tp_agree

    first = tp_agree(True, args.group, 0, 1)
    print("READY", flush=True)
    sys.stdin.readline()
    try:
        tp_agree(True, args.group, 0, 1)
        second = "no error"
    except DaemonUnavailable as err:
        second = str(err)
    return {"first": first, "second": second, "third": tp_agree(True, args.group, 0, 1)}


def forked(args) -> dict:
    """A forked child must not use its parent's buffer nor vote as its rank, and may open its own connection."""

    from peerd_client import ForkedProcessError, MonoUnsupported, PeerBuffer, tp_agree
    from peerd_client.connection import connection

    buf = PeerBuffer(args.nbytes, args.group, args.rank, args.npes)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(read)
        said = {}
        try:
            with open("/proc/self/maps") as maps:  # the parent's chunk and control page area stay with it
                said["mapped"] = [" ".join(line.split()[5:]) for line in maps if "/memfd:peerd" in line or "/memfd:controlpage" in line]
            try:
                buf.addresses
                said["verdict"] = "no error"
            except ForkedProcessError as err:
                said["verdict"] = str(err)
            said["own"] = tp_agree(True, f"{args.group}-child{args.rank}", 0, 1)  # its own connection
            try:
                said["agree"] = tp_agree(False, args.group)  # the membership it inherited is not its own
            except ForkedProcessError as err:
                said["agree"] = str(err)
            try:  # past the client's guard, the daemon refuses it too
                body = {"group": args.group, "rank": args.rank, "npes": args.npes, "ok": False, "timeout": 30}
                said["vote"] = connection().call("agree", body, timeout=40)
            except MonoUnsupported as err:
                said["vote"] = err.code
            del buf  # collection in the child must not release the parent's rank
        except Exception as err:
            said["error"] = repr(err)
        finally:
            os.write(write, json.dumps(said).encode())
            os._exit(0)
    os.close(write)
    _, status = os.waitpid(child, 0)
    child_says = json.loads(os.read(read, 65536))
    agreed = tp_agree(True, args.group)  # the parent still holds its rank and connection
    pointers = len(buf.pointers)
    buf.close()
    return {"child": child_says, "child_status": status, "agreed": agreed, "pointers": pointers}


def patient(args) -> dict:
    """Connect and print READY; join after a line on stdin, print the OUTCOME, then close after another line.

    Meanwhile the test reloads or stops the daemon, or stops this rank.
    """
    from peerd_client import MonoUnsupported, PeerBuffer
    from peerd_client.connection import connection

    connection()
    print("READY", flush=True)
    sys.stdin.readline()
    buf = None
    try:
        buf = PeerBuffer(args.nbytes, args.group, args.rank, args.npes, timeout=args.timeout)
        outcome = {"joined": True}
    except MonoUnsupported as err:
        outcome = {"type": type(err).__name__, "code": err.code, "message": str(err)}
    print("OUTCOME " + json.dumps(outcome), flush=True)
    sys.stdin.readline()
    if buf is not None:
        buf.close()
    return outcome


def interruptible(args) -> dict:
    """Connect and print READY; join after a line on stdin. Ctrl-C (SIGINT from the test) while it waits is
    caught, as an interactive session would: print OUTCOME, then after another line join again and print
    OUTCOME, and close after a third."""
    import signal

    from peerd_client import MonoUnsupported, PeerBuffer
    from peerd_client.connection import connection

    # Ctrl-C raises KeyboardInterrupt, as in a terminal, even where the test runner was started in the
    # background by a shell without job control (its children inherit SIGINT ignored)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    connection()
    print("READY", flush=True)
    outcomes, buf = [], None
    for _ in range(2):
        sys.stdin.readline()
        try:
            buf = PeerBuffer(args.nbytes, args.group, args.rank, args.npes, timeout=args.timeout)
            outcome = {"joined": True}
        except KeyboardInterrupt:
            outcome = {"interrupted": True}
        except MonoUnsupported as err:
            outcome = {"type": type(err).__name__, "code": err.code, "message": str(err)}
        outcomes.append(outcome)
        print("OUTCOME " + json.dumps(outcome), flush=True)
    sys.stdin.readline()
    if buf is not None:
        buf.close()
    return {"outcomes": outcomes}


def ctrl_c_storm(args) -> dict:
    """Hold a buffer, then make calls for --hold seconds while SIGALRM raises KeyboardInterrupt at random
    instants, as Ctrl-C's would: whatever instant one lands at, the connection must not stay held (every
    later call waited out its deadline, and the release at close was never sent)."""
    import random
    import signal
    import threading
    import time

    from peerd_client import PeerBuffer
    from peerd_client.connection import connection

    buf = PeerBuffer(args.nbytes, args.group, args.rank, args.npes, "cpu")
    conn = connection()

    def interrupt(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGALRM, interrupt)
    interrupts, end = 0, time.monotonic() + args.hold
    while time.monotonic() < end:
        try:
            signal.setitimer(signal.ITIMER_REAL, random.uniform(0.00002, 0.0004))
            while time.monotonic() < end:  # (an interrupt swallowed somewhere must not keep it here)
                conn.call("hello", {}, timeout=2)
        except KeyboardInterrupt:
            interrupts += 1
    while True:  # the last timer may still fire: ignored from here on, however late it comes
        try:
            signal.signal(signal.SIGALRM, signal.SIG_IGN)
            break
        except KeyboardInterrupt:
            interrupts += 1
    signal.setitimer(signal.ITIMER_REAL, 0)
    taken = []

    def take():  # from another thread, which a lock left held by this one would keep out
        taken.append(conn._lock.acquire(timeout=5))
        if taken[0]:
            conn._lock.release()

    thread = threading.Thread(target=take)
    thread.start()
    thread.join()
    buf.close()
    return {"interrupts": interrupts, "free": taken[0]}


def released_behind_a_busy_thread(args) -> dict:
    """Hold a buffer of --group (one rank), print READY; after a line on stdin (the test stalled the daemon
    past the heartbeat meanwhile, so this connection is lost), another thread waits in a tp_agree nobody
    answers (--timeout) on a new connection, and the buffer is closed: its release, which the lost
    connection could not send, is queued and must go out while that thread still waits. Prints CLOSED."""
    import threading

    from peerd_client import DaemonUnavailable, PeerBuffer, tp_agree

    buf = PeerBuffer(args.nbytes, args.group, 0, 1, "cpu")
    print("READY", flush=True)
    sys.stdin.readline()
    verdicts = []

    def wait_in_an_agreement() -> None:
        for _ in range(2):  # the first call hears that the connection was lost
            try:
                verdicts.append(tp_agree(True, f"{args.group}-alone", 0, 2, timeout=args.timeout))
                return
            except DaemonUnavailable:
                continue

    waiting = threading.Thread(target=wait_in_an_agreement)
    waiting.start()
    time.sleep(1.0)  # inside its call: the new connection is held
    buf.close()
    print("CLOSED", flush=True)
    waiting.join()
    return {"verdicts": verdicts}


def closes_behind_a_stuck_loop(args) -> dict:
    """Three buffers of --group (one rank); print READY, then after a line on stdin (the test stalled the
    daemon's loop meanwhile) close them one after another: how long each close() took."""
    from peerd_client import PeerBuffer

    bufs = [PeerBuffer(args.nbytes, args.group, 0, 1, "cpu", name=f"n{i}") for i in range(3)]
    print("READY", flush=True)
    sys.stdin.readline()
    took = []
    for buf in bufs:
        start = time.monotonic()
        buf.close()
        took.append(time.monotonic() - start)
    return {"took": took}


def connections(args) -> dict:
    """Open --hold connections to the daemon one after another, each greeted (or refused) and closed: the
    codes of their hellos' refusals."""
    from peerd.paths import default_socket
    from peerd_client import MonoUnsupported
    from peerd_client.connection import Connection

    codes = []
    for _ in range(int(args.hold)):
        try:
            Connection(default_socket()).close()
            codes.append(None)
        except MonoUnsupported as err:
            codes.append(err.code)
    return {"codes": codes}


def join_alone(args):
    """A thread waiting in a join that nobody answers (a group of its own, --timeout), inside its call once
    this returns; what the join raised lands in the dict."""
    import threading

    from peerd_client import MonoUnsupported, PeerBuffer

    lonely: dict = {}

    def wait_alone() -> None:
        try:
            PeerBuffer(args.nbytes, f"{args.group}-lonely", 0, 2, timeout=args.timeout)
        except MonoUnsupported as err:
            lonely["code"] = err.code

    waiting = threading.Thread(target=wait_alone)
    waiting.start()
    time.sleep(0.5)  # inside its call: the connection is held
    return waiting, lonely


def held_by_rank_1(args):
    """A buffer of a 2-rank --group: rank 0 gets it; rank 1 prints READY, holds it until a line on
    stdin, closes it and gets None."""
    from peerd_client import PeerBuffer

    buf = PeerBuffer(args.nbytes, args.group, args.rank, 2)
    if args.rank == 0:
        return buf
    print("READY", flush=True)
    sys.stdin.readline()
    buf.close()
    return None


def dropped_while_busy(args) -> dict:
    """Rank 0 of --group drops its buffer (--op drop) or closes it (--op close) while another thread of it
    waits in a join that nobody answers (a group of its own, --timeout): prints DROPPED once the finalizer
    ran or close() returned, then waits for that join. Rank 1 holds its buffer until a line on stdin."""
    import gc

    buf = held_by_rank_1(args)
    if buf is None:
        return {}
    waiting, lonely = join_alone(args)
    start = time.monotonic()
    if args.op == "close":
        buf.close()
    else:
        del buf
        gc.collect()
    dropped = time.monotonic() - start
    still_waiting = waiting.is_alive()
    print("DROPPED", flush=True)
    waiting.join()
    return {"dropped_s": dropped, "other_thread_still_waiting": still_waiting, "lonely": lonely}


def dropped_in_failed_call(args) -> dict:
    """Rank 0 of --group drops its buffer, and a collection pass runs inside a call of this thread that
    then fails (a bad request): the finalizer leaves its release to that call, which must send it
    however it ends. Prints DROPPED, then waits for a line on stdin. Rank 1 holds until a line on stdin."""
    import gc

    import peerd_client.connection as pc
    from peerd_client import MonoUnsupported

    buf = held_by_rank_1(args)
    if buf is None:
        return {}
    buf.cycle = buf  # only the cycle collector can free it
    del buf
    checked = pc.validate_request

    def collect_then_check(op, body):  # a collection pass that an allocation inside the call set off
        gc.collect()
        return checked(op, body)

    pc.validate_request = collect_then_check
    try:
        pc.connection().call("agree", {"group": args.group, "rank": -1, "npes": 2, "ok": True})
        failed = None
    except MonoUnsupported as err:
        failed = err.code
    finally:
        pc.validate_request = checked
    print("DROPPED", flush=True)
    sys.stdin.readline()
    return {"failed": failed}


def vote_behind_busy_thread(args) -> dict:
    """A thread waits in a vote nobody else joins (timeout 9); this one votes in another group with
    timeout 1 (6 s with the client's grace): its call waited behind the other's whole wait, and now ends at its
    own deadline."""
    import threading

    from peerd_client import MonoUnsupported, tp_agree

    lonely: dict = {}

    def wait_alone() -> None:
        lonely["verdict"] = tp_agree(True, f"{args.group}-lonely", 0, 2, timeout=9)

    waiting = threading.Thread(target=wait_alone)
    waiting.start()
    time.sleep(0.5)  # inside its call: the connection is held
    try:
        tp_agree(True, args.group, 0, 2, timeout=1)
        mine = {"raised": None}
    except MonoUnsupported as err:
        mine = {"raised": err.code, "message": str(err)}
    mine["other_thread_still_waiting"] = waiting.is_alive()
    waiting.join()
    return {**mine, "lonely": lonely}


def vote_after_busy_thread(args) -> dict:
    """A thread waits 8 s in a vote nobody else joins; this one votes in another group with timeout 8 half a
    second later, gets the connection once the other's wait ended, and must hear its round's False, at its
    own deadline: its request went out with the daemon's wait shortened by the 7.5 s waited for the turn."""
    import threading

    from peerd_client import DaemonUnavailable, tp_agree

    threading.Thread(target=lambda: tp_agree(True, f"{args.group}-lonely", 0, 2, timeout=8)).start()
    time.sleep(0.5)  # inside its call: the connection is held
    began = time.monotonic()
    try:
        verdict = tp_agree(True, args.group, 0, 2, timeout=8)
    except DaemonUnavailable as err:
        verdict = f"DaemonUnavailable: {err}"
    return {"verdict": verdict, "took": time.monotonic() - began}


def rebuilt_after_restart(args) -> dict:
    """Hold a one-rank set, print READY, and after a line on stdin (the test restarted the daemon
    meanwhile) vote on it, then build the group's next set: the first build after the restart works."""
    from peerd_client import DaemonUnavailable, PeerBuffer, tp_agree
    from peerd_client.mappings import mappings

    old = PeerBuffer(args.nbytes, args.group, 0, 1)
    dead = old._conn.run
    print("READY", flush=True)
    sys.stdin.readline()
    try:
        vote = repr(tp_agree(True, args.group))
    except DaemonUnavailable as err:
        vote = f"DaemonUnavailable: {err}"
    new = PeerBuffer(args.nbytes, args.group, 0, 1, name="after")
    agreed = tp_agree(True, args.group)
    dead_chunks_while_old_open = sum(key[0] == dead for key in mappings._open)
    new.close()
    old.close()
    return {"vote_on_old_set": vote, "agreed_on_new_set": agreed, "dead_chunks_while_old_open":
            dead_chunks_while_old_open, "dead_chunks_after": sum(key[0] == dead for key in mappings._open)}


def closer(args) -> dict:
    """Hold a buffer set and print READY; close it after a line on stdin, print CLOSED, exit after another."""
    from peerd_client import PeerBuffer

    buf = PeerBuffer(args.nbytes, args.group, args.rank, args.npes)
    print("READY", flush=True)
    sys.stdin.readline()
    buf.close()  # never raises, even with the daemon stopped
    print("CLOSED", flush=True)
    sys.stdin.readline()
    return {"closed": buf.local == 0}


def vote(args) -> dict:
    """Join through the raw protocol, vote --votes with the reason in --body, then hold until a line on stdin."""
    from peerd_client import MonoUnsupported
    from peerd_client.connection import connection

    slot = {"group": args.group, "name": args.name, "rank": args.rank}
    connection().call("join", {**slot, "npes": args.npes, "nbytes": args.nbytes, "device": "host"}, timeout=60)
    try:
        verdict = connection().call("commit", {**slot, "ok": args.votes == "1", **json.loads(args.body)}, timeout=60)
    except MonoUnsupported as err:
        verdict = {"code": err.code}
    print("VOTED", flush=True)
    sys.stdin.readline()
    return {"verdict": verdict}


def pipeline(args) -> dict:
    """Send --votes agree requests to one group, then one to each of --hold more groups, without reading;
    count the refusals and False answers that come back, print them, and hold the rounds until a line on stdin."""
    import collections

    import msgpack
    import zmq

    from peerd.protocol import VERSION, decode_reply
    from peerd.routingids import new_routing_id

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.ROUTING_ID, new_routing_id())
    sock.connect(f"ipc://{os.environ['PEERD_SOCKET']}")
    body = {"rank": 0, "npes": 2, "ok": True, "timeout": None}
    groups = [args.group] * int(args.votes) + [f"{args.group}-{g}" for g in range(int(args.hold))]
    for i, group in enumerate(groups):
        sock.send(msgpack.packb({"v": VERSION, "id": i + 1, "op": "agree", "body": {**body, "group": group}}))
    codes, examples = collections.Counter(), {}
    while sock.poll(3000):
        reply = decode_reply(sock.recv())
        if reply.error:
            code, message = reply.error.code.value, reply.error.message
        else:
            code, message = ("True", "") if reply.body["ok"] else ("False", reply.body["reason"])
        codes[code] += 1
        if message:
            examples.setdefault(message.split(" ", 1)[0] + " " + code, message)
    print(json.dumps({"codes": dict(codes), "examples": examples}), flush=True)
    sys.stdin.readline()
    return {}


def _where() -> dict:
    """The daemon this process reaches, for a test that runs it under `peerd run`."""
    import os

    from peerd_client.connection import connection

    return {"socket": os.environ["PEERD_SOCKET"], "daemon": connection().hello["pid"], "pid": os.getpid()}


def job(args) -> dict:
    """A job's own launcher, as torchrun is: start --npes `exchange` ranks and collect their results.

    Under `peerd run`, every rank finds the job's daemon through the PEERD_SOCKET it inherits.
    """
    import subprocess

    ranks = [
        subprocess.Popen(
            [sys.executable, __file__, "exchange", "--rank", str(r), "--npes", str(args.npes), "--group", args.group],
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(args.npes)
    ]
    return {**_where(), "ranks": [json.loads(p.communicate()[0].splitlines()[-1]) for p in ranks]}


def held(args) -> dict:
    """Hold a buffer set, print READY and where its daemon is, then call again after a line on stdin.

    Meanwhile the test kills this process, its `peerd run` or its daemon.
    """
    from peerd_client import DaemonUnavailable, PeerBuffer, tp_agree

    buf = PeerBuffer(args.nbytes, args.group, args.rank, args.npes)
    print("READY " + json.dumps(_where()), flush=True)
    sys.stdin.readline()
    try:
        tp_agree(True, args.group)
        after = "no error"
    except DaemonUnavailable as err:
        after = str(err)
    buf.close()
    return {"after": after}


def signals(args) -> dict:
    """Print READY, then report every SIGINT, SIGTERM and SIGHUP that arrives within 0.5 s of the first."""
    import signal

    received: list[int] = []
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, lambda signum, _: received.append(signum))
    print("READY", flush=True)
    deadline = time.monotonic() + 30
    while not received and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.5)
    return {"received": [signal.Signals(s).name for s in received]}


SCENARIOS = {
    "numpy_sizes": numpy_sizes,
    "single": single,
    "given_back": given_back,
    "kept": kept,
    "outlived": outlived,
    "close_race": close_race,
    "interruptible": interruptible,
    "ctrl_c_storm": ctrl_c_storm,
    "connections": connections,
    "closes_behind_a_stuck_loop": closes_behind_a_stuck_loop,
    "released_behind_a_busy_thread": released_behind_a_busy_thread,
    "bad_timeouts": bad_timeouts,
    "stale_release": stale_release,
    "vote_after_busy_thread": vote_after_busy_thread,
    "cache": cache,
    "queued": queued,
    "captured_close": captured_close,
    "beside_stopped": beside_stopped,
    "call": call,
    "sealed": sealed,
    "chaos": chaos,
    "restart": restart,
    "forked": forked,
    "exchange": exchange,
    "agree": agree,
    "join": join,
    "process_group": process_group,
    "process_group_without_rank_0": process_group_without_rank_0,
    "process_group_contradicted": process_group_contradicted,
    "string_key_contradicted": string_key_contradicted,
    "stops_before_its_vote": stops_before_its_vote,
    "dropped": dropped,
    "no_torch": no_torch,
    "job": job,
    "held": held,
    "signals": signals,
    "patient": patient,
    "closer": closer,
    "dropped_while_busy": dropped_while_busy,
    "dropped_in_failed_call": dropped_in_failed_call,
    "rebuilt_after_restart": rebuilt_after_restart,
    "vote_behind_busy_thread": vote_behind_busy_thread,
    "vote": vote,
    "pipeline": pipeline,
    "agree_npes": agree_npes,
}


def become(spec: str) -> None:
    """Drop root for another user, after importing what the scenarios need (the
    interpreter's own files may be unreadable to that user): the kernel then
    reports that uid on the daemon connection, opened only at the first call."""
    import torch  # noqa: F401

    import peerd.backends.host  # noqa: F401  (the mapper, loaded by name on first use)
    import peerd_client  # noqa: F401
    import peerd_client.connection  # noqa: F401

    uid, gid, *extra = spec.split(":")
    os.setgroups([int(g) for g in extra[0].split(",")] if extra and extra[0] else [])
    os.setgid(int(gid))
    os.setuid(int(uid))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=SCENARIOS)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--npes", type=int, required=True)
    parser.add_argument("--nbytes", type=int, default=1 << 16)
    parser.add_argument("--big", type=int, default=96 << 20, help="bytes of a buffer that is a whole chunk")
    parser.add_argument("--group", default="test-group")
    parser.add_argument("--name", default="default")
    parser.add_argument("--votes", default="1")
    parser.add_argument("--agree-npes", type=int, default=None, help="agree_npes: the first round's npes")
    parser.add_argument("--timeout", type=float, default=None)
    parser.add_argument("--first-timeout", default=None, help="agree_npes: the first round's timeout")
    parser.add_argument("--hold", type=float, default=0.0)
    parser.add_argument("--linger", action="store_true", help="after the result, live on until a line on stdin")
    parser.add_argument("--flags", type=int, default=0)
    parser.add_argument("--device", default=None, help="torch device of the buffer (default: the worker's)")
    parser.add_argument("--store", default="")
    parser.add_argument("--die-at", choices=STEPS + PAGE_STEPS, default=None)
    parser.add_argument("--op", default="ls")
    parser.add_argument("--body", default="{}")
    parser.add_argument("--as-user", default=None, help="uid:gid[:extra,gids]: drop to it before any call")
    args = parser.parse_args()
    if args.as_user:
        become(args.as_user)
    try:
        out = {"ok": True, **SCENARIOS[args.scenario](args)}
    except Exception as err:
        out = {"ok": False, "type": type(err).__name__, "code": getattr(err, "code", None), "message": str(err)}
    print(json.dumps(out), flush=True)
    if args.linger:
        sys.stdin.readline()
    sys.exit(0)


if __name__ == "__main__":
    main()
