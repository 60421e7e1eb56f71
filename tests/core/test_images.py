"""Image intake: real photographs, hostile files, SSRF refusals, a real local HTTP(S) server, S3 via Stubber."""

from __future__ import annotations

import base64
import http.server
import io
import shutil
import socket
import ssl
import struct
import subprocess
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs, quote, urlsplit

import boto3
import numpy as np
import pytest
from botocore.response import StreamingBody
from botocore.stub import Stubber
from PIL import Image
from skimage import data as skdata

from llava_sessions import images
from llava_sessions.config import Settings
from llava_sessions.errors import ErrorCode, ServiceError
from llava_sessions.images import decode_image, fetch, fetch_image_bytes
from llava_sessions.wire.inbound import ImageSource

MAX_PIXELS = 40_000_000


# --- helpers -------------------------------------------------------------------------------


def encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def photo(name: str) -> Image.Image:
    return Image.fromarray(getattr(skdata, name)())


@pytest.fixture(scope="module")
def astronaut_png() -> bytes:
    return encode(photo("astronaut"), "PNG")


@pytest.fixture(scope="module")
def astronaut_jpeg() -> bytes:
    return encode(photo("astronaut"), "JPEG", quality=90)


def error_of(fn, *args, **kwargs) -> ServiceError:
    with pytest.raises(ServiceError) as info:
        fn(*args, **kwargs)
    return info.value


