"""The MCP client: the only place the engine talks to a tenant's MCP server (streamable HTTP).

Owns the wrapper around the official `mcp` SDK (`mcp.Client` over `streamable_http_client`) and
its network path. Every connection is SSRF-guarded exactly like a webhook call
(`services.tools.ssrf.check_destination`: the URL is parsed, its host resolved ONCE and every
address checked against the operator's allowlist), then the SDK's HTTP client (httpx2, over
httpcore2) gets a transport whose network backend connects only to those checked addresses
(`_PinnedBackend`): a host the guard did not check, a second DNS answer (rebinding) or a proxy from
the environment can never be reached. TLS keeps verifying the certificate against the host name.
Response bodies are capped, and the whole exchange runs under one deadline. The server's auth
header (decrypted for this call) and every credential its URL carries (`redaction.url_secrets`: a
key in the query, a token as a path segment, as hosted servers' `/s/<key>/mcp`) are replaced by
[redacted] in every response body as it streams in, before the SDK decodes it: a server that
echoes its request headers or its URL into a tool's result, an error or a tool description cannot
hand the credential to the model, the call record or a log.

One MCP session per operation (discover or initialize, then `tools/list` or `tools/call`): MCP
servers are the tenant's, the host processes are many, and a fresh check per call keeps the DNS
pinning honest; on loopback a call costs a few milliseconds.

Every failure is a `services.tools.errors.ToolError` with a lower-case reason; none carries the
auth header, a URL's query or a stack trace.
"""

from __future__ import annotations

import asyncio
import copy
import ssl
from collections.abc import AsyncIterator, Iterable
from typing import Any

import httpcore2
import httpx2
import msgspec
import structlog
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import (
    CallToolResult,
    EmbeddedResource,
    ImageContent,
    Implementation,
    TextContent,
    TextResourceContents,
)

from services.fairshare import waiting
from services.tools.errors import (
    ToolError,
    UpstreamMalformed,
    UpstreamTimeout,
    UpstreamTooLarge,
    UpstreamUnreachable,
)
from services.tools.mcp import McpCallResult, McpToolInfo
from services.tools.redaction import StreamScrubber, secret_forms, url_secrets
from services.tools.ssrf import (
    AresResolver,
    CheckedDestination,
    DestinationPolicy,
    Resolver,
    blocked,
    check_destination,
)
from services.tools.webhook import idempotency_header

log = structlog.get_logger(__name__)

DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB per HTTP response (and per SSE event)
MAX_LIST_PAGES = 10  # a server whose tools/list never ends cannot hold the catalog load
CLIENT_INFO = Implementation(name="chat-engine", version="0.1.0")

_UNREACHABLE_ADVICE = "Tell the customer you cannot reach the service right now and offer another way to help."
_TIMEOUT_ADVICE = "Tell the customer you cannot complete this right now; they can try again in a few minutes."
_MALFORMED_ADVICE = "Tell the customer you cannot read the answer from the service right now."


class _UncheckedDestination(httpcore2.ConnectError):
    """The HTTP client asked to connect somewhere the guard did not check (a redirect elsewhere,
    a unix socket): refused without touching the network."""


class _PinnedBackend(httpcore2.AsyncNetworkBackend):
    """httpcore2 network backend that connects only to the addresses of one CheckedDestination.

    `connect_tcp` is asked for the URL's host name; it never resolves it: it tries the checked
    addresses in order and refuses any other host or port.
    """

    def __init__(self, destination: CheckedDestination, inner: httpcore2.AsyncNetworkBackend) -> None:
        self._destination = destination
        self._inner = inner
        self.connected: list[tuple[str, int]] = []  # (address, port) actually dialled, for tests

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore2.AsyncNetworkStream:
        d = self._destination
        if host.rstrip(".").lower().strip("[]") != d.host or port != d.port:
            raise _UncheckedDestination("destination not checked by the ssrf guard")
        last: Exception | None = None
        for address in d.addresses:
            try:
                stream = await self._inner.connect_tcp(
                    address, port, timeout=timeout, local_address=local_address, socket_options=socket_options
                )
            except (httpcore2.ConnectError, httpcore2.ConnectTimeout, OSError) as exc:
                last = exc
                continue
            self.connected.append((address, port))
            return stream
        assert last is not None  # a CheckedDestination has at least one address
        raise last

    async def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore2.AsyncNetworkStream:
        raise _UncheckedDestination("unix sockets are not a checked destination")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


