"""The server's errors: `APIError`, which answers with the OpenAI body {"error": {"message",
"type", "param", "code"}}, and the 400 of a request body that fails its schema."""
from __future__ import annotations

from typing import Sequence

from fastapi.responses import JSONResponse


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)



def _union_branch(part) -> bool:
    """A part of an error's location that names the branch of a union ('str', 'list[int]'), not a field."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part or "-" in part)


def validation_error(errors: Sequence[dict]) -> APIError:
    # Of a union's errors, one that is not a plain type mismatch names the limit the value broke
    # (100 stop strings: the 4-string limit of the list branch, not "not a string").
    errors = sorted(errors, key=lambda e: str(e.get("type", "")).endswith("_type"))
    e = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    loc = [str(x) for x in e.get("loc", ()) if x != "body" and not _union_branch(x)]
    if e.get("type") == "json_invalid":
        return APIError(400, f"We could not parse the JSON body of your request: {e.get('msg')}.",
                        code="invalid_json")
    msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
    if e.get("type") == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {loc[-1]}", param=loc[-1],
                        code="unknown_parameter")
    return APIError(400, f"{'.'.join(loc) or 'body'}: {msg}", param=loc[0] if loc else None,
                    code="invalid_value")

