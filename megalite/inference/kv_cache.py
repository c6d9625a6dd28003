"""A preallocated key-value cache for one generation request, freed with the request."""
import torch


class LayerKVCache:
    """Keys and values of one layer: [b, groups/tp, max_len, d] and [b, groups/tp, max_len, dv],
    allocated on the first `update` (with the shape, dtype and device of what it is given).
    Multi-head latent attention stores its latent c_kv [b, 1, s, kv_lora_rank] as the "keys"
    and its shared RoPE key [b, 1, s, rope dim] as the "values"."""

    def __init__(self, owner: "KVCache") -> None:
        self.owner = owner
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [b, groups/tp, s, d] at positions [offset, offset + s); return the keys
        and values of positions [0, offset + s) (views into the cache, no copy)."""
        start, end = self.owner.offset, self.owner.offset + k.shape[2]
        if end > self.owner.max_len:
            raise ValueError(f"KV cache of {self.owner.max_len} positions cannot take "
                             f"positions up to {end}")
        if self.keys is None:
            self.keys = k.new_empty(*k.shape[:2], self.owner.max_len, k.shape[3])
            self.values = v.new_empty(*v.shape[:2], self.owner.max_len, v.shape[3])
        self.keys[:, :, start:end] = k
        self.values[:, :, start:end] = v
        return self.keys[:, :, :end], self.values[:, :, :end]


class KVCache:
    """The cache of every layer of this rank (the model's `inference_params`).

    `offset` is the number of positions cached so far; after each forward step the caller
    moves it on with `advance(s)`.
    """

    def __init__(self, max_len: int) -> None:
        self.max_len, self.offset = max_len, 0
        self.layers: dict[int, LayerKVCache] = {}

    def layer(self, number: int) -> LayerKVCache:
        """The cache of global layer `number` (created on first use)."""
        if number not in self.layers:
            self.layers[number] = LayerKVCache(self)
        return self.layers[number]

    def bytes_per_token(self) -> int:
        """Bytes this rank's cache holds per position of one sequence, over all layers."""
        return sum((c.keys.shape[1] * c.keys.shape[3] + c.values.shape[1] * c.values.shape[3])
                   * c.keys.element_size() for c in self.layers.values() if c.keys is not None)

    def advance(self, s: int) -> None:
        self.offset += s
