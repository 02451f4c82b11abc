"""Settings refuse, at start-up and on SIGHUP, every value the daemon could not run with; bad files fail cleanly."""

from __future__ import annotations

import os
import threading

import click
import pytest
from click.testing import CliRunner

from peerd import settings as settings_module
from peerd.protocol import MAX_TIMEOUT_S
from peerd.settings import OPTIONS, ConfigError, Loader


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    """No PEERD_* variable of the test runner's leaks into what a test reads."""
    for option in OPTIONS:
        monkeypatch.delenv("PEERD_" + option.name.upper(), raising=False)
    monkeypatch.delenv("PEERD_CONFIG", raising=False)


def load_file(tmp_path, text: str | bytes):
    path = tmp_path / "peerd.toml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return Loader({}, str(path)).load()[0]


def refused(tmp_path, text: str | bytes) -> str:
    with pytest.raises(ConfigError) as err:
        load_file(tmp_path, text)
    return err.value.message


SECONDS = ("rendezvous_timeout", "agreement_timeout", "shutdown_grace", "arena_idle_s")


@pytest.mark.parametrize("key", SECONDS)
@pytest.mark.parametrize("value", ["100000", "86400.5", "nan", "inf", "-inf", "-1"])
def test_a_seconds_setting_past_the_protocols_limit_or_not_finite_is_refused_naming_key_and_range(
        tmp_path, key, value):
    """100000 was taken, and then every join failed ("field 'timeout' must be ... in (0, 86400]");
    shutdown_grace = inf crashed the daemon on SIGTERM (OverflowError) and nan never ended the drain."""
    message = refused(tmp_path, f"{key} = {value}\n")
    assert key in message and f"{MAX_TIMEOUT_S:g}" in message


@pytest.mark.parametrize("key", SECONDS)
def test_a_seconds_setting_takes_the_protocols_limit_itself(tmp_path, key):
    assert getattr(load_file(tmp_path, f"{key} = {MAX_TIMEOUT_S:g}\n"), key) == MAX_TIMEOUT_S


@pytest.mark.parametrize("key, zero_ok", [("rendezvous_timeout", False), ("agreement_timeout", False),
                                          ("shutdown_grace", True), ("arena_idle_s", True)])
def test_zero_seconds_is_taken_only_where_it_means_at_once(tmp_path, key, zero_ok):
    if zero_ok:
        assert getattr(load_file(tmp_path, f"{key} = 0\n"), key) == 0
    else:
        assert key in refused(tmp_path, f"{key} = 0\n")


def test_seconds_from_the_environment_and_command_line_are_bounded_too(tmp_path, monkeypatch):
    monkeypatch.setenv("PEERD_SHUTDOWN_GRACE", "inf")
    with pytest.raises(ConfigError, match="PEERD_SHUTDOWN_GRACE.*shutdown_grace"):
        Loader({}, None).load()
    seconds = settings_module._BY_NAME["rendezvous_timeout"].type
    with pytest.raises(click.BadParameter):
        seconds.convert("nan", None, None)
    assert seconds.convert("2.5", None, None) == 2.5


@pytest.mark.parametrize("key", ["max_buffer_bytes", "max_bytes_per_uid", "arena_chunk_bytes",
                                 "arena_max_bytes_per_uid"])
def test_a_negative_size_is_refused(tmp_path, key):
    assert key in refused(tmp_path, f"{key} = -5\n")


def test_zero_or_none_means_no_limit_for_a_limit_and_is_refused_for_the_chunk_size(tmp_path):
    assert load_file(tmp_path, "max_buffer_bytes = 0\nmax_bytes_per_uid = 'none'\n").limits.max_buffer_bytes is None
    assert "arena_chunk_bytes" in refused(tmp_path, "arena_chunk_bytes = 0\n")
    assert "arena_chunk_bytes" in refused(tmp_path, "arena_chunk_bytes = 'none'\n")
    assert load_file(tmp_path, "arena_chunk_bytes = '16MiB'\n").arena_chunk_bytes == 16 << 20


