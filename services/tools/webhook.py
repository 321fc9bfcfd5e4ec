"""The webhook client: the only place the engine makes outbound HTTP calls for tools.

Owns
- the calls a tool's URL template and binding describe, built by the pure module
  `services.tools.templating` (`render_request`, `binding_arguments`), sent over HTTP here;
- `WebhookToolBackend`: the registry's `ToolBackend` port (services.tools.registry) over the client;
- `idempotency_header`: a write's idempotency key as a header can carry it (the MCP client's too);
- `WebhookClient`: one aiohttp ClientSession per process. Every call is SSRF-checked
  (`services.tools.ssrf.check_destination`: host resolved once, every address checked), then
  connects only to the checked addresses through `_CheckedAddressResolver`; redirects are not
  followed; the response body is capped and the whole call (resolution, connect, headers, body)
  runs under one deadline, so a server that drips bytes cannot hold the call open. A 2xx body has
  every credential the call sent (the decrypted `Authorization`, any header with a secret-looking
  name, a credential the url template carries itself: `redaction.url_secrets`) replaced by
  [redacted] before it is decoded: an upstream that echoes its request headers or its url cannot
  hand the credential to the model, the call record or a log. A 2xx body nested more than
  `services.nesting.MAX_JSON_DEPTH` levels is malformed (counted before it is decoded), and a
  tool's result more than `MAX_VALUE_DEPTH` levels too (its call record could not be made).

Protected keys (tenant/account, a tool's own `protected`) reach a webhook only in the URL holes
they name, with the trusted scope's value (`WebhookClient.call_webhook`).

Every failure is a `services.tools.errors.ToolError` with a lower-case reason for the model. No
reason or log line carries a header value (the decrypted auth header above all) or a query value.
A response body never reaches a log line; of a rejected request's body (400, 404, 409, 422: at
most 4 KB, read within the call's deadline) the reason quotes only the upstream's own explanation
(`upstream_explanation`: one JSON string field or a short text/plain body, capped at 300
characters, with every credential the call sent replaced by [redacted]).
"""

from __future__ import annotations

import asyncio
import contextvars
import errno
import re
import socket
import string
import time
from collections.abc import Callable, Mapping
from typing import Any, Self
from urllib.parse import quote

import aiohttp
import msgspec
import structlog
import yarl
from aiohttp.abc import AbstractResolver, ResolveResult

from services.fairshare import waiting
from services.nesting import MAX_JSON_DEPTH, nests_deeper_than, raw_nests_deeper_than
from services.tools.context import TrustedContext
from services.tools.crypto import SecretBox, SecretDecryptError
from services.tools.errors import (
    MISCONFIGURED_ADVICE,
    SIGN_IN_ADVICE,
    DeadlineExceeded,
    InvalidArguments,
    PolicyDenied,
    ToolError,
    UpstreamMalformed,
    UpstreamStatus,
    UpstreamTimeout,
    UpstreamTooLarge,
    UpstreamUnreachable,
    blocked,
)
from services.tools.model import (
    ACCOUNT_KEYS,
    MAX_VALUE_DEPTH,
    BackendBindingTool,
    WebhookTool,
    is_protected,
    protected_forms,
)
from services.tools.redaction import (
    scrub_bytes,
    scrub_text,
    secret_forms,
    secret_name,
    url_secrets,
)
from services.tools.ssrf import (
    AresResolver,
    CheckedDestination,
    DestinationPolicy,
    Resolver,
    check_destination,
)
from services.tools.templating import binding_arguments, join_base, render_request, template_holes

DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB
#: statuses whose body may say what was wrong with the request (seed 001: "Check-out must be
#: after check-in; ask for corrected dates"); other errors' bodies are never read
EXPLAINED_STATUSES = frozenset({400, 404, 409, 422})
ERROR_BODY_MAX_BYTES = 4096  # a longer error body is not read: the status is answered alone
ERROR_BODY_WAIT_S = 1.0  # nor one slower than this (within the call's own deadline)
EXPLANATION_MAX_CHARS = 300  # what of it the model reads
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_READ_CHUNK = 64 * 1024
_HEADER_NAME_RE = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+\Z")
_HEADER_VALUE_BAD_RE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
# an idempotency key sent as it is (`idempotency_header`); any other has these kept and the rest encoded
_PLAIN_KEY_RE = re.compile(r"[\t\x20-\x7e]*\Z")
_ENCODED_KEY_SAFE = "".join(c for c in string.punctuation if c != "%")
_MIME_RE = re.compile(r"^[a-z0-9.+-]{1,40}/[a-z0-9.+-]{1,60}\Z")
# headers a caller may not set: they would change framing, routing or the connection itself
_FORBIDDEN_HEADERS = frozenset(
    {
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "upgrade",
        "te",
        "trailer",
        "proxy-authorization",
        "proxy-connection",
        "expect",
    }
)

_UNREACHABLE_ADVICE = (
    "Tell the customer you cannot reach the service right now and offer another way to help."
)
_TIMEOUT_ADVICE = (
    "Tell the customer you cannot retrieve this right now; they can try again in a few minutes."
)
_MALFORMED_ADVICE = "Tell the customer you cannot read the answer from the service right now."
_TOO_DEEP_ADVICE = (
    "Tell the customer you cannot read the answer from the service right now; calling it again will "
    "not help until the business fixes what it returns."
)
_CREDENTIALS_ADVICE = "Tell the customer you cannot access this right now; the business has to update the tool's credentials."

#: The destination the current call was checked against; read by `_CheckedAddressResolver`.
_checked_destination: contextvars.ContextVar[CheckedDestination | None] = contextvars.ContextVar(
    "webhook_checked_destination", default=None
)


class WebhookResponse(msgspec.Struct, frozen=True, kw_only=True):
    """A successful (2xx) upstream answer: `json` is the decoded body, None when the body was empty."""

    status: int
    json: Any
    elapsed_ms: float


# --------------------------------------------------------------------------- the client


