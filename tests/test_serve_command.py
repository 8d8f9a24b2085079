"""`evocache serve` as a user runs it: the installed command, from the repository root, serving the example tiny
Llama; answered with the official openai client (streaming), driven with `evocache policy`, stopped with SIGTERM."""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from _helpers import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
EVOCACHE = Path(sys.executable).with_name("evocache")


def _read_until(proc: subprocess.Popen, pattern: str, timeout: float) -> str:
    """The process's output up to ``pattern``, read from its pipe directly (a buffered reader would hold lines
    that select() cannot see)."""
    seen = b""
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            data = os.read(fd, 65536)
            if not data:
                break
            seen += data
            if re.search(pattern, seen.decode(errors="replace")):
                return seen.decode(errors="replace")
        elif proc.poll() is not None:
            break
    raise AssertionError(f"no {pattern!r} within {timeout}s; output:\n{seen.decode(errors='replace')}")


def test_evocache_serve_answers_the_openai_client_and_follows_policy_commands(tmp_path):
    port = free_port()
    store = tmp_path / "policies"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [str(EVOCACHE), "serve", "--port", str(port), "--workdir", str(tmp_path / "serve"), "--store", str(store)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        banner = _read_until(proc, r"Ctrl-C stops", timeout=180)
        assert f"http://127.0.0.1:{port}/v1" in banner and "policy serve-example@1" in banner
        key = re.search(r"sk-evc-[A-Za-z0-9_-]+", banner).group(0)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=60)
        pieces = [chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
            model="tiny-llama", temperature=0, max_tokens=8, stream=True,
            messages=[{"role": "user", "content": "Hello there"}]) if chunk.choices]
        assert "".join(pieces)
        again = client.chat.completions.with_raw_response.create(
            model="tiny-llama", temperature=0, max_tokens=8, messages=[{"role": "user", "content": "Hello there"}])
        assert again.headers["x-evocache-outcome"] == "hit"
        assert again.parse().choices[0].message.content == "".join(pieces)

        # /metrics answers the admin key generated beside the API keys (owner-only), not an API key.
        admin_key = tmp_path / "serve" / "metrics-key"
        assert admin_key.stat().st_mode & 0o077 == 0
        metrics = f"http://127.0.0.1:{port}/metrics"
        admin = {"Authorization": f"Bearer {admin_key.read_text().strip()}"}
        assert "evocache_http_requests_total" in httpx.get(metrics, headers=admin).text
        assert httpx.get(metrics, headers={"Authorization": f"Bearer {key}"}).status_code == 403

        system = {"role": "system", "content": "You answer questions about caching, briefly and exactly. " * 5}
        usages = [client.chat.completions.create(
            model="tiny-llama", temperature=0, max_tokens=4,
            messages=[system, {"role": "user", "content": question}]).usage
            for question in ("what is an eviction?", "what is a tier?")]
        assert usages[0].prompt_tokens_details.cached_tokens == 0
        cached = usages[1].prompt_tokens_details.cached_tokens  # the shared system prompt's full blocks
        assert 32 <= cached < usages[1].prompt_tokens and cached % 16 == 0

        newer = tmp_path / "serve-v2.yaml"
        newer.write_text((ROOT / "examples/policies/serve.yaml").read_text().replace("version: 1", "version: 2"))
        applied = subprocess.run([str(EVOCACHE), "policy", "apply", str(newer), "--store", str(store)],
                                 env=env, capture_output=True, text=True, timeout=60)
        assert applied.returncode == 0, applied.stderr
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            status = subprocess.run([str(EVOCACHE), "policy", "status", "--store", str(store)], env=env,
                                    capture_output=True, text=True, timeout=60).stdout
            replicas = [ln for ln in status.splitlines() if ln.strip().endswith(("Z", "stale"))
                        and "serve-example@2" in ln]
            if len(replicas) >= 2:  # the model replica and the ingress
                break
            time.sleep(0.3)
        assert len(replicas) >= 2, status
        r = client.completions.with_raw_response.create(model="tiny-llama", prompt="after", temperature=0,
                                                        max_tokens=4)
        assert r.headers["x-evocache-policy"] == "serve-example@2"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