def test_an_unquoted_mode_is_refused_with_the_advice_to_quote_it(tmp_path):
    """socket_dir_mode = 750 was read as decimal 750, that is 0o1356."""
    message = refused(tmp_path, "socket_dir_mode = 750\n")
    assert "socket_dir_mode" in message and "'0750'" in message


@pytest.mark.parametrize("text", ["'0999'", "'1777'", "'-750'", "'+750'", "0o750", "'7_50'", "''", "true"])
def test_a_mode_other_than_octal_permission_bits_is_refused(tmp_path, text):
    assert "socket_dir_mode" in refused(tmp_path, f"socket_dir_mode = {text}\n")


def test_a_quoted_mode_is_read_as_octal(tmp_path, monkeypatch):
    assert load_file(tmp_path, "socket_dir_mode = '0750'\n").socket_dir_mode == 0o750
    assert load_file(tmp_path, "socket_dir_mode = '0o750'\n").socket_dir_mode == 0o750
    monkeypatch.setenv("PEERD_SOCKET_DIR_MODE", "700")
    assert Loader({}, None).load()[0].socket_dir_mode == 0o700


@pytest.mark.parametrize("text", ["[1.5]", "[-1]", "[true]", "1.5"])
def test_allow_uid_takes_only_non_negative_integers(tmp_path, text):
    """allow_uid = [1.5] silently allowed uid 1."""
    assert "allow_uid" in refused(tmp_path, f"allow_uid = {text}\n")


def test_allow_uid_takes_integers_from_the_file_and_the_environment(tmp_path, monkeypatch):
    assert load_file(tmp_path, "allow_uid = [1000, 0]\n").allow_uid == (1000, 0)
    monkeypatch.setenv("PEERD_ALLOW_UID", " 1000, 1001 ")
    assert Loader({}, None).load()[0].allow_uid == (1000, 1001)
    monkeypatch.setenv("PEERD_ALLOW_UID", "1000 1001")  # a group name may hold a space: commas part the items
    with pytest.raises(ConfigError, match=r"PEERD_ALLOW_UID.*'1000 1001'.*\(a list's items are apart by commas\)"):
        Loader({}, None).load()


@pytest.mark.parametrize("text", ["max_groups = 1.5", "max_ranks = 2.0", "metrics_port = true", "allow_gid = [1.5]",
                                  "socket_group = 0.5"])
def test_an_integer_setting_refuses_a_float_or_boolean_instead_of_truncating_it(tmp_path, text):
    assert text.split()[0] in refused(tmp_path, text + "\n")


@pytest.mark.parametrize("content, words", [
    (b"log_level = \"\xff\"\n", "UTF-8"),
    (b"a = " + b"[" * 5000 + b"]" * 5000 + b"\n", "nested"),
    (b"a = " + b"{b = " * 5000 + b"1" + b"}" * 5000 + b"\n", "nested"),
])
def test_a_file_not_utf8_or_nested_too_deeply_is_a_clean_error(tmp_path, content, words):
    message = refused(tmp_path, content)
    assert str(tmp_path / "peerd.toml") in message and words in message


def test_peerd_config_reports_a_bad_file_without_a_traceback(tmp_path):
    from peerd.cli import main

    path = tmp_path / "peerd.toml"
    path.write_bytes(b"a = " + b"[" * 5000 + b"]" * 5000 + b"\n")
    result = CliRunner().invoke(main, ["config", "--config", str(path)])
    assert result.exit_code == 1 and "Error:" in result.output and "Traceback" not in result.output
    assert not isinstance(result.exception, RecursionError)