def png_bomb(width: int = 20000, height: int = 20000) -> bytes:
    """A valid 1-bit greyscale PNG of width x height zeros: ~50 KB on disk, 400 M pixels decoded."""

    def chunk(tag: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + tag + payload + struct.pack(">I", zlib.crc32(tag + payload))

    row = b"\x00" * (1 + (width + 7) // 8)  # filter byte + packed bits
    compressor = zlib.compressobj(9)
    block = row * 1000
    idat = b"".join(compressor.compress(block) for _ in range(height // 1000)) + compressor.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


# --- decode_image --------------------------------------------------------------------------


def test_public_api_is_pinned() -> None:
    assert sorted(images.__all__) == ["DECODE_FORMATS", "decode_image", "fetch_image_bytes"]


@pytest.mark.parametrize("name", ["astronaut", "coffee", "chelsea"])
def test_real_photographs_png_are_lossless(name: str) -> None:
    array = getattr(skdata, name)()
    image = decode_image(encode(Image.fromarray(array), "PNG"), max_pixels=MAX_PIXELS)
    assert image.mode == "RGB"
    assert image.size == (array.shape[1], array.shape[0])
    assert np.array_equal(np.asarray(image), array)


@pytest.mark.parametrize("fmt", ["JPEG", "WEBP", "BMP", "TIFF"])
def test_real_photograph_in_other_formats(fmt: str) -> None:
    array = skdata.coffee()
    image = decode_image(encode(Image.fromarray(array), fmt), max_pixels=MAX_PIXELS)
    assert image.mode == "RGB" and image.size == (600, 400)
    assert np.abs(np.asarray(image, dtype=np.int16) - array).mean() < 8


def test_greyscale_photograph_becomes_rgb() -> None:
    camera = skdata.camera()
    image = decode_image(encode(Image.fromarray(camera), "PNG"), max_pixels=MAX_PIXELS)
    rgb = np.asarray(image)
    assert image.mode == "RGB"
    for channel in range(3):
        assert np.array_equal(rgb[..., channel], camera)


def test_16_bit_greyscale_is_scaled_not_clipped() -> None:
    camera = skdata.camera()
    wide = Image.fromarray(camera.astype(np.uint16) * 257)  # full 16-bit range
    assert wide.mode.startswith("I;16")
    rgb = np.asarray(decode_image(encode(wide, "PNG"), max_pixels=MAX_PIXELS))
    assert np.abs(rgb[..., 0].astype(int) - camera).max() <= 1


def test_palette_image_becomes_rgb() -> None:
    palette = photo("coffee").quantize(colors=64)
    assert palette.mode == "P"
    image = decode_image(encode(palette, "PNG"), max_pixels=MAX_PIXELS)
    assert image.mode == "RGB"
    assert np.array_equal(np.asarray(image), np.asarray(palette.convert("RGB")))


def test_palette_transparency_is_composited_on_white() -> None:
    palette = Image.new("P", (8, 8), 0)
    palette.putpalette([255, 0, 0] + [0, 0, 255] * 255)
    palette.paste(1, (0, 0, 4, 8))  # left half: index 1 (blue), right: index 0 (red)
    data = encode(palette, "PNG", transparency=1)  # index 1 transparent
    image = decode_image(data, max_pixels=MAX_PIXELS)
    assert image.getpixel((0, 0)) == (255, 255, 255)
    assert image.getpixel((7, 0)) == (255, 0, 0)


def test_rgba_and_la_are_composited_on_white() -> None:
    rgba = photo("chelsea").convert("RGBA")
    alpha = Image.new("L", rgba.size, 255)
    alpha.paste(0, (0, 0, 100, rgba.size[1]))
    rgba.putalpha(alpha)
    image = decode_image(encode(rgba, "PNG"), max_pixels=MAX_PIXELS)
    assert image.getpixel((10, 10)) == (255, 255, 255)
    assert image.getpixel((300, 150)) == photo("chelsea").getpixel((300, 150))

    la = Image.merge("LA", (Image.new("L", (4, 4), 0), Image.new("L", (4, 4), 0)))
    assert decode_image(encode(la, "PNG"), max_pixels=MAX_PIXELS).getpixel((0, 0)) == (255, 255, 255)


def test_cmyk_jpeg_becomes_rgb() -> None:
    cmyk = photo("astronaut").convert("CMYK")
    image = decode_image(encode(cmyk, "JPEG", quality=95), max_pixels=MAX_PIXELS)
    assert image.mode == "RGB" and image.size == (512, 512)
    assert np.abs(np.asarray(image, dtype=np.int16) - skdata.astronaut()).mean() < 10


def test_one_bit_image_becomes_rgb() -> None:
    image = decode_image(encode(photo("camera").convert("1"), "PNG"), max_pixels=MAX_PIXELS)
    assert image.mode == "RGB"
    assert set(np.unique(np.asarray(image))) <= {0, 255}


def test_animated_gif_gives_its_first_frame() -> None:
    red = Image.new("RGB", (16, 16), (255, 0, 0))
    blue = Image.new("RGB", (16, 16), (0, 0, 255))
    gif = encode(red, "GIF", save_all=True, append_images=[blue], duration=100, loop=0)
    assert Image.open(io.BytesIO(gif)).n_frames == 2
    image = decode_image(gif, max_pixels=MAX_PIXELS)
    assert image.mode == "RGB" and image.getpixel((8, 8)) == (255, 0, 0)


def test_exif_orientation_is_applied() -> None:
    coffee = skdata.coffee()  # 400 x 600 (H x W)
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    data = encode(Image.fromarray(coffee), "JPEG", quality=95, exif=exif)
    image = decode_image(data, max_pixels=MAX_PIXELS)
    assert image.size == (400, 600)  # W x H after rotation
    expected = np.rot90(coffee, k=-1)  # clockwise
    assert np.abs(np.asarray(image, dtype=np.int16) - expected).mean() < 8


def test_returned_image_is_loaded_and_independent(astronaut_png: bytes) -> None:
    data = bytearray(astronaut_png)
    image = decode_image(bytes(data), max_pixels=MAX_PIXELS)
    data[:] = b"\x00" * len(data)
    del data
    assert image.getpixel((0, 0)) == tuple(skdata.astronaut()[0, 0])
    assert getattr(image, "fp", None) is None


def test_decompression_bomb_is_refused_before_decoding() -> None:
    bomb = png_bomb()
    assert len(bomb) < 200_000
    error = error_of(decode_image, bomb, max_pixels=MAX_PIXELS)
    assert (error.code, error.status) == (ErrorCode.IMAGE_TOO_LARGE, 413)
    assert "40000000 pixels" in error.message
    # no pixel is decoded: a bomb over the cap (but under Pillow's own guard) whose pixel data is cut
    # in half is refused as too large, where decoding it finds the truncation
    small = png_bomb(7000, 7000)
    cut = small[: len(small) // 2]
    assert error_of(decode_image, cut, max_pixels=MAX_PIXELS).code == ErrorCode.IMAGE_TOO_LARGE
    assert error_of(decode_image, cut, max_pixels=10**8).code == ErrorCode.IMAGE_INVALID
    # Pillow's own guard (Image.MAX_IMAGE_PIXELS) also maps to image_too_large.
    assert error_of(decode_image, bomb, max_pixels=10**12).code == ErrorCode.IMAGE_TOO_LARGE


def test_pixel_limit_is_exact(astronaut_png: bytes) -> None:
    assert decode_image(astronaut_png, max_pixels=512 * 512).size == (512, 512)
    assert error_of(decode_image, astronaut_png, max_pixels=512 * 512 - 1).code == ErrorCode.IMAGE_TOO_LARGE


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("truncated_jpeg", "truncated or corrupt"),
        ("truncated_png", "truncated or corrupt"),
        ("garbage", "not a recognised image file"),
        ("png_signature_then_garbage", ""),
        ("empty", "empty"),
        ("text", "not a recognised image file"),
        ("ppm", "not a recognised image file"),  # a real image, but not an accepted format
    ],
)
def test_bad_files_are_image_invalid(case: str, message: str, astronaut_jpeg: bytes, astronaut_png: bytes) -> None:
    rng = np.random.default_rng(0)
    data = {
        "truncated_jpeg": astronaut_jpeg[: len(astronaut_jpeg) // 2],
        "truncated_png": astronaut_png[: len(astronaut_png) // 2],
        "garbage": rng.integers(0, 256, 4096, dtype=np.uint8).tobytes(),
        "png_signature_then_garbage": b"\x89PNG\r\n\x1a\n" + rng.integers(0, 256, 512, dtype=np.uint8).tobytes(),
        "empty": b"",
        "text": b"<html>not an image</html>",
        "ppm": encode(photo("astronaut"), "PPM"),
    }[case]
    error = error_of(decode_image, data, max_pixels=MAX_PIXELS)
    assert (error.code, error.status) == (ErrorCode.IMAGE_INVALID, 400)
    assert message in error.message


# --- base64 --------------------------------------------------------------------------------


def test_base64_source(astronaut_png: bytes) -> None:
    text = base64.b64encode(astronaut_png).decode()
    settings = Settings()
    assert fetch_image_bytes(ImageSource(base64=text), settings) == astronaut_png
    assert fetch_image_bytes(ImageSource(base64="data:image/png;base64," + text), settings) == astronaut_png
    wrapped = "\n".join(text[i : i + 76] for i in range(0, len(text), 76))  # MIME line wrapping
    assert fetch_image_bytes(ImageSource(base64=wrapped), settings) == astronaut_png


@pytest.mark.parametrize("text", ["not base64!", "aGVsbG8", "aGVs-G8=", "data:image/png,aGVsbG8=", "aGVsbG8=é"])
def test_bad_base64_is_image_invalid(text: str) -> None:
    error = error_of(fetch_image_bytes, ImageSource(base64=text), Settings())
    assert error.code == ErrorCode.IMAGE_INVALID
    assert text not in error.message


def test_empty_base64_is_image_invalid() -> None:
    assert (
        error_of(fetch_image_bytes, ImageSource(base64="data:image/png;base64,"), Settings()).code
        == ErrorCode.IMAGE_INVALID
    )


def test_base64_over_the_byte_cap() -> None:
    settings = Settings(max_image_bytes=1000)
    assert len(fetch_image_bytes(ImageSource(base64=base64.b64encode(b"x" * 1000).decode()), settings)) == 1000
    error = error_of(fetch_image_bytes, ImageSource(base64=base64.b64encode(b"x" * 1001).decode()), settings)
    assert (error.code, error.status) == (ErrorCode.IMAGE_TOO_LARGE, 413)


# --- URL: SSRF refusals (no connection is ever made) ----------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "https://169.254.169.254/latest/meta-data/iam/security-credentials/",
        "https://[fd00:ec2::254]/latest/meta-data/",
        "https://10.0.0.1/a.png",
        "https://172.16.5.4/a.png",
        "https://192.168.1.1/a.png",
        "https://127.0.0.1/a.png",
        "https://127.1/a.png",  # inet_aton shorthand, resolved by getaddrinfo
        "https://2130706433/a.png",  # 127.0.0.1 as one integer
        "https://[::1]/a.png",
        "https://[::ffff:127.0.0.1]/a.png",  # IPv4-mapped
        "https://[::ffff:169.254.169.254]/a.png",
        "https://[2002:a9fe:a9fe::1]/a.png",  # 6to4 wrapping 169.254.169.254
        "https://0.0.0.0/a.png",
        "https://[::]/a.png",
        "https://224.0.0.1/a.png",
        "https://[ff02::1]/a.png",
        "https://100.64.0.1/a.png",  # carrier-grade NAT
        "https://240.0.0.1/a.png",  # reserved
        "https://255.255.255.255/a.png",
        "https://[fe80::1]/a.png",
        "https://localhost/a.png",
    ],
)
def test_private_and_special_addresses_are_refused(url: str) -> None:
    error = error_of(fetch_image_bytes, ImageSource(url=url), Settings())
    assert (error.code, error.status) == (ErrorCode.IMAGE_URL_FORBIDDEN, 400)
    host = urlsplit(url).hostname or ""
    assert host not in error.message and "169.254" not in error.message


@pytest.mark.parametrize(
    "url",
    [
        "https://169.254.169.254/latest/meta-data/",
        "https://[fd00:ec2::254]/latest/meta-data/",
        "https://[fe80::1]/",
        "https://0.0.0.0/",
        "https://224.0.0.1/",
    ],
)
def test_metadata_link_local_and_multicast_stay_refused_with_private_networks_allowed(url: str) -> None:
    settings = Settings(allow_private_networks=True)
    assert error_of(fetch_image_bytes, ImageSource(url=url), settings).code == ErrorCode.IMAGE_URL_FORBIDDEN


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("http://example.com/a.png", "must use https"),
        ("ftp://example.com/a.png", "must use https"),
        ("file:///etc/passwd", "must use https"),
        ("gopher://example.com/", "must use https"),
        ("https://user:pass@example.com/a.png", "credentials"),
        ("https:///a.png", "no host"),
        ("https://exa mple.com/a.png", "whitespace"),
        ("https://example.com:99999/a.png", "malformed"),
        ("https://example.com:0/a.png", "port"),
        ("https://exa_mple$.com/a.png", "host name is invalid"),
    ],
)
def test_bad_urls_are_refused(url: str, fragment: str) -> None:
    error = error_of(fetch_image_bytes, ImageSource(url=url), Settings())
    assert error.code == ErrorCode.IMAGE_URL_FORBIDDEN
    assert fragment in error.message


def test_allowlist_is_checked_before_resolving() -> None:
    settings = Settings(url_allowlist=(".example.com", "img.example.org"))
    error = error_of(fetch_image_bytes, ImageSource(url="https://evil.example.net/a.png"), settings)
    assert error.code == ErrorCode.IMAGE_URL_FORBIDDEN and "allowlist" in error.message
    error = error_of(fetch_image_bytes, ImageSource(url="https://example.com/a.png"), settings)
    assert "allowlist" in error.message  # ".example.com" matches subdomains only
    error = error_of(fetch_image_bytes, ImageSource(url="https://notexample.com/a.png"), settings)
    assert "allowlist" in error.message


# --- URL: a real local server ---------------------------------------------------------------


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"
    payloads: dict[str, bytes] = {}

    def log_message(self, *args) -> None:  # keep test output quiet
        pass

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        if "Content-Length" not in (headers or {}):
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except OSError:  # the client gave up (timeout tests)
            pass

    def do_GET(self) -> None:  # noqa: N802 (http.server API)
        parts = urlsplit(self.path)
        query = {k: v[0] for k, v in parse_qs(parts.query).items()}
        path = parts.path
        if path.startswith("/img/"):
            self._send(200, self.payloads[path[5:]], {"Content-Type": "image/png"})
        elif path == "/redirect":
            self._send(int(query.get("code", "302")), headers={"Location": query["to"]})
        elif path.startswith("/chain/"):
            left = int(path.rsplit("/", 1)[1])
            self._send(302, headers={"Location": f"/chain/{left - 1}" if left else "/img/astronaut"})
        elif path == "/noloc":
            self._send(302)
        elif path == "/host":
            expected = query["expect"]
            ok = self.headers.get("Host") == expected
            self._send(200 if ok else 421, self.payloads["astronaut"] if ok else b"wrong host")
        elif path == "/status":
            self._send(int(query["code"]), b"nope")
        elif path == "/declared-huge":
            self._send(200, b"x" * 10, {"Content-Length": str(10**9)})
        elif path == "/undeclared-huge":
            self.send_response(200)
            self.end_headers()  # HTTP/1.0, no length: body ends when the connection closes
            try:
                for _ in range(64):
                    self.wfile.write(b"x" * 65536)
            except OSError:
                pass
        elif path == "/slow-headers":
            time.sleep(float(query.get("s", "2")))
            self._send(200, b"late")
        elif path == "/drip":
            self.send_response(200)
            self.end_headers()
            try:
                for _ in range(60):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.05)
            except OSError:
                pass
        else:
            self._send(404)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False


