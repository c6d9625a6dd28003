"""Rotary position embedding (RoPE) in Hugging Face's half-split layout.

The head dim d is split in halves [x1 | x2]; position p rotates the pair (x1_i, x2_i) by
p * inv_freq_i. Meta's original checkpoints and GGUF files interleave the pairs instead
(x_2i, x_2i+1): their q/k weights need `megalite.hf.gguf.unpermute_rotary` first.
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


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention magnitude correction 0.1 mscale ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_scaled_inv_freq(inv_freq: torch.Tensor, factor: float, original_max_positions: int,
                         base: float, beta_fast: float = 32.0, beta_slow: float = 1.0
                         ) -> torch.Tensor:
    """YaRN's frequencies (DeepSeek-V2/V3, transformers' `rope_type="yarn"`): dims that rotate
    more than beta_fast times over the original context kept, fewer than beta_slow times
    divided by `factor`, a linear ramp between (bounds floored/ceiled)."""
    dim = 2 * inv_freq.numel()

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original_max_positions / (rotations * 2 * math.pi)) / (
            2 * math.log(base))
    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 0.001)
            ).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


class RotaryEmbedding(nn.Module):
    """position_ids [b, s] (or [1, s]) on the module's device -> (cos, sin) [b, 1, s, d] in
    fp32, no parameters.

    `scaling`: None, or the keyword arguments of `llama3_scaled_inv_freq` (less inv_freq).
    `yarn`: None, or those of `yarn_scaled_inv_freq` (less inv_freq and base) plus `mscale`
    and `mscale_all_dim`: cos and sin are then multiplied by mscale(factor, mscale) /
    mscale(factor, mscale_all_dim).
    The frequencies are computed on the CPU (the same values on every device) and kept on
    `device`.
    """

    def __init__(self, head_dim: int, base: float = 10000.0, scaling: dict | None = None,
                 yarn: dict | None = None, device=None) -> None:
        super().__init__()
        inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float()
                                  / head_dim)
        if scaling:
            inv_freq = llama3_scaled_inv_freq(inv_freq, **scaling)
        self.attention_factor = 1.0
        if yarn:
            yarn = dict(yarn)
            mscale, mscale_all_dim = yarn.pop("mscale"), yarn.pop("mscale_all_dim")
            inv_freq = yarn_scaled_inv_freq(inv_freq, base=base, **yarn)
            self.attention_factor = yarn_mscale(yarn["factor"], mscale) / yarn_mscale(
                yarn["factor"], mscale_all_dim) if mscale and mscale_all_dim \
                else yarn_mscale(yarn["factor"])
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = position_ids[:, :, None].float() * self.inv_freq  # [b, s, d/2]
        angles = torch.cat([angles, angles], dim=-1).unsqueeze(1)
        if self.attention_factor == 1.0:
            return angles.cos(), angles.sin()
        return angles.cos() * self.attention_factor, angles.sin() * self.attention_factor


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, s, d] rotated by (cos, sin) [b, 1, s, d]; computed in x's dtype."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin
