"""The daemon as a service: systemd's notify protocol, configuration, health,
metrics, draining on SIGTERM and reloading on SIGHUP."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from peerd_client.connection import Connection
from peerd_client.errors import MonoUnsupported

from tests.conftest import Daemon, finish, memfd_holders, run_ranks, start_rank, wait_until


def daemon_in(socket_dir: str, *args: str, **env) -> Daemon:
    return Daemon(os.path.join(socket_dir, "peerd.sock"), Path(socket_dir) / "daemon.log", args=args,
                  daemon_env=env).start()


def test_a_reload_raising_max_connections_past_the_fd_limit_warns_as_a_start_does(socket_dir):
    """The warning that a flood of connections could exhaust the fds (libzmq aborts then) was given at
    start only: a SIGHUP raising --max-connections past what the fd limit carries said nothing."""
    config = Path(socket_dir) / "peerd.toml"
    config.write_text("max_connections = 8\n")
    d = Daemon(os.path.join(socket_dir, "peerd.sock"), Path(socket_dir) / "daemon.log",
               launcher=("prlimit", "--nofile=4096:4096"), daemon_env={"PEERD_CONFIG": str(config)}).start()
    try:
        assert "needs about" not in d.logs()
        config.write_text("max_connections = 5000\n")
        d.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: "SIGHUP: reloaded" in d.logs(), 30, "the reload")
        assert "--max-connections 5000 needs about" in d.logs() and "the limit is 4096" in d.logs(), d.logs()
    finally:
        assert d.stop() == 0, d.logs()


@pytest.mark.parametrize("second", ["SIGINT", "SIGTERM", "SIGHUP"])
def test_signals_at_readiness_and_during_shutdown_leave_a_clean_stop(socket_dir, second):
    """A stop right as the daemon says it serves (systemctl stop after start), and another signal while
    it shuts down (a second Ctrl-C): the handlers were installed only after readiness and taken away
    before the cleanup, so the daemon died "Aborted!" or by the signal, leaving the socket, the fd
    socket and the lock behind; clients then waited out their whole connect timeout on them."""
    path = os.path.join(socket_dir, "peerd.sock")
    proc = subprocess.Popen([sys.executable, "-m", "peerd", "serve", "--backend", "host", "--socket", path],
                            stderr=subprocess.PIPE, text=True)
    lines = []
    try:
        for line in proc.stderr:
            lines.append(line)
            if "serving" in line:
                proc.send_signal(signal.SIGINT)
            if "shutting down" in line:
                proc.send_signal(getattr(signal, second))
                break
        lines += proc.stderr.readlines()
        assert proc.wait(timeout=30) == 0, "".join(lines)
    finally:
        proc.kill()
        proc.wait()
    assert "stopped" in lines[-1] and sorted(os.listdir(socket_dir)) == [], "".join(lines)


def test_notify_protocol_ready_status_watchdog_stopping(socket_dir):
    path = os.path.join(socket_dir, "notify")
    systemd = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    systemd.bind(path)
    systemd.settimeout(20)
    d = daemon_in(socket_dir, NOTIFY_SOCKET=path, WATCHDOG_USEC="400000")
    try:
        ready = systemd.recv(4096).decode()
        assert "READY=1" in ready and f"MAINPID={d.proc.pid}" in ready
        assert f"STATUS=serving {d.socket} (host): 0 buffer set(s), 0 rank(s) held" in ready
        pings = 0
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and pings < 3:
            pings += systemd.recv(4096).decode().count("WATCHDOG=1")
        assert pings >= 3, "WATCHDOG=1 every half WATCHDOG_USEC"
        before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        d.proc.send_signal(signal.SIGHUP)
        seen = ""
        while "READY=1" not in seen.split("RELOADING=1", 1)[-1]:
            seen += systemd.recv(4096).decode() + "\n"  # one datagram a message
        stamp = int(seen.split("MONOTONIC_USEC=", 1)[1].split()[0])  # which reload this is, as systemd asks
        assert "RELOADING=1\nMONOTONIC_USEC=" in seen and before <= stamp
        d.proc.send_signal(signal.SIGTERM)
        seen = ""
        while "STOPPING=1" not in seen:
            seen += systemd.recv(4096).decode()
        assert "STATUS=draining" in seen
        assert d.proc.wait(timeout=20) == 0
    finally:
        systemd.close()
        d.stop()


def test_a_reload_that_failed_stays_in_the_status_systemd_shows_until_one_succeeds(socket_dir):
    """`systemctl reload` ends at the daemon's READY=1 whether the file was good or not: its STATUS said
    nothing of a failed one, so an administrator who did not read the log believed the change applied."""
    path = os.path.join(socket_dir, "notify")
    systemd = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    systemd.bind(path)
    systemd.settimeout(20)
    config = Path(socket_dir) / "peerd.toml"
    config.write_text("max_groups = 12\n")
    d = daemon_in(socket_dir, NOTIFY_SOCKET=path, PEERD_CONFIG=str(config))

    def status_after_reload() -> str:
        d.proc.send_signal(signal.SIGHUP)
        seen = ""
        while "READY=1" not in seen.split("RELOADING=1", 1)[-1]:
            seen += systemd.recv(4096).decode() + "\n"
        return seen.rsplit("STATUS=", 1)[1].splitlines()[0]

    try:
        assert "READY=1" in systemd.recv(4096).decode()
        config.write_text("bogus = 1\n")
        failed = status_after_reload()
        assert failed.startswith(f"serving {d.socket}") and "the last reload failed" in failed and "bogus" in failed
        shown = d.cli("status")  # and to every probe, where no systemd shows it (Kubernetes)
        assert shown.returncode == 1 and "problem: the last reload failed" in shown.stdout, shown.stdout
        config.write_text("max_groups = 13\ncontrol_pages = false\n")
        assert "failed" not in status_after_reload()
        shown = d.cli("status")
        assert shown.returncode == 0, shown.stdout
        assert "reloaded, but these settings take a restart: control_pages" in shown.stdout, shown.stdout
    finally:
        systemd.close()
        assert d.stop() == 0, d.logs()


def test_config_file_environment_and_command_line_with_their_sources(socket_dir):
    config = Path(socket_dir) / "peerd.toml"
    config.write_text('log_level = "debug"\nmax_groups = 12\nallow_uid = [1000, 1001]\nmax_buffer_bytes = "64MiB"\n')
    env = {**os.environ, "PEERD_CONFIG": str(config), "PEERD_MAX_RANKS": "8"}
    result = subprocess.run([sys.executable, "-m", "peerd", "config", "--json", "--max-groups", "7"],
                            capture_output=True, text=True, env=env, timeout=30)
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["log_level"] == {"value": "debug", "source": str(config)}
    assert shown["max_groups"] == {"value": "7", "source": "command line"}
    assert shown["max_ranks"] == {"value": "8", "source": "environment (PEERD_MAX_RANKS)"}
    assert shown["max_buffer_bytes"]["value"] == str(64 << 20) and shown["allow_uid"]["value"] == "[1000, 1001]"
    assert shown["rendezvous_timeout"] == {"value": "60.0", "source": "default"}


def test_a_bad_configuration_is_a_clear_error_at_start_naming_the_key_and_peerd_config_refuses_it_too(socket_dir):
    """`peerd config --config FILE` is how docs/service.md says to check a file before a reload; it passed
    an unknown group, a group-writable directory mode and a chunk size the arenas cannot carve by."""
    config = Path(socket_dir) / "peerd.toml"
    for text, words in [
        ("max_grups = 3\n", f"{config}: unknown key(s) max_grups"),
        ('max_groups = "many"\n', f"{config}: bad value for max_groups"),
        ("socket_dir_mode = '0999'\n", f"{config}: bad value for socket_dir_mode"),
        ("log_level = [\n", f"cannot read configuration file {config}"),
        ('allow_gid = ["peerd-no-such-group"]\n', f"{config}: no such group 'peerd-no-such-group' (allow_gid, --allow-gid)"),
        ('socket_group = "peerd-no-such-group"\n', f"{config}: no such group 'peerd-no-such-group' (socket_group"),
        ("socket_dir_mode = '0770'\n", f"{config}: bad value for socket_dir_mode: '0770' lets other users write"),
        ("arena_chunk_bytes = 5000\n", "bad value for arena_chunk_bytes: 5000 is not a multiple of 4096 bytes"),
    ]:
        config.write_text(text)
        for command in (["serve", "--backend", "host", "--socket", os.path.join(socket_dir, "s.sock")], ["config"]):
            result = subprocess.run([sys.executable, "-m", "peerd", *command, "--config", str(config)],
                                    capture_output=True, text=True, timeout=30)
            assert result.returncode == 1 and words in result.stderr, (command, text, result.stderr)
    missing = subprocess.run([sys.executable, "-m", "peerd", "config", "--config", "/nonexistent.toml"],
                             capture_output=True, text=True, timeout=30)
    assert missing.returncode == 1 and "/nonexistent.toml does not exist" in missing.stderr
    config.write_text('max_groups = "lots"\n')  # overridden, and still the file's mistake: a check of the file
    overridden = subprocess.run([sys.executable, "-m", "peerd", "config", "--config", str(config), "--max-groups", "7"],
                                capture_output=True, text=True, timeout=30, env={**os.environ, "PEERD_MAX_GROUPS": "5"})
    assert overridden.returncode == 1 and f"{config}: bad value for max_groups" in overridden.stderr, overridden.stderr
    config.write_text("max_groups = 5\n")  # and the environment's, where the command line overrides it
    overridden = subprocess.run([sys.executable, "-m", "peerd", "config", "--config", str(config), "--max-groups", "7"],
                                capture_output=True, text=True, timeout=30, env={**os.environ, "PEERD_MAX_GROUPS": "x"})
    assert overridden.returncode == 1 and "environment (PEERD_MAX_GROUPS): bad value" in overridden.stderr, \
        overridden.stderr
    blank = subprocess.run([sys.executable, "-m", "peerd", "config", "--config", str(config), "--max-groups", "7"],
                           capture_output=True, text=True, timeout=30, env={**os.environ, "PEERD_MAX_GROUPS": " "})
    assert blank.returncode == 0, "an empty variable overridden is as good as unset (templates leave them so)"


def test_a_relative_socket_path_is_the_same_socket_at_every_reload(socket_dir):
    """A relative --socket (or PEERD_SOCKET) was made absolute at start only: every SIGHUP then reported
    the socket as changed, needing a restart that would change nothing."""
    log = Path(socket_dir) / "daemon.log"
    proc = subprocess.Popen([sys.executable, "-m", "peerd", "serve", "--backend", "host", "--socket", "rel.sock"],
                            cwd=socket_dir, stdout=open(log, "ab"), stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: "serving" in log.read_text(), 20, "the daemon to serve")
        assert f"serving {socket_dir}/rel.sock" in log.read_text()
        proc.send_signal(signal.SIGHUP)
        wait_until(lambda: "SIGHUP: reloaded" in log.read_text(), 10, "the reload")
        assert "needing a restart" not in log.read_text(), log.read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()


def test_status_tells_healthy_from_degraded(socket_dir):
    d = daemon_in(socket_dir, "--max-groups", "1")
    try:
        assert d.cli("status").returncode == 0
        holders = [start_rank(d, "join", r, 2, "--group", "only", "--hold", "60") for r in (0, 1)]
        wait_until(lambda: "group=only name=default live" in d.logs(), 90, "the set to go live")
        result = d.cli("status")
        assert result.returncode == 1 and "degraded" in result.stdout
        assert "1 buffer sets held of at most 1 (--max-groups)" in result.stdout
        info = json.loads(d.cli("status", "--json").stdout)
        assert info["health"] == "degraded" and info["problems"]
        for p in holders:
            p.kill()
        wait_until(lambda: d.cli("status").returncode == 0, 90, "health to come back")
    finally:
        assert d.stop() == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_prometheus_metrics(socket_dir):
    port = _free_port()
    # agreements are counted where the daemon answers them: on the message path (a page's rounds never reach it)
    d = daemon_in(socket_dir, "--metrics-port", str(port), "--control-pages", "false")
    try:
        assert all(r["ok"] for r in run_ranks(d, "exchange", 2, "--group", "scraped"))
        victim = start_rank(d, "join", 0, 2, "--group", "dies", "--hold", "60")
        wait_until(lambda: "group=dies name=default rank=0" in d.logs(), 90, "rank 0 to join")
        victim.kill()
        wait_until(lambda: f"(pid {victim.pid}) of group=dies name=default died" in d.logs(), 90, "the death")
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert 'peerd_joins_total{outcome="ok"} 2.0' in text
        assert 'peerd_agreements_total{outcome="true"} 4.0' in text  # two barriers by two ranks
        assert "peerd_rank_deaths_total 1.0" in text
        assert 'peerd_request_seconds_bucket{le="0.001",op="hello"}' in text
        # everything released: each series reads 0 (one that vanished read as its last value, stale, to a dashboard)
        assert "peerd_ranks_held 0.0" in text and 'peerd_bytes_allocated{device="host"} 0.0' in text
        assert all(f'peerd_buffer_sets{{state="{state}"}} 0.0' in text for state in ("joining", "opening", "live"))
        assert 'peerd_buffer_sets{state="failed"} 1.0' in text  # the dead rank's set: its verdict kept a while
    finally:
        assert d.stop() == 0


def test_a_metrics_port_another_process_holds_never_stops_the_daemon(socket_dir):
    """Any local user may take the port first (between two restarts of the service, say): the daemon
    refused to start. It serves without metrics, says so naming the port, and takes the port once free."""
    from peerd.metrics import BIND_RETRY_S

    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    port = squatter.getsockname()[1]
    d = daemon_in(socket_dir, "--metrics-port", str(port))
    try:
        held = d.cli("status")  # degraded while it lasts: a log line alone went unseen by every probe
        assert held.returncode == 1 and f"problem: metrics (--metrics-port): cannot listen on 127.0.0.1:{port} " \
            in held.stdout and "another process holds the port" in held.stdout, held.stdout
        assert f"cannot listen on 127.0.0.1:{port}" in d.logs() and "serving on without metrics" in d.logs()
        assert all(r["ok"] for r in run_ranks(d, "exchange", 2, "--group", "unscraped"))
        squatter.close()
        wait_until(lambda: f"metrics on http://127.0.0.1:{port}/metrics" in d.logs(), 3 * BIND_RETRY_S,
                   "the daemon to take the port once it was free")
        assert d.cli("status").returncode == 0
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert 'peerd_joins_total{outcome="ok"} 2.0' in text
    finally:
        squatter.close()
        assert d.stop() == 0


def test_sigterm_drains_live_groups_and_refuses_new_joins(socket_dir):
    d = daemon_in(socket_dir, "--shutdown-grace", "60")
    holders = [start_rank(d, "join", r, 2, "--group", "live", "--hold", "6") for r in (0, 1)]
    wait_until(lambda: "group=live name=default live" in d.logs(), 90, "the set to go live")
    d.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: "draining" in d.logs(), 10, "the drain to start")
    conn = Connection(d.socket)  # from this process: no interpreter start-up to race the drain
    with pytest.raises(MonoUnsupported) as late:
        conn.call("join", {"group": "late", "name": "n", "rank": 0, "npes": 2, "nbytes": 4096, "device": "host"})
    conn.close()
    assert late.value.code == "SHUTTING_DOWN" and "takes no new joins" in str(late.value)
    probe = d.cli("status")  # a readiness probe must send no new job to a daemon that refuses joins
    assert probe.returncode == 1 and "draining after SIGTERM" in probe.stdout, probe.stdout + probe.stderr
    assert d.proc.poll() is None, "the daemon waits for the live group"
    assert [finish(p)["ok"] for p in holders] == [True, True], "the live group finished undisturbed"
    assert d.proc.wait(timeout=20) == 0
    assert "released (0 still hold it)" in d.logs()


def test_the_drain_ends_after_the_grace_period(socket_dir):
    d = daemon_in(socket_dir, "--shutdown-grace", "1")
    holders = [start_rank(d, "join", r, 2, "--group", "stubborn", "--hold", "60") for r in (0, 1)]
    wait_until(lambda: "group=stubborn name=default live" in d.logs(), 90, "the set to go live")
    held = set(d.segments())
    started = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(timeout=20) == 0
    assert time.monotonic() - started < 10
    for p in holders:
        p.kill()
        p.wait()
    assert not memfd_holders(held), "the memory is gone once the daemon and its last holder are"


SLOW_NSS = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <grp.h>
#include <string.h>
#include <unistd.h>
/* getgrnam_r("slow:NAME") answers NAME's entry 4 s later: a directory server slow to answer */
int getgrnam_r(const char *name, struct group *g, char *buf, size_t len, struct group **out) {
    int (*real)(const char *, struct group *, char *, size_t, struct group **) =
        (int (*)(const char *, struct group *, char *, size_t, struct group **))dlsym(RTLD_NEXT, "getgrnam_r");
    if (strncmp(name, "slow:", 5) == 0) {
        sleep(4);
        name += 5;
    }
    return real(name, g, buf, len, out);
}
"""