def _serve(server: _Server) -> Iterator[_Server]:
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def http_server(astronaut_png: bytes) -> Iterator[str]:
    _Handler.payloads = {"astronaut": astronaut_png}
    server = _Server(("127.0.0.1", 0), _Handler)
    for running in _serve(server):
        yield f"http://127.0.0.1:{running.server_address[1]}"


@pytest.fixture
def dev() -> Settings:
    """Local-testing policy: loopback and plain http allowed, short timeouts."""
    return Settings(allow_private_networks=True, allow_http=True, fetch_connect_timeout_s=2.0, fetch_read_timeout_s=2.0)


def url_source(url: str) -> ImageSource:
    return ImageSource(url=url)


def test_loopback_server_is_refused_by_default(http_server: str) -> None:
    settings = Settings(allow_http=True)
    error = error_of(fetch_image_bytes, url_source(f"{http_server}/img/astronaut"), settings)
    assert error.code == ErrorCode.IMAGE_URL_FORBIDDEN
    assert "127.0.0.1" not in error.message


def test_fetch_from_local_server(http_server: str, dev: Settings, astronaut_png: bytes) -> None:
    data = fetch_image_bytes(url_source(f"{http_server}/img/astronaut"), dev)
    assert data == astronaut_png
    assert decode_image(data, max_pixels=MAX_PIXELS).size == (512, 512)