class _Redacted(str):
    """A header value whose repr hides it (tracebacks with locals, multidict reprs)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "'[redacted]'"


class _UncheckedHost(OSError):
    """The connector asked to resolve a host that this call did not check."""


class _CheckedAddressResolver(AbstractResolver):
    """aiohttp resolver that answers only with the addresses `check_destination` approved.

    It never does DNS itself: the host was resolved once by the guard, and the connection must go
    to one of the addresses that were checked (no second lookup an attacker could rebind).
    """

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_UNSPEC
    ) -> list[ResolveResult]:
        destination = _checked_destination.get()
        if destination is None or host.rstrip(".").lower() != destination.host:
            raise _UncheckedHost(errno.EACCES, "host was not checked by the ssrf guard")
        flags = socket.AI_NUMERICHOST | socket.AI_NUMERICSERV
        return [
            ResolveResult(
                hostname=host,
                host=address,
                port=port,
                family=socket.AF_INET6 if ":" in address else socket.AF_INET,
                proto=0,
                flags=flags,
            )
            for address in destination.addresses
        ]

    async def close(self) -> None:
        return None


SocketFactory = Callable[[tuple[Any, ...]], socket.socket]


class WebhookClient:
    """Outbound HTTP for tools, SSRF-guarded and bounded. One instance (one session) per process.

    Use as `async with WebhookClient(policy=...) as client:` or call `start()` / `close()`.
    `resolver` defaults to `AresResolver` (c-ares, made on first use); `socket_factory` is passed
    to aiohttp's connector (tests use it to refuse any non-loopback connect).
    """

    def __init__(
        self,
        *,
        policy: DestinationPolicy,
        resolver: Resolver | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        connection_limit: int = 100,
        socket_factory: SocketFactory | None = None,
        user_agent: str = "chat-engine-webhook/0.1",
    ) -> None:
        self._policy = policy
        self._resolver: Resolver = resolver or AresResolver()
        self._max_body_bytes = max_body_bytes
        self._connection_limit = connection_limit
        self._socket_factory = socket_factory
        self._user_agent = user_agent
        self._session: aiohttp.ClientSession | None = None

    @property
    def policy(self) -> DestinationPolicy:
        """The operator-wide exceptions to the guard this client checks every call against."""
        return self._policy

    async def start(self) -> None:
        """Open the shared session (idempotent)."""
        if self._session is not None:
            return
        connector = aiohttp.TCPConnector(
            resolver=_CheckedAddressResolver(),
            use_dns_cache=False,  # every call must use the addresses it checked, not a cache
            limit=self._connection_limit,
            socket_factory=self._socket_factory,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            trust_env=False,  # a proxy from the environment would bypass the address check
            cookie_jar=aiohttp.DummyCookieJar(),  # no cookies carried between tenants' calls
            raise_for_status=False,
        )

    async def close(self) -> None:
        """Close the session and its connections (idempotent)."""
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ calls

    async def call(
        self,
        *,
        url_template: str,
        method: str,
        args: Mapping[str, Any],
        headers: Mapping[str, str],
        timeout_s: float,
        idempotency_key: str | None = None,
        tool_name: str | None = None,
        policy: DestinationPolicy | None = None,
    ) -> WebhookResponse:
        """Render, check, send and decode one request, all within `timeout_s` seconds; the
        destination is checked against `policy` (a tenant's: DestinationPolicy.for_tenant), else
        the client's own.

        Returns the 2xx answer with its JSON (None for an empty body). Raises InvalidArguments,
        DestinationBlocked (before any connection), UpstreamTimeout, UpstreamUnreachable,
        UpstreamStatus (3xx: redirects are not followed; 4xx; 5xx), UpstreamMalformed,
        UpstreamTooLarge, DeadlineExceeded (no time left on entry).
        """
        session = self._session
        if session is None:
            raise RuntimeError("WebhookClient is not started; use `async with` or await start()")
        if timeout_s <= 0:
            raise DeadlineExceeded("deadline passed before the call started")
        rendered = render_request(url_template, method, args)
        body_bytes: bytes | None = None
        if rendered.body is not None:
            try:
                body_bytes = msgspec.json.encode(rendered.body)
            except (TypeError, msgspec.EncodeError):
                raise InvalidArguments(
                    "arguments cannot be sent as json",
                    advice="Call the tool again with plain values.",
                ) from None
        request_headers = self._request_headers(
            headers, idempotency_key, has_body=body_bytes is not None
        )
        # what the body must not echo back: the credentials this call sends (not Accept & co.),
        # in its headers or written into its url by the tenant: a key in the query
        # (`?api_key=...`), a token as a path segment (`/services/T000/B000/<token>`)
        secrets = secret_forms(
            [v for v in request_headers.values() if isinstance(v, _Redacted)]
            + url_secrets(url_template)
        )

        log = structlog.get_logger(__name__)
        started = time.monotonic()
        destination: CheckedDestination | None = None
        try:
            try:
                async with asyncio.timeout(timeout_s):
                    destination = await check_destination(
                        rendered.url, self._resolver, policy or self._policy
                    )
                    response = await self._send(
                        session,
                        destination,
                        rendered.method,
                        request_headers,
                        body_bytes,
                        timeout_s,
                        started,
                        secrets,
                    )
            except TimeoutError:
                raise UpstreamTimeout("upstream timeout", advice=_TIMEOUT_ADVICE) from None
        except ToolError as error:
            log.info(
                "webhook_call_failed",
                tool_name=tool_name,
                method=rendered.method,
                host=destination.host if destination else None,
                error_kind=error.kind,
                status=getattr(error, "status", None),
                rule=getattr(error, "rule", None),
                detail=getattr(error, "detail", None),
                elapsed_ms=_elapsed_ms(started),
            )
            raise
        log.info(
            "webhook_call_completed",
            tool_name=tool_name,
            method=rendered.method,
            host=destination.host,
            status=response.status,
            elapsed_ms=response.elapsed_ms,
        )
        return response

    async def call_webhook(
        self,
        tool: WebhookTool,
        args: Mapping[str, Any],
        secret_box: SecretBox | None,
        timeout_s: float | None = None,
        *,
        idempotency_key: str | None = None,
        policy: DestinationPolicy | None = None,
    ) -> WebhookResponse:
        """Call a tenant webhook tool (seed 000) with the model's (already validated) arguments.

        `args` are the executor's prepared arguments (services.tools.executor.scoped_args): the
        model's protected keys were stripped at every depth and the trusted scope's values merged
        in, so a protected key in them holds the trusted value. That value fills a URL hole of its
        name (`{account_id}`); protected keys, in any spelling (`is_protected`), are sent nowhere
        else, and a hole named by another spelling (`{AccountId}`, which the trusted scope does
        not hold) is the PolicyDenied below. The auth header is decrypted here, at call time,
        and sent as `Authorization`. The time limit is the tool's
        `timeout_ms`, or `timeout_s` when that is shorter (the executor's remaining deadline).
        Raises as `call`, plus PolicyDenied when a protected hole has no trusted value (the tool
        is misconfigured: the customer cannot supply it) and ToolError when the stored auth header
        cannot be decrypted; errors carry `tool_name`.
        """
        forms = protected_forms(tool.protected_keys)
        clean = {k: v for k, v in args.items() if not is_protected(k, forms)}
        for hole in template_holes(tool.webhook_url):
            if not is_protected(hole, forms):
                continue
            if args.get(hole) is None and hole in ACCOUNT_KEYS:
                # the customer's account: only a verified contact's token gives it
                raise PolicyDenied(
                    f"the url needs {{{hole}}}, the customer's account, which only a signed-in customer's verified "
                    "identity gives, and this conversation has none",
                    advice=SIGN_IN_ADVICE, tool_name=tool.name,
                )
            if args.get(hole) is None:
                raise PolicyDenied(
                    f"the url needs {{{hole}}}, which only the business's trusted context may fill, and it "
                    "holds no value for it: the tool is misconfigured",
                    advice=MISCONFIGURED_ADVICE,
                    tool_name=tool.name,
                )
            clean[hole] = args[hole]
        headers: dict[str, str] = {}
        try:
            if tool.auth_header_enc:
                headers["Authorization"] = self._open_auth_header(tool, secret_box)
        except ToolError as error:
            error.tool_name = error.tool_name or tool.name
            raise
        return await self._call_tool(tool, tool.webhook_url, clean, headers, timeout_s, idempotency_key, policy)

    async def call_binding(
        self,
        base_url: str,
        tool: BackendBindingTool,
        model_args: Mapping[str, Any],
        trusted_scope: Mapping[str, Any],
        headers: Mapping[str, str],
        timeout_s: float | None = None,
        *,
        idempotency_key: str | None = None,
        policy: DestinationPolicy | None = None,
    ) -> WebhookResponse:
        """Call a declarative backend binding (seed 001) at `base_url` + `tool.path`.

        Arguments are `binding_arguments(tool, model_args, trusted_scope)`: renamed by
        `parameter_map`, protected keys dropped, `scope` filled from `trusted_scope`. They fill
        `{holes}` in the path, then go to the query (GET/DELETE) or a JSON body (others), through
        the same guarded path as `call`. Raises as `call`, plus PolicyDenied for a missing scope.
        """
        try:
            backend_args = binding_arguments(tool, model_args, trusted_scope)
        except ToolError as error:
            error.tool_name = error.tool_name or tool.name
            raise
        return await self._call_tool(
            tool, join_base(base_url, tool.path), backend_args, headers, timeout_s, idempotency_key, policy
        )

    # ------------------------------------------------------------------ internals

    async def _call_tool(
        self, tool: WebhookTool | BackendBindingTool, url_template: str, args: Mapping[str, Any],
        headers: Mapping[str, str], timeout_s: float | None, idempotency_key: str | None,
        policy: DestinationPolicy | None = None,
    ) -> WebhookResponse:
        """`call` for one tool: its method, its time budget, and its name on any error. Its 2xx
        JSON is the tool's result: one nested more than MAX_VALUE_DEPTH levels is UpstreamMalformed
        (the call record, redacted recursively, could not be made of it). Only here: a
        notification's or a workflow start's answer is never read, so its depth does not matter."""
        try:
            response = await self.call(
                url_template=url_template, method=tool.method, args=args, headers=headers,
                timeout_s=_budget(tool.timeout_ms, timeout_s), idempotency_key=idempotency_key,
                tool_name=tool.name, policy=policy,
            )
            if nests_deeper_than(response.json, MAX_VALUE_DEPTH):
                structlog.get_logger(__name__).info(
                    "webhook_result_too_deep", tool_name=tool.name, limit=MAX_VALUE_DEPTH
                )
                raise UpstreamMalformed(
                    f"upstream returned json nested more than {MAX_VALUE_DEPTH} levels deep, which is not read",
                    advice=_TOO_DEEP_ADVICE,
                )
            return response
        except ToolError as error:
            error.tool_name = error.tool_name or tool.name
            raise

    @staticmethod
    def _open_auth_header(tool: WebhookTool, secret_box: SecretBox | None) -> str:
        if secret_box is None:
            raise ToolError("tool credentials are unavailable", advice=_CREDENTIALS_ADVICE)
        try:
            return _Redacted(secret_box.decrypt(tool.auth_header_enc or ""))
        except SecretDecryptError:
            structlog.get_logger(__name__).warning(
                "webhook_auth_header_undecryptable", tool_name=tool.name
            )
            raise ToolError(
                "tool credentials cannot be decrypted", advice=_CREDENTIALS_ADVICE
            ) from None

    def _request_headers(
        self, headers: Mapping[str, str], idempotency_key: str | None, *, has_body: bool
    ) -> dict[str, str]:
        out: dict[str, str] = {"User-Agent": self._user_agent, "Accept": "application/json"}
        for name, value in headers.items():
            if not isinstance(name, str) or not _HEADER_NAME_RE.match(name):
                raise ToolError("a configured header name is invalid", advice=_CREDENTIALS_ADVICE)
            if name.lower() in _FORBIDDEN_HEADERS or name.lower().startswith("proxy-"):
                raise ToolError(
                    f"header {name.lower()!r} cannot be set by a tool", advice=_CREDENTIALS_ADVICE
                )
            if not isinstance(value, str) or _HEADER_VALUE_BAD_RE.search(value):
                # the value may be a credential: say which header, never what it holds
                raise ToolError(
                    f"header {name.lower()!r} has an invalid value (a line break or control character)",
                    advice=_CREDENTIALS_ADVICE,
                )
            secret = name.lower() == "authorization" or secret_name(name)
            out[name] = _Redacted(value) if secret else value
        if idempotency_key is not None:
            if not idempotency_key:
                raise ToolError("idempotency key is invalid")
            out["Idempotency-Key"] = idempotency_header(idempotency_key)
        if has_body:
            out["Content-Type"] = "application/json"
        return out

    async def _send(
        self,
        session: aiohttp.ClientSession,
        destination: CheckedDestination,
        method: str,
        headers: dict[str, str],
        body: bytes | None,
        timeout_s: float,
        started: float,
        secrets: tuple[bytes, ...] = (),
    ) -> WebhookResponse:
        token = _checked_destination.set(destination)
        try:
            async with waiting("upstream"), session.request(
                method,
                yarl.URL(destination.url, encoded=True),
                headers=headers,
                data=body,
                allow_redirects=False,
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as response:
                status = response.status
                if not 200 <= status < 300:
                    explanation = None
                    if status in EXPLAINED_STATUSES:
                        explanation = await self._explanation(response, secrets)
                    else:
                        response.close()  # do not drain an error body we will not read
                    raise _status_error(status, explanation)
                raw = scrub_bytes(await self._read_capped(response), secrets)
                content_type = response.headers.get("Content-Type", "")
            return WebhookResponse(
                status=status, json=_decode_json(raw, content_type), elapsed_ms=_elapsed_ms(started)
            )
        except TimeoutError:
            raise
        except aiohttp.ClientConnectorDNSError as exc:
            if isinstance(exc.__cause__, _UncheckedHost):
                raise blocked(
                    "unchecked host", "connector asked for a host the guard did not check"
                ) from None
            raise UpstreamUnreachable(
                "upstream host name could not be resolved", advice=_UNREACHABLE_ADVICE
            ) from None
        except aiohttp.ClientSSLError:
            raise UpstreamUnreachable(
                "tls handshake with upstream failed", advice=_UNREACHABLE_ADVICE
            ) from None
        except aiohttp.ClientConnectorError as exc:
            reason = (
                "upstream refused the connection"
                if exc.os_error.errno == errno.ECONNREFUSED
                else "could not connect to upstream"
            )
            raise UpstreamUnreachable(reason, advice=_UNREACHABLE_ADVICE) from None
        except aiohttp.ClientPayloadError:
            raise UpstreamUnreachable(
                "upstream closed the connection mid-response", advice=_UNREACHABLE_ADVICE
            ) from None
        except aiohttp.ServerDisconnectedError:
            raise UpstreamUnreachable(
                "upstream closed the connection", advice=_UNREACHABLE_ADVICE
            ) from None
        except aiohttp.ClientOSError:
            raise UpstreamUnreachable(
                "connection to upstream was reset", advice=_UNREACHABLE_ADVICE
            ) from None
        except aiohttp.InvalidURL:
            raise blocked("malformed url", "aiohttp rejected the checked url") from None
        except aiohttp.ClientResponseError:
            raise UpstreamMalformed(
                "upstream sent an invalid http response", advice=_MALFORMED_ADVICE
            ) from None
        except aiohttp.ClientError:
            raise UpstreamUnreachable(
                "upstream request failed", advice=_UNREACHABLE_ADVICE
            ) from None
        finally:
            _checked_destination.reset(token)

    async def _explanation(
        self, response: aiohttp.ClientResponse, secrets: tuple[bytes, ...]
    ) -> str | None:
        """The upstream's own words for a rejected request (`upstream_explanation`), or None.
        Reads at most ERROR_BODY_MAX_BYTES (never past the client's body cap) for at most
        ERROR_BODY_WAIT_S, within the call's deadline; a body that is larger, slower or broken is
        left unread (the connection dropped) and the status is answered alone."""
        limit = min(ERROR_BODY_MAX_BYTES, self._max_body_bytes)
        if response.content_length is not None and response.content_length > limit:
            response.close()
            return None
        buffer = bytearray()
        try:
            async with asyncio.timeout(ERROR_BODY_WAIT_S):
                async for chunk in response.content.iter_chunked(limit + 1):
                    buffer += chunk
                    if len(buffer) > limit:
                        response.close()
                        return None
        except (TimeoutError, aiohttp.ClientError):
            response.close()
            return None
        return upstream_explanation(
            bytes(buffer), response.headers.get("Content-Type", ""), secrets
        )

    async def _read_capped(self, response: aiohttp.ClientResponse) -> bytes:
        limit = self._max_body_bytes
        if response.content_length is not None and response.content_length > limit:
            response.close()
            raise _too_large(limit)
        buffer = bytearray()
        async for chunk in response.content.iter_chunked(_READ_CHUNK):
            buffer += chunk
            if len(buffer) > limit:
                response.close()  # stop reading: drop the connection rather than drain it
                raise _too_large(limit)
        return bytes(buffer)


BaseUrl = str | Callable[[TrustedContext], str | None] | None


class WebhookToolBackend:
    """The registry's `ToolBackend` port, implemented over one `WebhookClient`.

    Handlers get the decoded JSON of a 2xx answer (None for an empty body). Bindings go to
    `binding_base_url` (a fixed URL, or a function of the trusted context returning the tenant's
    backend) with `binding_headers`; their `scope` comes from `ctx.scope`.
    """

    def __init__(
        self,
        client: WebhookClient,
        *,
        secret_box: SecretBox | None,
        binding_base_url: BaseUrl = None,
        binding_headers: Mapping[str, str] | None = None,
        policy: DestinationPolicy | None = None,
    ) -> None:
        self._client = client
        self._policy = policy  # the tenant's (its egress allowances); None: the client's own
        self._secret_box = secret_box
        self._binding_base_url = binding_base_url
        self._binding_headers = dict(binding_headers or {})

    async def call_webhook(
        self,
        tool: WebhookTool,
        args: dict[str, Any],
        *,
        timeout_s: float,
        idempotency_key: str | None,
    ) -> Any:
        """The JSON answer of `tool`'s webhook. Raises the ToolErrors of `WebhookClient.call_webhook`."""
        response = await self._client.call_webhook(
            tool, args, self._secret_box, timeout_s, idempotency_key=idempotency_key, policy=self._policy
        )
        return response.json

    async def call_binding(
        self,
        tool: BackendBindingTool,
        args: dict[str, Any],
        *,
        ctx: TrustedContext,
        timeout_s: float,
        idempotency_key: str | None,
    ) -> Any:
        """The JSON answer of the binding. Raises the ToolErrors of `WebhookClient.call_binding`,
        or ToolError when no backend is configured for this tenant."""
        base = (
            self._binding_base_url(ctx)
            if callable(self._binding_base_url)
            else self._binding_base_url
        )
        if not base:
            raise ToolError(
                "no backend is configured for this tool",
                advice="Tell the customer this action is unavailable right now.",
                tool_name=tool.name,
            )
        response = await self._client.call_binding(
            base,
            tool,
            args,
            ctx.scope,
            self._binding_headers,
            timeout_s,
            idempotency_key=idempotency_key,
            policy=self._policy,
        )
        return response.json


def _budget(timeout_ms: int, timeout_s: float | None) -> float:
    tool_limit = timeout_ms / 1000.0
    return tool_limit if timeout_s is None else min(tool_limit, timeout_s)


def _elapsed_ms(started: float) -> float:
    return round((time.monotonic() - started) * 1000.0, 1)


def _too_large(limit: int) -> UpstreamTooLarge:
    return UpstreamTooLarge(
        f"upstream response is larger than {limit} bytes",
        advice="Tell the customer you cannot retrieve this right now; ask them to narrow the request.",
    )


def upstream_explanation(raw: bytes, content_type: str, secrets: tuple[bytes, ...] = ()) -> str | None:
    """What an upstream said about a request it rejected, fit to quote to the model, or None.

    Taken from a JSON object's string `error`, `message` or `detail` (an `error` object's
    `message`/`detail`; a list of validation errors' `msg`/`message`, up to three), then a
    problem+json `title`; or from a text/plain body. Every credential the call sent (`secrets`,
    from `secret_forms`) is replaced by [redacted], before decoding and after; the text is put on
    one line and capped at EXPLANATION_MAX_CHARS. HTML and other types are not quoted.
    """
    raw = scrub_bytes(raw, secrets)
    mime = content_type.split(";", 1)[0].strip().lower()
    text: str | None = None
    if mime == "application/json" or mime.endswith("+json") or mime == "text/json":
        if raw_nests_deeper_than(raw):
            return None
        try:
            value = msgspec.json.decode(raw)
        except (msgspec.DecodeError, RecursionError):  # RecursionError: as in _decode_json
            return None
        text = _said(value, problem=mime == "application/problem+json")
    elif mime == "text/plain":
        text = raw.decode("utf-8", errors="replace")
    if text is None:
        return None
    text = scrub_text(text, (form.decode("utf-8", errors="replace") for form in secrets))
    text = " ".join(_CONTROL_RE.sub(" ", text).split())
    if not text:
        return None
    if len(text) > EXPLANATION_MAX_CHARS:
        text = text[: EXPLANATION_MAX_CHARS - 1].rstrip() + "…"
    return text


def _said(value: Any, *, problem: bool) -> str | None:
    if not isinstance(value, dict):
        return None
    keys = ("detail", "title") if problem else ("error", "message", "detail", "error_description", "title")
    for key in keys:
        found = value.get(key)
        if isinstance(found, str) and found.strip():
            return found
        if isinstance(found, dict):
            inner = next((found[k] for k in ("message", "detail") if isinstance(found.get(k), str)), None)
            if inner:
                return inner
        if isinstance(found, list):  # e.g. FastAPI's 422: [{"loc": [...], "msg": "..."}]
            items = [i if isinstance(i, str) else i.get("msg") or i.get("message") if isinstance(i, dict) else None
                     for i in found[:3]]
            joined = "; ".join(i for i in items if isinstance(i, str) and i.strip())
            if joined:
                return joined
    return None


def _status_error(status: int, explanation: str | None = None) -> UpstreamStatus:
    said = f'; the service said: "{explanation}"' if explanation else ""
    if 300 <= status < 400:
        return UpstreamStatus(
            f"upstream redirected ({status}); redirects are not followed",
            status=status,
            advice="Tell the customer this action is unavailable right now; the business has to update the tool's address.",
        )
    if status == 404:
        return UpstreamStatus(
            f"not found (404){said}",
            status=status,
            advice="Ask the customer to double-check the identifier they gave (for example the order number) and try again.",
        )
    if status in (401, 403):
        return UpstreamStatus(
            f"upstream refused credentials ({status})", status=status, advice=_CREDENTIALS_ADVICE
        )
    if status == 429:
        return UpstreamStatus(
            "upstream rate limited (429)",
            status=status,
            advice="Tell the customer the service is busy and to try again in a few minutes.",
        )
    if 400 <= status < 500:
        return UpstreamStatus(
            f"upstream rejected the request ({status}){said}",
            status=status,
            advice="Check the details you sent with the customer, then try once more.",
        )
    if status >= 500:
        return UpstreamStatus(
            f"upstream error ({status})", status=status, advice=_UNREACHABLE_ADVICE
        )
    return UpstreamStatus(
        f"unexpected upstream status ({status})", status=status, advice=_MALFORMED_ADVICE
    )


_TOO_DEEP_JSON = f"upstream returned json nested too deeply (more than {MAX_JSON_DEPTH} levels)"


def _decode_json(raw: bytes, content_type: str) -> Any:
    """The JSON value of a 2xx body; None for an empty body. Raises UpstreamMalformed."""
    if not raw.strip():
        return None
    mime = content_type.split(";", 1)[0].strip().lower()
    if mime and not (mime == "application/json" or mime.endswith("+json") or mime == "text/json"):
        shown = mime if _MIME_RE.match(mime) else "a non-json type"
        raise UpstreamMalformed(f"upstream returned {shown}, not json", advice=_MALFORMED_ADVICE)
    if raw_nests_deeper_than(raw):  # counted before decoding: the same answer on every Python
        raise UpstreamMalformed(_TOO_DEEP_JSON, advice=_MALFORMED_ADVICE)
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError:
        raise UpstreamMalformed(
            "upstream returned malformed json", advice=_MALFORMED_ADVICE
        ) from None
    except RecursionError:  # only under a caller's unusually deep stack on 3.11: the same answer
        raise UpstreamMalformed(_TOO_DEEP_JSON, advice=_MALFORMED_ADVICE) from None


def idempotency_header(key: str) -> str:
    """`key` as an `Idempotency-Key` header value, for webhooks, bindings and MCP servers alike.

    A key of printable ASCII (tabs too) goes out as it is, byte for byte as it always has, so an
    upstream that dedups on it still finds the keys it has seen. Any other key (the client's
    message id may hold any printable text: `commande-é-1`) has every character but ASCII
    letters, digits and punctuation, and `%` itself, percent-encoded as UTF-8
    (`commande-%C3%A9-1`; a lone surrogate as its three bytes): a header carries ASCII only, and
    the MCP client's HTTP stack refused anything else before sending. A control character, which
    the gateway refuses in a message id, is encoded the same way rather than refused. Escaping `%`
    keeps two encoded keys apart; a client whose own ASCII message id spells another's encoded
    form can only collide with its own messages (the key's digest holds the tenant and session)."""
    if _PLAIN_KEY_RE.match(key):
        return key
    return quote(key, safe=_ENCODED_KEY_SAFE, errors="surrogatepass")