def test_a_fifo_in_place_of_the_file_is_refused_at_once(tmp_path):
    """SIGHUP read the file on the daemon's loop: a FIFO there blocked every client until a writer came."""
    path = tmp_path / "peerd.toml"
    os.mkfifo(path)
    outcome: list = []

    def load():
        try:
            Loader({}, str(path)).load()
        except ConfigError as err:
            outcome.append(err.message)

    reader = threading.Thread(target=load, daemon=True)
    reader.start()
    reader.join(5)
    if reader.is_alive():  # the old code blocks in open(): let it go before failing
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(5)
        pytest.fail("reading a FIFO as the configuration file blocked")
    assert outcome and "not a regular file" in outcome[0] and str(path) in outcome[0]


@pytest.mark.parametrize("make", [lambda p: p.mkdir(), lambda p: p.symlink_to("/dev/null")])
def test_a_directory_or_device_in_place_of_the_file_is_refused(tmp_path, make):
    path = tmp_path / "peerd.toml"
    make(path)
    with pytest.raises(ConfigError, match="not a regular file"):
        Loader({}, str(path)).load()


def test_a_file_larger_than_the_cap_is_refused_naming_the_cap(tmp_path):
    cap = settings_module.MAX_CONFIG_BYTES
    padding = b"# " + b"x" * 78 + b"\n"
    too_big = b"log_level = 'info'\n" + padding * (cap // len(padding) + 1)
    message = refused(tmp_path, too_big)
    assert "larger than" in message and "1 MiB" in message
    assert load_file(tmp_path, too_big[:cap]).log_level == "info"


def test_a_missing_file_is_an_error_only_when_named(tmp_path, monkeypatch):
    monkeypatch.setattr(settings_module, "DEFAULT_CONFIG", str(tmp_path / "absent.toml"))
    assert Loader({}, None).load()[0].log_level == "info"
    with pytest.raises(ConfigError, match="does not exist"):
        Loader({}, str(tmp_path / "absent.toml")).load()


def _as_nobody(check) -> bool:
    """``check()`` run in a forked child that became uid/gid 65534: whether it returned true."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            os._exit(0 if check() else 1)
        except BaseException:
            os._exit(2)
    return os.waitpid(pid, 0)[1] == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user (CI runs as root)")
def test_the_default_file_out_of_the_users_sight_counts_as_absent_a_named_one_is_an_error(tmp_path):
    """A user who may not enter /etc/peerd (0700, the service's) got a ConfigError from every command that
    reads the settings; the file it cannot see is no file to it, as before. A file it names is read or refused."""
    hidden = tmp_path / "etc"
    hidden.mkdir(mode=0o700)
    (hidden / "peerd.toml").write_text("max_groups = 7\n")
    os.chmod(tmp_path, 0o755)
    path = str(hidden / "peerd.toml")
    nothing = {o.name: (() if o.multiple else None) for o in OPTIONS}

    def unseen_is_absent() -> bool:
        return Loader(nothing, None, path).read_file() == ({}, None)

    def named_is_refused() -> bool:
        try:
            Loader(nothing, path).read_file()
        except ConfigError as err:
            return "Permission denied" in str(err)
        return False

    assert _as_nobody(unseen_is_absent) and _as_nobody(named_is_refused)
    assert Loader(nothing, None, path).read_file()[0] == {"max_groups": 7}, "root still reads it"


def test_a_default_file_gone_since_it_was_read_keeps_the_running_settings(tmp_path):
    """A hand-run daemon reads /etc/peerd/peerd.toml where nothing names a file; removed, then SIGHUP, it
    read as no file at all: the allowlist, limits and timeouts went back to their defaults without a word."""
    path = tmp_path / "peerd.toml"
    path.write_text("max_groups = 5\n")
    loader = Loader({}, default_file=str(path))
    assert loader.load()[0].limits.max_groups == 5
    path.unlink()
    with pytest.raises(ConfigError, match=f"configuration file {path} was read before and is gone now"):
        loader.load()
    never_there = Loader({}, default_file=str(tmp_path / "absent.toml"))
    assert never_there.load()[1]["max_groups"] == "default", "a default file that never was: the defaults"
