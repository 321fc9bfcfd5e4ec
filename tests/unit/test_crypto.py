"""SecretBox: round trip, key rotation, tamper detection, errors that leak nothing, the local key file."""

from __future__ import annotations

import os
import stat

import pytest

from kernel.errors import ConfigError
from services.tools.crypto import SecretBox, SecretDecryptError, generate_key, load_or_create_key

PLAINTEXT = "Bearer sk-live-0123456789abcdef"


def test_encrypt_then_decrypt_returns_the_plaintext() -> None:
    box = SecretBox([generate_key()])
    token = box.encrypt(PLAINTEXT)
    assert box.decrypt(token) == PLAINTEXT


def test_ciphertext_does_not_contain_the_plaintext_and_differs_each_time() -> None:
    box = SecretBox([generate_key()])
    first, second = box.encrypt(PLAINTEXT), box.encrypt(PLAINTEXT)
    assert "sk-live" not in first
    assert first != second  # random IV: equal secrets are not recognisable at rest


def test_unicode_plaintext_round_trips() -> None:
    box = SecretBox([generate_key()])
    assert box.decrypt(box.encrypt("Bearer ключ-🔑")) == "Bearer ключ-🔑"


def test_new_key_first_still_decrypts_tokens_of_the_old_key() -> None:
    old, new = generate_key(), generate_key()
    token = SecretBox([old]).encrypt(PLAINTEXT)
    assert SecretBox([new, old]).decrypt(token) == PLAINTEXT


def test_rotate_re_encrypts_under_the_first_key_so_the_old_key_can_be_dropped() -> None:
    old, new = generate_key(), generate_key()
    token = SecretBox([old]).encrypt(PLAINTEXT)
    rotated = SecretBox([new, old]).rotate(token)
    assert SecretBox([new]).decrypt(rotated) == PLAINTEXT
    with pytest.raises(SecretDecryptError):
        SecretBox([old]).decrypt(rotated)


def test_token_of_a_rotated_out_key_is_refused_with_a_clear_error_that_leaks_nothing() -> None:
    old, new = generate_key(), generate_key()
    token = SecretBox([old]).encrypt(PLAINTEXT)
    with pytest.raises(SecretDecryptError, match="cannot be decrypted.*CE_SECRET_KEY") as info:
        SecretBox([new]).decrypt(token)
    text = str(info.value)
    assert token not in text and PLAINTEXT not in text and old not in text and new not in text
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_rotate_of_a_token_no_key_opens_raises_the_same_error() -> None:
    token = SecretBox([generate_key()]).encrypt(PLAINTEXT)
    with pytest.raises(SecretDecryptError, match="cannot be decrypted"):
        SecretBox([generate_key()]).rotate(token)


@pytest.mark.parametrize("position", [0, 10, 40, -5])
def test_a_tampered_token_is_detected(position: int) -> None:
    box = SecretBox([generate_key()])
    token = box.encrypt(PLAINTEXT)
    flipped = "A" if token[position] != "A" else "B"
    index = position % len(token)
    tampered = token[:index] + flipped + token[index + 1 :]
    assert tampered != token
    with pytest.raises(SecretDecryptError) as info:
        box.decrypt(tampered)
    assert tampered not in str(info.value)


@pytest.mark.parametrize("garbage", ["", "not-a-token", "gAAAAA", "ключ"])
def test_garbage_is_refused_as_undecryptable(garbage: str) -> None:
    with pytest.raises(SecretDecryptError):
        SecretBox([generate_key()]).decrypt(garbage)


def test_no_key_is_a_config_error_naming_the_variable() -> None:
    with pytest.raises(ConfigError, match="CE_SECRET_KEY") as info:
        SecretBox([])
    assert info.value.variable == "CE_SECRET_KEY"


def test_an_invalid_key_is_a_config_error_giving_its_position_not_its_value() -> None:
    bad = "this-is-not-a-fernet-key"
    with pytest.raises(ConfigError, match="key #2 is not a valid key") as info:
        SecretBox([generate_key(), bad])
    assert bad not in str(info.value)


def test_comma_separated_keys_string_is_accepted_like_the_environment_variable() -> None:
    old, new = generate_key(), generate_key()
    token = SecretBox([old]).encrypt(PLAINTEXT)
    box = SecretBox(f"{new}, {old}")
    assert box.decrypt(token) == PLAINTEXT
    assert SecretBox([new]).decrypt(box.encrypt("x")) == "x"


def test_repr_shows_no_key_material() -> None:
    key = generate_key()
    assert key not in repr(SecretBox([key]))
    assert repr(SecretBox([key])) == "SecretBox(keys=1)"


def test_generate_key_gives_distinct_usable_keys() -> None:
    a, b = generate_key(), generate_key()
    assert a != b
    assert SecretBox([a]).decrypt(SecretBox([a]).encrypt("x")) == "x"


def test_load_or_create_key_writes_a_0600_key_file_and_returns_the_same_key_later(tmp_path) -> None:
    path = tmp_path / ".data" / "secret.key"
    key = load_or_create_key(path)
    assert path.exists()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_or_create_key(path) == key
    assert SecretBox([key]).decrypt(SecretBox([key]).encrypt("x")) == "x"
    assert [p.name for p in path.parent.iterdir()] == ["secret.key"]  # no temporary file left


def test_load_or_create_key_accepts_the_data_directory(tmp_path) -> None:
    data = tmp_path / ".data"
    data.mkdir()
    key = load_or_create_key(data)
    assert (data / "secret.key").read_text().strip() == key


def test_load_or_create_key_tightens_a_world_readable_key_file(tmp_path) -> None:
    path = tmp_path / "secret.key"
    path.write_text(generate_key())
    os.chmod(path, 0o644)
    load_or_create_key(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_load_or_create_key_refuses_a_corrupt_key_file(tmp_path) -> None:
    path = tmp_path / "secret.key"
    path.write_text("garbage")
    os.chmod(path, 0o600)
    with pytest.raises(ConfigError, match="does not hold a valid key"):
        load_or_create_key(path)
