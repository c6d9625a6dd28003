"""Rotary position embedding (RoPE) in Hugging Face's half-split layout.

The head dim d is split in halves [x1 | x2]; position p rotates the pair (x1_i, x2_i) by
p * inv_freq_i. Meta's original checkpoints and GGUF files interleave the pairs instead
(x_2i, x_2i+1): their q/k weights need `megalite.hf.llama.unpermute_rotary` first.
"""
import math

import torch
from torch import nn


def llama3_scaled_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float,
                           high_freq_factor: float, original_max_positions: int) -> torch.Tensor:
    """Llama 3.1's frequency scaling: long wavelengths divided by `factor`, short ones kept,
    a smooth blend between (transformers' `rope_type="llama3"`)."""
    low_wavelen = original_max_positions / low_freq_factor
    high_wavelen = original_max_positions / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (original_max_positions / wavelen - low_freq_factor) / (high_freq_factor
                                                                     - low_freq_factor)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    middle = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(middle, blended, scaled)


class RotaryEmbedding(nn.Module):
    """position_ids [b, s] (or [1, s]) on the module's device -> (cos, sin) [b, 1, s, d] in
    fp32, no parameters.

    `scaling`: None, or the keyword arguments of `llama3_scaled_inv_freq` (less inv_freq).
    The frequencies are computed on the CPU (the same values on every device) and kept on
    `device`.
    """

    def __init__(self, head_dim: int, base: float = 10000.0, scaling: dict | None = None,
                 device=None) -> None:
        super().__init__()
        inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float()
                                  / head_dim)
        if scaling:
            inv_freq = llama3_scaled_inv_freq(inv_freq, **scaling)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = position_ids[:, :, None].float() * self.inv_freq  # [b, s, d/2]
        angles = torch.cat([angles, angles], dim=-1).unsqueeze(1)
        return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, s, d] rotated by (cos, sin) [b, 1, s, d]; computed in x's dtype."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin
