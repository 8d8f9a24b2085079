"""`evocache serve --upstream` as a user runs it in front of a real vLLM (the session's server, tests/_vllm.py):
the installed command through Ray, the official client streaming and caching through it, vLLM's refusal
passed through the replica, and SIGTERM ending it cleanly."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from _helpers import free_port
from test_serve_command import _finish, _read_until, _stop

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
EVOCACHE = Path(sys.executable).with_name("evocache")


def test_evocache_serve_in_front_of_vllm_streams_caches_and_passes_refusals_through(tmp_path, vllm_upstream):
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [str(EVOCACHE), "serve", "--upstream", vllm_upstream.base_url, "--tokenizer", str(vllm_upstream.model_dir),
         "--port", str(port), "--workdir", str(tmp_path / "serve"), "--store", str(tmp_path / "policies")],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        banner = _read_until(proc, r"Ctrl-C stops", timeout=240)
        assert f"serving {vllm_upstream.model} from {vllm_upstream.base_url}" in banner
        key = re.search(r"sk-evc-[A-Za-z0-9_-]+", banner).group(0)
        base = f"http://127.0.0.1:{port}/v1"
        client = openai.OpenAI(base_url=base, api_key=key, max_retries=0)
        assert [m.id for m in client.models.list()] == [vllm_upstream.model]

        def stream() -> tuple[str, list[str]]:
            raw = client.chat.completions.with_streaming_response.create(
                model=vllm_upstream.model, messages=[{"role": "user", "content": "Hello through the gateway"}],
                temperature=0, max_tokens=16, stream=True)
            with raw as response:
                pieces = [c.choices[0].delta.content or "" for c in response.parse() if c.choices]
                return response.headers["x-evocache-outcome"], pieces

        (first, a), (second, b) = stream(), stream()
        assert (first, second) == ("miss", "hit") and a == b and "".join(a)
        plain = client.chat.completions.create(
            model=vllm_upstream.model, messages=[{"role": "user", "content": "Hello through the gateway"}],
            temperature=0, max_tokens=16)
        assert plain.choices[0].message.content == "".join(a)
        with pytest.raises(openai.BadRequestError) as err:  # vLLM's own 400, through the Ray replica
            client.chat.completions.create(model=vllm_upstream.model, messages=[{"role": "user", "content": "x"}],
                                           temperature=0, max_tokens=4, tool_choice="required")
        assert "tools" in err.value.body["message"]
        r = httpx.post(f"{base}/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=30,
                       json={"model": vllm_upstream.model, "messages": [{"role": "user", "content": "x"}],
                             "cache_salt": "guess"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
        proc.send_signal(signal.SIGTERM)
        code, output = _finish(proc, timeout=120)
        assert code == 0, output
    finally:
        _stop(proc, [])
