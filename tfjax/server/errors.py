"""OpenAI-style errors: `ApiError` (a refused request) and the `{"error": {...}}` body every refusal gets."""

from __future__ import annotations


class ApiError(Exception):
    """A refused request: HTTP status, OpenAI error type and code, the offending parameter."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.type = status, message, code, param, type
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.code, self.param)


def error_body(message: str, type: str, code: str | None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
