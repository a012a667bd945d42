"""Stored responses: in memory, bounded by count, least recently used first out; what
`previous_response_id` and item references read, and the routes of `responses_objects`
serve."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request

from pippin.api.openai.responses_protocol import (
    ItemReference,
)
from pippin.serving.errors import (
    ApiError,
)

# --- the store -----------------------------------------------------------------


# Stored responses kept in memory before the least recently used is dropped.
STORE_CAPACITY = 1000


@dataclass
class StoredResponse:
    body: dict[str, Any]
    # The conversation up to and including this response's output (instructions aside:
    # as OpenAI, they are not carried over to the next response).
    conversation: list[Any]
    # How many of those items came before the output: the response's input items.
    inputs: int = 0


class ResponseStore:
    """Responses by id, bounded by count; the least recently used goes first."""

    def __init__(self, capacity: int = STORE_CAPACITY) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def get(self, response_id: str) -> StoredResponse | None:
        hit = self._items.get(response_id)
        if hit is not None:
            self._items.move_to_end(response_id)
        return hit

    def put(self, response_id: str, stored: StoredResponse) -> None:
        self._items[response_id] = stored
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None

    def find_item(self, item_id: str) -> Any | None:
        """An item of a stored conversation by its id (for `item_reference`)."""
        for stored in reversed(self._items.values()):
            for item in stored.conversation:
                if getattr(item, "id", None) == item_id and not isinstance(item, ItemReference):
                    return item
        return None


T = TypeVar("T")


def app_object(request: Request, name: str, make: Callable[[], T]) -> T:
    """The app's one `name` object, made on first use."""
    app_state = request.app.state
    obj = getattr(app_state, name, None)
    if obj is None:
        obj = make()
        setattr(app_state, name, obj)
    return obj


def get_store(request: Request) -> ResponseStore:
    return app_object(request, "responses_store", ResponseStore)


def not_found(response_id: str, param: str | None = None) -> ApiError:
    return ApiError(
        404,
        f"Response with id '{response_id}' not found.",
        param=param,
        code="response_not_found",
    )
