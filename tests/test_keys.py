"""Tests for hetpipe/core/protocol/keys.py: the key files `hetpipe keys` writes, their modes, and reading
them back."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import zmq
import zmq.auth

from hetpipe.core.errors import UsageError
from hetpipe.core.protocol.keys import (
    ADMIN,
    SERVER,
    client_keys,
    key_users,
    public_path,
    read_public,
    secret_path,
    server_keys,
    vw_of_user,
    vw_user,
    write_keys,
)

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="this libzmq has no CURVE support")


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize(
    ("user", "vw"),
    [
        ("vw0", 0),
        ("vw12", 12),
        ("admin", None),
        ("server", None),
        ("vw", None),
        ("vw01", None),
        ("vw-1", None),
        ("xvw1", None),
    ],
)
def test_vw_of_user(user: str, vw: int | None) -> None:
    assert vw_of_user(user) == vw
    if vw is not None:
        assert vw_user(vw) == user


def test_key_users_are_one_per_vw_then_admin() -> None:
    assert key_users(3) == ["vw0", "vw1", "vw2", "admin"]


def test_write_keys_layout_and_modes(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    written = write_keys(keys, key_users(2))
    names = sorted(p.name for p in keys.iterdir())
    assert names == sorted(f"{u}{s}" for u in (SERVER, "vw0", "vw1", ADMIN) for s in (".key", ".key_secret"))
    assert sorted(written) == sorted(keys.iterdir())
    assert mode(keys) == 0o700
    for user in (SERVER, "vw0", "vw1", ADMIN):
        assert mode(secret_path(keys, user)) == 0o600
        assert mode(public_path(keys, user)) == 0o644
        public, secret = zmq.auth.load_certificate(secret_path(keys, user))  # zmq.auth reads our format
        assert zmq.curve_public(secret) == public
        assert zmq.auth.load_certificate(public_path(keys, user)) == (public, None)
        assert b"secret-key" not in public_path(keys, user).read_bytes()
    publics = {read_public(keys, u) for u in (SERVER, "vw0", "vw1", ADMIN)}
    assert len(publics) == 4  # every pair is its own


def test_client_keys_hold_only_their_own_secret(tmp_path: Path) -> None:
    write_keys(tmp_path, key_users(2))
    vw1 = client_keys(tmp_path, "vw1")
    assert vw1.user == "vw1"
    assert vw1.public == read_public(tmp_path, "vw1") and zmq.curve_public(vw1.secret) == vw1.public
    assert vw1.server_public == read_public(tmp_path, SERVER)
    assert vw1.secret.decode() not in repr(vw1)  # a logged job or traceback never shows it


def test_server_keys_map_every_client_key_to_its_user(tmp_path: Path) -> None:
    write_keys(tmp_path, key_users(3))
    keys = server_keys(tmp_path, num_vws=3)
    assert keys.public == read_public(tmp_path, SERVER) and zmq.curve_public(keys.secret) == keys.public
    assert keys.clients == {read_public(tmp_path, u): u for u in ("vw0", "vw1", "vw2", ADMIN)}
    assert keys.secret.decode() not in repr(keys)


def test_server_keys_need_a_key_for_every_vw(tmp_path: Path) -> None:
    write_keys(tmp_path, key_users(2))
    with pytest.raises(UsageError) as err:
        server_keys(tmp_path, num_vws=3)
    assert f"{tmp_path / 'vw2.key'}: no such key file" in str(err.value)
    assert "hetpipe keys CONFIG --out DIR" in str(err.value) and err.value.exit_code == 2


def test_existing_keys_are_kept_unless_forced(tmp_path: Path) -> None:
    write_keys(tmp_path, key_users(1))
    before = read_public(tmp_path, "vw0")
    with pytest.raises(UsageError, match="already holds keys.*--force"):
        write_keys(tmp_path, key_users(1))
    assert read_public(tmp_path, "vw0") == before
    write_keys(tmp_path, key_users(1), force=True)
    assert read_public(tmp_path, "vw0") != before


def test_unwritable_key_dir_names_the_path(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(UsageError, match=f"cannot write keys to {blocker / 'keys'}"):
        write_keys(blocker / "keys", key_users(1))


def test_a_secret_readable_by_others_is_refused(tmp_path: Path) -> None:
    write_keys(tmp_path, key_users(1))
    secret_path(tmp_path, "vw0").chmod(0o640)
    with pytest.raises(UsageError) as err:
        client_keys(tmp_path, "vw0")
    assert "readable by other users (mode 640)" in str(err.value)
    assert f"chmod 600 {secret_path(tmp_path, 'vw0')}" in str(err.value)


@pytest.mark.parametrize(
    ("edit", "fragment"),
    [
        (lambda text: text.replace("secret-key", "secret-kee"), "no secret-key line"),
        (lambda text: text.replace('public-key = "', 'public-key = "x'), "not a 40-character Z85 CURVE key"),
        (
            lambda text: text[: text.index("secret-key")] + 'secret-key = "' + "0" * 40 + '"\n',
            "its secret key does not belong to its public key",
        ),
    ],
)
def test_damaged_key_files_are_refused_with_the_file_named(tmp_path: Path, edit, fragment: str) -> None:
    write_keys(tmp_path, key_users(1))
    path = secret_path(tmp_path, "vw0")
    path.write_text(edit(path.read_text()))
    with pytest.raises(UsageError) as err:
        client_keys(tmp_path, "vw0")
    assert str(err.value).startswith(f"{path}: ") and fragment in str(err.value)


def test_missing_key_file_says_how_to_make_one(tmp_path: Path) -> None:
    with pytest.raises(UsageError) as err:
        client_keys(tmp_path, "vw0")
    assert f"{secret_path(tmp_path, 'vw0')}: no such key file" in str(err.value)
    assert "set [ps] keys_dir = DIR" in str(err.value)
