"""MediaConfig: the settings of image inputs (where they may come from, how many, how large)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from minisgl.config_fields import as_tuple, check_fields, setting

if TYPE_CHECKING:
    from minisgl.multimodal.media import MediaPolicy


def _pixels(bound: str) -> Any:
    description = (
        "pixels an image is resized to (the smart resize); unset = the folder's preprocessor config."
    )
    return setting(None, f"{bound} {description}", ge=1)


@dataclasses.dataclass(frozen=True)
class MediaConfig:
    """Image inputs of vision-language models: read by whoever turns a request's images into pixels."""

    max_images_per_request: int = setting(16, "Images one request may carry (400 past it).", ge=0, le=4096)
    image_min_pixels: int | None = _pixels("Fewest")
    image_max_pixels: int | None = _pixels("Most")
    media_fetch_timeout_s: float = setting(
        10.0, "Seconds the fetch of one http(s) image URL may take, redirects included.", gt=0
    )
    media_max_bytes: int = setting(
        20 << 20, "Largest image, in bytes, read from a URL, a data URL or a file (400 past it).", ge=1
    )
    allowed_media_domains: tuple[str, ...] | None = setting(
        None,
        "Hosts whose image URLs may resolve to loopback, private, link-local or reserved addresses "
        "(e.g. [images.lan, 127.0.0.1]); unset = public addresses only, redirects included.",
        parse=as_tuple,
        given_as=list[str] | None,
    )
    allowed_local_media_path: str | None = setting(
        None,
        "Folder whose files (and only those, after symlinks and '..' are resolved) requests may name as "
        "images (a path or file:// URL); unset = local files refused.",
    )

    def __post_init__(self) -> None:
        check_fields(self)

    def policy(self) -> MediaPolicy:
        """Where images may come from, as `minisgl.multimodal.media.load_image` takes it."""
        from minisgl.multimodal.media import MediaPolicy  # Pillow only where images are read

        return MediaPolicy(
            fetch_timeout_s=self.media_fetch_timeout_s,
            max_bytes=self.media_max_bytes,
            allowed_domains=self.allowed_media_domains or (),
            allowed_local_path=self.allowed_local_media_path,
        )
