"""Verified contacts: a tenant's contact-token settings and the verification of a token.

A tenant that signs its customers in gives each a JWT (its `Contact-Token`); the engine checks it
with PyJWT, never by hand: the signature with the tenant's public keys (JWKs) or its HS256 secret,
`alg` from the tenant's allowlist only (never `none`; an HS256 token is checked with the secret
alone, so a public key can never serve as an HMAC secret), `exp`, `nbf` and `iat` with a small
leeway, the longest lifetime the tenant accepts, issuer and audience. What passes is the contact
(`sub`) and the trusted scope the tenant maps from its claims (`scope_claims`). Every refusal
names the check that failed and what to do, and never repeats the token.

Test contacts: an admin may have the engine mint a token for a made-up customer (the dashboard's
"Try it" signs in as one) with the tenant's test key, an HMAC key derived from the engine's
secret key and the tenant's id (`keys_for_test_contacts`), which no one outside the engine holds. Such a token
(`kid` "chat-engine-test") passes only that key, and its `sub` always starts with `test:`, so a
test contact can never be, or read the sessions of, a real customer.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Sequence
from typing import Any

import jwt
import msgspec

from kernel.errors import InvalidInput, Unauthorized

#: what a tenant may accept; anything else (`none` first of all) is refused before any key is tried
ALGORITHMS = ("EdDSA", "ES256", "RS256", "HS256")
#: the JWK key type each asymmetric algorithm needs
_KEY_TYPES = {"EdDSA": "OKP", "ES256": "EC", "RS256": "RSA"}
#: clock difference allowed between the tenant's sign-in service and the engine
LEEWAY_S = 30
MAX_LIFETIME_S = 7 * 86400
MAX_SUB = 256
MAX_KEYS = 20
#: what marks a token the engine minted for a test contact, and what every test contact's sub starts with
TEST_KID, TEST_ISSUER, TEST_PREFIX = "chat-engine-test", "chat-engine test contacts", "test:"
TEST_TTL_S = 900
MAX_SCOPE_CLAIMS = 16
MAX_CLAIM = 64
#: private members of a JWK: a tenant must never send its signing key
_PRIVATE_MEMBERS = frozenset({"d", "p", "q", "dp", "dq", "qi", "k"})


class ContactVerification(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A tenant's contact-token settings (bot-config `contact_verification`)."""

    #: anonymous messages are refused (401) when set
    required: bool = False
    algorithms: tuple[str, ...] = ()
    #: public JWKs; a `kid` in a token's header picks one
    keys: tuple[dict[str, Any], ...] = ()
    #: the HS256 secret, encrypted (the API takes `hs256_secret` write-only)
    hs256_secret_enc: str | None = None
    issuer: str = ""
    audience: str = ""
    #: the longest lifetime (exp - iat) a token may have
    max_lifetime_s: int = 3600
    #: scope key -> the claim it is read from: {"account_id": "sub", "stay_id": "stay"}
    scope_claims: dict[str, str] = {}


class Contact(msgspec.Struct, frozen=True, kw_only=True):
    """Who a verified token says is writing, and the trusted scope its claims give."""

    sub: str
    scope: dict[str, str] = {}


class TokenRefused(Unauthorized):
    """A Contact-Token that does not pass `check` (401); the message says what to do."""

    def __init__(self, check: str, advice: str) -> None:
        super().__init__(f"the Contact-Token was refused ({check}): {advice}")
        self.check = check


def check_verification(settings: ContactVerification, *, has_secret: bool) -> None:
    """Refuse settings no token could pass, or that would hold a private key. Raises InvalidInput
    naming the field under `$.contact_verification`."""
    at = "$.contact_verification"
    if not settings.algorithms or any(a not in ALGORITHMS for a in settings.algorithms):
        raise InvalidInput(f"algorithms must name one or more of {', '.join(ALGORITHMS)} - at `{at}.algorithms`",
                           path=f"{at}.algorithms")
    if "HS256" in settings.algorithms and not has_secret:
        raise InvalidInput(f"HS256 is accepted but no hs256_secret is set; send it (at least 32 characters) or "
                           f"leave HS256 out - at `{at}.hs256_secret`", path=f"{at}.hs256_secret")
    asymmetric = [a for a in settings.algorithms if a != "HS256"]
    if asymmetric and not settings.keys:
        raise InvalidInput(f"{', '.join(asymmetric)} accepted but no public keys given; send them as JWKs in "
                           f"`keys` - at `{at}.keys`", path=f"{at}.keys")
    if len(settings.keys) > MAX_KEYS:
        raise InvalidInput(f"at most {MAX_KEYS} keys - at `{at}.keys`", path=f"{at}.keys")
    for i, key in enumerate(settings.keys):
        where = f"{at}.keys[{i}]"
        if _PRIVATE_MEMBERS & key.keys():
            raise InvalidInput(f"keys[{i}] holds private key material; send the public key only (never `d`, "
                               f"`p`, `q`, `k`) - at `{where}`", path=where)
        try:
            parsed = jwt.PyJWK(key)
        except (jwt.PyJWKError, jwt.InvalidKeyError, ValueError, TypeError, KeyError):
            raise InvalidInput(f"keys[{i}] is not a JWK this engine can use (an OKP Ed25519, EC P-256 or RSA "
                               f"public key) - at `{where}`", path=where) from None
        if parsed.key_type not in {_KEY_TYPES[a] for a in asymmetric}:
            raise InvalidInput(f"keys[{i}] is a {parsed.key_type} key, which none of the accepted algorithms "
                               f"uses - at `{where}`", path=where)
    for name in ("issuer", "audience"):
        if not getattr(settings, name).strip():
            raise InvalidInput(f"{name} must be set: tokens are checked against it - at `{at}.{name}`",
                               path=f"{at}.{name}")
    if not 60 <= settings.max_lifetime_s <= MAX_LIFETIME_S:
        raise InvalidInput(f"max_lifetime_s must be from 60 to {MAX_LIFETIME_S} seconds - at "
                           f"`{at}.max_lifetime_s`", path=f"{at}.max_lifetime_s")


