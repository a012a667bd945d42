"""Every test's requests to a module's server asked at once, before the tests check them.

On a CPU a decode step of a real model costs about the same for one sequence as for a
dozen (it reads every weight once either way), so a module whose tests each wait for
their own answers in turn takes the sum of their times, and one whose requests all go
out together takes about the longest one's. A module registers, per test function, the
requests its test makes (`@batch.first(test)`, given the test's parameters) and those
that answer them (`@batch.then(test)`, given the first answers: a tool call's result, the
next turn); a module-scoped fixture asks them all (`batch.ask(request, server)`), the
follow-ups of each test as soon as its own first answers are in; each test then checks
its own (`batch.mine(answers, request)`), whose `got(part)` raises what that request
raised. Only the selected tests' requests are asked (`-k` runs stay short).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

Asks = dict[str, Callable[[], Any]]
Got = Callable[[str], Any]
Builder = Callable[..., Asks]

NO_FOLLOW_UP = "!then"  # the part under which a follow-up that could not be built says why


def _outcome(request: Callable[[], Any]) -> Any:
    """The request's result, or the exception it raised (for its own test to raise)."""
    try:
        return request()
    except Exception as e:  # noqa: BLE001
        return e


def _all_at_once(asks: Asks) -> dict[str, Any]:
    if not asks:
        return {}
    with ThreadPoolExecutor(len(asks)) as pool:
        futures = {part: pool.submit(_outcome, ask) for part, ask in asks.items()}
        return {part: f.result() for part, f in futures.items()}


class Batch:
    def __init__(self) -> None:
        self._first: dict[str, Builder] = {}
        self._then: dict[str, Builder] = {}

    def first(self, test: str) -> Callable[[Builder], Builder]:
        """Registers `fn(*context, **params) -> {part: request}`: the test's own requests."""

        def register(fn: Builder) -> Builder:
            self._first[test] = fn
            return fn

        return register

    def then(self, test: str) -> Callable[[Builder], Builder]:
        """Registers `fn(*context, got, **params) -> {part: request}`: the requests that
        follow the test's first answers (`got(part)`)."""

        def register(fn: Builder) -> Builder:
            self._then[test] = fn
            return fn

        return register

    def ask(self, request: pytest.FixtureRequest, *context: Any) -> dict[str, Any]:
        """Every selected test's requests of `request`'s module, at once: {test:part: answer}."""
        tests: dict[str, tuple[str, dict[str, Any]]] = {}
        for item in request.session.items:
            if item.path == request.path and isinstance(item, pytest.Function):
                callspec = getattr(item, "callspec", None)
                tests[item.name] = (item.originalname, dict(callspec.params) if callspec else {})
        firsts = {
            name: self._first[fn](*context, **params)
            for name, (fn, params) in tests.items()
            if fn in self._first
        }
        follows = [(name, fn, params) for name, (fn, params) in tests.items() if fn in self._then]
        workers = sum(len(asks) for asks in firsts.values()) + len(follows)
        if not workers:
            return {}
        with ThreadPoolExecutor(workers) as pool:
            futures: dict[str, dict[str, Future[Any]]] = {
                name: {part: pool.submit(_outcome, ask) for part, ask in asks.items()}
                for name, asks in firsts.items()
            }

            def follow(name: str, fn: str, params: dict[str, Any]) -> dict[str, Any]:
                got = {f"{name}:{p}": f.result() for p, f in futures.get(name, {}).items()}
                try:
                    asks = self._then[fn](*context, self.got(got, name), **params)
                except Exception as e:  # noqa: BLE001  (the test raises it, after its checks)
                    return {f"{name}:{NO_FOLLOW_UP}": e}
                return {f"{name}:{p}": r for p, r in _all_at_once(asks).items()}

            later = [pool.submit(follow, *f) for f in follows]
            answers = {
                f"{name}:{part}": f.result()
                for name, parts in futures.items()
                for part, f in parts.items()
            }
            for f in later:
                answers.update(f.result())
        return answers

    @staticmethod
    def got(answers: dict[str, Any], test: str) -> Got:
        def get(part: str) -> Any:
            key = f"{test}:{part}"
            got = answers[key] if key in answers else answers[f"{test}:{NO_FOLLOW_UP}"]
            if isinstance(got, Exception):
                raise got
            return got

        return get

    def mine(self, answers: dict[str, Any], request: pytest.FixtureRequest) -> Got:
        """The answers of the test that `request` is for."""
        return self.got(answers, request.node.name)
