"""Pictures, videos and a local HTTP server for the media tests."""

from __future__ import annotations

import base64
import io
import ssl
import struct
import subprocess
import threading
import time
import zlib
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from PIL import Image


def picture(
    size: tuple[int, int] = (64, 48), color: tuple[int, ...] = (200, 30, 30)
) -> Image.Image:
    """A picture with some structure (a gradient square), so resizing changes pixels."""
    mode = "RGBA" if len(color) == 4 else "RGB"
    image = Image.new(mode, size, color)
    for x in range(min(size) // 2):
        image.putpixel(
            (x, x), (x * 4 % 256, 255 - x * 4 % 256, 0) + ((255,) if mode == "RGBA" else ())
        )
    return image


def noise_png(seed: int, size: tuple[int, int] = (56, 56)) -> bytes:
    """A PNG of random pixels: each seed a different picture, for answers that depend on it."""
    import numpy as np

    arr = (np.random.default_rng(seed).random((size[1], size[0], 3)) * 255).astype(np.uint8)
    return encode(Image.fromarray(arr))


def encode(image: Image.Image, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    image.save(out, fmt)
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def png_claiming(width: int, height: int) -> bytes:
    """A tiny PNG whose header claims ``width`` x ``height`` (a decompression bomb's
    shape, without the memory to make a real one)."""
    data = bytearray(encode(Image.new("L", (1, 1))))
    ihdr = data.index(b"IHDR")
    data[ihdr + 4 : ihdr + 12] = struct.pack(">II", width, height)
    crc = zlib.crc32(bytes(data[ihdr : ihdr + 17]))
    data[ihdr + 17 : ihdr + 21] = struct.pack(">I", crc)
    return bytes(data)


def blank_png(width: int, height: int) -> bytes:
    """A real grayscale PNG of ``width`` x ``height`` black pixels, written row by row
    (small: zeros compress ~200:1), without holding the picture in memory."""
    deflate = zlib.compressobj(1)
    row = bytes(width + 1)  # filter byte 0, then the row
    idat = b"".join(deflate.compress(row) for _ in range(height)) + deflate.flush()

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def video_bytes(
    tmp: Path,
    seconds: float = 3.0,
    fps: int = 10,
    size: tuple[int, int] = (32, 24),
    name: str = "clip.mp4",
    codec: str = "mp4v",
) -> bytes:
    """A video (by default MP4 in MPEG-4 part 2, which OpenCV's FFmpeg writes everywhere)
    whose frame i is a flat colour with red = 8 * i, so a sampled frame tells its index."""
    import cv2
    import numpy as np

    path = tmp / name
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*codec), fps, size)
    assert writer.isOpened()
    for i in range(round(seconds * fps)):
        frame = np.zeros((size[1], size[0], 3), np.uint8)
        frame[:, :] = (0, 60, min(255, 8 * i))  # BGR
        writer.write(frame)
    writer.release()
    return path.read_bytes()


class TestServer:
    """An HTTP server on 127.0.0.1 with routes for the fetcher's cases; counts hits."""

    def __init__(self, png: bytes, tls: ssl.SSLContext | None = None) -> None:
        self.png = png
        self.hits: Counter[str] = Counter()
        self.hosts: list[str] = []
        self.redirect_to = ""
        self.files: dict[str, tuple[bytes, str]] = {}  # more paths to serve: (body, type)
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                path = self.path.split("?")[0]
                server.hits[path] += 1
                server.hosts.append(self.headers.get("Host", ""))
                if path == "/img.png":
                    self._send(200, server.png, "image/png")
                elif path in server.files:
                    self._send(200, *server.files[path])
                elif path == "/redirect":
                    self._redirect("/img.png")
                elif path == "/redirect-away":
                    self._redirect(server.redirect_to)
                elif path == "/loop":
                    self._redirect("/loop")
                elif path == "/big":  # no Content-Length: the cap must stop the stream
                    self.send_response(200)
                    self.send_header("Content-Type", "image/png")
                    self.end_headers()
                    try:
                        for _ in range(64):
                            self.wfile.write(b"\0" * 65536)
                    except OSError:
                        pass
                elif path == "/big-declared":
                    self.send_response(200)
                    self.send_header("Content-Length", str(50 * 1024 * 1024))
                    self.end_headers()
                elif path == "/slow":
                    self.send_response(200)
                    self.end_headers()
                    try:
                        for _ in range(50):
                            self.wfile.write(b"\0")
                            self.wfile.flush()
                            time.sleep(0.1)
                    except OSError:
                        pass
                else:
                    self._send(404, b"not found", "text/plain")

            def _redirect(self, location: str) -> None:
                self.send_response(302)
                self.send_header("Location", location)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def _send(self, status: int, body: bytes, kind: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.scheme = "http"
        if tls is not None:
            self.httpd.socket = tls.wrap_socket(self.httpd.socket, server_side=True)
            self.scheme = "https"

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"{self.scheme}://{host}:{self.port}{path}"


@contextmanager
def serving(png: bytes, tls: ssl.SSLContext | None = None) -> Iterator[TestServer]:
    server = TestServer(png, tls)
    thread = threading.Thread(target=server.httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.httpd.shutdown()
        server.httpd.server_close()
        thread.join(5)


def self_signed(tmp: Path, name: str) -> tuple[Path, Path]:
    """(certificate, key) for ``name`` only (no IP address in it), made by openssl."""
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-days", "2", "-subj", f"/CN={name}", "-addext", f"subjectAltName=DNS:{name}",
         "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


def ca_signed(tmp: Path, name: str) -> tuple[Path, Path, Path]:
    """(CA certificate, certificate for ``name`` signed by that CA, its key), made by
    openssl: a company CA's shape, which only trusting the CA makes valid."""
    ca, ca_key = tmp / "ca.pem", tmp / "ca-key.pem"
    cert, key, csr, ext = tmp / "cert.pem", tmp / "key.pem", tmp / "cert.csr", tmp / "cert.ext"
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    ext.write_text(
        f"subjectAltName=DNS:{name}\nbasicConstraints=critical,CA:FALSE\n"
        "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n"
        "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n"
    )
    for command in (
        ["openssl", "req", "-x509", *ec, "-days", "2", "-subj", "/CN=pippin test CA",
         "-addext", "basicConstraints=critical,CA:TRUE",
         "-addext", "keyUsage=critical,keyCertSign,cRLSign",
         "-keyout", str(ca_key), "-out", str(ca)],
        ["openssl", "req", *ec, "-subj", f"/CN={name}", "-keyout", str(key), "-out", str(csr)],
        ["openssl", "x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
         "-CAcreateserial", "-days", "2", "-extfile", str(ext), "-out", str(cert)],
    ):  # fmt: skip
        subprocess.run(command, check=True, capture_output=True)
    return ca, cert, key


def cert_dir(tmp: Path, ca: Path) -> Path:
    """A folder holding ``ca`` under its subject hash, as SSL_CERT_DIR folders are laid out."""
    folder = tmp / "certs"
    folder.mkdir()
    digest = subprocess.run(
        ["openssl", "x509", "-subject_hash", "-noout", "-in", str(ca)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    (folder / f"{digest}.0").write_bytes(ca.read_bytes())
    return folder
