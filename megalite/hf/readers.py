"""Read a transformers directory or a Llama GGUF file into a megalite config and full
megalite weights, one reader per family (tools/convert_checkpoint.py's --model-type values).
Every reader refuses weights that do not fit its model (nothing initialised at random, nothing
dropped silently)."""
from collections.abc import Callable

import torch

from megalite.config import ModelConfig
from megalite.hf import bert, deepseek_v3, gguf, gpt2, llama, moe
from megalite.hf.families import family_of_source

State = dict[str, torch.Tensor]  # full megalite state dict: parameter name -> tensor


def from_pretrained(cls, src: str):
    """`cls.from_pretrained(src)` in fp32; ValueError if the directory's weights and the
    class's differ (transformers would initialise the missing ones at random)."""
    hf, info = cls.from_pretrained(src, local_files_only=True, dtype="float32",
                                   output_loading_info=True)
    bad = {kind: sorted(info[kind]) for kind in ("missing_keys", "unexpected_keys",
                                                  "mismatched_keys") if info[kind]}
    if bad:
        raise ValueError(f"{src}: weights do not fit {type(hf).__name__}: " + "; ".join(
            f"{kind.replace('_', ' ')} {names[:3]} ({len(names)})" for kind, names in bad.items()))
    return hf


def read_gpt(src: str) -> tuple[ModelConfig, State]:
    from transformers import GPT2LMHeadModel
    hf = from_pretrained(GPT2LMHeadModel, src)
    config = gpt2.gpt2_config(hf.config)
    return config, gpt2.gpt2_to_megalite(hf.state_dict(), config)


def read_bert(src: str) -> tuple[ModelConfig, State]:
    """Every weight of the directory must map (a pretraining head, e.g., would be lost)."""
    hf_config, state = bert.read_bert_dir(src)
    config = bert.bert_config(hf_config)
    full = bert.bert_to_megalite(state, config)
    mapped = {k.removeprefix("bert.") for k in bert.megalite_to_bert(full, config)}
    unused = sorted({k.removeprefix("bert.") for k in state} - mapped
                    - {"embeddings.position_ids"})
    if unused:
        raise ValueError(f"{src}: weights megalite's BERT has no place for: {unused[:3]} "
                         f"({len(unused)})")
    return config, full


def read_llama(src: str, log: Callable[[str], None] = print) -> tuple[ModelConfig, State]:
    """A transformers Llama directory, or a llama-architecture .gguf file (dequantised to
    fp32; progress lines to `log`)."""
    if src.endswith(".gguf"):
        hf_config, state = gguf.read_llama_gguf(src, log)
    else:
        from transformers import LlamaForCausalLM
        hf = from_pretrained(LlamaForCausalLM, src)
        hf_config, state = hf.config, hf.state_dict()
    config = llama.llama_config(hf_config)
    return config, llama.llama_to_megalite(state, config)


def read_moe(src: str) -> tuple[ModelConfig, State]:
    """A transformers MixtralForCausalLM or Qwen2MoeForCausalLM directory."""
    from transformers import AutoModelForCausalLM
    hf = from_pretrained(AutoModelForCausalLM, src)
    config = moe.moe_config(hf.config)
    return config, moe.moe_to_megalite(hf.state_dict(), config)


def read_deepseek_v3(src: str) -> tuple[ModelConfig, State]:
    """A transformers DeepseekV3ForCausalLM directory (either RoPE layout)."""
    from transformers import DeepseekV3ForCausalLM
    hf = from_pretrained(DeepseekV3ForCausalLM, src)
    config = deepseek_v3.deepseek_v3_config(hf.config)
    return config, deepseek_v3.deepseek_v3_to_megalite(hf.state_dict(), config,
                                                       hf.config.rope_interleave)


READERS = {"gpt": read_gpt, "bert": read_bert, "llama": read_llama, "mixtral": read_moe,
           "qwen2_moe": read_moe, "deepseek_v3": read_deepseek_v3}
CAUSAL = tuple(family for family in READERS if family != "bert")  # what generation loads


def read_source(src: str, flag: str, families: tuple[str, ...] = tuple(READERS)
                ) -> tuple[ModelConfig, State]:
    """Config and full megalite weights of a transformers directory or .gguf file of one of
    `families`; ValueError naming `flag` and `src` otherwise."""
    return READERS[family_of_source(src, flag, families)](src)
