"""A model replica that dies fails none of the requests it had not started answering: ``RayBackend`` sends a
call whose replica died before its first piece (Ray's ``RayActorError`` family) once more, to another replica,
and never a call that already produced output or failed for another reason.

The fast tests drive ``RayBackend`` over a stand-in handle that raises Ray's own exception classes (a dead
replica is the one part that cannot be had cheaply); the slow one kills one of two replicas of a running Ray
Serve application while requests run.
"""

from __future__ import annotations

import asyncio

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError

from evocache.serving._deployment import RayBackend
from evocache.serving._request import Completion, Decision, Finish, GenerateRequest

REQUEST = GenerateRequest(
    request_id="cmpl-1", endpoint="completions", model="echo", prompt="hi", input_ids=(104, 105), blocks=(),
    tenant="acme", tenant_tier="pro", max_tokens=4, temperature=0.0, top_p=1.0, seed=None, stop=(),
    stream=False, include_usage=False, created=0, chunks=(),
)
DECISION = Decision(outcome="miss", tier="none", rule="default", policy="p@1", arm="active", replica="b")
FINISH = Finish(finish_reason="stop", prompt_tokens=2, completion_tokens=1, cached_tokens=0)
DONE = Completion(decision=DECISION, text="hi", finish=FINISH)


class Response:
    """A stand-in for a ``DeploymentResponse`` (awaited) or ``DeploymentResponseGenerator`` (iterated): what
    one replica answers, or the exception it fails with after ``items``."""

    def __init__(self, items: list, error: BaseException | None = None) -> None:
        self.items, self.error, self.cancelled = items, error, False

    async def _fetch_future_result_async(self) -> None:
        await asyncio.sleep(0)

    def __await__(self):
        yield from asyncio.sleep(0).__await__()
        if self.error is not None:
            raise self.error
        return self.items[0]

    async def _iterate(self):
        for item in self.items:
            await asyncio.sleep(0)
            yield item
        if self.error is not None:
            raise self.error

    def __aiter__(self):
        return self._iterate()

    def cancel(self) -> None:
        self.cancelled = True


class Method:
    def __init__(self, answers: list[Response]) -> None:
        self.answers, self.calls = answers, []

    def remote(self, request: GenerateRequest) -> Response:
        self.calls.append(request)
        return self.answers[len(self.calls) - 1]


class Handle:
    """A stand-in ``DeploymentHandle`` whose successive calls get ``answers`` in turn (each from the replica
    Ray's router would pick next)."""

    def __init__(self, answers: list[Response]) -> None:
        self.complete = Method(answers)
        self.generate = Method(answers)

    def options(self, stream: bool = False) -> Handle:
        return self


def died() -> ActorDiedError:
    return ActorDiedError()


def unavailable() -> ActorUnavailableError:
    return ActorUnavailableError("the replica's node is gone", None)


def raised_by_the_replica() -> RayTaskError:
    # What Ray raises for an exception the replica's own code raised: a RayTaskError that is also an instance of
    # its cause's class, here a dead actor the replica itself called.
    return RayTaskError("complete", "Traceback: ...", ActorDiedError()).as_instanceof_cause()


def complete(handle: Handle):
    async def run():
        placed = asyncio.Event()
        result = await RayBackend(handle, "app").complete(REQUEST, placed)
        assert placed.is_set()
        return result

    return asyncio.run(run())


def stream(handle: Handle) -> tuple[list, BaseException | None]:
    async def run():
        items = []
        try:
            async for item in RayBackend(handle, "app").stream(REQUEST, asyncio.Event()):
                items.append(item)
        except Exception as exc:  # noqa: BLE001 - what the caller would see
            return items, exc
        return items, None

    return asyncio.run(run())


@pytest.mark.parametrize("error", [died, unavailable])
def test_a_call_whose_replica_died_is_sent_once_more(error):
    first, second = Response([], error()), Response([DONE])
    handle = Handle([first, second])
    assert complete(handle) == DONE
    assert handle.complete.calls == [REQUEST, REQUEST]
    assert not second.cancelled


def test_only_once():
    handle = Handle([Response([], died()), Response([], unavailable()), Response([DONE])])
    with pytest.raises(ActorUnavailableError):
        complete(handle)
    assert len(handle.complete.calls) == 2


@pytest.mark.parametrize("error", [raised_by_the_replica, lambda: ValueError("bad request")])
def test_a_call_that_failed_for_another_reason_is_not_sent_again(error):
    exc = error()
    handle = Handle([Response([], exc), Response([DONE])])
    with pytest.raises(type(exc)):
        complete(handle)
    assert len(handle.complete.calls) == 1


def test_a_stream_whose_replica_died_before_its_first_item_is_sent_once_more():
    handle = Handle([Response([], died()), Response([DECISION, "hi", FINISH])])
    assert stream(handle) == ([DECISION, "hi", FINISH], None)
    assert len(handle.generate.calls) == 2


def test_a_stream_that_produced_output_is_not_sent_again():
    handle = Handle([Response([DECISION, "h"], died()), Response([DECISION, "hi", FINISH])])
    items, exc = stream(handle)
    assert items == [DECISION, "h"] and isinstance(exc, ActorDiedError)
    assert len(handle.generate.calls) == 1


def test_a_stream_that_failed_for_another_reason_is_not_sent_again():
    handle = Handle([Response([], raised_by_the_replica()), Response([DECISION, "hi", FINISH])])
    items, exc = stream(handle)
    assert items == [] and isinstance(exc, RayTaskError)
    assert len(handle.generate.calls) == 1


def test_a_retried_call_is_still_cancelled_when_its_caller_stops():
    never = asyncio.Event()

    class Hanging(Response):
        def __await__(self):
            return (yield from never.wait().__await__())

    second = Hanging([])
    handle = Handle([Response([], died()), second])

    async def run():
        task = asyncio.ensure_future(RayBackend(handle, "app").complete(REQUEST))
        while len(handle.complete.calls) < 2:
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert second.cancelled
