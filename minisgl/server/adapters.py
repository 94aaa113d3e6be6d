"""LoRA adapters loaded and unloaded while serving, with vLLM's routes and fields: `POST
/v1/load_lora_adapter` {"lora_name", "lora_path"} and `POST /v1/unload_lora_adapter` {"lora_name"},
behind the setting allow_runtime_lora (off: 403). Under data parallelism every replica loads the
adapter (or none keeps it). docs/lora.md.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from minisgl.server.errors import APIError, short
from minisgl.server.guards import error_response, load_json, read_body, why_unavailable
from minisgl.server.state import ServerState


def add_routes(app: FastAPI, state: ServerState) -> None:
    """The two routes on `app`."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        return await _change(state, request, ("lora_name", "lora_path"))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        return await _change(state, request, ("lora_name",))


async def _change(state: ServerState, request: Request, fields: tuple[str, ...]) -> Response:
    """Loads (`fields` has lora_path) or unloads the adapter the body names."""
    loading = "lora_path" in fields
    try:
        unavailable = why_unavailable(state)
        if unavailable is not None:
            raise unavailable
        if not state.allow_runtime_lora:
            raise APIError(
                "loading and unloading LoRA adapters while serving is off: start the server with "
                "allow_runtime_lora (--allow-runtime-lora, MINISGL_ALLOW_RUNTIME_LORA=1)",
                status=403,
                type="permission_error",
                code="runtime_lora_disabled",
            )
        values = _fields(load_json(await read_body(state, request)), fields)
        name = values["lora_name"]
        if loading and name == state.served_model:
            raise APIError(
                f"lora_name={short(name)} is the base model's name: give the adapter another name",
                param="lora_name",
            )
        client = state.client
        answer = await (client.load_lora(name, values["lora_path"]) if loading else client.unload_lora(name))
        if answer["error"] is not None:
            status = answer["status"]
            if status == 404:
                raise APIError(answer["error"], status=404, param="lora_name", code="lora_not_found")
            kind = "server_error" if status >= 500 else "invalid_request_error"
            raise APIError(answer["error"], status=status, type=kind)
    except APIError as e:
        return error_response(e)
    done = "added" if loading else "removed"
    return PlainTextResponse(f"Success: LoRA adapter '{name}' {done} successfully.")


def _fields(body: dict[str, Any], fields: tuple[str, ...]) -> dict[str, str]:
    """The body's `fields`, each a non-empty string; a 400 naming one missing or unknown."""
    for key in body:
        if key not in fields:
            raise APIError(
                f"unknown field {short(key)}: this route takes {', '.join(fields)}",
                param=key,
                code="unknown_parameter",
            )
    for key in fields:
        value = body.get(key)
        if not isinstance(value, str) or not value.strip():
            got = "it is missing" if key not in body else f"got {short(value)}"
            raise APIError(f"{key} must be a non-empty string ({got})", param=key)
    return {key: body[key] for key in fields}
