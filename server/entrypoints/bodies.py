"""HTTP request bodies (read up to a limit) and query strings, each validated as one pydantic
model."""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from core.errors import InvalidFrame, PayloadTooLarge, validation_problems

MAX_BODY_BYTES = 2**20
"""Largest JSON body accepted: 200 messages of 16,000 characters do not fit, real chats do."""

_M = TypeVar("_M", bound=BaseModel)


async def read_json(request: Request, model: type[_M]) -> _M:
    """The body as ``model``; ``PayloadTooLarge`` past ``MAX_BODY_BYTES`` (read no further),
    ``InvalidFrame`` with the path-level reasons for anything else."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise PayloadTooLarge(f"the body is {declared} bytes; at most {MAX_BODY_BYTES}")
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY_BYTES:
            raise PayloadTooLarge(f"the body is over {MAX_BODY_BYTES} bytes")
    try:
        return model.model_validate_json(bytes(raw))
    except ValidationError as exc:
        raise InvalidFrame(validation_problems(exc, "body", limit=10)) from exc


def read_query(request: Request, model: type[_M]) -> _M:
    """The query string as ``model`` (one value a name; a name it does not know is refused):
    ``InvalidFrame`` with the path-level reasons."""
    try:
        return model.model_validate(dict(request.query_params))
    except ValidationError as exc:
        raise InvalidFrame(validation_problems(exc, "query", limit=10)) from exc
