"""Moving cached keys to another position: the RoPE shift a KV prefix cache needs to reuse a chunk elsewhere.

The math. A Llama-family model rotates each key before it enters the cache (values are not rotated): the key
of a token at position p is ``s · R(p·θ) k``, where ``k`` is the projected key, ``θ`` the model's inverse
frequencies after its rope scaling, ``R(a)`` the rotation that pairs dimension ``i`` with ``i + d/2``
(``rotate_half``) and turns the pair by angle ``a_i``, and ``s`` the model's ``attention_scaling``
(transformers multiplies cos and sin by it). Rotations about the same planes compose by adding angles, so

    R(Δ·θ) · s·R(p·θ) k = s·R((p + Δ)·θ) k,

that is ``k·cos(Δθ) + rotate_half(k)·sin(Δθ)`` with *unscaled* cos and sin: scaling them by ``s`` as the
model's own cos and sin are would multiply the key by ``s`` a second time. The shift is computed in at least
float32 with float64 angles and returned in the keys' dtype; in bfloat16 the result differs from keys
computed at the new position by bfloat16 rounding, as two computations at the same position may.

Which scalings are exact. The identity holds when ``θ`` is one fixed vector for every position and every run:

- ``default``, ``linear`` (θ / factor), ``llama3`` (θ rescaled per frequency band by wavelength) and ``yarn``
  (θ blended between interpolated and extrapolated, with ``attention_scaling`` > 1): their frequencies are
  computed once from the config; transformers' ``dynamic_rope_update`` leaves them alone, and their
  ``ROPE_INIT_FUNCTIONS`` entries ignore ``seq_len`` (checked at construction).
- ``dynamic`` (NTK) is refused: once a run passes ``max_position_embeddings`` it recomputes θ from the run's
  length, so a cached key's rotation depends on the run that computed it, not only on its position.
- ``longrope`` is refused: it switches every frequency between short and long factors by the run's length.
- Any other rope type is refused as not shown exact; so is partial rotary (a rotary dim below head_dim),
  whose pass-through layout differs between model families, and per-layer-type rope parameters.

Only model families whose rotary layout is verified (``ROTARY_EMBEDDINGS``: RoPE over the whole head with
``rotate_half`` halves, before the cache update) are accepted; the frequencies are the model's own, from its
rotary embedding class or module, so they match it bit for bit. tests/test_kv_rope.py checks each family and
scaling against the model itself.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch

from .errors import RopeShiftUnsupported

# model_type -> the transformers class that computes the family's rotary frequencies ("module:Class").
ROTARY_EMBEDDINGS: dict[str, str] = {
    "gemma": "transformers.models.gemma.modeling_gemma:GemmaRotaryEmbedding",
    "llama": "transformers.models.llama.modeling_llama:LlamaRotaryEmbedding",
    "mistral": "transformers.models.mistral.modeling_mistral:MistralRotaryEmbedding",
    "qwen2": "transformers.models.qwen2.modeling_qwen2:Qwen2RotaryEmbedding",
    "qwen3": "transformers.models.qwen3.modeling_qwen3:Qwen3RotaryEmbedding",
}

EXACT_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3", "yarn")

_INEXACT: dict[str, str] = {
    "dynamic": "dynamic NTK scaling recomputes the frequencies from the length of the run once it passes "
    "max_position_embeddings, so a cached key's rotation depends on the run that computed it, not only on "
    "its position",
    "longrope": "longrope switches every frequency between its short and long factors by the length of "
    "the run",
}


def _rope_type(config: Any) -> str:
    """The config's rope type, once it is shown to shift exactly; else RopeShiftUnsupported saying why."""
    model_type = config.model_type
    if model_type not in ROTARY_EMBEDDINGS:
        raise RopeShiftUnsupported(
            f"model type {model_type!r}: its rotary layout is not verified for a RoPE shift; "
            f"accepted model types: {', '.join(sorted(ROTARY_EMBEDDINGS))}"
        )
    params = config.rope_parameters
    if not isinstance(params, dict) or "rope_type" not in params:
        raise RopeShiftUnsupported(
            f"model type {model_type!r}: rope_parameters {params!r} are not one set of RoPE parameters "
            "(per-layer-type RoPE is not supported by the RoPE shift)"
        )
    rope_type = params["rope_type"]
    if rope_type not in EXACT_ROPE_TYPES:
        why = _INEXACT.get(rope_type, "it is not shown to depend on the position alone")
        raise RopeShiftUnsupported(
            f"rope type {rope_type!r} cannot be shifted exactly: {why}; "
            f"accepted rope types: {', '.join(EXACT_ROPE_TYPES)}"
        )
    if rope_type != "default":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: PLC0415 - model code

        init = ROPE_INIT_FUNCTIONS[rope_type]
        short, _ = init(config, None, 1)
        long, _ = init(config, None, 8 * config.max_position_embeddings)
        if not torch.equal(short, long):
            raise RopeShiftUnsupported(
                f"rope type {rope_type!r}: this transformers version computes its frequencies from the "
                "sequence length, so a RoPE shift would not be exact"
            )
    return rope_type