class _CappedStream(httpx2.AsyncByteStream):
    def __init__(self, inner: httpx2.AsyncByteStream, limit: int) -> None:
        self._inner = inner
        self._limit = limit

    async def __aiter__(self) -> AsyncIterator[bytes]:
        seen = 0
        async for chunk in self._inner:
            seen += len(chunk)
            if seen > self._limit:
                raise UpstreamTooLarge(
                    f"mcp server response is larger than {self._limit} bytes",
                    advice="Tell the customer you cannot retrieve this right now; ask them to narrow the request.",
                )
            yield chunk

    async def aclose(self) -> None:
        await self._inner.aclose()


class _ScrubbedStream(httpx2.AsyncByteStream):
    """A response body with the call's credentials replaced, also when one is split across chunks
    (JSON answers and SSE events alike: "[redacted]" holds no quote, backslash or line break)."""

    def __init__(self, inner: httpx2.AsyncByteStream, forms: tuple[bytes, ...]) -> None:
        self._inner = inner
        self._forms = forms

    async def __aiter__(self) -> AsyncIterator[bytes]:
        scrubber = StreamScrubber(self._forms)
        async for chunk in self._inner:
            safe = scrubber.feed(chunk)
            if safe:
                yield safe
        rest = scrubber.flush()
        if rest:
            yield rest

    async def aclose(self) -> None:
        await self._inner.aclose()


class _PinnedTransport(httpx2.AsyncHTTPTransport):
    """httpx2's transport with its connection pool rebuilt on a `_PinnedBackend`.

    httpx2 does not take a network backend as an argument, so the pool it builds is replaced by
    one that has ours (the same class with the same TLS context). No proxy, no environment.
    """

    def __init__(self, backend: _PinnedBackend, *, ssl_context: ssl.SSLContext, max_body_bytes: int,
                 secrets: tuple[bytes, ...] = ()) -> None:
        super().__init__(verify=ssl_context, trust_env=False, retries=0)
        if not hasattr(self, "_pool"):  # pragma: no cover - a changed httpx2 must fail loudly
            raise RuntimeError("httpx2.AsyncHTTPTransport has no _pool; the ssrf pinning needs updating")
        self._pool = httpcore2.AsyncConnectionPool(
            ssl_context=ssl_context, max_connections=4, network_backend=backend
        )
        self._max_body_bytes = max_body_bytes
        self._secrets = secrets  # secret_forms of the auth header and the url: never passed on in a body
        #: the first HTTP error status seen: the SDK turns it into a JSON-RPC error without it
        self.error_status: int | None = None

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        # The size cap counts bytes as they arrive; httpx2 inflates them afterwards, so a
        # compressed answer could pass it and inflate a thousandfold (a "compression bomb")
        # during a catalog load. None is asked for, and one that comes anyway is refused.
        request.headers["Accept-Encoding"] = "identity"
        response = await super().handle_async_request(request)
        if response.status_code >= 400 and self.error_status is None:
            self.error_status = response.status_code
        encoding = response.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            await response.aclose()
            raise UpstreamMalformed(
                f"mcp server sent a compressed response (Content-Encoding: {encoding[:20]}) though none was asked for",
                advice="Tell the customer you cannot retrieve this right now.",
            )
        length = response.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self._max_body_bytes:
            await response.aclose()
            raise UpstreamTooLarge(
                f"mcp server response is larger than {self._max_body_bytes} bytes",
                advice="Tell the customer you cannot retrieve this right now; ask them to narrow the request.",
            )
        stream: httpx2.AsyncByteStream = _CappedStream(response.stream, self._max_body_bytes)  # type: ignore[arg-type]
        if self._secrets:
            stream = _ScrubbedStream(stream, self._secrets)
        response.stream = stream
        return response


