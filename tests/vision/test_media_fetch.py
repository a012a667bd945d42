"""The remote fetcher's SSRF rules (pippin.vision.fetch), against a real local HTTP server.

Every connection the tests make is checked to go to 127.0.0.1: a refusal that failed
would otherwise send traffic to a private or metadata address.
"""

from __future__ import annotations

import asyncio
import ipaddress
import shutil
import socket
import ssl
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpcore
import pytest

pytest.importorskip("PIL")

from media_helpers import ca_signed, cert_dir, encode, picture, self_signed, serving  # noqa: E402

from pippin.vision import fetch  # noqa: E402
from pippin.vision.fetch import BlockedAddress, refused_reason, resolve_public  # noqa: E402
from pippin.vision.media import MediaError, MediaLimits, load_image  # noqa: E402

REAL_GETADDRINFO = socket.getaddrinfo


@pytest.fixture(autouse=True)
def only_loopback_connections(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records every TCP connect and fails the test on one to anything but 127.0.0.1."""
    seen: list[str] = []
    real = httpcore.AnyIOBackend.connect_tcp

    async def connect_tcp(self: Any, host: str, port: int, **kwargs: Any) -> Any:
        seen.append(host)
        assert host == "127.0.0.1", f"the fetcher tried to connect to {host}"
        return await real(self, host, port, **kwargs)

    monkeypatch.setattr(httpcore.AnyIOBackend, "connect_tcp", connect_tcp)
    return seen


def fake_dns(monkeypatch: pytest.MonkeyPatch, table: dict[str, list[str]]) -> list[str]:
    """socket.getaddrinfo answering names in ``table`` (others: the real resolver);
    returns the list of names looked up."""
    asked: list[str] = []

    def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        name = host.decode() if isinstance(host, bytes) else host
        asked.append(name)
        if name not in table:
            return REAL_GETADDRINFO(host, port, *args, **kwargs)
        out = []
        for a in table[name]:
            ip = ipaddress.ip_address(a)
            if ip.version == 4:
                out.append((socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port or 0)))
            else:
                out.append((socket.AF_INET6, socket.SOCK_STREAM, 6, "", (a, port or 0, 0, 0)))
        return out

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return asked


PNG = encode(picture())


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1",
        "127.8.9.10",
        "10.1.2.3",
        "172.16.5.4",
        "192.168.0.10",
        "169.254.169.254",
        "169.254.10.10",
        "100.64.0.1",
        "100.100.100.200",
        "192.0.0.192",
        "224.0.0.251",
        "0.0.0.0",
        "255.255.255.255",
        "240.0.0.1",
        "::1",
        "::",
        "fe80::1",
        "fc00::1",
        "fd00:ec2::254",
        "ff02::1",
        "::ffff:127.0.0.1",
        "::ffff:10.0.0.1",
        "::ffff:169.254.169.254",
        "2002:7f00:1::",  # 6to4 of 127.0.0.1
        "64:ff9b::a00:1",  # NAT64 of 10.0.0.1
    ],
)
def test_non_public_addresses_are_refused(address: str) -> None:
    assert refused_reason(ipaddress.ip_address(address)) is not None


@pytest.mark.parametrize(
    "address", ["8.8.8.8", "1.1.1.1", "93.184.216.34", "2606:4700:4700::1111", "::ffff:8.8.8.8"]
)
def test_public_addresses_pass(address: str) -> None:
    assert refused_reason(ipaddress.ip_address(address)) is None


def test_metadata_reason_is_named() -> None:
    assert "metadata" in (refused_reason(ipaddress.ip_address("169.254.169.254")) or "")
    assert "metadata" in (refused_reason(ipaddress.ip_address("fd00:ec2::254")) or "")


def test_a_name_resolving_to_a_private_address_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_dns(monkeypatch, {"intranet.example": ["10.0.0.7"]})
    with pytest.raises(BlockedAddress, match="private address"):
        asyncio.run(resolve_public("intranet.example", 80, MediaLimits()))


def test_one_private_address_among_public_ones_refuses_the_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_dns(monkeypatch, {"mixed.example": ["93.184.216.34", "2606:2800::1", "127.0.0.1"]})
    with pytest.raises(BlockedAddress, match="loopback"):
        asyncio.run(resolve_public("mixed.example", 443, MediaLimits()))


def test_a_public_name_resolves(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_dns(monkeypatch, {"cdn.example": ["93.184.216.34", "2606:2800::1"]})
    got = asyncio.run(resolve_public("cdn.example", 443, MediaLimits()))
    assert [str(a) for a in got] == ["93.184.216.34", "2606:2800::1"]


def test_metadata_names_are_refused_without_a_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    asked = fake_dns(monkeypatch, {})
    for name in ("metadata.google.internal", "METADATA.google.internal.", "metadata.goog"):
        with pytest.raises(BlockedAddress, match="metadata"):
            asyncio.run(resolve_public(name, 80, MediaLimits()))
    assert asked == []


def test_allowed_domains_restrict_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_dns(monkeypatch, {"img.example": ["93.184.216.34"], "other.example": ["93.184.216.35"]})
    limits = MediaLimits(allowed_domains=("img.example",))
    assert asyncio.run(resolve_public("IMG.example", 443, limits))
    with pytest.raises(BlockedAddress, match="not one this server fetches media from"):
        asyncio.run(resolve_public("other.example", 443, limits))


# --- over HTTP, against a server on 127.0.0.1 --------------------------------------


def test_loopback_server_is_refused_by_default(only_loopback_connections: list[str]) -> None:
    with serving(PNG) as server:
        for url in (server.url("/img.png"), server.url("/img.png", "localhost")):
            with pytest.raises(BlockedAddress, match="loopback"):
                asyncio.run(load_image(url, MediaLimits()))
        assert server.hits["/img.png"] == 0
    assert only_loopback_connections == []


@pytest.mark.parametrize(
    "url",
    [
        "http://169.254.169.254/latest/meta-data/",
        "http://[fd00:ec2::254]/latest/meta-data/",
        "http://metadata.google.internal/computeMetadata/v1/",
        "http://10.0.0.1/a.png",
        "http://192.168.1.1/a.png",
        "http://[::1]/a.png",
        "http://[::ffff:127.0.0.1]/a.png",
        "http://0.0.0.0/a.png",
        "http://2130706433/a.png",  # 127.0.0.1 as one number
        "http://0x7f.1/a.png",
    ],
)
def test_private_and_metadata_urls_are_refused(
    url: str, only_loopback_connections: list[str]
) -> None:
    with pytest.raises(MediaError, match="metadata|loopback|private|unspecified|link-local"):
        asyncio.run(load_image(url, MediaLimits()))
    assert only_loopback_connections == []


@pytest.mark.parametrize("url", ["ftp://example.com/a.png", "gopher://x/1", "javascript:alert(1)"])
def test_other_schemes_are_refused(url: str) -> None:
    with pytest.raises(MediaError, match="scheme"):
        asyncio.run(load_image(url, MediaLimits()))


def test_fetch_succeeds_and_follows_redirects_when_allowed() -> None:
    limits = MediaLimits(allow_private_for_tests=True)
    with serving(PNG) as server:
        direct = asyncio.run(load_image(server.url("/img.png"), limits))
        redirected = asyncio.run(load_image(server.url("/redirect"), limits))
        assert server.hits["/redirect"] == 1 and server.hits["/img.png"] == 2
    assert direct.image.size == (64, 48) and direct.sha256 == redirected.sha256


def test_connects_to_the_checked_address_with_one_lookup(
    monkeypatch: pytest.MonkeyPatch, only_loopback_connections: list[str]
) -> None:
    """Each connection resolves the name once (the check's look-up) and goes to the
    address checked; the request still carries the name as its Host."""
    asked = fake_dns(monkeypatch, {"pinned.example": ["127.0.0.1"]})
    limits = MediaLimits(public_hosts_for_tests=frozenset({"pinned.example"}))
    with serving(PNG) as server:
        got = asyncio.run(load_image(server.url("/redirect", "pinned.example"), limits))
        assert server.hosts == [f"pinned.example:{server.port}"] * 2
    assert got.image.size == (64, 48)
    # http.server closes each connection: two connections, two look-ups, not four.
    assert asked == ["pinned.example"] * 2
    assert only_loopback_connections == ["127.0.0.1"] * 2


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_https_sends_the_name_and_verifies_the_certificate_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, only_loopback_connections: list[str]
) -> None:
    """Connected to the checked address, TLS still uses the name: SNI carries it and the
    certificate must be valid for it (a self-signed one is refused; trusted, it passes
    although it names no IP address)."""
    cert, key = self_signed(tmp_path, "pinned.example")
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert, key)
    names: list[str | None] = []

    def record(_sock: ssl.SSLObject, name: str | None, _ctx: ssl.SSLContext) -> None:
        names.append(name)

    server_ctx.sni_callback = record  # type: ignore[assignment]
    fake_dns(monkeypatch, {"pinned.example": ["127.0.0.1"]})
    limits = MediaLimits(public_hosts_for_tests=frozenset({"pinned.example"}))
    with serving(PNG, server_ctx) as server:
        url = server.url("/img.png", "pinned.example")
        with pytest.raises(MediaError, match="CERTIFICATE_VERIFY_FAILED|certificate verify"):
            asyncio.run(load_image(url, limits))
        assert names == ["pinned.example"] and server.hits["/img.png"] == 0
        trusting = replace(limits, ca_bundle=cert)
        got = asyncio.run(load_image(url, trusting))
        assert got.image.size == (64, 48) and server.hits["/img.png"] == 1
    assert set(only_loopback_connections) == {"127.0.0.1"}


@pytest.fixture
def company_ca_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Path, str, MediaLimits]]:
    """An https server on 127.0.0.1 for corp.example, its certificate signed by a CA of
    its own (a company's), with the environment's CA variables unset: (the CA's
    certificate, the image's URL, the limits that let the fetcher reach it)."""
    for name in ("SSL_CERT_FILE", "SSL_CERT_DIR"):
        monkeypatch.delenv(name, raising=False)
    ca, cert, key = ca_signed(tmp_path, "corp.example")
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert, key)
    fake_dns(monkeypatch, {"corp.example": ["127.0.0.1"]})
    limits = MediaLimits(public_hosts_for_tests=frozenset({"corp.example"}))
    with serving(PNG, server_ctx) as server:
        url = server.url("/img.png", "corp.example")
        with pytest.raises(MediaError, match="CERTIFICATE_VERIFY_FAILED"):
            asyncio.run(load_image(url, limits))  # the public CAs do not vouch for it
        yield ca, url, limits
        assert server.hits["/img.png"] == 1


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_the_machines_ca_file_is_trusted(
    company_ca_server: tuple[Path, str, MediaLimits],
    monkeypatch: pytest.MonkeyPatch,
    only_loopback_connections: list[str],
) -> None:
    """SSL_CERT_FILE names the CAs to trust, as for Python, curl and httpx; the
    environment's proxy still does not apply (the connection goes to the checked address)."""
    ca, url, limits = company_ca_server
    monkeypatch.setenv("SSL_CERT_FILE", str(ca))
    monkeypatch.setenv("HTTPS_PROXY", "http://10.9.9.9:3128")
    assert asyncio.run(load_image(url, limits)).image.size == (64, 48)
    assert set(only_loopback_connections) == {"127.0.0.1"}


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_the_machines_ca_folder_is_trusted(
    company_ca_server: tuple[Path, str, MediaLimits],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ca, url, limits = company_ca_server
    monkeypatch.setenv("SSL_CERT_DIR", str(cert_dir(tmp_path, ca)))
    assert asyncio.run(load_image(url, limits)).image.size == (64, 48)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_the_servers_ca_bundle_is_trusted(company_ca_server: tuple[Path, str, MediaLimits]) -> None:
    """--media-ca-bundle's CAs are trusted beside the public ones."""
    ca, url, limits = company_ca_server
    got = asyncio.run(load_image(url, replace(limits, ca_bundle=ca)))
    assert got.image.size == (64, 48)


def test_an_unreadable_ca_file_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "missing.pem"))
    with pytest.raises(MediaError, match="CA certificates .* cannot be read") as info:
        asyncio.run(fetch.shared_ssl_context())
    assert str(tmp_path) not in str(info.value)  # no server path in a client's answer


def test_a_redirect_to_loopback_is_refused(
    monkeypatch: pytest.MonkeyPatch, only_loopback_connections: list[str]
) -> None:
    fake_dns(monkeypatch, {"public.example": ["127.0.0.1"]})
    limits = MediaLimits(public_hosts_for_tests=frozenset({"public.example"}))
    with serving(PNG) as server:
        server.redirect_to = server.url("/img.png")  # 127.0.0.1
        with pytest.raises(BlockedAddress, match="loopback"):
            asyncio.run(load_image(server.url("/redirect-away", "public.example"), limits))
        assert server.hits["/redirect-away"] == 1 and server.hits["/img.png"] == 0


@pytest.mark.parametrize(
    "target",
    [
        "http://intranet.example/a.png",
        "http://169.254.169.254/latest/meta-data/",
        "http://metadata.google.internal/",
        "file:///etc/passwd",
    ],
)
def test_a_redirect_to_a_private_or_metadata_host_is_refused(
    target: str, monkeypatch: pytest.MonkeyPatch, only_loopback_connections: list[str]
) -> None:
    fake_dns(monkeypatch, {"public.example": ["127.0.0.1"], "intranet.example": ["10.0.0.5"]})
    limits = MediaLimits(public_hosts_for_tests=frozenset({"public.example"}))
    with serving(PNG) as server:
        server.redirect_to = target
        with pytest.raises(MediaError, match="private|metadata|only http"):
            asyncio.run(load_image(server.url("/redirect-away", "public.example"), limits))
    assert set(only_loopback_connections) == {"127.0.0.1"}


def test_a_redirect_off_the_allowed_domains_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_dns(monkeypatch, {"img.example": ["127.0.0.1"], "other.example": ["127.0.0.1"]})
    limits = MediaLimits(
        allowed_domains=("img.example",),
        public_hosts_for_tests=frozenset({"img.example", "other.example"}),
    )
    with serving(PNG) as server:
        server.redirect_to = server.url("/img.png", "other.example")
        assert asyncio.run(load_image(server.url("/img.png", "img.example"), limits))
        with pytest.raises(BlockedAddress, match="not one this server fetches media from"):
            asyncio.run(load_image(server.url("/redirect-away", "img.example"), limits))
        assert server.hits["/img.png"] == 1


def test_allowed_domains_match_international_names(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_dns(monkeypatch, {"xn--bcher-kva.example": ["127.0.0.1"]})
    limits = MediaLimits(
        allowed_domains=("xn--bcher-kva.example",),
        public_hosts_for_tests=frozenset({"xn--bcher-kva.example"}),
    )
    with serving(PNG) as server:
        got = asyncio.run(load_image(server.url("/img.png", "bücher.example"), limits))
    assert got.image.size == (64, 48)


def test_redirects_are_capped() -> None:
    limits = MediaLimits(allow_private_for_tests=True, max_redirects=3)
    with serving(PNG) as server:
        with pytest.raises(MediaError, match="more than 3 redirects"):
            asyncio.run(load_image(server.url("/loop"), limits))
        assert server.hits["/loop"] == 4
        no_redirects = MediaLimits(allow_private_for_tests=True, max_redirects=0)
        with pytest.raises(MediaError, match="more than 0 redirects"):
            asyncio.run(load_image(server.url("/redirect"), no_redirects))


def test_bytes_are_capped_while_streaming() -> None:
    limits = MediaLimits(allow_private_for_tests=True, max_image_bytes=256 * 1024)
    with serving(PNG) as server:
        with pytest.raises(MediaError, match="over this server's 0.2 MiB"):
            asyncio.run(load_image(server.url("/big"), limits))
        with pytest.raises(MediaError, match="50.0 MiB, over"):
            asyncio.run(load_image(server.url("/big-declared"), limits))


def test_a_slow_server_times_out() -> None:
    limits = MediaLimits(allow_private_for_tests=True, fetch_timeout_s=0.5)
    with serving(PNG) as server:
        with pytest.raises(MediaError, match="longer than 0.5 s"):
            asyncio.run(load_image(server.url("/slow"), limits))


def test_http_errors_are_reported() -> None:
    limits = MediaLimits(allow_private_for_tests=True)
    with serving(PNG) as server:
        with pytest.raises(MediaError, match="HTTP 404"):
            asyncio.run(load_image(server.url("/missing.png"), limits))


def test_no_proxy_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """A proxy would make the connection for us, to an address nobody checked."""
    monkeypatch.setenv("HTTP_PROXY", "http://10.9.9.9:3128")
    monkeypatch.setenv("ALL_PROXY", "http://10.9.9.9:3128")
    with serving(PNG) as server:
        got = asyncio.run(
            load_image(server.url("/img.png"), MediaLimits(allow_private_for_tests=True))
        )
    assert got.image.size == (64, 48)


def test_the_guarded_pool_is_the_transports() -> None:
    transport = fetch.GuardedTransport(MediaLimits(), asyncio.run(fetch.shared_ssl_context()))
    assert isinstance(transport._pool._network_backend, fetch.GuardedBackend)
    assert asyncio.run(fetch.shared_ssl_context()) is asyncio.run(fetch.shared_ssl_context())
