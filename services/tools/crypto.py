"""Encryption at rest of webhook auth headers, with key rotation.

Owns `SecretBox` (authenticated encryption with `cryptography`'s MultiFernet: the first key
encrypts, every key decrypts, so a new key can be put first in `CE_SECRET_KEY` while the old one
still opens existing rows) and the key file used for local runs (`load_or_create_key`).

Neither a key, a plaintext nor a ciphertext ever appears in an error message or a log line.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Sequence
from pathlib import Path

import structlog
from cryptography.fernet import Fernet, InvalidToken, MultiFernet

from kernel.errors import ChatEngineError, ConfigError

DEFAULT_KEY_FILE = "secret.key"

_GENERATE_HINT = (
    "generate one with `python -c 'from services.tools.crypto import generate_key; "
    "print(generate_key())'`"
)


class SecretDecryptError(ChatEngineError):
    """A stored secret could not be opened: wrong key, key rotated out, or altered ciphertext.

    The message never contains the ciphertext or any plaintext.
    """


def generate_key() -> str:
    """A fresh random key (32 bytes, url-safe base64), suitable for `CE_SECRET_KEY`."""
    return Fernet.generate_key().decode("ascii")


class SecretBox:
    """Authenticated encryption of short secrets (webhook auth headers) under rotating keys.

    `keys[0]` encrypts; all keys decrypt. Raises ConfigError when `keys` is empty or one is not a
    valid key (the message gives the key's position, never its value).
    """

    __slots__ = ("_fernet", "_key_count")

    def __init__(self, keys: Sequence[str]) -> None:
        if isinstance(keys, str):
            keys = [k for k in (p.strip() for p in keys.split(",")) if k]
        if not keys:
            raise ConfigError(
                f"no encryption key: set CE_SECRET_KEY to one or more comma-separated keys; {_GENERATE_HINT}",
                variable="CE_SECRET_KEY",
            )
        fernets = []
        for position, key in enumerate(keys, start=1):
            try:
                fernets.append(Fernet(key.strip().encode("ascii")))
            except (ValueError, UnicodeEncodeError):
                raise ConfigError(
                    f"CE_SECRET_KEY key #{position} is not a valid key (expected 32 url-safe "
                    f"base64-encoded bytes); {_GENERATE_HINT}",
                    variable="CE_SECRET_KEY",
                ) from None
        self._fernet = MultiFernet(fernets)
        self._key_count = len(fernets)

    def __repr__(self) -> str:
        return f"SecretBox(keys={self._key_count})"

    def encrypt(self, plaintext: str) -> str:
        """The ciphertext (an opaque ASCII token) of `plaintext`, under the first key."""
        return self._fernet.encrypt(plaintext.encode("utf-8")).decode("ascii")

    def decrypt(self, token: str) -> str:
        """The plaintext of `token`. Raises SecretDecryptError if no key opens it or it was altered."""
        try:
            return self._fernet.decrypt(_token_bytes(token)).decode("utf-8")
        except (InvalidToken, UnicodeDecodeError):
            raise SecretDecryptError(_UNREADABLE) from None

    def rotate(self, token: str) -> str:
        """`token` re-encrypted under the first key (run over stored rows after adding a new key).

        Raises SecretDecryptError like `decrypt`.
        """
        try:
            return self._fernet.rotate(_token_bytes(token)).decode("ascii")
        except InvalidToken:
            raise SecretDecryptError(_UNREADABLE) from None


_UNREADABLE = (
    "stored secret cannot be decrypted: it was encrypted with a key that is not in CE_SECRET_KEY "
    "(rotated out?) or it was altered; restore the old key in CE_SECRET_KEY or re-enter the secret"
)


def _token_bytes(token: str) -> bytes:
    if not isinstance(token, str):
        raise SecretDecryptError(_UNREADABLE)
    try:
        return token.encode("ascii")
    except UnicodeEncodeError:
        raise SecretDecryptError(_UNREADABLE) from None


def load_or_create_key(path: str | os.PathLike[str]) -> str:
    """The key stored at `path` (e.g. `.data/secret.key`), created there with mode 0600 if absent.

    `path` may also be a directory (`.data`): the key file is then `<path>/secret.key`.

    For local runs only; production sets CE_SECRET_KEY. Creation is atomic (write to a temporary
    file, then link), so two processes starting together end up with the same key. A key file
    readable by group or others is tightened to 0600. Raises ConfigError if the file holds no
    valid key.
    """
    target = Path(path)
    if target.is_dir():
        target = target / DEFAULT_KEY_FILE
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not target.exists():
        _create_key_file(target)
    mode = stat.S_IMODE(target.stat().st_mode)
    if mode & 0o077:
        os.chmod(target, 0o600)
        structlog.get_logger(__name__).warning(
            "secret_key_file_permissions_tightened", path=str(target), old_mode=oct(mode)
        )
    key = target.read_text(encoding="ascii").strip()
    try:
        Fernet(key.encode("ascii"))
    except ValueError:
        raise ConfigError(
            f"key file {str(target)!r} does not hold a valid key; delete it to create a new one "
            "(secrets encrypted with the old key become unreadable) or set CE_SECRET_KEY",
            variable="CE_SECRET_KEY",
        ) from None
    return key


def _create_key_file(target: Path) -> None:
    fd, tmp_name = tempfile.mkstemp(prefix=".secret-", dir=target.parent)  # mkstemp: mode 0600
    try:
        with os.fdopen(fd, "w", encoding="ascii") as handle:
            handle.write(generate_key() + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.link(tmp_name, target)  # fails if another process created it first: keep theirs
        except FileExistsError:
            pass
        except OSError:  # no hard links on this filesystem: exclusive create instead
            _create_exclusive(target, Path(tmp_name).read_text(encoding="ascii"))
    finally:
        os.unlink(tmp_name)


def _create_exclusive(target: Path, content: str) -> None:
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    with os.fdopen(fd, "w", encoding="ascii") as handle:
        handle.write(content)
        handle.flush()
        os.fsync(handle.fileno())