def keys_for_test_contacts(secret_keys: Sequence[str], tenant_id: str) -> tuple[bytes, ...]:
    """The tenant's test-contact keys, one per configured secret key (the first signs, every one
    verifies: rotation), domain-separated from the engine's other uses of them."""
    message = b"chat-engine test contacts v1\x00" + tenant_id.encode()
    return tuple(hmac.new(k.encode(), message, hashlib.sha256).digest() for k in secret_keys)


def mint_test_token(key: bytes, settings: ContactVerification, sub: str, claims: dict[str, str | int],
                    *, ttl_s: int = TEST_TTL_S, now: float | None = None) -> tuple[str, str, int]:
    """A test contact's token for the tenant whose settings these are: (token, sub, exp). The sub
    gets `test:` in front; `claims` (the ones `scope_claims` reads: `stay`) go in beside the
    registered ones, which they cannot replace. Raises InvalidInput naming the field."""
    if not isinstance(sub, str) or not 0 < len(sub) <= MAX_SUB - len(TEST_PREFIX):
        raise InvalidInput(f"sub must be 1-{MAX_SUB - len(TEST_PREFIX)} characters - at `$.sub`", path="$.sub")
    if len(claims) > MAX_SCOPE_CLAIMS:
        raise InvalidInput(f"at most {MAX_SCOPE_CLAIMS} claims - at `$.claims`", path="$.claims")
    for name in claims:
        if name in _REGISTERED or not 0 < len(name) <= MAX_CLAIM:
            raise InvalidInput(f"claim {name[:70]!r} is not one a test contact may carry (1-{MAX_CLAIM} characters; "
                               f"never {', '.join(sorted(_REGISTERED))}) - at `$.claims`", path="$.claims")
    issued = int(time.time() if now is None else now)
    expires = issued + max(60, min(ttl_s, settings.max_lifetime_s))
    full = TEST_PREFIX + sub
    payload = {**claims, "sub": full, "iss": TEST_ISSUER, "aud": settings.audience, "iat": issued, "exp": expires}
    return jwt.encode(payload, key, algorithm="HS256", headers={"kid": TEST_KID}), full, expires


#: the claims a test token's own fields hold
_REGISTERED = frozenset({"sub", "iss", "aud", "iat", "exp", "nbf", "jti"})