def test_a_reload_waiting_for_a_slow_group_lookup_keeps_the_daemon_answering(socket_dir):
    """SIGHUP looks the allowed groups up through NSS; a directory server that takes seconds must not
    hold the daemon's requests (and systemd's watchdog pings) behind it: a real getgrnam_r, slowed
    by a preloaded library, while this test asks for status."""
    import grp
    import shutil

    if shutil.which("gcc") is None:
        pytest.skip("no gcc to build the slow NSS library")
    shim = Path(socket_dir) / "slownss.so"
    source = Path(socket_dir) / "slownss.c"
    source.write_text(SLOW_NSS)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(shim), str(source), "-ldl"], check=True)
    config = Path(socket_dir) / "peerd.toml"
    config.write_text('log_level = "info"\n')
    d = daemon_in(socket_dir, "--config", str(config), LD_PRELOAD=str(shim))
    conn = Connection(d.socket)
    try:
        config.write_text(f'allow_gid = ["slow:{grp.getgrgid(0).gr_name}"]\n')
        d.proc.send_signal(signal.SIGHUP)
        asked = time.monotonic()
        waits = []
        while "SIGHUP: reloaded" not in d.logs():
            assert time.monotonic() - asked < 30, "the reload never finished: " + d.logs()
            started = time.monotonic()
            status = conn.call("status", {}, timeout=10)
            waits.append(time.monotonic() - started)
            assert waits[-1] < 1.0, f"a status waited {waits[-1]:.2f}s behind the reload"
            if started - asked < 3.0:  # well before the 4 s lookup answers (later, the reload may land first)
                assert 0 not in status["allowed"]["gids"], "not applied before the lookup answered"
            time.sleep(0.05)
        assert time.monotonic() - asked >= 3.5 and len(waits) >= 10, "the lookup must have been slow: " + str(waits)
        assert 0 in conn.call("status", {})["allowed"]["gids"], "applied once the lookup answered"
    finally:
        conn.close()
        assert d.stop() == 0, d.logs()


