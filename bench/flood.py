"""Floods by a hostile local user (issue 13, items 5 to 8): what another user still gets from the daemon.

    python bench/flood.py                  # as root: creates and removes users pdf-bench-*

One fresh daemon per scenario, under RLIMIT_NOFILE 1024:1024 as in the
issue, its socket group holding three users: a flooder, a stranger the
allowlist refuses, and a bystander. The flooders are tests/flooders.py:

  baseline  no flood
  idle      1100 idle connections from the flooder
  partial   300 connections from the stranger, each sending a 1 MiB frame one byte short
  ls        4000 sets of the longest keys held by the flooder, which sends 300 `ls` and reads nothing
  hello     two processes of the flooder sending `hello` in a tight loop, reading nothing

Under each: `status` round trips from the bystander (p50/p99 over 300
calls on one connection, ms), the setup of the bystander's 2-rank group
(PeerBuffer in two processes from a common start until both hold it; median
and max of 5, ms), the daemon's peak RSS while the flood is on and its RSS
3 s after the flooders left (MiB); ratios against the baseline.
"""

from __future__ import annotations

import argparse
import grp
import json
import os
import pwd
import resource
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

sys.path.insert(0, str(C.ROOT))
from tests.conftest import local_users, wait_until  # noqa: E402

FLOODER, STRANGER, BYSTANDER, GROUP = "pdf-bench-flood", "pdf-bench-stranger", "pdf-bench-other", "pdf-bench-sock"
FLOODS = {
    "baseline": [],
    "idle": [("idle", FLOODER, 1100)],
    "partial": [("partial", STRANGER, 300)],
    "ls": [("sets", FLOODER, 4000), ("ls", FLOODER, 300)],
    "hello": [("hello", FLOODER, 1), ("hello", FLOODER, 1)],
}


def spec(name: str) -> str:
    user = pwd.getpwnam(name)
    return f"{user.pw_uid}:{user.pw_gid}:{grp.getgrnam(GROUP).gr_gid}"


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def probe(socket: str, user: str, calls: int, setups: int) -> dict:
    """Run as the bystander: status round trips, then 2-rank setups from a common start."""
    import torch  # noqa: F401

    from peerd_client import PeerBuffer
    from peerd_client.connection import Connection

    uid, gid, gids = user.split(":")
    os.setgroups([int(gids)])
    os.setgid(int(gid))
    os.setuid(int(uid))
    conn = Connection(socket)
    rtts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        conn.call("status", {})
        rtts.append((time.perf_counter() - t0) * 1e3)
        time.sleep(0.002)
    conn.close()
    setup = []
    for rep in range(setups):
        start = time.monotonic() + 0.2
        pipes = []
        for rank in range(2):
            read, write = os.pipe()
            if os.fork() == 0:
                time.sleep(max(0.0, start - time.monotonic()))
                buf = PeerBuffer(4096, f"bench-{os.getppid()}-{rep}", rank, 2)
                os.write(write, str((time.monotonic() - start) * 1e3).encode())
                buf.close()
                os._exit(0)
            os.close(write)
            pipes.append(read)
        setup.append(max(float(os.read(r, 64)) for r in pipes))
        for _ in pipes:
            os.wait()
    return {"status_ms": rtts, "setup_ms": setup}


def scenario(name: str, workdir: str) -> dict:
    socket = os.path.join(workdir, f"{name}.sock")
    log = open(os.path.join(workdir, f"{name}.log"), "ab")
    env = {**os.environ, "PEERD_SOCKET": socket}
    daemon = subprocess.Popen(
        [sys.executable, "-m", "peerd", "serve", "--backend", "host", "--socket", socket, "--socket-group", GROUP,
         "--allow-gid", "root", "--allow-uid", str(pwd.getpwnam(FLOODER).pw_uid),
         "--allow-uid", str(pwd.getpwnam(BYSTANDER).pw_uid)],
        stdout=log, stderr=subprocess.STDOUT, env=env, cwd=C.ROOT,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024)))
    wait_until(lambda: os.path.exists(socket), 30, "the daemon's socket")
    time.sleep(0.5)
    flooders = []
    for kind, user, count in FLOODS[name]:
        proc = subprocess.Popen([sys.executable, str(C.ROOT / "tests" / "flooders.py"), kind, "--socket", socket,
                                 "--count", str(count), "--as-user", spec(user)],
                                stdout=subprocess.PIPE, text=True, env=env)
        assert proc.stdout.readline().startswith("READY"), f"{kind} flooder did not start"
        flooders.append(proc)
    peak, sampling = [rss_mib(daemon.pid)], True

    def sample() -> None:
        while sampling:
            peak.append(rss_mib(daemon.pid))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample)
    sampler.start()
    out = subprocess.run([sys.executable, __file__, "--probe", socket, spec(BYSTANDER)],
                         capture_output=True, text=True, env=env, timeout=300)
    sampling = False
    sampler.join()
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    alive = daemon.poll() is None
    for proc in flooders:
        proc.kill()
        proc.wait()
    time.sleep(3)
    after = rss_mib(daemon.pid) if alive else float("nan")
    daemon.terminate()
    daemon.wait(timeout=60)
    status, setup = C.summary(result["status_ms"]), C.summary(result["setup_ms"])
    return {"scenario": name, "alive": alive, "status_p50_ms": status["p50"], "status_p99_ms": status["p99"],
            "setup_p50_ms": setup["p50"], "setup_max_ms": setup["max"], "rss_peak_mib": max(peak),
            "rss_after_mib": after, "samples": result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--probe", nargs=2, metavar=("SOCKET", "UID:GID:GIDS"), help=argparse.SUPPRESS)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--setups", type=int, default=5)
    parser.add_argument("--out", default=str(C.RESULTS / "flood-host.json"))
    args = parser.parse_args()
    if args.probe:
        print(json.dumps(probe(*args.probe, args.calls, args.setups)))
        return
    rows = []
    with local_users(GROUP, FLOODER, STRANGER, BYSTANDER), tempfile.TemporaryDirectory(prefix="pb-", dir="/tmp") as d:
        os.chmod(d, 0o755)
        for name in FLOODS:
            rows.append(scenario(name, d))
            print(f"{name}: done", file=sys.stderr)
    base = rows[0]
    header = ["flood", "alive", "status p50 ms", "p99 ms", "p99 / base", "2-rank setup p50 ms", "max ms",
              "p50 / base", "RSS peak MiB", "RSS after MiB"]
    table = [[r["scenario"], "yes" if r["alive"] else "NO", f"{r['status_p50_ms']:.2f}", f"{r['status_p99_ms']:.2f}",
              f"{r['status_p99_ms'] / base['status_p99_ms']:.2f}", f"{r['setup_p50_ms']:.1f}",
              f"{r['setup_max_ms']:.1f}", f"{r['setup_p50_ms'] / base['setup_p50_ms']:.2f}",
              f"{r['rss_peak_mib']:.0f}", f"{r['rss_after_mib']:.0f}"] for r in rows]
    print(C.markdown_table(header, table))
    with open(args.out, "w") as f:
        json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