def test_host_name_is_resolved_and_sent_as_host_header(http_server: str, dev: Settings, astronaut_png: bytes) -> None:
    # "localhost" may resolve to ::1 first (nothing listens there): the next vetted address is used.
    port = urlsplit(http_server).port
    url = f"http://localhost:{port}/host?expect=" + quote(f"localhost:{port}")
    assert fetch_image_bytes(url_source(url), dev) == astronaut_png


def test_allowlist_with_local_server(http_server: str, astronaut_png: bytes) -> None:
    port = urlsplit(http_server).port
    settings = Settings(allow_private_networks=True, allow_http=True, url_allowlist=("localhost",))
    assert fetch_image_bytes(url_source(f"http://localhost:{port}/img/astronaut"), settings) == astronaut_png
    error = error_of(fetch_image_bytes, url_source(f"{http_server}/img/astronaut"), settings)
    assert error.code == ErrorCode.IMAGE_URL_FORBIDDEN


@pytest.mark.parametrize("code", [301, 302, 303, 307, 308])
def test_redirects_are_followed(http_server: str, dev: Settings, astronaut_png: bytes, code: int) -> None:
    url = f"{http_server}/redirect?code={code}&to=" + quote("/img/astronaut")
    assert fetch_image_bytes(url_source(url), dev) == astronaut_png