class ContactVerifier:
    """Verifies tokens against one tenant's settings (keys parsed once), and test contacts'
    tokens against the tenant's test keys."""

    def __init__(self, settings: ContactVerification, *, hs256_secret: str | None,
                 test_keys: Sequence[bytes] = ()) -> None:
        self.settings = settings
        self._secret = hs256_secret
        self._test_keys = tuple(test_keys)
        self._keys: list[tuple[str | None, jwt.PyJWK]] = []
        for key in settings.keys:
            try:
                self._keys.append((key.get("kid"), jwt.PyJWK(key)))
            except (jwt.PyJWKError, jwt.InvalidKeyError, ValueError, TypeError, KeyError):
                continue  # refused when saved; one stored before that check is skipped

    @property
    def required(self) -> bool:
        return self.settings.required

    def verify(self, token: str) -> Contact:
        """The contact a token names; raises TokenRefused saying which check failed."""
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            raise _refused("malformed") from None
        alg = header.get("alg")
        if header.get("kid") == TEST_KID:
            return self._verify_test(token, alg)
        if alg not in self.settings.algorithms or alg not in ALGORITHMS:
            raise _refused("algorithm")
        keys = self._keys_for(alg, header.get("kid"))
        if not keys:
            raise _refused("key")
        claims = self._decode(token, keys, alg, self.settings.issuer)
        contact = self._contact(claims)
        if contact.sub.startswith(TEST_PREFIX):
            raise _refused("test sub")  # the engine's own test contacts' only
        return contact

    def _verify_test(self, token: str, alg: Any) -> Contact:
        """A test contact's token: HS256 with one of the tenant's test keys, nothing else."""
        if alg != "HS256":
            raise _refused("algorithm")
        if not self._test_keys:
            raise _refused("key")
        contact = self._contact(self._decode(token, self._test_keys, "HS256", TEST_ISSUER))
        if not contact.sub.startswith(TEST_PREFIX):
            raise _refused("sub")
        return contact

    def _decode(self, token: str, keys: Sequence[Any], alg: str, issuer: str) -> dict[str, Any]:
        claims: dict[str, Any] | None = None
        failure: str = "signature"
        for key in keys:
            try:
                claims = jwt.decode(
                    token, key, algorithms=[alg], audience=self.settings.audience, issuer=issuer,
                    leeway=LEEWAY_S, options={"require": ["exp", "iat", "iss", "aud"]},
                )
                break
            except jwt.InvalidSignatureError:
                continue  # another key of the tenant may have signed it
            except jwt.PyJWTError as exc:
                failure = _check_of(exc)
                break
        if claims is None:
            raise _refused(failure)
        if claims["exp"] - claims["iat"] > self.settings.max_lifetime_s:
            raise _refused("lifetime")
        return claims

    def _contact(self, claims: dict[str, Any]) -> Contact:
        sub = claims.get("sub")
        if not isinstance(sub, str) or not 0 < len(sub) <= MAX_SUB:
            raise _refused("sub")
        scope = {name: str(claims[claim]) for name, claim in self.settings.scope_claims.items()
                 if isinstance(claims.get(claim), str | int) and not isinstance(claims.get(claim), bool)}
        return Contact(sub=sub, scope=both_account_spellings(scope))

    def _keys_for(self, alg: str, kid: Any) -> list[Any]:
        if alg == "HS256":
            return [self._secret] if self._secret else []
        kty = _KEY_TYPES[alg]
        return [key.key for k, key in self._keys if key.key_type == kty and (kid is None or k == kid)]


def both_account_spellings(scope: dict[str, str]) -> dict[str, str]:
    """`scope` (a contact's scope, or the claim mapping that makes it) with the account under both
    names tools may give it (`account_id`, `accountId`), whichever one the tenant mapped, as the
    tenant's id is held under both of its names."""
    for name, other in (("account_id", "accountId"), ("accountId", "account_id")):
        if name in scope and other not in scope:
            scope = {**scope, other: scope[name]}
    return scope


_ADVICE = {
    "malformed": "it is not a JWT; send the token the sign-in service issued, whole",
    "algorithm": "its `alg` is not one this tenant accepts (never `none`); sign with an accepted algorithm",
    "key": "no key of this tenant matches its `alg` and `kid`; sign with a key the tenant configured",
    "signature": "its signature does not match this tenant's keys; sign with the tenant's key",
    "expired": "it has expired; get a fresh token from the sign-in service",
    "not yet valid": "it is not valid yet (`nbf` or `iat` in the future); check the signing clock",
    "audience": "its `aud` is not this tenant's audience",
    "issuer": "its `iss` is not this tenant's issuer",
    "claims": "it lacks `exp`, `iat`, `iss` or `aud`; issue tokens with all four",
    "lifetime": "it lives longer than this tenant accepts (max_lifetime_s); issue shorter-lived tokens",
    "sub": "it names no contact (`sub`, a string of 1-256 characters)",
    "test sub": "its `sub` starts with `test:`, which names the engine's test contacts only; give the customer another",
}


def _refused(check: str) -> TokenRefused:
    return TokenRefused(check, _ADVICE[check])


#: PyJWT's refusals, most specific first, as the check they name (anything else: "malformed")
_CHECKS: tuple[tuple[type[jwt.PyJWTError], str], ...] = (
    (jwt.ExpiredSignatureError, "expired"),
    (jwt.ImmatureSignatureError, "not yet valid"),
    (jwt.InvalidAudienceError, "audience"),
    (jwt.InvalidIssuerError, "issuer"),
    (jwt.MissingRequiredClaimError, "claims"),
    (jwt.InvalidAlgorithmError, "algorithm"),
    (jwt.InvalidSignatureError, "signature"),
    (jwt.exceptions.InvalidSubjectError, "sub"),
    (jwt.InvalidIssuedAtError, "claims"),
)


def _check_of(exc: jwt.PyJWTError) -> str:
    return next((check for kind, check in _CHECKS if isinstance(exc, kind)), "malformed")
