"""CurveZMQ key files of a run: the layout `hetpipe keys` writes, writing a set, and reading keys back. No
sockets.

One directory per cluster (or per run):
    server.key  server.key_secret        the PS shards' key pair (every shard uses it)
    vw<I>.key   vw<I>.key_secret         one pair per virtual worker: its stages act as VW I and no other
    admin.key   admin.key_secret         the launcher's pair: it may read the weights and the status only
`<name>.key` holds the public key, `<name>.key_secret` both keys (mode 0600), in the ZPL text format of
zmq.auth.create_certificates (zmq.auth.load_certificate reads them too). The user name of a key is its file
name; the PS admits only the public keys of the directory and binds each to that name
(hetpipe.core.protocol.access).
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.utils.z85

from hetpipe.core.errors import UsageError

__all__ = [
    "ADMIN",
    "SERVER",
    "ClientKeys",
    "ServerKeys",
    "client_keys",
    "key_users",
    "public_path",
    "read_public",
    "secret_path",
    "server_keys",
    "vw_of_user",
    "vw_user",
    "write_keys",
]

SERVER = "server"
ADMIN = "admin"
_VW = re.compile(r"vw(0|[1-9][0-9]{0,8})")
_KEY_LINE = re.compile(rb'\s*(public|secret)-key\s*=\s*"([^"]*)"\s*')
_KEY_CHARS = 40  # a 32-byte key in Z85
_FIX = "make the run's keys with `hetpipe keys CONFIG --out DIR` and set [ps] keys_dir = DIR"


def vw_user(vw: int) -> str:
    """The user name, and key file stem, of virtual worker `vw`."""
    return f"vw{vw}"


def vw_of_user(user: str) -> int | None:
    """The VW index a user name stands for ("vw3" -> 3), None for admin and anything else."""
    match = _VW.fullmatch(user)
    return int(match[1]) if match else None


def key_users(num_vws: int) -> list[str]:
    """The client users of a run with `num_vws` VWs: vw0 .. vw<n-1>, then admin."""
    return [vw_user(v) for v in range(num_vws)] + [ADMIN]


def public_path(directory: Path, user: str) -> Path:
    return Path(directory) / f"{user}.key"


def secret_path(directory: Path, user: str) -> Path:
    return Path(directory) / f"{user}.key_secret"


@dataclass(frozen=True)
class ClientKeys:
    """What one PS client needs: its key pair and the server's public key (Z85 bytes); the secret never
    prints."""

    user: str
    public: bytes
    secret: bytes = field(repr=False)
    server_public: bytes


@dataclass(frozen=True)
class ServerKeys:
    """What a PS shard needs: its key pair and every admitted client's public key, mapped to its user name."""

    public: bytes
    secret: bytes = field(repr=False)
    clients: Mapping[bytes, str]  # Z85 public key -> user ("vw0", ..., "admin")


# ---------------------------------------------------------------------------------------------- writing


def _banner(user: str, secret: bool) -> str:
    if secret:
        return (
            f"#   ****  hetpipe CURVE secret key pair: {user}  ****\n"
            "#   Give it only to the processes that act as this user; never commit it.\n"
        )
    return (
        f"#   ****  hetpipe CURVE public key: {user}  ****\n"
        "#   The PS admits the holder of the matching secret key as this user.\n"
    )


def _key_text(user: str, public: bytes, secret: bytes | None) -> str:
    lines = [
        _banner(user, secret is not None),
        "metadata\n",
        "curve\n",
        f'    public-key = "{public.decode()}"\n',
    ]
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode()}"\n')
    return "".join(lines)