def test_redirect_limit(http_server: str, astronaut_png: bytes) -> None:
    settings = Settings(allow_private_networks=True, allow_http=True, max_redirects=2)
    assert fetch_image_bytes(url_source(f"{http_server}/chain/1"), settings) == astronaut_png  # 2 redirects
    error = error_of(fetch_image_bytes, url_source(f"{http_server}/chain/2"), settings)  # 3 redirects
    assert error.code == ErrorCode.IMAGE_FETCH_FAILED and "more than 2" in error.message
    no_redirects = Settings(allow_private_networks=True, allow_http=True, max_redirects=0)
    assert (
        error_of(fetch_image_bytes, url_source(f"{http_server}/chain/0"), no_redirects).code
        == ErrorCode.IMAGE_FETCH_FAILED
    )


@pytest.mark.parametrize(
    "target",
    [
        "http://169.254.169.254/latest/meta-data/iam/security-credentials/",
        "http://[fd00:ec2::254]/latest/meta-data/",
        "http://0.0.0.0:80/",
        "file:///etc/passwd",
        "ftp://127.0.0.1/a.png",
    ],
)
def test_redirect_to_a_forbidden_target_is_refused(http_server: str, dev: Settings, target: str) -> None:
    error = error_of(fetch_image_bytes, url_source(f"{http_server}/redirect?to=" + quote(target, safe="")), dev)
    assert (error.code, error.status) == (ErrorCode.IMAGE_URL_FORBIDDEN, 400)