def test_sighup_rereads_the_allowlist_and_the_log_level(socket_dir):
    config = Path(socket_dir) / "peerd.toml"
    config.write_text('log_level = "info"\n')
    d = daemon_in(socket_dir, "--config", str(config))
    try:
        assert 4242 not in json.loads(d.cli("status", "--json").stdout)["allowed"]["uids"]
        config.write_text('log_level = "debug"\nallow_uid = [4242]\nmax_groups = 5\nmetrics_port = 9999\n')
        d.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: "SIGHUP: reloaded" in d.logs(), 10, "the reload")
        status = json.loads(d.cli("status", "--json").stdout)
        assert 4242 in status["allowed"]["uids"] and status["limits"]["max_groups"] == 5
        assert "log level debug; changed but needing a restart: metrics_port" in d.logs()
        for bad in ("allow_uid = 'x'\n", "allow_gid = ['no-such-group-xyz']\n"):
            config.write_text(bad)
            refused = d.logs().count("configuration not reloaded")
            d.proc.send_signal(signal.SIGHUP)
            wait_until(lambda: d.logs().count("configuration not reloaded") > refused, 10, "the refused reload")
            assert d.proc.poll() is None, "a bad reload must not stop the daemon"
            assert 4242 in json.loads(d.cli("status", "--json").stdout)["allowed"]["uids"], "the old one stays"
    finally:
        assert d.stop() == 0

