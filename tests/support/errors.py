"""The one assertion on an API error: its status, and a body in the format of its API.

Each API writes errors its own way (`pippin.api.errors`):

- OpenAI: ``{"error": {"message", "type", "param", "code"}}``, those four keys exactly;
- Anthropic: ``{"type": "error", "error": {"type", "message"}}``;
- Ollama: ``{"error": "message"}``.

`assert_api_error` takes what a test has at hand: an HTTP response (httpx, Starlette's
TestClient, schemathesis), an SDK's exception (openai, anthropic, ollama) or the
``pytest.raises`` info around one. The API is the one the request's path belongs to (the
server picks the format the same way), else the SDK's, else `api=`.
"""

from __future__ import annotations

from typing import Any, Literal

from pippin.api.errors import is_anthropic_path, is_ollama_path

Api = Literal["openai", "anthropic", "ollama"]
OPENAI_KEYS = {"message", "type", "param", "code"}


def assert_api_error(
    got: Any,
    status: int,
    *,
    param: str | None = None,
    code: str | None = None,
    type: str | None = None,  # noqa: A002  (the field's name)
    message: str | None = None,
    api: Api | None = None,
) -> dict[str, Any]:
    """Check `got` is an error of `status` in its API's format, and each of `param`,
    `code`, `type` given equals the body's (`message`: a part of it). Returns the error
    object: OpenAI's and Anthropic's ``error``, Ollama's as ``{"message": ...}``."""
    got = getattr(got, "value", got)  # pytest.ExceptionInfo
    actual_status, body, found = _status_and_body(got)
    api = api or found
    assert actual_status == status, (actual_status, body)
    assert isinstance(body, dict), body
    if api == "ollama":
        assert set(body) == {"error"} and isinstance(body["error"], str), body
        err: dict[str, Any] = {"message": body["error"]}
        assert param is None and code is None and type is None, "Ollama errors are a message"
    elif api == "anthropic":
        assert body.get("type") == "error" and isinstance(body.get("error"), dict), body
        err = body["error"]
        assert isinstance(err.get("type"), str), body
        assert param is None and code is None, "Anthropic errors have no param or code"
    else:
        assert set(body) == {"error"} and isinstance(body["error"], dict), body
        err = body["error"]
        assert set(err) == OPENAI_KEYS and isinstance(err["type"], str), body
        if param is not None:
            assert err["param"] == param, err
        if code is not None:
            assert err["code"] == code, err
    assert isinstance(err.get("message"), str) and err["message"], body
    if type is not None:
        assert err["type"] == type, err
    if message is not None:
        assert message in err["message"], err
    return err


def _status_and_body(got: Any) -> tuple[int, Any, Api]:
    """(status, the whole body as sent, the API) of a response or an SDK's exception."""
    if callable(getattr(got, "json", None)):  # a response
        return got.status_code, got.json(), api_of_path(_path(got))
    module = type(got).__module__.split(".")[0]
    if module == "ollama":
        return got.status_code, {"error": got.error}, "ollama"
    if module == "anthropic":
        return got.status_code, got.body, "anthropic"
    if module == "openai":
        # The SDK keeps the inner object of OpenAI's body: the whole one is put back.
        return got.status_code, {"error": got.body}, api_of_path(_path(got.response))
    raise TypeError(f"not a response or an API error: {got!r}")


def _path(response: Any) -> str:
    request = getattr(response, "request", None)
    url = getattr(request, "url", "")
    return str(getattr(url, "path", "") or "") or _url_path(str(url))


def _url_path(url: str) -> str:
    rest = url.split("://", 1)[-1]
    return "/" + rest.split("/", 1)[1].split("?", 1)[0] if "/" in rest else ""


def api_of_path(path: str) -> Api:
    """The API whose error format the server uses at `path`."""
    if is_ollama_path(path):
        return "ollama"
    return "anthropic" if is_anthropic_path(path) else "openai"