def test_redirect_to_loopback_is_refused_when_only_the_first_host_is_allowlisted(http_server: str) -> None:
    port = urlsplit(http_server).port
    settings = Settings(allow_private_networks=True, allow_http=True, url_allowlist=("127.0.0.1",))
    target = f"http://localhost:{port}/img/astronaut"
    error = error_of(fetch_image_bytes, url_source(f"{http_server}/redirect?to=" + quote(target, safe="")), settings)
    assert error.code == ErrorCode.IMAGE_URL_FORBIDDEN


def test_redirect_without_location(http_server: str, dev: Settings) -> None:
    assert error_of(fetch_image_bytes, url_source(f"{http_server}/noloc"), dev).code == ErrorCode.IMAGE_FETCH_FAILED


@pytest.mark.parametrize("code", [404, 403, 500])
def test_http_errors_are_fetch_failed(http_server: str, dev: Settings, code: int) -> None:
    error = error_of(fetch_image_bytes, url_source(f"{http_server}/status?code={code}&token=s3cret"), dev)
    assert (error.code, error.status) == (ErrorCode.IMAGE_FETCH_FAILED, 400)
    assert f"host 127.0.0.1 answered HTTP {code}" in error.message  # the host only: no path, query or port
    assert "s3cret" not in error.message and "/status" not in error.message
    assert str(urlsplit(http_server).port) not in error.message


def test_declared_length_over_the_cap(http_server: str) -> None:
    settings = Settings(allow_private_networks=True, allow_http=True, max_image_bytes=1000)
    error = error_of(fetch_image_bytes, url_source(f"{http_server}/declared-huge"), settings)
    assert (error.code, error.status) == (ErrorCode.IMAGE_TOO_LARGE, 413)


def test_undeclared_body_over_the_cap_is_cut_off(http_server: str) -> None:
    settings = Settings(allow_private_networks=True, allow_http=True, max_image_bytes=100_000)
    error = error_of(fetch_image_bytes, url_source(f"{http_server}/undeclared-huge"), settings)
    assert error.code == ErrorCode.IMAGE_TOO_LARGE


def test_read_timeout(http_server: str) -> None:
    settings = Settings(
        allow_private_networks=True, allow_http=True, fetch_connect_timeout_s=1.0, fetch_read_timeout_s=0.3
    )
    # the headers come after 2 s: the message names the read timeout that fired first
    error = error_of(fetch_image_bytes, url_source(f"{http_server}/slow-headers?s=2"), settings)
    assert (error.code, error.status) == (ErrorCode.IMAGE_FETCH_TIMEOUT, 400)
    assert error.message == "fetching the image from 127.0.0.1 timed out (no bytes for the 0.3 s read timeout)"


def test_slow_drip_hits_the_total_deadline(http_server: str) -> None:
    # Each byte arrives well within the read timeout, but the whole fetch may not take longer
    # than fetch_total_timeout_s.
    settings = Settings(
        allow_private_networks=True,
        allow_http=True,
        fetch_connect_timeout_s=0.2,
        fetch_read_timeout_s=0.5,
        fetch_total_timeout_s=0.7,
    )
    started = time.perf_counter()
    error = error_of(fetch_image_bytes, url_source(f"{http_server}/drip"), settings)
    elapsed = time.perf_counter() - started
    assert error.code == ErrorCode.IMAGE_FETCH_TIMEOUT and "(the 0.7 s fetch deadline)" in error.message
    assert elapsed >= 0.6  # it waited for the deadline (the drip itself never ends: the message says which fired)


def test_connection_refused_is_fetch_failed(dev: Settings) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    error = error_of(fetch_image_bytes, url_source(f"http://127.0.0.1:{port}/a.png"), dev)
    assert error.code == ErrorCode.IMAGE_FETCH_FAILED
    assert "host 127.0.0.1" in error.message and str(port) not in error.message and "a.png" not in error.message


def test_unresolvable_host_is_fetch_failed(dev: Settings) -> None:
    error = error_of(fetch_image_bytes, url_source("https://no-such-host.invalid/a.png"), dev)
    assert error.code == ErrorCode.IMAGE_FETCH_FAILED and "resolve" in error.message


