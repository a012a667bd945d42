"""Fetching remote media without letting a request reach what it should not (SSRF).

The rules (docs/reliability.md, "Fetching media"):
- only http and https, at most `max_redirects` redirects, `fetch_timeout_s` for the
  whole fetch, at most the byte cap (the body is streamed and dropped past it);
- every host name is resolved by pippin and refused if any of its addresses is not
  public (private, loopback, link-local, CGNAT, multicast, unspecified, reserved, an
  IPv4 address embedded in IPv6 that is one of those, cloud-metadata addresses), and
  metadata host names are refused by name;
- the connection goes to the address that was checked: `GuardedBackend` is the network
  backend of httpcore's connection pool, so the check and the connect are one step with
  no second DNS look-up between them (no DNS rebinding), and it runs for every new
  connection, so for every redirect hop; TLS still verifies the certificate against
  the host name (httpcore passes the name for SNI, not the address), against the
  machine's CAs where `SSL_CERT_FILE` / `SSL_CERT_DIR` name them (else the public ones)
  and `--media-ca-bundle`'s; no other setting of the environment (proxies) applies;
- `allowed_domains`, when set, is checked for the first URL and every redirect.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import ssl
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpcore
import httpx

from pippin import __version__, envs
from pippin.vision.limits import MIB, MediaError, MediaLimits

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# Cloud metadata services (AWS, GCP, Azure, OpenStack; AWS's IPv6; Alibaba; Oracle).
METADATA_ADDRESSES = frozenset(
    ipaddress.ip_address(a)
    for a in ("169.254.169.254", "fd00:ec2::254", "100.100.100.200", "192.0.0.192")
)
METADATA_NAMES = frozenset(
    (
        "metadata.google.internal",
        "metadata.goog",
        "metadata",
        "instance-data",
        "instance-data.ec2.internal",
    )
)
_CGNAT = ipaddress.ip_network("100.64.0.0/10")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
REDIRECTS = (301, 302, 303, 307, 308)


class BlockedAddress(MediaError):
    """The URL's host is one this server never fetches from."""


def refused_reason(address: IPAddress) -> str | None:
    """Why pippin does not connect to ``address``; None when it is a public address."""
    if isinstance(address, ipaddress.IPv6Address):
        address = ipaddress.IPv6Address(int(address))  # without a %scope
        if address.ipv4_mapped is not None:
            return refused_reason(address.ipv4_mapped)
        embedded = address.sixtofour
        if embedded is None and address in _NAT64:
            embedded = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if embedded is not None:
            reason = refused_reason(embedded)
            if reason is not None:
                return f"{reason} (embedded in an IPv6 address)"
    if address in METADATA_ADDRESSES:
        return "a cloud metadata address"
    for reason, hit in (
        ("a loopback address", address.is_loopback),
        ("a link-local address", address.is_link_local),
        ("a multicast address", address.is_multicast),
        ("the unspecified address", address.is_unspecified),
        (
            "a shared (CGNAT) address",
            isinstance(address, ipaddress.IPv4Address) and address in _CGNAT,
        ),
        ("a private address", address.is_private),
        ("a reserved address", address.is_reserved),
        ("not a public address", not address.is_global),
    ):
        if hit:
            return reason
    return None


def _name(host: str) -> str:
    return host.strip().rstrip(".").lower()


def check_host_name(host: str, limits: MediaLimits) -> None:
    """Refuses a host by its name: metadata names, and names not in `allowed_domains`."""
    name = _name(host)
    if not name:
        raise MediaError("the URL has no host")
    if name in METADATA_NAMES and not limits.allow_private_for_tests:
        raise BlockedAddress(f"the host {host} is a cloud metadata service")
    if limits.allowed_domains is not None and name not in limits.allowed_domains:
        raise BlockedAddress(f"the host {host} is not one this server fetches media from")


async def resolve_public(host: str, port: int, limits: MediaLimits) -> list[IPAddress]:
    """The addresses of ``host`` to connect to, all checked; refused (BlockedAddress) when
    any address it resolves to is not public (a name with one private address among
    public ones is a rebinding trick, not a misconfiguration to work around)."""
    check_host_name(host, limits)
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(_name(host), port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise MediaError(f"cannot resolve the host {host} ({e})") from None
    addresses: list[IPAddress] = []
    for family, *_, sockaddr in infos:
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        address = ipaddress.ip_address(str(sockaddr[0]).split("%")[0])
        if address not in addresses:
            addresses.append(address)
    if not addresses:
        raise MediaError(f"the host {host} has no IP address")
    trusted = limits.allow_private_for_tests or _name(host) in limits.public_hosts_for_tests
    if not trusted:
        for address in addresses:
            reason = refused_reason(address)
            if reason is not None:
                raise BlockedAddress(
                    f"the host {host} resolves to {reason}; this server fetches media only "
                    "from public addresses"
                )
    return addresses


class GuardedBackend(httpcore.AsyncNetworkBackend):
    """httpcore's network backend with the address check in `connect_tcp`: it resolves
    the host itself and connects to the address it checked."""

    def __init__(self, limits: MediaLimits) -> None:
        self._limits = limits
        self._inner = httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        addresses = await resolve_public(host, port, self._limits)
        error: Exception | None = None
        for address in addresses:
            try:
                return await self._inner.connect_tcp(
                    str(address),
                    port,
                    timeout=timeout,
                    local_address=local_address,
                    socket_options=socket_options,
                )
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as e:
                error = e
        assert error is not None
        raise error

    async def connect_unix_socket(self, *args: Any, **kwargs: Any) -> httpcore.AsyncNetworkStream:
        raise BlockedAddress("unix sockets are never used to fetch media")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


class GuardedTransport(httpx.AsyncHTTPTransport):
    """httpx's transport over a connection pool whose every connection goes through
    `GuardedBackend`; no proxy (an environment's proxy would connect for us, unchecked)."""

    def __init__(self, limits: MediaLimits, ssl_context: ssl.SSLContext) -> None:
        super().__init__(verify=ssl_context, trust_env=False)
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=ssl_context,
            max_connections=4,
            network_backend=GuardedBackend(limits),
        )


