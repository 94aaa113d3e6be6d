"""Image references to PIL images: `data:` URLs, http(s) URLs, local files, and PIL images or paths
given from Python.

Untrusted references (strings, as a request carries them) follow a `MediaPolicy`:

- ``data:`` URLs (base64 or percent-encoded) always; PNG, JPEG, WebP and GIF (its first frame) only.
- ``http://`` and ``https://`` URLs: the host is resolved once, every address it resolves to must be
  public (not loopback, private, link-local, reserved, multicast or unspecified) unless the host is in
  ``allowed_domains``, and the connection goes to the checked address (no second lookup for a DNS
  rebinding to slip into). Redirects are followed here, each hop checked the same way. The whole fetch
  is bounded by ``fetch_timeout_s`` and its body by ``max_bytes``.
- local paths (``/a/b.png`` or ``file://``): only inside ``allowed_local_path``, checked after symlinks
  and ``..`` are resolved; unset, every local path is refused.

A `pathlib.Path` or a PIL image comes from the Python caller itself (`LLM.chat`) and is trusted: a Path is
read wherever it points. Every failure raises `MediaError`, whose message names the input and the reason.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import io
import ipaddress
import os
import socket
import ssl
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

# the formats an image may come in; Pillow's other decoders are never reached
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
MAX_REDIRECTS = 5
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_CHUNK = 64 << 10


class MediaError(ValueError):
    """An image reference that cannot be used; the message names it and says why (the server's 400)."""


@dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from: the settings media_fetch_timeout_s, media_max_bytes,
    allowed_media_domains and allowed_local_media_path."""

    fetch_timeout_s: float = 10.0
    max_bytes: int = 20 << 20
    allowed_domains: tuple[str, ...] = ()
    allowed_local_path: str | None = None


def load_image(ref: str | os.PathLike[str] | Image.Image, policy: MediaPolicy) -> Image.Image:
    """The decoded image `ref` names (its first frame, pixels loaded); MediaError when it cannot be had."""
    if isinstance(ref, Image.Image):
        return ref
    if isinstance(ref, os.PathLike):  # from Python: trusted, read wherever it points
        return decode_image(
            _read_file(Path(ref), policy.max_bytes, _describe(os.fspath(ref))), os.fspath(ref)
        )
    if not isinstance(ref, str):
        raise MediaError(f"an image must be a URL, a path or a PIL image, got {type(ref).__name__}")
    scheme = urllib.parse.urlsplit(ref).scheme.lower() if "://" in ref or ref.startswith("data:") else ""
    if scheme == "data":
        return decode_image(_data_url_bytes(ref, policy.max_bytes), ref)
    if scheme in ("http", "https"):
        return decode_image(fetch_url(ref, policy), ref)
    if scheme in ("", "file"):
        return decode_image(_read_local(ref, policy), ref)
    raise MediaError(
        f"image {_describe(ref)}: unsupported URL scheme {scheme!r} (use data:, http(s) or a path)"
    )


def decode_image(data: bytes, ref: str) -> Image.Image:
    """`data` decoded as one of IMAGE_FORMATS (a GIF's first frame), its pixels loaded."""
    try:
        image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
        image.seek(0)
        image.load()
    except Image.DecompressionBombError as e:
        raise MediaError(f"image {_describe(ref)} is too large to decode: {e}") from None
    except (OSError, ValueError, SyntaxError) as e:  # Pillow's UnidentifiedImageError is an OSError
        raise MediaError(
            f"image {_describe(ref)} does not decode as {', '.join(IMAGE_FORMATS)} ({type(e).__name__}: {e})"
        ) from None
    return image


def _describe(ref: str) -> str:
    """`ref` for an error message: long data URLs cut short."""
    return repr(ref if len(ref) <= 100 else ref[:80] + "...")


def _data_url_bytes(url: str, max_bytes: int) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma:
        raise MediaError(f"image {_describe(url)}: a data URL needs a ',' before its data")
    if len(payload) > 3 * max_bytes + 4:  # before decoding: base64 is 4/3 of the bytes, percent-encoding 3x
        raise MediaError(f"image {_describe(url)}: larger than media_max_bytes={max_bytes}")
    try:
        if header.lower().endswith(";base64"):
            data = base64.b64decode(payload, validate=True)
        else:
            data = urllib.parse.unquote_to_bytes(payload)
    except (binascii.Error, ValueError) as e:
        raise MediaError(f"image {_describe(url)}: its base64 data does not decode ({e})") from None
    if len(data) > max_bytes:
        raise MediaError(f"image {_describe(url)}: {len(data)} bytes, more than media_max_bytes={max_bytes}")
    return data


def _read_local(ref: str, policy: MediaPolicy) -> bytes:
    path_text = urllib.parse.unquote(urllib.parse.urlsplit(ref).path) if ref.startswith("file:") else ref
    if policy.allowed_local_path is None:
        raise MediaError(
            f"image {_describe(ref)}: local files are refused (set allowed_local_media_path to a folder "
            "to allow the files under it)"
        )
    root = Path(policy.allowed_local_path).resolve()
    try:
        path = Path(path_text).resolve(strict=True)  # symlinks and '..' resolved before the check
    except (OSError, RuntimeError) as e:
        raise MediaError(f"image {_describe(ref)}: no such file ({e})") from None
    if not path.is_relative_to(root):
        raise MediaError(
            f"image {_describe(ref)}: {str(path)!r} is outside allowed_local_media_path={str(root)!r}"
        )
    return _read_file(path, policy.max_bytes, _describe(ref))


def _read_file(path: Path, max_bytes: int, described: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise MediaError(f"image {described}: cannot be read ({e})") from None
    if len(data) > max_bytes:
        raise MediaError(f"image {described}: more than media_max_bytes={max_bytes} bytes")
    return data


# -- http(s) -------------------------------------------------------------------------------------------


def is_public_address(address: str) -> bool:
    """Whether `address` (an IP literal) is a public unicast address (IPv4-mapped IPv6 read as IPv4)."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not (ip.is_multicast or ip.is_unspecified or ip.is_reserved)


def _checked_address(url: str, host: str, port: int, policy: MediaPolicy, deadline: float) -> str:
    """The address to connect to for `host`: its first resolved one, after checking them all."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        raise MediaError(f"image URL {_describe(url)}: host {host!r} does not resolve ({e})") from None
    if time.monotonic() > deadline:
        raise MediaError(
            f"image URL {_describe(url)}: timed out (media_fetch_timeout_s={policy.fetch_timeout_s})"
        )
    addresses = [info[4][0] for info in infos]
    if host.lower() not in {d.lower() for d in policy.allowed_domains}:
        private = [a for a in addresses if not is_public_address(a)]
        if private:
            raise MediaError(
                f"image URL {_describe(url)}: host {host!r} resolves to {private[0]}, a loopback, private, "
                "link-local or reserved address (refused; add the host to allowed_media_domains to allow it)"
            )
    return addresses[0]


class _PinnedHTTP(http.client.HTTPConnection):
    """An HTTP connection to the checked address `ip`, with the URL's host in its Host header."""

    def __init__(self, host: str, port: int, ip: str, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self.ip = ip

    def connect(self) -> None:
        self.sock = socket.create_connection((self.ip, self.port), self.timeout)


class _PinnedHTTPS(http.client.HTTPSConnection):
    """An HTTPS connection to the checked address `ip`; the certificate is checked against the host."""

    def __init__(self, host: str, port: int, ip: str, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout, context=ssl.create_default_context())
        self.ip = ip

    def connect(self) -> None:
        sock = socket.create_connection((self.ip, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)


def fetch_url(url: str, policy: MediaPolicy) -> bytes:
    """The body of http(s) `url` under `policy` (see the module docstring), redirects followed here."""
    deadline = time.monotonic() + policy.fetch_timeout_s
    current = url
    for _ in range(MAX_REDIRECTS + 1):
        parts = urllib.parse.urlsplit(current)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise MediaError(
                f"image URL {_describe(url)}: redirected to {_describe(current)}, not an http(s) URL"
            )
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError as e:
            raise MediaError(f"image URL {_describe(url)}: bad port ({e})") from None
        ip = _checked_address(url, parts.hostname, port, policy, deadline)
        cls = _PinnedHTTPS if parts.scheme == "https" else _PinnedHTTP
        connection = cls(parts.hostname, port, ip, _remaining(url, deadline, policy))
        try:
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            connection.request("GET", path, headers={"User-Agent": "minisgl", "Accept": "image/*"})
            sock = connection.sock  # kept: the connection lets go of it once the response owns it
            response = connection.getresponse()
            if response.status in _REDIRECTS and response.getheader("Location"):
                current = urllib.parse.urljoin(current, response.getheader("Location"))
                continue
            if response.status != 200:
                raise MediaError(f"image URL {_describe(url)}: HTTP {response.status} {response.reason}")
            return _read_body(url, response, sock, policy, deadline)
        except (OSError, http.client.HTTPException) as e:
            if isinstance(e, TimeoutError) or time.monotonic() > deadline:
                raise MediaError(
                    f"image URL {_describe(url)}: timed out (media_fetch_timeout_s={policy.fetch_timeout_s})"
                ) from None
            raise MediaError(f"image URL {_describe(url)}: fetch failed ({type(e).__name__}: {e})") from None
        finally:
            connection.close()
    raise MediaError(f"image URL {_describe(url)}: more than {MAX_REDIRECTS} redirects")


def _remaining(url: str, deadline: float, policy: MediaPolicy) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise MediaError(
            f"image URL {_describe(url)}: timed out (media_fetch_timeout_s={policy.fetch_timeout_s})"
        )
    return left


def _read_body(
    url: str,
    response: http.client.HTTPResponse,
    sock: socket.socket,
    policy: MediaPolicy,
    deadline: float,
) -> bytes:
    too_large = f"image URL {_describe(url)}: larger than media_max_bytes={policy.max_bytes}"
    length = response.getheader("Content-Length")
    if length is not None and length.isdigit() and int(length) > policy.max_bytes:
        raise MediaError(too_large)
    chunks: list[bytes] = []
    size = 0
    while True:
        sock.settimeout(_remaining(url, deadline, policy))  # each read: at most what the fetch has left
        chunk = response.read1(_CHUNK)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > policy.max_bytes:
            raise MediaError(too_large)
        chunks.append(chunk)
