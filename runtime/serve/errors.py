"""The error a refused request gets: its HTTP status and OpenAI's error body."""
from __future__ import annotations

from helmc.errors import HelmcError


class OpenAIError(HelmcError):
    """A request the server refuses: HTTP status and OpenAI's error fields."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
