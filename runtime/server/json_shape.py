"""Bounds on the shape of a JSON request body, checked on its bytes before any Python object exists,
answered as the server's 400 (`request_too_complex`, `param` naming the top-level field).

The walk itself is `json_bounds` (torch-free, shared with `kvasir router`), which says why the
bounds are what they are. The bounds are read from this module at each call, so a test may patch
them here."""

from __future__ import annotations

from kvasir.runtime.server.errors import APIError
from kvasir.runtime.server.json_bounds import (
    MAX_CONTAINERS,
    MAX_DEPTH,
    MAX_MEMBERS,
    MAX_STRINGS,
    MAX_VALUES,
    ShapeBounds,
    ShapeError,
    check_shape,
)

__all__ = ["MAX_CONTAINERS", "MAX_DEPTH", "MAX_MEMBERS", "MAX_STRINGS", "MAX_VALUES", "check_json_shape"]


def check_json_shape(body: bytes) -> None:
    """Raise APIError 400 (param: the top-level field) if `body` passes a bound; otherwise return."""
    bounds = ShapeBounds(MAX_DEPTH, MAX_CONTAINERS, MAX_VALUES, MAX_STRINGS, MAX_MEMBERS)
    try:
        check_shape(body, bounds)
    except ShapeError as error:
        raise APIError(400, error.message, param=error.param, code="request_too_complex") from None
