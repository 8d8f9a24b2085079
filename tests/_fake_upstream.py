"""A stand-in OpenAI-compatible upstream for the tests of evocache's own gateway logic (keys, pass-through,
error mapping, salts): instant, deterministic, and recording what it was sent. What a real engine does is
tested against a real vLLM (tests/test_upstream_vllm.py).

It answers chat and completions, streamed (it is always called streamed), with the words of the prompt (a chat's
last message) reversed, one chunk per word, and usage last. Prompts that start with a word below misbehave:

    fail500     a 500                       refuse400    a 400 naming ``temperature``
    hang        no byte until released      cut          two chunks, then the connection dropped
    denied      a 401 (the gateway's key)   slow         a chunk every 20 ms
    tool        a tool call (``get_weather``, arguments in two pieces), finish_reason ``tool_calls``
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

UPSTREAM_KEY = "sk-upstream-secret-9"


class FakeUpstream:
    def __init__(self, model: str = "up-model") -> None:
        self.model = model
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.released = threading.Event()
        self.closed = 0  # streams whose client went away before their end
        self.app = self._build()

    def calls(self, word: str | None = None) -> int:
        return sum(1 for b in self.bodies if word is None or word in json.dumps(b))

    def _build(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models() -> Response:
            return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model",
                                                             "max_model_len": 512}]})

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            return await self._answer(request, "chat")

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await self._answer(request, "completions")

        return app

    async def _answer(self, request: Request, endpoint: str) -> Response:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        if body.get("model") != self.model:
            return JSONResponse({"error": {"message": f"model {body.get('model')!r} not found", "type":
                                           "NotFoundError", "param": "model", "code": 404}}, status_code=404)
        if endpoint == "chat":
            messages = body["messages"]
            prompt = messages[-1]["content"] if isinstance(messages[-1].get("content"), str) else ""
        else:
            prompt = body["prompt"] if isinstance(body["prompt"], str) else " ".join(map(str, body["prompt"]))
        first = prompt.split()[0] if prompt.split() else ""
        if first == "fail500":
            return JSONResponse({"error": {"message": "engine exploded", "type": "InternalServerError"}},
                                status_code=500)
        if first == "refuse400":
            return JSONResponse({"object": "error", "message": "temperature is not liked", "type": "BadRequestError",
                                 "param": "temperature", "code": 400}, status_code=400)
        if first == "denied":
            return JSONResponse({"error": {"message": "bad key"}}, status_code=401)
        if first == "hang":
            while not self.released.is_set():
                await asyncio.sleep(0.01)
        words = prompt.split()[::-1][: body.get("max_tokens") or body.get("max_completion_tokens") or 16]
        tool = first == "tool"
        return StreamingResponse(self._stream(endpoint, words, tool, first), media_type="text/event-stream")

    async def _stream(self, endpoint: str, words: list[str], tool: bool, first: str) -> AsyncIterator[bytes]:
        def event(choice: dict[str, Any] | None, usage: dict[str, Any] | None = None) -> bytes:
            document: dict[str, Any] = {"id": "x", "object": "chunk", "model": self.model,
                                        "choices": [] if choice is None else [{"index": 0, **choice}]}
            if usage is not None:
                document["usage"] = usage
            return b"data: " + json.dumps(document).encode() + b"\n\n"

        ended = False
        try:
            if endpoint == "chat":
                yield event({"delta": {"role": "assistant", "content": ""}, "finish_reason": None})
            if tool:
                call = {"index": 0, "id": "call_1", "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": '}}
                yield event({"delta": {"tool_calls": [call]}, "finish_reason": None})
                yield event({"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]},
                             "finish_reason": None})
                reason = "tool_calls"
            else:
                for i, word in enumerate(words):
                    text = word if i == 0 else " " + word
                    if first == "slow":
                        await asyncio.sleep(0.02)
                    if first == "cut" and i == 2:
                        raise ConnectionResetError("dropped")  # uvicorn closes the connection mid-body
                    yield event({"delta": {"content": text}} if endpoint == "chat" else {"text": text})
                reason = "length" if len(words) >= 16 else "stop"
            yield event({"delta": {}, "finish_reason": reason} if endpoint == "chat"
                        else {"text": "", "finish_reason": reason})
            yield event(None, {"prompt_tokens": 7, "completion_tokens": max(1, len(words)), "total_tokens": 9,
                               "prompt_tokens_details": {"cached_tokens": 3}})
            yield b"data: [DONE]\n\n"
            ended = True
        finally:
            if not ended:
                self.closed += 1
