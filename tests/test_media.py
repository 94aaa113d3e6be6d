"""minisgl.multimodal.media: image references (data URLs, http(s) with the SSRF checks, local files) to PIL
images, every failure a MediaError naming the input; and the media settings."""

from __future__ import annotations

import base64
import http.server
import io
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image

from minisgl.multimodal import media
from minisgl.multimodal.media import MediaError, MediaPolicy, is_public_address, load_image
from minisgl.settings import EngineSettings


def image_bytes(fmt: str, size: tuple[int, int] = (13, 7), color=(200, 30, 60), **save) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format=fmt, **save)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


POLICY = MediaPolicy(fetch_timeout_s=5.0, max_bytes=1 << 20)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_data_url_of_each_format(fmt: str) -> None:
    image = load_image(
        data_url(image_bytes(fmt, lossless=True) if fmt == "WEBP" else image_bytes(fmt)), POLICY
    )
    assert image.format == fmt and image.size == (13, 7)
    r, g, b = image.convert("RGB").getpixel((3, 3))
    if fmt == "JPEG":
        assert abs(r - 200) < 8 and abs(g - 30) < 8 and abs(b - 60) < 8
    else:
        assert (r, g, b) == (200, 30, 60)


def test_gif_gives_its_first_frame() -> None:
    frames = [Image.new("RGB", (8, 8), color) for color in [(255, 0, 0), (0, 0, 255)]]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:])
    image = load_image(data_url(buf.getvalue(), "image/gif"), POLICY)
    assert getattr(image, "n_frames", 1) == 2 and image.tell() == 0
    assert image.convert("RGB").getpixel((0, 0)) == (255, 0, 0)


def test_percent_encoded_data_url() -> None:
    from urllib.parse import quote

    image = load_image("data:image/png," + quote(image_bytes("PNG")), POLICY)
    assert image.size == (13, 7)


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        (data_url(b"definitely not an image"), "does not decode"),
        (data_url(image_bytes("BMP")), "does not decode"),  # a real image, a format not accepted
        ("data:image/png;base64,@@@@", "base64"),
        ("data:image/png;base64", "','"),
        ("ftp://example.com/a.png", "unsupported URL scheme"),
    ],
)
def test_bad_data_is_refused_naming_the_input(url: str, reason: str) -> None:
    with pytest.raises(MediaError, match=reason) as info:
        load_image(url, POLICY)
    assert url[:30] in str(info.value)


def test_data_url_byte_limit() -> None:
    data = image_bytes("PNG", size=(64, 64))
    assert load_image(data_url(data), MediaPolicy(max_bytes=len(data))).size == (64, 64)
    with pytest.raises(MediaError, match="media_max_bytes"):
        load_image(data_url(data), MediaPolicy(max_bytes=len(data) - 1))


def test_pil_image_and_python_path_are_taken(tmp_path: Path) -> None:
    image = Image.new("RGB", (5, 4))
    assert load_image(image, POLICY) is image
    path = tmp_path / "a.png"
    path.write_bytes(image_bytes("PNG"))
    assert load_image(path, POLICY).size == (13, 7)  # a Path from Python: no folder needed
    with pytest.raises(MediaError, match="URL, a path or a PIL image"):
        load_image(3, POLICY)  # type: ignore[arg-type]


# -- local files ---------------------------------------------------------------------------------------


@pytest.fixture
def media_folder(tmp_path: Path) -> Path:
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "in.png").write_bytes(image_bytes("PNG"))
    (tmp_path / "secret.png").write_bytes(image_bytes("PNG"))
    (allowed / "link.png").symlink_to(tmp_path / "secret.png")
    return allowed


def test_local_files_refused_without_a_folder(media_folder: Path) -> None:
    with pytest.raises(MediaError, match="allowed_local_media_path"):
        load_image(str(media_folder / "in.png"), POLICY)


def test_local_files_only_inside_the_folder(media_folder: Path) -> None:
    policy = MediaPolicy(allowed_local_path=str(media_folder))
    assert load_image(str(media_folder / "in.png"), policy).size == (13, 7)
    assert load_image((media_folder / "in.png").as_uri(), policy).size == (13, 7)
    for escape in [str(media_folder / ".." / "secret.png"), str(media_folder / "link.png")]:
        with pytest.raises(MediaError, match="outside allowed_local_media_path"):
            load_image(escape, policy)
    with pytest.raises(MediaError, match="no such file"):
        load_image(str(media_folder / "missing.png"), policy)


# -- http ----------------------------------------------------------------------------------------------

PNG = image_bytes("PNG", size=(31, 17))


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def _send(self, status: int, body: bytes = b"", **headers: str) -> None:
        self.send_response(status)
        for name, value in {"Content-Length": str(len(body)), **headers}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        port = self.server.server_address[1]
        if self.path == "/named-host" and self.headers["Host"].startswith("images.test:"):
            self._send(200, PNG)
        elif self.path == "/img.png":
            self._send(200, PNG, **{"Content-Type": "image/png"})
        elif self.path == "/garbage":
            self._send(200, b"<html>not an image</html>")
        elif self.path == "/to-img":
            self._send(302, Location="/img.png")
        elif self.path == "/to-localhost":
            self._send(302, Location=f"http://localhost:{port}/img.png")
        elif self.path == "/loop":
            self._send(302, Location="/loop")
        elif self.path == "/slow":
            time.sleep(2.0)  # longer than the test's timeout; bounded
            self._send(200, PNG)
        else:
            self._send(404)


