"""The bare baseline of bench/gateway.py part a: a FastAPI app under uvicorn that answers ``POST
/v1/completions`` with a recorded response, nothing else.

    python bench/_gateway_echo.py --port PORT --response FILE

``FILE`` is JSON ``{"body": <the response body, as text>, "headers": {name: value}}``: evocache's hit, recorded
by the bench, so both sides send the same bytes. The app reads and parses the request's JSON body, as any server
of the API must, and returns the recorded body and headers; uvicorn's access log is off.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from pathlib import Path

from fastapi import FastAPI, Request, Response


def app(body: str, headers: Mapping[str, str]) -> FastAPI:
    echo = FastAPI()
    payload = body.encode("utf-8")

    @echo.post("/v1/completions")
    async def completions(request: Request) -> Response:
        await request.json()
        return Response(payload, media_type="application/json", headers=dict(headers))

    @echo.get("/healthz")
    async def healthz() -> Response:
        return Response(b"ok")

    return echo


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--response", type=Path, required=True)
    args = parser.parse_args()
    recorded = json.loads(args.response.read_text(encoding="utf-8"))
    uvicorn.run(app(recorded["body"], recorded["headers"]), host="127.0.0.1", port=args.port,
                log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
