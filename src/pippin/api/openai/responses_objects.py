"""The routes of stored responses: GET (polled while a background response runs, or its
stream read again), DELETE, POST .../cancel and GET .../input_items.

Input items get ids when their response is created (`with_ids`), so a response's
`input_items` list the same ids every time and `item_reference` can name them.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from pippin.api.common import SSE_HEADERS
from pippin.api.openai.responses_input import check_includes
from pippin.api.openai.responses_live import get_live
from pippin.api.openai.responses_output import new_id
from pippin.api.openai.responses_protocol import MessageItem
from pippin.api.openai.responses_store import get_store, not_found
from pippin.api.openapi import openai_route
from pippin.serving.errors import bad_request, unsupported_param

router = APIRouter()

# Id prefixes of input items the client sent without one (OpenAI's).
_PREFIX = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "reasoning": "rs",
    "mcp_list_tools": "mcpl",
    "mcp_approval_response": "mcpr",
}


def with_ids(items: list[Any]) -> list[Any]:
    """The items, each with an id (a new one where the client gave none)."""
    out = []
    for item in items:
        if getattr(item, "id", "") is None:
            kind = getattr(item, "type", None) or "message"
            item = item.model_copy(update={"id": new_id(_PREFIX.get(kind, "item"))})
        out.append(item)
    return out


def item_body(item: Any) -> dict[str, Any]:
    """An input item as `input_items` lists it (the SDK's `ResponseItem`)."""
    body: dict[str, Any] = item.model_dump(mode="json", by_alias=True, exclude_none=True)
    if isinstance(item, MessageItem):
        body["type"] = "message"
        body.setdefault("status", "completed")
        if isinstance(item.content, str):
            kind = "output_text" if item.role == "assistant" else "input_text"
            part: dict[str, Any] = {"type": kind, "text": item.content}
            if kind == "output_text":
                part["annotations"] = []
            body["content"] = [part]
    return body


def _include(request: Request) -> None:
    query = request.query_params
    check_includes([*query.getlist("include"), *query.getlist("include[]")])


@router.get("/v1/responses/{response_id}", response_model=None, **openai_route(stream=True))
async def retrieve_response(
    response_id: str,
    request: Request,
    stream: bool | None = None,
    starting_after: int | None = None,
    include_obfuscation: bool | None = None,
) -> Any:
    _include(request)
    running = get_live(request).get(response_id)
    if stream:
        if running is None or not running.background:
            raise unsupported_param(
                "stream", "Only a background response can be streamed again, while it runs."
            )
        after = -1 if starting_after is None else starting_after
        return StreamingResponse(
            running.sse(after, obfuscate=bool(include_obfuscation)),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )
    if running is not None and running.background:
        return running.snapshot()
    stored = get_store(request).get(response_id)
    if stored is None:
        raise not_found(response_id)
    return stored.body


@router.delete("/v1/responses/{response_id}", **openai_route())
async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
    running = get_live(request).get(response_id)
    if running is not None and not running.done:
        await running.cancel()
    get_live(request).forget(response_id)
    if not get_store(request).delete(response_id) and running is None:
        raise not_found(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


@router.post("/v1/responses/{response_id}/cancel", **openai_route())
async def cancel_response(response_id: str, request: Request) -> dict[str, Any]:
    """Stops a background response or a stream in flight (the latter is pippin's own:
    OpenAI cancels only background responses). A cancelled one is answered again."""
    running = get_live(request).get(response_id)
    if running is not None and not running.done:
        return await running.cancel()
    stored = get_store(request).get(response_id)
    if stored is None:
        raise not_found(response_id)
    body = stored.body
    if body["status"] == "cancelled":
        return body
    if not body.get("background"):
        raise bad_request("Cannot cancel a synchronous response.")
    raise bad_request(f"Cannot cancel a response that is already {body['status']}.")


@router.get("/v1/responses/{response_id}/input_items", **openai_route())
async def list_input_items(
    response_id: str,
    request: Request,
    limit: int = 20,
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> dict[str, Any]:
    _include(request)
    if not 1 <= limit <= 100:
        raise bad_request(
            f"Invalid 'limit': {limit}. It must be between 1 and 100.",
            param="limit",
            code="invalid_value",
        )
    running = get_live(request).get(response_id)
    if running is not None and running.background and not running.done:
        items = running.run.conversation
    else:
        stored = get_store(request).get(response_id)
        if stored is None:
            raise not_found(response_id)
        items = stored.conversation[: stored.inputs]
    bodies = [item_body(i) for i in items]
    if order == "desc":
        bodies.reverse()
    if after is not None:
        ids = [b.get("id") for b in bodies]
        if after not in ids:
            raise bad_request(f"No input item with id '{after}' in this response.", param="after")
        bodies = bodies[ids.index(after) + 1 :]
    page = bodies[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(bodies) > limit,
    }