def _head_dim(config: Any) -> int:
    # transformers' own rule: an explicit head_dim, else hidden_size split over the attention heads
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


@dataclass(frozen=True, slots=True, eq=False)
class RopeShift:
    """Moves a model's cached keys by whole positions: ``shift(keys, delta)`` turns keys computed at
    positions ``p`` into the keys the model computes at ``p + delta``. Build it with ``for_config`` or
    ``from_model``, which raise ``RopeShiftUnsupported`` for a model or rope type that cannot be shifted
    exactly."""

    rope_type: str
    inv_freq: torch.Tensor  # [head_dim // 2], float32: the model's frequencies after its rope scaling
    attention_scaling: float  # the model scales cos and sin by it; cached keys carry it, a shift keeps it

    @property
    def head_dim(self) -> int:
        return 2 * self.inv_freq.numel()

    @classmethod
    def for_config(cls, config: Any) -> RopeShift:
        """The shift for a transformers model config (``LlamaConfig``, ``AutoConfig.from_pretrained(..)``)."""
        rope_type = _rope_type(config)
        module, _, name = ROTARY_EMBEDDINGS[config.model_type].partition(":")
        rotary = getattr(importlib.import_module(module), name)(config=config)
        return cls._build(config, rope_type, rotary.inv_freq, rotary.attention_scaling)

    @classmethod
    def from_model(cls, model: Any) -> RopeShift:
        """The shift for a loaded model (``LlamaForCausalLM`` or its base ``LlamaModel``), from the
        frequencies its rotary embedding holds, on the model's device."""
        rope_type = _rope_type(model.config)
        try:
            rotary = model.base_model.rotary_emb
        except AttributeError:
            raise RopeShiftUnsupported(
                f"{type(model).__name__}: no rotary embedding at base_model.rotary_emb to read frequencies "
                "from"
            ) from None
        return cls._build(model.config, rope_type, rotary.inv_freq, rotary.attention_scaling)

    @classmethod
    def _build(cls, config: Any, rope_type: str, inv_freq: torch.Tensor, scaling: float) -> RopeShift:
        head_dim, rotary_dim = _head_dim(config), 2 * inv_freq.numel()
        if rotary_dim != head_dim:
            raise RopeShiftUnsupported(
                f"model type {config.model_type!r}: partial rotary (rotary dim {rotary_dim} of head_dim "
                f"{head_dim}) is not supported by the RoPE shift"
            )
        return cls(rope_type, inv_freq.detach().to(torch.float32).clone(), float(scaling))

    def shift(self, keys: torch.Tensor, delta: int | torch.Tensor) -> torch.Tensor:
        """``keys`` computed at positions ``p`` -> the same keys at ``p + delta`` (``delta`` may be negative).

        ``keys`` is ``[..., seq, head_dim]``: one layer's cached ``[batch, kv_heads, seq, head_dim]``, or many
        layers stacked in front. ``delta`` is an int, or an integer tensor broadcastable to
        ``keys.shape[:-1]`` (a move per token or per sequence). Returns a new tensor in ``keys``' dtype and
        device; ``keys`` itself when ``delta`` is the int 0. Raises ``ValueError`` for a head_dim other than
        the model's or a ``delta`` that does not broadcast, ``TypeError`` for keys that are not floating point
        or a ``delta`` that is not an integer.
        """
        if not keys.is_floating_point():
            raise TypeError(f"keys must be a floating-point tensor, not {keys.dtype}")
        if keys.shape[-1] != self.head_dim:
            raise ValueError(f"keys' head_dim is {keys.shape[-1]}; the model's rotary dim is {self.head_dim}")
        if isinstance(delta, torch.Tensor):
            if delta.is_floating_point() or delta.is_complex() or delta.dtype == torch.bool:
                raise TypeError(f"delta must be an integer tensor, not {delta.dtype}")
            try:
                fits = torch.broadcast_shapes(delta.shape, keys.shape[:-1]) == keys.shape[:-1]
            except RuntimeError:
                fits = False
            if not fits:
                shape, into = tuple(delta.shape), tuple(keys.shape[:-1])
                raise ValueError(f"delta of shape {shape} does not broadcast to {into}")
        elif isinstance(delta, int) and not isinstance(delta, bool):
            if delta == 0:
                return keys
        else:
            raise TypeError(f"delta must be an int or an integer tensor, not {type(delta).__name__}")
        # float64 angles keep Δ·θ exact to well past any context length; MPS has no float64
        angle_dtype = torch.float32 if keys.device.type == "mps" else torch.float64
        moves = torch.as_tensor(delta, device=keys.device).to(angle_dtype)[..., None]
        angles = moves * self.inv_freq.to(device=keys.device, dtype=angle_dtype)
        angles = torch.cat((angles, angles), dim=-1)
        work = torch.promote_types(keys.dtype, torch.float32)
        k = keys.to(work)
        half = self.head_dim // 2
        rotated = torch.cat((-k[..., half:], k[..., :half]), dim=-1)
        return (k * angles.cos().to(work) + rotated * angles.sin().to(work)).to(keys.dtype)
