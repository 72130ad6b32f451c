"""Rotary position embeddings (HF `rotate_half` convention), with Llama-3.1 frequency scaling."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from sbd_jax.model.config import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """Per-pair rotation frequencies, float32 `[head_dim // 2]`, as transformers computes them."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is not None:
        # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between.
        old_len = scaling.original_max_position_embeddings
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > old_len / scaling.low_freq_factor, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= old_len / scaling.high_freq_factor) & (wavelen <= old_len / scaling.low_freq_factor)
        inv_freq = np.where(medium, smoothed, scaled)
    return inv_freq.astype(np.float32)


def apply_rope(x_BTNH: jax.Array, positions_BT: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotates q or k `[B, T, heads, head_dim]` by explicit integer positions `[B, T]`.

    Angles and the rotation are computed in float32 whatever the activation dtype.
    """
    angles = positions_BT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, H/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x = x_BTNH.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x * cos + rotated * sin).astype(x_BTNH.dtype)
