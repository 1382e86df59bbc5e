"""What the service accepts as a request body: at most ``AUTOPAR_MAX_BODY_BYTES`` (413 beyond), and JSON
whose numbers are finite (a NaN or an Infinity answers 422 naming its field, before FastAPI validates).

:class:`BodyLimit` is the ASGI middleware; :class:`FiniteJSONRoute` the route class every router uses.
"""

from __future__ import annotations

import json
import math
from typing import Any

from fastapi import Request, Response
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute

from planner.errors import AutoparError

# -- request body limit --------------------------------------------------------------------------

class BodyLimit:
    """ASGI middleware: bodies over ``max_bytes`` get 413 (by Content-Length, or counted while streaming)."""

    def __init__(self, app: Any, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        too_big = JSONResponse(status_code=413, content={
            "detail": f"request body is larger than {self.max_bytes} bytes; send less, or raise "
                      "AUTOPAR_MAX_BODY_BYTES on the server"})
        try:
            if declared is not None and int(declared) > self.max_bytes:
                await too_big(scope, receive, send)
                return
        except ValueError:
            await JSONResponse(status_code=400,
                               content={"detail": "Content-Length is not a number"})(scope, receive, send)
            return
        seen = 0
        answered = False

        async def guarded_send(message: dict) -> None:
            if not answered:  # after the 413 the app's own reply (to a disconnect) is dropped
                await send(message)

        async def counted() -> dict:
            nonlocal seen, answered
            if answered:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    await too_big(scope, receive, send)
                    answered = True
                    return {"type": "http.disconnect"}
            return message

        try:
            await self.app(scope, counted, guarded_send)
        except Exception:
            if not answered:
                raise


# -- request bodies hold finite numbers -------------------------------------------------------------

class _NonFinite:
    """A number JSON has no place for, where it stood in a body: ``NaN``, ``Infinity``, ``-Infinity``
    (Python's json reads them) or a literal beyond the largest float (``1e999``)."""

    def __init__(self, text: str):
        self.text = text


def _float_or_mark(text: str) -> float | _NonFinite:
    value = float(text)
    return value if math.isfinite(value) else _NonFinite(text)


def non_finite_field(document: Any) -> tuple[str, str] | None:
    """(dotted path, literal) of the first non-finite number of a document parsed by
    :func:`finite_json`, else None (an explicit stack: bodies may nest as deeply as json reads)."""
    stack: list[tuple[str, Any]] = [("", document)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, _NonFinite):
            return path or "body", node.text
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        stack.extend(reversed([(f"{path}.{k}" if path else str(k), v) for k, v in items]))
    return None


def finite_json(body: bytes) -> Any:
    """The JSON document in ``body``; AutoparError naming the field of a number that is not finite
    (ValueError or RecursionError where ``body`` is no JSON, as :func:`json.loads`)."""
    document = json.loads(body, parse_constant=_NonFinite, parse_float=_float_or_mark)
    found = non_finite_field(document)
    if found is not None:
        field, literal = found
        raise AutoparError(field, literal, "send a finite number (JSON has no NaN or Infinity)",
                           problem="is not a finite number")
    return document


class FiniteJSONRequest(Request):
    """A request whose JSON body is read by :func:`finite_json`, once."""

    async def json(self) -> Any:
        if not hasattr(self, "_finite_json"):
            self._finite_json = finite_json(await self.body())
        return self._finite_json


class FiniteJSONRoute(APIRoute):
    """A route that answers 422, naming the field, a body holding NaN or ±Infinity, before FastAPI
    validates it (whose error would echo ``nan``, which no JSON response can hold)."""

    def get_route_handler(self) -> Any:
        from api.deps import Writer, authorize

        handle = super().get_route_handler()
        writes = any(d.dependency is Writer.dependency for d in self.dependencies)

        async def handler(request: Request) -> Response:
            if writes:  # the token before the body: 401 for a client without one, whatever it sent
                authorize(request)
            request = FiniteJSONRequest(request.scope, request.receive)
            try:
                if await request.body():
                    await request.json()
            except AutoparError:
                raise
            except Exception:  # noqa: BLE001 - no JSON, or no whole body: FastAPI answers it as it answers any such
                pass
            return await handle(request)

        return handler


COMMON_RESPONSES: dict = {
    400: {"description": "the body is not valid JSON"},
    413: {"description": "the body is larger than AUTOPAR_MAX_BODY_BYTES"},
}