def _write_new(path: Path, text: str, mode: int) -> None:
    """Create `path` with `mode` from the start (never readable by others, not even briefly)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.fchmod(fd, mode)
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def _need_curve() -> None:
    if not zmq.has("curve"):
        raise UsageError(
            f"this pyzmq (libzmq {zmq.zmq_version()}) was built without CURVE support: "
            'install a pyzmq wheel with libsodium, or set [ps] auth = "none"'
        )


def write_keys(directory: Path, users: Sequence[str], *, force: bool = False) -> list[Path]:
    """Write a fresh server key pair and one pair per user into `directory` (made 0700); returns the files.

    Refuses to replace existing key files unless `force`: running shards and workers would stop matching.
    """
    _need_curve()
    directory = Path(directory)
    names = [SERVER, *users]
    existing = [
        p for n in names for p in (public_path(directory, n), secret_path(directory, n)) if p.exists()
    ]
    if existing and not force:
        raise UsageError(
            f"{existing[0]} exists: {directory} already holds keys; a new set would lock out every "
            "process using the old one: give another --out, or --force to replace them"
        )
    try:
        directory.mkdir(parents=True, exist_ok=True)
        directory.chmod(0o700)
        written = []
        for name in names:
            public, secret = zmq.curve_keypair()
            _write_new(secret_path(directory, name), _key_text(name, public, secret), 0o600)
            _write_new(public_path(directory, name), _key_text(name, public, None), 0o644)
            written += [public_path(directory, name), secret_path(directory, name)]
    except OSError as exc:
        raise UsageError(
            f"cannot write keys to {directory}: {exc.strerror or exc}; choose a writable --out"
        ) from None
    return written


# ---------------------------------------------------------------------------------------------- reading


def _read_key_file(path: Path, want_secret: bool) -> tuple[bytes, bytes | None]:
    try:
        info = path.stat()
        raw = path.read_bytes()
    except FileNotFoundError:
        raise UsageError(f"{path}: no such key file; {_FIX}") from None
    except OSError as exc:
        raise UsageError(f"{path}: cannot read the key file ({exc.strerror or exc})") from None
    if want_secret and info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise UsageError(
            f"{path}: a secret key readable by other users (mode {stat.S_IMODE(info.st_mode):o}): "
            f"run `chmod 600 {path}`"
        )
    found: dict[str, bytes] = {}
    for line in raw.splitlines():
        match = _KEY_LINE.fullmatch(line)
        if match:
            found[match[1].decode()] = match[2]
    for kind in ("public", "secret") if want_secret else ("public",):
        key = found.get(kind)
        if key is None:
            raise UsageError(f"{path}: no {kind}-key line; {_FIX}")
        if len(key) != _KEY_CHARS or not _is_z85(key):
            raise UsageError(f"{path}: the {kind} key is not a {_KEY_CHARS}-character Z85 CURVE key; {_FIX}")
    secret = found.get("secret") if want_secret else None
    if secret is not None and zmq.curve_public(secret) != found["public"]:
        raise UsageError(
            f"{path}: its secret key does not belong to its public key (an edited file?); {_FIX}"
        )
    return found["public"], secret


def _is_z85(key: bytes) -> bool:
    try:
        return len(zmq.utils.z85.decode(key)) == 32
    except (ValueError, KeyError, IndexError):
        return False


def read_public(directory: Path, user: str) -> bytes:
    """The Z85 public key of `user` from `directory`; UsageError names the file and the fix."""
    return _read_key_file(public_path(directory, user), want_secret=False)[0]


def client_keys(directory: Path, user: str) -> ClientKeys:
    """What the client acting as `user` needs: its own pair and the server's public key (not its secret)."""
    _need_curve()
    public, secret = _read_key_file(secret_path(directory, user), want_secret=True)
    assert secret is not None
    return ClientKeys(user, public, secret, read_public(directory, SERVER))


def server_keys(directory: Path, num_vws: int | None = None) -> ServerKeys:
    """The shards' pair and the admitted clients: every vw<I>.key and admin.key of `directory`.

    With `num_vws`, each of vw0 .. vw<num_vws - 1> must have a key (a run that needs it fails early).
    """
    _need_curve()
    directory = Path(directory)
    public, secret = _read_key_file(secret_path(directory, SERVER), want_secret=True)
    assert secret is not None
    users = sorted(
        (p.stem for p in directory.glob("*.key") if vw_of_user(p.stem) is not None), key=vw_of_user
    )
    if num_vws is not None:
        missing = [vw_user(v) for v in range(num_vws) if vw_user(v) not in users]
        if missing:
            raise UsageError(
                f"{public_path(directory, missing[0])}: no such key file, but the run has {num_vws} "
                f"virtual workers; {_FIX} (it writes one pair per VW of the config)"
            )
    if public_path(directory, ADMIN).exists():
        users.append(ADMIN)
    clients: dict[bytes, str] = {}
    for user in users:
        key = read_public(directory, user)
        if key in clients or key == public:
            raise UsageError(
                f"{public_path(directory, user)}: the same public key as "
                f"{public_path(directory, clients.get(key, SERVER))}; {_FIX}"
            )
        clients[key] = user
    return ServerKeys(public, secret, clients)
