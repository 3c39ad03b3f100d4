"""A cluster's keys: who may speak on kvroute's ZeroMQ sockets, and the secret its cache
salts are keyed by.

A key folder (``kvroute keys init DIR``) holds one CURVE key pair per role and a salt
secret::

    orchestrator.key  orchestrator.key_secret   the registry's and replicas' server key;
                                                the orchestrator's client key
    worker.key        worker.key_secret         every worker's server and client key
    salt.secret                                 keys the cache salts (orchestrator only)

A process needs the public keys of both roles and the secret of its own; a worker's
folder may leave out ``orchestrator.key_secret`` and ``salt.secret`` (``kvroute keys
worker-set``), so a worker cannot speak as the orchestrator. The two public keys are the
allow-list: a peer whose client key is neither gets no reply (see foundation.zmq_auth).
Files are written 0600 in a 0700 folder, and a folder others can read is refused.
``install`` makes such a folder from one that fails that check, as a Kubernetes Secret
volume does (see ``install``).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

ROLES = ("orchestrator", "worker")
SALT_FILE = "salt.secret"
SALT_BYTES = 32
KEY_FILES = tuple(f"{role}.{suffix}" for role in ROLES for suffix in ("key", "key_secret")) + (SALT_FILE,)


class ClusterKeyError(ValueError):
    """A key folder that is missing, incomplete or readable by others."""


@dataclass(frozen=True)
class KeyPair:
    public: bytes  # z85, 40 bytes
    secret: bytes | None  # z85; None where this folder does not hold it


@dataclass(frozen=True)
class ClusterKeys:
    folder: Path
    pairs: dict[str, KeyPair]
    salt_secret: bytes | None

    def public(self, role: str) -> bytes:
        return self.pairs[role].public

    def secret(self, role: str) -> bytes:
        secret = self.pairs[role].secret
        if secret is None:
            raise ClusterKeyError(f"{self.folder} holds no secret key of the {role} role "
                                  f"({role}.key_secret); a {role} needs it")
        return secret

    def holds(self, role: str) -> bool:
        return self.pairs[role].secret is not None

    def role_of(self, client_public_key: bytes) -> str | None:
        """The role a CURVE client key (z85) belongs to; None: not a member."""
        for role, pair in self.pairs.items():
            if secrets.compare_digest(pair.public, client_public_key):
                return role
        return None


def init(folder: str | Path) -> Path:
    """Create a new key folder; refuses to overwrite one."""
    folder = _new_private_folder(folder)
    for role in ROLES:
        public_file, secret_file = zmq.auth.create_certificates(folder, role)
        os.chmod(public_file, 0o600)
        os.chmod(secret_file, 0o600)
    _write_private(folder / SALT_FILE, secrets.token_hex(SALT_BYTES).encode())
    return folder


@contextlib.contextmanager
def temporary() -> Iterator[Path]:
    """A new key folder for one run (the embedded default, a benchmark), removed after."""
    folder = Path(tempfile.mkdtemp(prefix="kvroute-keys-"))
    try:
        yield init(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def of_this_run(given: str = "") -> Iterator[str]:
    """``given``, else ``KVROUTE_CLUSTER_KEYS``, else a temporary folder: the keys a
    benchmark's processes speak with."""
    folder = given or os.environ.get("KVROUTE_CLUSTER_KEYS", "")
    if folder:
        yield folder
        return
    with temporary() as made:
        yield str(made)


def worker_set(source: str | Path, folder: str | Path) -> Path:
    """A folder for workers: both public keys and the worker's secret, nothing else."""
    keys = load(source)
    folder = _new_private_folder(folder)
    for name in ("orchestrator.key", "worker.key", "worker.key_secret"):
        _write_private(folder / name, (keys.folder / name).read_bytes())
    return folder


def install(source: str | Path, folder: str | Path) -> Path:
    """A private copy (0700 folder, 0600 files, owned by this process's user) of the key
    files in ``source``, a folder the loader would refuse: a Kubernetes Secret volume is
    mounted in a folder anyone may list (0777) with files owned by root, which a pod that
    does not run as root reads only through its ``fsGroup`` (mode 0440). Only the names a
    key folder holds are copied, symbolic links followed (a Secret volume's files link into
    its ``..data`` folder); the copy must then load, or nothing is left behind."""
    source = Path(source)
    if not source.is_dir():
        raise ClusterKeyError(f"{source} is not a folder of cluster keys")
    names = [name for name in KEY_FILES if (source / name).is_file()]
    if not names:
        raise ClusterKeyError(f"{source} holds none of {', '.join(KEY_FILES)}: not a kvroute key folder")
    folder = _new_private_folder(folder)
    try:
        for name in names:
            _write_private(folder / name, (source / name).read_bytes())
        load(folder)
    except (OSError, ClusterKeyError):
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return folder


def load(folder: str | Path) -> ClusterKeys:
    folder = Path(folder)
    if not folder.is_dir():
        raise ClusterKeyError(f"cluster key folder {folder} does not exist "
                              f"(create one with `kvroute keys init {folder}`)")
    _refuse_readable_by_others(folder)
    pairs = {}
    for role in ROLES:
        public_file = folder / f"{role}.key"
        secret_file = folder / f"{role}.key_secret"
        if not public_file.is_file():
            raise ClusterKeyError(f"{folder} has no {public_file.name}: not a kvroute key folder "
                                  f"(create one with `kvroute keys init DIR`)")
        try:
            public, _ = zmq.auth.load_certificate(public_file)
            secret = zmq.auth.load_certificate(secret_file)[1] if secret_file.is_file() else None
        except (OSError, ValueError) as error:
            raise ClusterKeyError(f"unreadable key in {folder}: {error}") from error
        if len(public) != 40 or (secret is not None and len(secret) != 40):
            raise ClusterKeyError(f"{folder}: {role} keys are not 40-character z85 CURVE keys")
        pairs[role] = KeyPair(public, secret)
    salt_file = folder / SALT_FILE
    salt = bytes.fromhex(salt_file.read_text().strip()) if salt_file.is_file() else None
    return ClusterKeys(folder, pairs, salt)


def _new_private_folder(folder: str | Path) -> Path:
    """``folder``, made 0700 (with its parents), empty; refuses one that holds anything."""
    folder = Path(folder)
    if folder.exists() and any(folder.iterdir()):
        raise ClusterKeyError(f"{folder} exists and is not empty; keys are never overwritten")
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    return folder


def _write_private(path: Path, data: bytes) -> None:
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as file:
        file.write(data)


def _refuse_readable_by_others(folder: Path) -> None:
    for path in (folder, *folder.glob("*secret*")):
        mode = path.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ClusterKeyError(f"{path} is open to other users (mode {stat.filemode(mode)}); "
                                  f"run `chmod -R go-rwx {folder}`")