class _Server(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        pass  # a client that stops reading (the byte limit, the timeout) breaks the pipe: expected


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """An HTTP server on 127.0.0.1 answering at most 100 requests or for at most 60 s."""
    httpd = _Server(("127.0.0.1", 0), _Handler)
    httpd.timeout = 0.1
    httpd.daemon_threads = True
    stop = threading.Event()
    deadline = time.monotonic() + 60

    def serve() -> None:
        for _ in range(100):
            if stop.is_set() or time.monotonic() > deadline:
                break
            httpd.handle_request()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    stop.set()
    thread.join(timeout=5)
    httpd.server_close()


def allowed(**kwargs) -> MediaPolicy:
    return MediaPolicy(**{"fetch_timeout_s": 5.0, "allowed_domains": ("127.0.0.1",), **kwargs})


def test_loopback_url_refused_by_default(server: str) -> None:
    with pytest.raises(MediaError, match="loopback, private") as info:
        load_image(f"{server}/img.png", POLICY)
    assert "allowed_media_domains" in str(info.value) and "127.0.0.1" in str(info.value)


def test_loopback_url_allowed_when_its_host_is_listed(server: str) -> None:
    image = load_image(f"{server}/img.png", allowed())
    assert image.size == (31, 17) and image.format == "PNG"
    assert load_image(f"{server}/to-img", allowed()).size == (31, 17)  # a redirect to the same host


def test_redirect_to_loopback_refused(server: str) -> None:
    with pytest.raises(MediaError, match="'localhost' resolves to"):
        load_image(f"{server}/to-localhost", allowed())


def fake_dns(monkeypatch: pytest.MonkeyPatch, answers: dict[str, list[str]]) -> list[str]:
    """Resolves the names of `answers` to their addresses (no other name); returns the names looked up."""
    looked_up: list[str] = []
    real = socket.getaddrinfo

    def getaddrinfo(host, port, *args, **kwargs):
        if host.replace(".", "").isdigit():  # the connection's own lookup of an address: no DNS
            return real(host, port, *args, **kwargs)
        looked_up.append(host)
        if host not in answers:
            raise socket.gaierror(f"{host} unknown in this test")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port)) for address in answers[host]]

    monkeypatch.setattr(media.socket, "getaddrinfo", getaddrinfo)
    return looked_up


def test_connects_to_the_checked_address(server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The host is resolved once and the connection goes to that address, the host in the Host header."""
    looked_up = fake_dns(monkeypatch, {"images.test": ["127.0.0.1"]})
    url = server.replace("127.0.0.1", "images.test") + "/named-host"
    assert load_image(url, MediaPolicy(allowed_domains=("images.test",))).size == (31, 17)
    assert looked_up == ["images.test"]


def test_any_private_address_of_a_host_refuses_it(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_dns(monkeypatch, {"mixed.test": ["8.8.8.8", "10.0.0.7"]})
    with pytest.raises(MediaError, match="10.0.0.7"):
        load_image("http://mixed.test/a.png", POLICY)
    with pytest.raises(MediaError, match="does not resolve"):
        load_image("http://unknown.test/a.png", POLICY)


def test_http_failures(server: str) -> None:
    with pytest.raises(MediaError, match="media_max_bytes"):
        load_image(f"{server}/img.png", allowed(max_bytes=len(PNG) - 1))
    with pytest.raises(MediaError, match="does not decode"):
        load_image(f"{server}/garbage", allowed())
    with pytest.raises(MediaError, match="HTTP 404"):
        load_image(f"{server}/nothing", allowed())
    with pytest.raises(MediaError, match="redirects"):
        load_image(f"{server}/loop", allowed())


def test_fetch_timeout(server: str) -> None:
    with pytest.raises(MediaError, match="timed out"):
        load_image(f"{server}/slow", allowed(fetch_timeout_s=0.3))


@pytest.mark.parametrize(
    ("address", "public"),
    [
        ("8.8.8.8", True),
        ("2606:4700:4700::1111", True),
        ("127.0.0.1", False),
        ("10.1.2.3", False),
        ("172.16.0.1", False),
        ("192.168.1.1", False),
        ("169.254.169.254", False),  # cloud metadata
        ("100.64.0.1", False),  # shared address space
        ("0.0.0.0", False),
        ("240.0.0.1", False),
        ("224.0.0.1", False),
        ("::1", False),
        ("fe80::1", False),
        ("fd00::1", False),
        ("::ffff:127.0.0.1", False),
        ("::ffff:8.8.8.8", True),
    ],
)
def test_is_public_address(address: str, public: bool) -> None:
    assert is_public_address(address) is public


def test_media_settings_layers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ["MINISGL_CONFIG", "MINISGL_MEDIA_MAX_BYTES", "MINISGL_ALLOWED_MEDIA_DOMAINS"]:
        monkeypatch.delenv(name, raising=False)
    config = EngineSettings.load(None).to_media_config()
    assert config.max_images_per_request == 16 and config.image_max_pixels is None
    policy = config.policy()
    assert policy.allowed_domains == () and policy.allowed_local_path is None
    monkeypatch.setenv("MINISGL_ALLOWED_MEDIA_DOMAINS", "a.lan,127.0.0.1")
    yaml_file = tmp_path / "s.yaml"
    yaml_file.write_text("media_max_bytes: 1000\nallowed_local_media_path: /srv/images\n")
    config = EngineSettings.load(yaml_file, image_max_pixels=4096).to_media_config()
    policy = config.policy()
    assert policy.allowed_domains == ("a.lan", "127.0.0.1") and policy.max_bytes == 1000
    assert policy.allowed_local_path == "/srv/images" and config.image_max_pixels == 4096
