"""Errors as the OpenAI API shapes them: {"error": {"message", "type", "param", "code"}}."""
from __future__ import annotations

from sanic.response import json as json_response


class APIError(Exception):
    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self):
        return json_response(self.body(), status=self.status)


def invalid(message: str, param: str | None = None) -> APIError:
    return APIError(message, 400, "invalid_request_error", param)
