"""Errors in each protocol's own shape:
  OpenAI     {"error": {"message", "type", "param", "code"}}
  Anthropic  {"type": "error", "error": {"type", "message"}}"""
from __future__ import annotations

from sanic.response import json as json_response

# OpenAI error type -> Anthropic's name for the same thing
_ANTHROPIC_TYPE = {"invalid_request_error": "invalid_request_error", "authentication_error": "authentication_error",
                   "not_found_error": "not_found_error", "server_error": "api_error",
                   "rate_limit_error": "rate_limit_error", "overloaded_error": "overloaded_error",
                   "request_too_large": "request_too_large"}


class APIError(Exception):
    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, protocol: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.protocol = protocol          # None: decided by the path that was called
        self.headers = headers or {}

    def body(self, protocol: str | None = None) -> dict:
        if (self.protocol or protocol) == "anthropic":
            return {"type": "error", "error": {"type": _ANTHROPIC_TYPE.get(self.type, self.type),
                                               "message": self.message}}
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, protocol: str | None = None):
        return json_response(self.body(protocol), status=self.status, headers=self.headers)


def invalid(message: str, param: str | None = None) -> APIError:
    return APIError(message, 400, "invalid_request_error", param)


# an image in a tool's result (a file the agent read, a screenshot it took) while the model reads text
# only: the prompt says so, and the turn goes on
IMAGE_NOTE = "[image omitted: this model reads text only]"


def vision_disabled(where: str, param: str | None = None) -> APIError:
    """An image outside a tool result while vision is off (every model today): 400, code vision_disabled."""
    return APIError(f"{where}: images are not supported: this model reads text only (vision is disabled)", 400,
                    "invalid_request_error", param, "vision_disabled")


def protocol_of(path: str) -> str:
    return "anthropic" if path.startswith("/v1/messages") else "openai"