# --- URL: TLS to a pinned address ------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory, astronaut_png: bytes) -> Iterator[tuple[str, Path]]:
    """An https server on 127.0.0.1 whose self-signed certificate names only "localhost"."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        [
            openssl,
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost",
        ],
        check=True,
        capture_output=True,
    )
    _Handler.payloads = {"astronaut": astronaut_png}
    server = _Server(("127.0.0.1", 0), _Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    for running in _serve(server):
        yield f"https://localhost:{running.server_address[1]}", cert


def test_tls_is_verified_against_the_host_name_while_connecting_to_the_vetted_ip(
    tls_server: tuple[str, Path], astronaut_png: bytes
) -> None:
    base, cert = tls_server
    settings = Settings(allow_private_networks=True)
    # Connected to 127.0.0.1 (the vetted address), yet SNI and the certificate check use "localhost".
    assert fetch._fetch_url(f"{base}/img/astronaut", settings, verify=str(cert)) == astronaut_png
    # The certificate does not name 127.0.0.1: verification is really on.
    port = urlsplit(base).port
    error = error_of(fetch._fetch_url, f"https://127.0.0.1:{port}/img/astronaut", settings, verify=str(cert))
    assert error.code == ErrorCode.IMAGE_FETCH_FAILED and "certificate" in error.message
    # Without the test CA the self-signed certificate is refused (production default verify=True).
    assert (
        error_of(fetch_image_bytes, url_source(f"{base}/img/astronaut"), settings).code == ErrorCode.IMAGE_FETCH_FAILED
    )


def test_https_to_http_downgrade_redirect_is_refused(tls_server: tuple[str, Path], http_server: str) -> None:
    base, cert = tls_server
    settings = Settings(allow_private_networks=True)  # allow_http stays False
    target = quote(f"{http_server}/img/astronaut", safe="")
    error = error_of(fetch._fetch_url, f"{base}/redirect?to={target}", settings, verify=str(cert))
    assert error.code == ErrorCode.IMAGE_URL_FORBIDDEN and "https" in error.message


# --- S3 (botocore Stubber) -----------------------------------------------------------------


@pytest.fixture
def s3():
    client = boto3.client("s3", region_name="us-east-1", aws_access_key_id="testing", aws_secret_access_key="testing")
    with Stubber(client) as stubber:
        yield client, stubber
        stubber.assert_no_pending_responses()


def _body(data: bytes) -> StreamingBody:
    return StreamingBody(io.BytesIO(data), len(data))


def test_s3_object_is_fetched_with_a_capped_range(s3, astronaut_png: bytes) -> None:
    client, stubber = s3
    settings = Settings()
    cap = settings.max_image_bytes
    stubber.add_response(
        "head_object", {"ContentLength": len(astronaut_png)}, {"Bucket": "my-bucket", "Key": "dir/astronaut.png"}
    )
    stubber.add_response(
        "get_object",
        {"Body": _body(astronaut_png), "ContentLength": len(astronaut_png)},
        {"Bucket": "my-bucket", "Key": "dir/astronaut.png", "Range": f"bytes=0-{cap}"},
    )
    data = fetch_image_bytes(ImageSource(s3_uri="s3://my-bucket/dir/astronaut.png"), settings, s3_client=client)
    assert data == astronaut_png


def test_s3_object_over_the_cap_is_refused_after_head(s3) -> None:
    client, stubber = s3
    stubber.add_response("head_object", {"ContentLength": 1001}, {"Bucket": "my-bucket", "Key": "big.png"})
    error = error_of(
        fetch_image_bytes,
        ImageSource(s3_uri="s3://my-bucket/big.png"),
        Settings(max_image_bytes=1000),
        s3_client=client,
    )
    assert (error.code, error.status) == (ErrorCode.IMAGE_TOO_LARGE, 413)


def test_s3_object_that_grew_after_head_is_cut_off(s3) -> None:
    client, stubber = s3
    stubber.add_response("head_object", {"ContentLength": 10}, {"Bucket": "b-b", "Key": "k"})
    grown = b"x" * 1001  # the range reply holds cap + 1 bytes
    stubber.add_response("get_object", {"Body": _body(grown)}, {"Bucket": "b-b", "Key": "k", "Range": "bytes=0-1000"})
    error = error_of(
        fetch_image_bytes, ImageSource(s3_uri="s3://b-b/k"), Settings(max_image_bytes=1000), s3_client=client
    )
    assert error.code == ErrorCode.IMAGE_TOO_LARGE


@pytest.mark.parametrize(
    ("error_code", "status", "fragment"),
    [
        ("404", 404, "not found"),
        ("NoSuchBucket", 404, "not found"),
        ("403", 403, "denied"),
        ("SlowDown", 503, "could not be fetched"),
    ],
)
def test_s3_errors_are_fetch_failed(s3, error_code: str, status: int, fragment: str) -> None:
    client, stubber = s3
    stubber.add_client_error(
        "head_object",
        service_error_code=error_code,
        service_message="internal detail arn:aws:s3:::x",
        http_status_code=status,
    )
    error = error_of(fetch_image_bytes, ImageSource(s3_uri="s3://my-bucket/a.png"), Settings(), s3_client=client)
    assert (error.code, error.status) == (ErrorCode.IMAGE_FETCH_FAILED, 400)
    assert fragment in error.message and "arn:" not in error.message
    assert f"S3 answered {error_code}, HTTP {status}" in error.message  # the cause, S3's own code
    assert "bucket my-bucket" in error.message and "a.png" not in error.message  # the bucket, never the key


def test_s3_without_credentials_says_so(monkeypatch) -> None:
    """A server with no AWS credentials at all: the message names the cause and what to do."""
    import boto3

    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/dev/null")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    client = boto3.session.Session(region_name="us-east-1").client("s3")
    error = error_of(fetch_image_bytes, ImageSource(s3_uri="s3://my-bucket/a.png"), Settings(), s3_client=client)
    assert error.code == ErrorCode.IMAGE_FETCH_FAILED and "NoCredentialsError" in error.message
    assert "bucket my-bucket" in error.message


def test_every_url_fetch_failure_names_the_host(dev: Settings) -> None:
    """docs/api.md: ``image_fetch_failed`` names the URL's host (or the S3 bucket), never its path or
    query: an unresolvable host, one whose TLS certificate does not verify, one that refuses."""
    import threading

    unresolvable = error_of(fetch_image_bytes, url_source("https://no-such-host.invalid/a.png?t=1"), Settings())
    assert unresolvable.code == ErrorCode.IMAGE_FETCH_FAILED
    assert "no-such-host.invalid" in unresolvable.message and "a.png" not in unresolvable.message
    with socket.socket() as plain:  # a TLS client meets a server that is no TLS server: verification fails
        plain.bind(("127.0.0.1", 0))
        plain.listen(1)
        port = plain.getsockname()[1]

        def answer() -> None:
            conn, _ = plain.accept()
            with conn:
                conn.recv(1024)
                conn.sendall(b"HTTP/1.1 200 OK\r\n\r\n")

        threading.Thread(target=answer, daemon=True).start()
        bad_tls = error_of(fetch_image_bytes, url_source(f"https://127.0.0.1:{port}/secret/a.png"), dev)
    assert bad_tls.code == ErrorCode.IMAGE_FETCH_FAILED, bad_tls.message
    assert "127.0.0.1" in bad_tls.message and "secret" not in bad_tls.message


def test_empty_s3_object_is_image_invalid(s3) -> None:
    client, stubber = s3
    stubber.add_response("head_object", {"ContentLength": 0}, {"Bucket": "my-bucket", "Key": "empty.png"})
    error = error_of(fetch_image_bytes, ImageSource(s3_uri="s3://my-bucket/empty.png"), Settings(), s3_client=client)
    assert error.code == ErrorCode.IMAGE_INVALID


class _TricklingBody(io.RawIOBase):
    """An object body that gives 100 bytes every 0.2 s, forever (a trickling S3 connection)."""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        time.sleep(0.2)
        n = min(100, len(buffer))
        buffer[:n] = b"x" * n
        return n


def test_an_s3_object_that_trickles_ends_at_the_total_deadline(s3) -> None:
    """Each read brings bytes (no read timeout fires), but the whole fetch stops at
    ``fetch_total_timeout_s`` with ``image_fetch_timeout`` naming the bucket only."""
    client, stubber = s3
    stubber.add_response("head_object", {"ContentLength": 10**6}, {"Bucket": "slow-b", "Key": "k.png"})
    body = StreamingBody(io.BufferedReader(_TricklingBody(), buffer_size=100), 10**6)
    stubber.add_response("get_object", {"Body": body}, {"Bucket": "slow-b", "Key": "k.png", "Range": "bytes=0-2000000"})
    settings = Settings(max_image_bytes=2_000_000, fetch_total_timeout_s=1.0)
    error = error_of(fetch_image_bytes, ImageSource(s3_uri="s3://slow-b/k.png"), settings, s3_client=client)
    assert (error.code, error.status) == (ErrorCode.IMAGE_FETCH_TIMEOUT, 400)
    assert (
        "S3 bucket slow-b" in error.message and "1 s fetch deadline" in error.message and "k.png" not in error.message
    )
