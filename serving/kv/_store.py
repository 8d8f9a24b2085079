"""What a KV block is, and its bytes in the controller's tiers (L2, L3).

A block is ``block_size`` tokens of every layer's keys and values, ``[kv_heads, block_size, head_dim]`` each
(batch 1, before grouped-query repetition). In L1 a block is kept as tensors on the model's device
(``_pool.DeviceBlocks``). In L2 (Redis) and L3 (disk) a block is one entry per layer group: a small JSON
header (the geometry it was written for) and the tensors' raw bytes, in the controller's tiers, whose entry
codec checks every payload with the deployment's secret and binds it to its namespace and key. A payload whose
header does not match this model's geometry is refused like a corrupt one: it is never loaded into a cache.

Nothing here is unpickled: tensors are rebuilt from bytes whose size the header fixes. On a CUDA device the bytes
travel through pinned host buffers with non-blocking copies (``_cuda_to_bytes``, ``_bytes_to_cuda``): one staging
buffer and one device transfer per payload; on the CPU the tensors' own memory is read and written.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .errors import KvReuseError

_MAGIC = b"EVKV1"
_HEADER = struct.Struct("<I")
MAX_HEADER_BYTES = 4096
_DTYPES = ("float32", "float16", "bfloat16")


class CorruptBlock(KvReuseError):
    """A stored block that cannot be used: malformed, or written for another model geometry."""


@dataclass(frozen=True, slots=True)
class BlockGeometry:
    """What a block holds: ``layers`` layers of ``kv_heads`` x ``block_size`` x ``head_dim`` keys and values of
    ``dtype``. A block written under another geometry is never loaded."""

    layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        for name in ("layers", "kv_heads", "head_dim", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")

    @property
    def itemsize(self) -> int:
        return 4 if self.dtype == "float32" else 2

    def layer_bytes(self) -> int:
        """Bytes of one layer's keys and values for one block."""
        return 2 * self.kv_heads * self.block_size * self.head_dim * self.itemsize

    def block_bytes(self) -> int:
        return self.layers * self.layer_bytes()

    @classmethod
    def of_model(cls, model: Any, block_size: int) -> BlockGeometry:
        config = model.config
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        return cls(config.num_hidden_layers, getattr(config, "num_key_value_heads", None) or heads, head_dim,
                   block_size, dtype)


def layer_groups(geometry: BlockGeometry, group_size: int) -> list[tuple[int, int]]:
    """The ``[start, stop)`` layer ranges of one block's L2/L3 payloads (``group_size`` 0: all layers in one)."""
    size = group_size or geometry.layers
    return [(start, min(start + size, geometry.layers)) for start in range(0, geometry.layers, size)]


def encode_group(layers: Sequence[tuple[Any, Any]], geometry: BlockGeometry, start: int) -> bytes:
    """One payload for the layers ``start .. start + len(layers)`` of a block: header, then each layer's keys and
    values as raw bytes (moved to the host)."""
    import torch  # noqa: PLC0415

    header = json.dumps({"layers": [start, start + len(layers)], "kv_heads": geometry.kv_heads,
                         "block_size": geometry.block_size, "head_dim": geometry.head_dim,
                         "dtype": geometry.dtype}, separators=(",", ":")).encode()
    parts = [_MAGIC, _HEADER.pack(len(header)), header]
    tensors = [t for pair in layers for t in pair]
    if tensors and tensors[0].is_cuda:
        parts.append(_cuda_to_bytes(tensors))
        return b"".join(parts)
    for t in tensors:
        host = t.detach().to("cpu").contiguous()
        if host.dtype == torch.bfloat16:
            host = host.view(torch.int16)
        parts.append(host.numpy().tobytes())
    return b"".join(parts)


def _cuda_to_bytes(tensors: Sequence[Any]) -> bytes:
    """The raw bytes of CUDA ``tensors``, one after the other: every tensor copied without blocking into one
    pinned host buffer, then one wait on the stream, so a payload costs one synchronisation, not one per
    tensor (a pageable copy would also stage through a driver buffer)."""
    import torch  # noqa: PLC0415

    sizes = [t.numel() * t.element_size() for t in tensors]
    host = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=True)
    offset = 0
    for t, size in zip(tensors, sizes, strict=True):
        host[offset : offset + size].view(t.dtype).view(t.shape).copy_(t.detach(), non_blocking=True)
        offset += size
    torch.cuda.current_stream(tensors[0].device).synchronize()
    return host.numpy().tobytes()


def _bytes_to_cuda(body: memoryview, device: Any) -> Any:
    """``body`` as one uint8 tensor on the CUDA ``device``: staged in a pinned host buffer and copied without
    blocking (work queued after it on the device's stream sees the data; the caching host allocator keeps the
    buffer until the copy is done)."""
    import numpy  # noqa: PLC0415
    import torch  # noqa: PLC0415

    host = torch.empty(len(body), dtype=torch.uint8, pin_memory=True)
    host.numpy()[:] = numpy.frombuffer(body, dtype=numpy.uint8)
    return host.to(device, non_blocking=True)


def _is_cuda(device: Any) -> bool:
    import torch  # noqa: PLC0415

    return torch.device(device).type == "cuda"


def decode_group(data: bytes, geometry: BlockGeometry, start: int, stop: int, device: Any) -> list[tuple[Any, Any]]:
    """The layers of a payload written by ``encode_group``, as tensors on ``device``; ``CorruptBlock`` for a
    payload that is malformed or was written for another geometry or layer range."""
    import torch  # noqa: PLC0415

    if data[: len(_MAGIC)] != _MAGIC or len(data) < len(_MAGIC) + _HEADER.size:
        raise CorruptBlock("not a KV block payload")
    (size,) = _HEADER.unpack_from(data, len(_MAGIC))
    offset = len(_MAGIC) + _HEADER.size
    if size > MAX_HEADER_BYTES or offset + size > len(data):
        raise CorruptBlock("KV block header of a wrong size")
    try:
        header = json.loads(data[offset : offset + size])
    except ValueError as exc:
        raise CorruptBlock(f"KV block header is not JSON: {exc}") from None
    expected = {"layers": [start, stop], "kv_heads": geometry.kv_heads, "block_size": geometry.block_size,
                "head_dim": geometry.head_dim, "dtype": geometry.dtype}
    if header != expected:
        raise CorruptBlock(f"KV block written for {header}, this model needs {expected}")
    body = memoryview(data)[offset + size :]
    per_tensor = geometry.layer_bytes() // 2
    if len(body) != per_tensor * 2 * (stop - start):
        raise CorruptBlock(f"KV block body of {len(body)} bytes, expected {per_tensor * 2 * (stop - start)}")
    shape = (geometry.kv_heads, geometry.block_size, geometry.head_dim)
    dtype = getattr(torch, geometry.dtype)
    if _is_cuda(device):
        flat = _bytes_to_cuda(body, device)
        tensors = [flat[k * per_tensor : (k + 1) * per_tensor].view(dtype).view(shape)
                   for k in range(2 * (stop - start))]
        return list(zip(tensors[0::2], tensors[1::2], strict=True))
    raw = torch.int16 if dtype == torch.bfloat16 else dtype
    out = []
    for i in range(stop - start):
        pair = []
        for j in range(2):
            chunk = body[(2 * i + j) * per_tensor : (2 * i + j + 1) * per_tensor]
            t = torch.frombuffer(bytearray(chunk), dtype=raw).reshape(shape)
            pair.append((t.view(dtype) if raw is not dtype else t).to(device))
        out.append((pair[0], pair[1]))
    return out
