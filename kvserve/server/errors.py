"""APIError: an error answered in OpenAI's shape ({"error": {"message", "type", "param", "code"}})."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from kvserve.server import protocol as P


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers

    def body(self) -> dict:
        """The JSON body."""
        return P.ErrorResponse(error=P.ErrorInfo(message=self.message, type=self.type,
                                                 param=self.param, code=self.code)).model_dump()

    def response(self) -> JSONResponse:
        """The JSON error response."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)
