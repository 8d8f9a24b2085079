"""What bench/serving.py deploys besides evocache: the models a replica calls and the bare Ray Serve baselines.

Ray's workers import this module by name (bench/serving.py puts bench/ on PYTHONPATH before ``ray.init``), so
the callables here are what ``ModelConfig(kind="callable", callable="_serving_models:...")`` names, and the
baseline deployments are classes Ray can rebuild in a replica.

The models answer with a fixed-size text that depends only on the prompt: a hit and a miss carry the same
payload, and the baselines can return an equal-sized answer without any cache.
"""

import hashlib
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from ray import serve

from evocache.serving import Completion, Decision, Finish

ANSWER_CHARS = 256
MODEL_S = 0.05  # the slow model's call: what a miss costs before evocache adds anything


def answer(prompt: str) -> str:
    """``ANSWER_CHARS`` characters determined by the prompt."""
    digest = hashlib.blake2b(prompt.encode("utf-8"), digest_size=16).hexdigest()
    return (digest * (ANSWER_CHARS // len(digest) + 1))[:ANSWER_CHARS]


def instant_model(prompt: str) -> str:
    return answer(prompt)


def model_50ms(prompt: str) -> str:
    # A sleep, not busy work: on two shared cores a spinning model would slow the side being measured with it.
    time.sleep(MODEL_S)
    return answer(prompt)


def bare_completion(text: str, prompt_tokens: int) -> Completion:
    """What a replica without evocache hands back: the same dataclasses, a decision saying nothing was cached."""
    return Completion(Decision("miss", "", "", "", "active", "bare"), text,
                      Finish("stop", prompt_tokens, len(text.encode("utf-8"))))


class EchoModel:
    """Bare Ray Serve: ``complete`` returns a prepared payload (the baseline of a hit over a handle)."""

    def __init__(self, payload: Completion) -> None:
        self.payload = payload

    def complete(self, request: Any) -> Completion:
        return self.payload


class BareModel:
    """Bare Ray Serve over the slow model: ``complete`` calls it and wraps its answer (the miss baseline)."""

    def complete(self, request: Any) -> Completion:
        return bare_completion(model_50ms(request.prompt), len(request.input_ids))


echo_api = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)


@serve.ingress(echo_api)
class EchoIngress:
    """Bare FastAPI ingress: parses the JSON body and returns a prepared one with the same headers; with a
    ``model`` handle it first calls that deployment, as evocache's ingress calls its model deployment."""

    def __init__(self, body: dict[str, Any], headers: dict[str, str], model: Any = None) -> None:
        self.body = body
        self.headers = headers
        self.model = model

    @echo_api.post("/v1/completions")
    async def completions(self, request: Request) -> JSONResponse:
        await request.json()
        if self.model is not None:
            await self.model.complete.remote(None)
        return JSONResponse(self.body, headers=self.headers)