class McpHttpClient:
    """The registry's MCP connector (`services.tools.mcp.McpConnector`): SSRF-guarded, bounded.

    `resolver` defaults to `AresResolver` (c-ares, made on first use); `network_backend` (the
    backend the pinned one dials through) defaults to httpcore2's anyio backend; tests pass
    recording fakes of both.
    """

    def __init__(
        self,
        *,
        policy: DestinationPolicy,
        resolver: Resolver | None = None,
        network_backend: httpcore2.AsyncNetworkBackend | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> None:
        self._policy = policy
        self._resolver: Resolver = resolver or AresResolver()
        self._network_backend = network_backend
        self._max_body_bytes = max_body_bytes
        self._ssl_context: ssl.SSLContext | None = None  # built once: loading the CA bundle takes ~50 ms

    def for_tenant(self, allowances: tuple[tuple[str, int], ...]) -> McpHttpClient:
        """This client (its resolver, its TLS context once built), checking destinations with one
        tenant's egress allowances added to the operator's (DestinationPolicy.for_tenant)."""
        tenant = copy.copy(self)
        tenant._policy = self._policy.for_tenant(allowances)
        return tenant

    async def list_tools(self, url: str, *, auth_header: str | None, timeout_s: float) -> list[McpToolInfo]:
        """Every tool the server at `url` lists (at most MAX_LIST_PAGES pages).

        Raises DestinationBlocked before any connection when the guard refuses the URL, and the
        other ToolErrors of `call_tool` when the server cannot be reached or answers badly.
        """

        async def run(client: Client) -> list[McpToolInfo]:
            tools: list[McpToolInfo] = []
            cursor: str | None = None
            for _ in range(MAX_LIST_PAGES):
                page = await client.list_tools(cursor=cursor)
                tools += [_tool_info(t) for t in page.tools]
                cursor = page.next_cursor
                if cursor is None:
                    break
            return tools

        return await self._session(url, auth_header, timeout_s, run)

    async def call_tool(
        self, url: str, name: str, arguments: dict[str, Any], *, auth_header: str | None, timeout_s: float,
        idempotency_key: str | None = None,
    ) -> McpCallResult:
        """The result of `tools/call` for `name` (an `isError` result is returned, not raised).

        `idempotency_key` (write tools) goes out as the `Idempotency-Key` header, as for webhooks
        (`services.tools.webhook.idempotency_header`: as it is when printable ASCII, else percent-encoded).

        Raises DestinationBlocked (before any connection), UpstreamTimeout, UpstreamUnreachable,
        UpstreamTooLarge or UpstreamMalformed.
        """

        async def run(client: Client) -> McpCallResult:
            async with waiting("upstream"):  # the server's answer: other turns compute meanwhile (services.fairshare)
                result = await client.call_tool(name, arguments)
            return _call_result(result)

        return await self._session(url, auth_header, timeout_s, run, idempotency_key=idempotency_key)

    async def _session(
        self, url: str, auth_header: str | None, timeout_s: float, run, *, idempotency_key: str | None = None
    ) -> Any:
        destination = await check_destination(url, self._resolver, self._policy)
        backend = _PinnedBackend(destination, self._network_backend or httpcore2.AnyIOBackend())
        headers = {"User-Agent": "chat-engine-mcp/0.1"}
        if auth_header:
            headers["Authorization"] = auth_header
        if idempotency_key:
            # as a webhook's: the client's message id in it may hold any printable text, and
            # httpx2 encodes header values as ASCII (it raised before anything was sent)
            headers["Idempotency-Key"] = idempotency_header(idempotency_key)
        if self._ssl_context is None:
            self._ssl_context = httpx2.create_ssl_context(trust_env=False)
        transport = _PinnedTransport(backend, ssl_context=self._ssl_context, max_body_bytes=self._max_body_bytes,
                                     secrets=secret_forms([*([auth_header] if auth_header else []),
                                                           *url_secrets(url)]))
        try:
            async with asyncio.timeout(timeout_s):
                async with httpx2.AsyncClient(
                    transport=transport, headers=headers, timeout=httpx2.Timeout(timeout_s),
                    trust_env=False, follow_redirects=False,
                ) as http:
                    stream = streamable_http_client(
                        destination.url, http_client=http, max_sse_event_size=self._max_body_bytes
                    )
                    async with Client(stream, mode="auto", cache=None, client_info=CLIENT_INFO) as client:
                        return await run(client)
        except TimeoutError:
            raise UpstreamTimeout("mcp server timeout", advice=_TIMEOUT_ADVICE) from None
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - translated below; nothing raw leaves this module
            raise _translate(exc, transport.error_status) from None


def _translate(exc: BaseException, http_status: int | None = None) -> ToolError:
    """The ToolError for whatever the SDK or the HTTP stack raised (groups unwrapped);
    `http_status` is the HTTP error the transport saw, if any (it explains an SDK error)."""
    leaf = _first_leaf(exc)
    if isinstance(leaf, ToolError):
        return leaf
    if http_status in (401, 403):
        return UpstreamUnreachable(
            f"mcp server refused the credentials ({http_status})",
            advice="Tell the customer you cannot access this right now; the business has to update the "
                   "server's credentials.",
        )
    if http_status is not None and http_status != 404:
        return UpstreamUnreachable(f"mcp server answered http {http_status}", advice=_UNREACHABLE_ADVICE)
    if isinstance(leaf, _UncheckedDestination):
        return blocked("unchecked destination", "the mcp client tried to reach a destination the guard did not check")
    if isinstance(leaf, httpx2.TimeoutException | TimeoutError):
        return UpstreamTimeout("mcp server timeout", advice=_TIMEOUT_ADVICE)
    if isinstance(leaf, httpx2.ConnectError | OSError):
        return UpstreamUnreachable("could not connect to the mcp server", advice=_UNREACHABLE_ADVICE)
    if isinstance(leaf, httpx2.HTTPError):
        return UpstreamUnreachable("mcp server connection failed", advice=_UNREACHABLE_ADVICE)
    if isinstance(leaf, MCPError):
        return UpstreamMalformed(f"mcp server error: {_clip(str(leaf.error.message), 200)}",
                                 advice=_MALFORMED_ADVICE)
    log.warning("mcp_call_failed", error=type(leaf).__name__)
    return UpstreamMalformed("mcp server answered with something that is not valid mcp", advice=_MALFORMED_ADVICE)


def _first_leaf(exc: BaseException) -> BaseException:
    """The first non-group exception inside (nested) exception groups, following __cause__ of
    the SDK's wrappers when that is where the HTTP error is."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    if not isinstance(exc, ToolError | httpx2.HTTPError | MCPError) and exc.__cause__ is not None:
        cause = _first_leaf(exc.__cause__)
        if isinstance(cause, ToolError | httpx2.HTTPError | OSError):
            return cause
    return exc


def _tool_info(tool: Any) -> McpToolInfo:
    hints = tool.annotations
    return McpToolInfo(
        name=tool.name,
        title=tool.title,
        description=tool.description or "",
        input_schema=dict(tool.input_schema or {}),
        read_only_hint=getattr(hints, "read_only_hint", None),
        destructive_hint=getattr(hints, "destructive_hint", None),
        idempotent_hint=getattr(hints, "idempotent_hint", None),
        open_world_hint=getattr(hints, "open_world_hint", None),
    )


def _call_result(result: CallToolResult) -> McpCallResult:
    texts: list[str] = []
    for block in result.content or ():
        if isinstance(block, TextContent):
            texts.append(block.text)
        elif isinstance(block, EmbeddedResource) and isinstance(block.resource, TextResourceContents):
            texts.append(block.resource.text)
        elif isinstance(block, ImageContent):
            texts.append(f"[image ({block.mime_type}) not shown]")
        else:
            texts.append(f"[{getattr(block, 'type', 'content')} not shown]")
    structured = result.structured_content
    return McpCallResult(
        texts=texts,
        structured=msgspec.UNSET if structured is None else structured,
        is_error=bool(result.is_error),
    )


def _clip(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