def make_ssl_context(ca_bundle: Path | None = None) -> ssl.SSLContext:
    """The CAs https media is checked against: those of SSL_CERT_FILE / SSL_CERT_DIR where
    either is set (instead of the public ones, as Python, curl and httpx take them), else
    the public ones (certifi's); and `ca_bundle`'s on top."""
    cafile, capath = envs.SSL_CERT_FILE, envs.SSL_CERT_DIR
    try:
        if cafile or capath:
            ctx = ssl.create_default_context(cafile=cafile, capath=capath)
        else:
            ctx = httpx.create_ssl_context(trust_env=False)
        if ca_bundle is not None:
            ctx.load_verify_locations(cafile=ca_bundle)
    except (OSError, ssl.SSLError) as e:
        # The server's setting, not the request's; no path in a message a client reads.
        raise MediaError(
            "this server's CA certificates (SSL_CERT_FILE, SSL_CERT_DIR or "
            f"--media-ca-bundle) cannot be read ({type(e).__name__})"
        ) from None
    return ctx


# By what they were made of: a changed environment (a test's) gets a context of its own.
_ssl_contexts: dict[tuple[str | None, str | None, Path | None], ssl.SSLContext] = {}


async def shared_ssl_context(ca_bundle: Path | None = None) -> ssl.SSLContext:
    """One TLS context for every fetch: making one reads the CA bundle (~100 ms), which
    must not happen per request, nor on the event loop."""
    key = (envs.SSL_CERT_FILE, envs.SSL_CERT_DIR, ca_bundle)
    ctx = _ssl_contexts.get(key)
    if ctx is None:
        ctx = _ssl_contexts[key] = await asyncio.to_thread(make_ssl_context, ca_bundle)
    return ctx


def check_url(url: httpx.URL, limits: MediaLimits) -> None:
    if url.scheme not in ("http", "https"):
        raise MediaError(f"only http(s) URLs are fetched, not {url.scheme or 'this'}:")
    # The ASCII (IDNA) form: what the connection resolves, and how the allow-list is kept.
    check_host_name(url.raw_host.decode("ascii"), limits)


async def fetch_bytes(
    url: str, limits: MediaLimits, cap: int, what: str
) -> tuple[str | None, bytes]:
    """(Content-Type, body) of an http(s) URL, under the rules in this module's docstring."""
    try:
        return await asyncio.wait_for(_fetch(url, limits, cap, what), limits.fetch_timeout_s)
    except (asyncio.TimeoutError, httpx.TimeoutException):
        raise MediaError(
            f"fetching the {what} took longer than {limits.fetch_timeout_s:g} s"
        ) from None


async def _fetch(url: str, limits: MediaLimits, cap: int, what: str) -> tuple[str | None, bytes]:
    try:
        current = httpx.URL(url)
    except (httpx.InvalidURL, ValueError) as e:
        raise MediaError(f"not a valid URL ({e})") from None
    headers = {
        "User-Agent": f"pippin/{__version__}",
        "Accept": "image/*, video/*, */*;q=0.5",
        # Media is compressed already; and no gzip bomb to inflate chunk by chunk.
        "Accept-Encoding": "identity",
    }
    async with httpx.AsyncClient(
        transport=GuardedTransport(limits, await shared_ssl_context(limits.ca_bundle)),
        follow_redirects=False,
        trust_env=False,
        timeout=limits.fetch_timeout_s,
        headers=headers,
    ) as client:
        for _ in range(limits.max_redirects + 1):
            check_url(current, limits)
            try:
                async with client.stream("GET", current) as response:
                    if response.status_code in REDIRECTS:
                        location = response.headers.get("location")
                        if not location:
                            raise MediaError(
                                f"fetching the {what} failed: HTTP {response.status_code} "
                                "with no Location"
                            )
                        try:
                            current = current.join(location)
                        except (httpx.InvalidURL, ValueError) as e:
                            raise MediaError(
                                f"the redirect's Location is not a URL ({e})"
                            ) from None
                        continue
                    if response.status_code != 200:
                        raise MediaError(f"fetching the {what} failed: HTTP {response.status_code}")
                    return response.headers.get("content-type"), await _read(response, cap, what)
            except httpx.TimeoutException:
                raise
            except httpx.HTTPError as e:
                raise MediaError(f"fetching the {what} failed ({type(e).__name__}: {e})") from None
    raise MediaError(f"fetching the {what} took more than {limits.max_redirects} redirects")


async def _read(response: httpx.Response, cap: int, what: str) -> bytes:
    declared = response.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > cap:
        raise MediaError(
            f"the {what} is {int(declared) / MIB:.1f} MiB, over this server's {cap / MIB:.1f} MiB"
        )
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.aiter_bytes():
        size += len(chunk)
        if size > cap:  # stop reading: the rest is never downloaded
            raise MediaError(f"the {what} is over this server's {cap / MIB:.1f} MiB")
        chunks.append(chunk)
    return b"".join(chunks)
