"""Structured output in the server's requests: OpenAI's ``response_format`` (``text``, ``json_object``,
``json_schema``) and SGLang's ``regex`` and ``ebnf`` fields, at most one, onto the SamplingParams
fields ``json_schema``, ``json_object``, ``regex`` and ``ebnf``. Errors name the request's field
(`GRAMMAR_PARAMS`). docs/server.md ("Endpoints"), docs/structured-output.md.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# a SamplingParams field an error message starts with -> the request's field it came from
GRAMMAR_PARAMS = {"json_schema": "response_format.json_schema.schema", "json_object": "response_format"}


class _Strict(BaseModel):
    # as the protocol's request models: no coercion, no unknown field
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, populate_by_name=False)


class JSONSchemaFormat(_Strict):
    """OpenAI's ``response_format.json_schema``."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's ``response_format``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputError(ValueError):
    """A request whose structured output fields do not go together; `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def grammar_fields(
    response_format: ResponseFormat | None, regex: str | None, ebnf: str | None
) -> dict[str, Any]:
    """The SamplingParams fields of a request's ``response_format``, ``regex`` and ``ebnf`` (only those
    it sets); a `StructuredOutputError` when they do not go together."""
    fields: dict[str, Any] = {}
    given = []
    if response_format is not None:
        kind, spec = response_format.type, response_format.json_schema
        if spec is not None and kind != "json_schema":
            raise StructuredOutputError(
                f"response_format.json_schema goes with type 'json_schema', not {kind!r}; set the type "
                "or leave json_schema out",
                "response_format.json_schema",
            )
        if kind == "json_schema":
            if spec is None or spec.schema_ is None:
                param = "response_format.json_schema" + ("" if spec is None else ".schema")
                raise StructuredOutputError(
                    f"missing required parameter '{param}': type 'json_schema' needs a JSON schema object",
                    param,
                )
            fields["json_schema"] = spec.schema_
            given.append("response_format")
        elif kind == "json_object":
            fields["json_object"] = True
            given.append("response_format")
    for name, value in (("regex", regex), ("ebnf", ebnf)):
        if value is not None:
            fields[name] = value
            given.append(name)
    if len(given) > 1:
        raise StructuredOutputError(
            f"{given[0]} and {given[1]} both ask for structured output: give at most one of "
            "response_format (json_object, json_schema), regex and ebnf",
            given[1],
        )
    return fields
