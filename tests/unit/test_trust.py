"""The socket path walk (peerd.trust) on real directories, symlinks, owners and modes."""

from __future__ import annotations

import json
import os
import socket
import stat
from pathlib import Path

import pytest

from peerd import paths, trust
from peerd.trust import AccessDenied, NotASocket, UntrustedPath, check_directories, check_socket

NOBODY = 65534
ROOT_ONLY = {0}

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown (CI runs as root)")


@pytest.fixture
def tree(socket_dir):
    """A root-owned 0755 directory under /tmp, with a socket in ``run/``."""
    top = Path(socket_dir)
    os.chmod(top, 0o755)
    (top / "run").mkdir(mode=0o755)
    bound = socket.socket(socket.AF_UNIX)
    bound.bind(str(top / "run" / "s.sock"))
    yield top
    bound.close()


def test_a_root_owned_chain_ending_in_a_socket_passes(tree):
    check_socket(str(tree / "run" / "s.sock"), ROOT_ONLY)


def test_a_symlinked_directory_is_refused_naming_the_link_and_where_it_leads(tree):
    (tree / "link").symlink_to(tree / "run")
    with pytest.raises(UntrustedPath) as refused:
        check_socket(str(tree / "link" / "s.sock"), ROOT_ONLY)
    assert f"{tree}/link is a symlink (to {tree}/run)" in str(refused.value)
    assert "give the resolved path" in str(refused.value)


def test_a_symlinked_socket_is_refused(tree):
    (tree / "run" / "alias.sock").symlink_to(tree / "run" / "s.sock")
    with pytest.raises(UntrustedPath, match="alias.sock is a symlink"):
        check_socket(str(tree / "run" / "alias.sock"), ROOT_ONLY)


def test_a_directory_of_another_user_is_refused_unless_that_user_is_trusted(tree):
    os.chown(tree / "run", NOBODY, NOBODY)
    with pytest.raises(UntrustedPath) as refused:
        check_socket(str(tree / "run" / "s.sock"), ROOT_ONLY)
    assert f"{tree}/run is owned by uid {NOBODY}" in str(refused.value)
    assert "PEERD_DAEMON_USER" in str(refused.value)
    check_socket(str(tree / "run" / "s.sock"), {0, NOBODY})


def test_a_socket_of_another_user_is_refused(tree):
    os.chown(tree / "run" / "s.sock", NOBODY, NOBODY, follow_symlinks=False)
    with pytest.raises(UntrustedPath, match=f"the socket {tree}/run/s.sock is owned by uid {NOBODY}"):
        check_socket(str(tree / "run" / "s.sock"), ROOT_ONLY)


@pytest.mark.parametrize("mode, who", [(0o775, "group"), (0o757, "everyone")])
def test_a_directory_others_may_write_to_is_refused_unless_sticky(tree, mode, who):
    os.chmod(tree / "run", mode)
    with pytest.raises(UntrustedPath) as refused:
        check_socket(str(tree / "run" / "s.sock"), ROOT_ONLY)
    assert f"is writable by {who}" in str(refused.value) and "chmod go-w" in str(refused.value)
    os.chmod(tree / "run", mode | stat.S_ISVTX)  # like /tmp: nobody renames or removes what they do not own
    check_socket(str(tree / "run" / "s.sock"), ROOT_ONLY)


def test_a_regular_file_or_a_directory_is_not_a_socket(tree):
    (tree / "run" / "file").write_text("data")
    with pytest.raises(NotASocket, match="is not a socket but a regular file"):
        check_socket(str(tree / "run" / "file"), ROOT_ONLY)
    with pytest.raises(NotASocket, match="is not a socket but a directory"):
        check_socket(str(tree / "run"), ROOT_ONLY)
    with pytest.raises(NotASocket, match="is a regular file, not a directory"):
        check_socket(str(tree / "run" / "file" / "s.sock"), ROOT_ONLY)


def test_nothing_there_is_file_not_found(tree):
    with pytest.raises(FileNotFoundError):
        check_socket(str(tree / "run" / "none.sock"), ROOT_ONLY)
    with pytest.raises(FileNotFoundError):
        check_directories(str(tree / "gone" / "deeper"), ROOT_ONLY)


def as_nobody(function, *args) -> dict:
    """function(*args) in a child running as nobody: its error's type and message."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            function(*args)
            out = {"type": None}
        except Exception as err:
            out = {"type": type(err).__name__, "message": str(err)}
        os.write(write, json.dumps(out).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        out = json.loads(pipe.read())
    os.waitpid(pid, 0)
    return out


def test_a_directory_this_user_may_not_enter_says_permission_denied_and_names_the_group(tree):
    os.chmod(tree / "run", 0o750)
    os.chown(tree / "run", 0, 0)
    out = as_nobody(check_socket, str(tree / "run" / "s.sock"), ROOT_ONLY)
    assert out["type"] == AccessDenied.__name__, out
    assert f"may not enter {tree}/run (mode 0750, owner uid 0 (root), group root)" in out["message"]
    assert "only root's group may: ask the daemon's operator to give it a socket group of users " \
           "(socket_group, --socket-group)" in out["message"], "not: ask to be added to root's group"
    os.chmod(tree / "run", 0o700)
    assert "only its owner may" in as_nobody(check_socket, str(tree / "run" / "s.sock"), ROOT_ONLY)["message"]


def test_a_socket_this_user_may_not_connect_to_says_permission_denied_and_names_the_group(tree):
    os.chmod(tree / "run" / "s.sock", 0o660)
    out = as_nobody(check_socket, str(tree / "run" / "s.sock"), ROOT_ONLY)
    assert out["type"] == "AccessDenied" and "may not connect to" in out["message"], out
    assert "only root's group may" in out["message"] and "usermod" not in out["message"], out
    os.chmod(tree / "run" / "s.sock", 0o666)
    assert as_nobody(check_socket, str(tree / "run" / "s.sock"), ROOT_ONLY)["type"] is None


def test_the_daemon_user_by_name_or_uid_else_the_system_user(monkeypatch):
    monkeypatch.setenv("PEERD_DAEMON_USER", "nobody")
    assert trust.daemon_user() == NOBODY and NOBODY in trust.client_trusts()
    monkeypatch.setenv("PEERD_DAEMON_USER", "4242")
    assert trust.daemon_user() == 4242
    monkeypatch.setenv("PEERD_DAEMON_USER", "pdt-no-such-user")
    with pytest.raises(UntrustedPath, match="PEERD_DAEMON_USER='pdt-no-such-user' names no user"):
        trust.daemon_user()
    monkeypatch.delenv("PEERD_DAEMON_USER")
    monkeypatch.setattr(trust, "SYSTEM_DAEMON_USER", "nobody")
    assert trust.daemon_user() == NOBODY, "the service's user is trusted without configuration"
    monkeypatch.setattr(trust, "SYSTEM_DAEMON_USER", "pdt-no-such-user")
    assert trust.daemon_user() is None and trust.client_trusts() == {0}


def test_a_system_socket_this_user_may_not_look_at_is_still_the_default(tree, monkeypatch):
    """Else a user outside the socket group is sent to a socket of their own that does not exist."""
    monkeypatch.setattr(paths, "SYSTEM_SOCKET", str(tree / "run" / "s.sock"))
    monkeypatch.delenv("PEERD_SOCKET", raising=False)
    os.chmod(tree / "run", 0o750)

    def default_is_the_system_socket():
        assert paths.default_socket() == paths.SYSTEM_SOCKET

    assert as_nobody(default_is_the_system_socket)["type"] is None
