"""Sampling a token from a Hugging Face model's logits (``serving._model._pick``) for every value the API
lets through: the bounds of ``top_p`` and ``temperature`` never leave nothing to sample."""

from __future__ import annotations

import pytest
import torch

from evocache.serving._model import GenerationParams, _pick


@pytest.mark.parametrize("top_p", [5e-324, 1e-300, 1e-40, 1e-8, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1e-300, 1e-5, 0.7, 2.0])
def test_any_top_p_and_temperature_pick_a_token(top_p, temperature):
    logits = torch.tensor([0.1, 3.0, -1.0, 2.5])
    rng = torch.Generator().manual_seed(0)
    token = _pick(torch, logits, GenerationParams(4, temperature, top_p, 0, ()), rng)
    assert 0 <= token < 4
    if top_p <= 1e-8 or temperature <= 1e-5:
        assert token == 1  # nothing but the likeliest token is left
