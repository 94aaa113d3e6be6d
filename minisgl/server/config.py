"""ServerConfig: the settings of `minisgl-run serve` (HTTP front end), beside the engine's and the
scheduler's; declared once here, read by the settings layer like every other setting."""

from __future__ import annotations

from dataclasses import dataclass

from minisgl.config_fields import check_fields, setting

SECRET_SETTINGS = frozenset({"api_key"})  # never printed (`minisgl-run config`, logs)


@dataclass(frozen=True)
class ServerConfig:
    """Where the OpenAI-compatible server listens and how it bounds its work."""

    host: str = setting(
        "127.0.0.1",
        "Address `minisgl-run serve` binds to; 127.0.0.1 (loopback) unless told otherwise, e.g. 0.0.0.0.",
    )
    port: int = setting(30000, "TCP port of `minisgl-run serve` (HTTP API and /metrics).", ge=1, le=65535)
    served_model_name: str | None = setting(
        None, "Model name the server answers to (/v1/models, the `model` field); unset = the folder's name."
    )
    api_key: str | None = setting(
        None,
        "Require `Authorization: Bearer KEY` on /v1/* (401 otherwise); unset = no key. Never printed.",
    )
    max_waiting_requests: int = setting(
        1024,
        "Requests the server queues beyond max_running_req; past it new requests get 503 with Retry-After.",
        ge=0,
    )
    shutdown_grace_s: float = setting(
        30.0,
        "On SIGINT/SIGTERM, seconds the server lets running requests finish before aborting them.",
        ge=0,
    )
    max_request_bytes: int = setting(
        8 << 20, "Largest request body the server reads, in bytes (413 past it).", ge=1024
    )

    def __post_init__(self) -> None:
        check_fields(self)
