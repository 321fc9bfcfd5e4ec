"""Contact tokens (services.contacts), pure: a tenant's settings checked when saved, and a token
verified with PyJWT against them: signature, `alg` from the tenant's allowlist only, lifetime,
issuer, audience; every refusal names the check that failed and never echoes the token."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time

import jwt
import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kernel.errors import InvalidInput
from services.contacts import (
    TEST_KID,
    TEST_TTL_S,
    Contact,
    ContactVerification,
    ContactVerifier,
    TokenRefused,
    check_verification,
    keys_for_test_contacts,
    mint_test_token,
)
from services.gateway.config_routes import check_scope_claims

ED = ed25519.Ed25519PrivateKey.generate()
EC = ec.generate_private_key(ec.SECP256R1())
RSA = rsa.generate_private_key(public_exponent=65537, key_size=2048)
OTHER_ED = ed25519.Ed25519PrivateKey.generate()
SECRET = "s" * 48


def public_jwk(key, kid: str) -> dict:
    algorithm = {ed25519.Ed25519PrivateKey: jwt.algorithms.OKPAlgorithm,
                 ec.EllipticCurvePrivateKey: jwt.algorithms.ECAlgorithm,
                 rsa.RSAPrivateKey: jwt.algorithms.RSAAlgorithm}
    for cls, alg in algorithm.items():
        if isinstance(key, cls):
            return {**json.loads(alg.to_jwk(key.public_key())), "kid": kid}
    raise AssertionError(key)


SETTINGS = ContactVerification(
    algorithms=("EdDSA", "ES256", "RS256", "HS256"),
    keys=(public_jwk(ED, "ed"), public_jwk(EC, "ec"), public_jwk(RSA, "rsa")),
    issuer="https://login.example", audience="hotel-bot", max_lifetime_s=3600,
    scope_claims={"account_id": "sub", "stay_id": "stay"},
)
VERIFIER = ContactVerifier(SETTINGS, hs256_secret=SECRET)


def claims(**over) -> dict:
    now = int(time.time())
    return {"sub": "guest-1", "stay": "S-42", "iss": SETTINGS.issuer, "aud": SETTINGS.audience,
            "iat": now, "exp": now + 600, **over}


def token(key=ED, alg="EdDSA", kid="ed", **over) -> str:
    return jwt.encode(claims(**over), key, algorithm=alg, headers={"kid": kid} if kid else None)


def refused(raw: str) -> TokenRefused:
    with pytest.raises(TokenRefused) as caught:
        VERIFIER.verify(raw)
    assert not raw or (raw not in str(caught.value) and raw[-20:] not in str(caught.value))  # never echoed
    return caught.value


@pytest.mark.parametrize(("key", "alg", "kid"), [(ED, "EdDSA", "ed"), (EC, "ES256", "ec"), (RSA, "RS256", "rsa"),
                                                 (SECRET, "HS256", None)])
def test_a_token_signed_as_configured_gives_the_contact_and_its_scope(key, alg, kid):
    contact = VERIFIER.verify(token(key, alg, kid))
    assert contact.sub == "guest-1" and contact.scope == {"account_id": "guest-1", "accountId": "guest-1", "stay_id": "S-42"}


def test_a_scope_claim_the_token_lacks_is_left_out_not_made_up():
    contact = VERIFIER.verify(token(stay=None))
    assert contact.scope == {"account_id": "guest-1", "accountId": "guest-1"}


@pytest.mark.parametrize(("raw", "check"), [
    (lambda: token(OTHER_ED), "signature"),
    (lambda: jwt.encode(claims(), None, algorithm="none"), "algorithm"),
    (lambda: token(ec.generate_private_key(ec.SECP384R1()), "ES384", "ec"), "algorithm"),
    (lambda: token(exp=int(time.time()) - 300), "expired"),
    (lambda: token(nbf=int(time.time()) + 300), "not yet valid"),
    (lambda: token(iat=int(time.time()) + 300), "not yet valid"),
    (lambda: token(aud="another-bot"), "audience"),
    (lambda: token(iss="https://evil.example"), "issuer"),
    (lambda: token(exp=int(time.time()) + 7200), "lifetime"),
    (lambda: token(sub=None), "sub"),
    (lambda: token(kid="unknown"), "key"),
    (lambda: "not.a.token", "malformed"),
    (lambda: "", "malformed"),
])
def test_each_refusal_says_which_check_failed(raw, check):
    assert refused(raw()).check == check


def hs256_signed_with(secret: bytes, payload: dict) -> str:
    """An HS256 token made by hand (PyJWT refuses to use a public key as an HMAC secret)."""
    def b64(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode()
    signing_input = b64(json.dumps({"alg": "HS256", "typ": "JWT"}).encode()) + "." + b64(json.dumps(payload).encode())
    return signing_input + "." + b64(hmac.new(secret, signing_input.encode(), hashlib.sha256).digest())


def test_an_hs256_token_made_with_a_public_key_as_its_secret_is_refused():
    pem = RSA.public_key().public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo)
    for secret in (pem, json.dumps(public_jwk(RSA, "rsa")).encode()):
        assert refused(hs256_signed_with(secret, claims())).check == "signature"
        rs_only = ContactVerifier(msgspec.structs.replace(SETTINGS, algorithms=("RS256",)), hs256_secret=None)
        with pytest.raises(TokenRefused) as caught:
            rs_only.verify(hs256_signed_with(secret, claims()))
        assert caught.value.check == "algorithm"
    assert VERIFIER.verify(hs256_signed_with(SECRET.encode(), claims())).sub == "guest-1"  # the helper is sound


def test_hs256_is_refused_when_the_tenant_has_no_secret():
    verifier = ContactVerifier(SETTINGS, hs256_secret=None)
    with pytest.raises(TokenRefused) as caught:
        verifier.verify(token(SECRET, "HS256", None))
    assert caught.value.check == "key"


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(payload=st.dictionaries(st.sampled_from(["sub", "stay", "iss", "aud", "iat", "exp", "nbf", "x"]),
                               st.one_of(st.text(max_size=20), st.integers(), st.none()), max_size=8),
       alg=st.sampled_from(["EdDSA", "ES256", "RS256", "HS256", "none", "HS384"]),
       tamper=st.integers(min_value=0, max_value=200))
def test_no_token_without_a_valid_signature_is_ever_accepted(payload, alg, tamper):
    # signed with keys the tenant does not have (or tampered after signing by its own key)
    keys = {"EdDSA": OTHER_ED, "ES256": ec.generate_private_key(ec.SECP256R1()), "RS256": None,
            "HS256": "another-secret-of-enough-length-xxxxxxxx", "none": None, "HS384": SECRET}
    try:
        raw = jwt.encode(payload, keys[alg], algorithm="none" if keys[alg] is None else alg)
    except (TypeError, ValueError):
        assume(False)  # PyJWT will not even make it (a claim of the wrong type)
    with pytest.raises(TokenRefused):
        VERIFIER.verify(raw)
    good = token()
    head, body, signature = good.split(".")
    mangled = f"{head}.{body}.{signature[:tamper % len(signature)]}x{signature[tamper % len(signature) + 1:]}"
    if mangled != good:
        with pytest.raises(TokenRefused):
            VERIFIER.verify(mangled)


# -- the settings, when a tenant saves them --------------------------------------------------------

def test_settings_a_token_could_never_pass_are_refused_when_saved_naming_the_field():
    with pytest.raises(InvalidInput, match="algorithms"):
        check_verification(ContactVerification(algorithms=("none",), issuer="i", audience="a"), has_secret=False)
    with pytest.raises(InvalidInput, match="algorithms"):
        check_verification(ContactVerification(algorithms=(), issuer="i", audience="a"), has_secret=False)
    with pytest.raises(InvalidInput, match="hs256_secret"):
        check_verification(ContactVerification(algorithms=("HS256",), issuer="i", audience="a"), has_secret=False)
    with pytest.raises(InvalidInput, match="keys"):
        check_verification(ContactVerification(algorithms=("EdDSA",), issuer="i", audience="a"), has_secret=False)
    private = {**public_jwk(ED, "ed"), "d": "private-part"}
    with pytest.raises(InvalidInput, match="private"):
        check_verification(ContactVerification(algorithms=("EdDSA",), keys=(private,), issuer="i", audience="a"),
                           has_secret=False)
    with pytest.raises(InvalidInput, match="not a JWK"):
        check_verification(ContactVerification(algorithms=("EdDSA",), keys=({"kty": "nope"},), issuer="i",
                                               audience="a"), has_secret=False)
    with pytest.raises(InvalidInput, match="issuer"):
        check_verification(ContactVerification(algorithms=("EdDSA",), keys=(public_jwk(ED, "ed"),), issuer="",
                                               audience="a"), has_secret=False)
    with pytest.raises(InvalidInput, match="max_lifetime_s"):
        check_verification(ContactVerification(algorithms=("EdDSA",), keys=(public_jwk(ED, "ed"),), issuer="i",
                                               audience="a", max_lifetime_s=0), has_secret=False)
    check_verification(SETTINGS, has_secret=True)  # all four, keys and a secret: fine


@pytest.mark.parametrize(("mapping", "refusal"), [
    ({"tenant_id": "org"}, "the tenant's id"),   # a token never says which tenant it is
    ({"TenantId": "org"}, "the tenant's id"),
    ({"AccountId": "sub"}, "spells 'accountId' or 'account_id' another way"),
    ({"stay id": "stay"}, "not a parameter name"),
    ({"stay_id": ""}, "must name a claim"),
    ({f"k{i}": "c" for i in range(17)}, "at most 16"),
])
def test_a_claim_mapping_no_tool_could_use_or_that_names_the_tenant_is_refused(mapping, refusal):
    with pytest.raises(InvalidInput, match=refusal) as caught:
        check_scope_claims(mapping)
    assert caught.value.path.startswith("$.contact_verification.scope_claims")


def test_an_account_mapped_under_either_name_is_held_under_both():
    for name in ("account_id", "accountId"):
        check_scope_claims({name: "sub", "stay_id": "stay"})
        verifier = ContactVerifier(msgspec.structs.replace(SETTINGS, scope_claims={name: "sub"}), hs256_secret=SECRET)
        assert verifier.verify(token(SECRET, "HS256", None)).scope == {"account_id": "guest-1", "accountId": "guest-1"}


def test_a_test_contact_minted_with_the_tenants_test_key_passes_and_is_always_test_prefixed():
    keys_a, keys_b = keys_for_test_contacts(["k-one"], "tenant-a"), keys_for_test_contacts(["k-one"], "tenant-b")
    assert keys_a != keys_b and keys_for_test_contacts(["k-two", "k-one"], "tenant-a")[1] == keys_a[0]  # rotation
    raw, sub, expires = mint_test_token(keys_a[0], SETTINGS, "ann", {"stay": "S-7"})
    assert sub == "test:ann" and expires - time.time() <= TEST_TTL_S + 1
    verifier = ContactVerifier(SETTINGS, hs256_secret=SECRET, test_keys=keys_a)
    assert verifier.verify(raw) == Contact(sub="test:ann", scope={"account_id": "test:ann", "accountId": "test:ann",
                                                                  "stay_id": "S-7"})
    # another tenant's test key, or a tenant whose engine holds none, does not pass it
    assert refused_by(ContactVerifier(SETTINGS, hs256_secret=SECRET, test_keys=keys_b), raw).check == "signature"
    assert refused(raw).check == "key"
    # the test kid with another algorithm, or a test sub without the engine's key
    forged = jwt.encode(claims(sub="test:ann"), ED, algorithm="EdDSA", headers={"kid": TEST_KID})
    assert refused_by(verifier, forged).check == "algorithm"
    assert refused_by(verifier, token(sub="test:ann")).check == "test sub"  # a real token may not claim it
    with pytest.raises(InvalidInput, match="claim 'sub'"):
        mint_test_token(keys_a[0], SETTINGS, "ann", {"sub": "bob"})


def refused_by(verifier: ContactVerifier, raw: str) -> TokenRefused:
    with pytest.raises(TokenRefused) as caught:
        verifier.verify(raw)
    return caught.value
