"""Convert checkpoints: Hugging Face <-> megalite, and megalite -> megalite at another TP/PP.

  hf -> megalite:       --direction hf-to-megalite --input HF_DIR --output CKPT --target-tp 2 --target-pp 2
  megalite -> hf:       --direction megalite-to-hf --input CKPT --output HF_DIR
  megalite -> megalite: --direction reshard --input CKPT --output CKPT2 --target-tp 4 --target-pp 1

--model-type gpt (GPT-2, default), llama (LlamaForCausalLM directory, or a llama GGUF file as
--input, e.g. SmolLM2 from `megalite.hf.smollm2_gguf_path()`) or bert (BertModel,
BertForSequenceClassification or BertForMaskedLM, picked by the head the weights have;
tokenizer files are not converted), mixtral or qwen2_moe (MixtralForCausalLM /
Qwen2MoeForCausalLM directories; experts are stored by global index, so a checkpoint loads
under any expert-parallel size too).
megalite checkpoints hold full tensors per pipeline stage, so any of them loads under any
layout; --target-tp/--target-pp record the layout and split the stage files.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite import checkpointing  # noqa: E402
from megalite.config import ModelConfig  # noqa: E402
from megalite.hf import bert, gguf, gpt2, llama, moe  # noqa: E402

State = dict  # full megalite state dict: parameter name -> tensor


def read_gpt(src: str) -> tuple[ModelConfig, State]:
    from transformers import GPT2LMHeadModel
    hf = GPT2LMHeadModel.from_pretrained(src, local_files_only=True)
    config = gpt2.gpt2_config(hf.config)
    return config, gpt2.gpt2_to_megalite(hf.state_dict(), config)


def write_gpt(dst: str, full: State, config: ModelConfig, src: str) -> None:
    from transformers import GPT2LMHeadModel
    model = GPT2LMHeadModel(gpt2.to_gpt2_config(config))
    missing, unexpected = model.load_state_dict(gpt2.megalite_to_gpt2(full, config), strict=False)
    if unexpected or any("lm_head" not in k and not k.endswith(".attn.bias") for k in missing):
        raise ValueError(f"{src}: weights do not fit GPT2LMHeadModel: missing {missing}, "
                         f"unexpected {unexpected}")
    model.tie_weights()
    model.save_pretrained(dst)


def read_bert(src: str) -> tuple[ModelConfig, State]:
    hf_config, state = bert.read_bert_dir(src)
    config = bert.bert_config(hf_config)
    return config, bert.bert_to_megalite(state, config)


def write_bert(dst: str, full: State, config: ModelConfig, src: str) -> None:
    """A model with a head via save_bert_dir; a bare encoder (all-MiniLM-L6-v2) as BertModel."""
    if any(name.startswith(bert.HEAD_PREFIXES) for name in full):
        bert.save_bert_dir(dst, full, config)
        return
    from transformers import BertModel
    model = BertModel(bert.to_bert_config(config),
                      add_pooling_layer="pooler.dense.weight" in full)
    hf_state = bert.megalite_to_bert(full, config)
    model.load_state_dict({k.removeprefix("bert."): v for k, v in hf_state.items()})
    model.save_pretrained(dst)


def read_llama(src: str) -> tuple[ModelConfig, State]:
    """A transformers Llama directory, or a llama-architecture .gguf file."""
    if src.endswith(".gguf"):
        hf_config, state = gguf.read_llama_gguf(src)
    else:
        from transformers import LlamaForCausalLM
        hf = LlamaForCausalLM.from_pretrained(src, local_files_only=True, dtype="float32")
        hf_config, state = hf.config, hf.state_dict()
    config = llama.llama_config(hf_config)
    return config, llama.llama_to_megalite(state, config)


def write_llama(dst: str, full: State, config: ModelConfig, src: str) -> None:
    llama.save_llama_dir(dst, full, config)


def read_moe(src: str) -> tuple[ModelConfig, State]:
    """A transformers MixtralForCausalLM or Qwen2MoeForCausalLM directory."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(src, local_files_only=True, dtype="float32")
    config = moe.moe_config(hf.config)
    return config, moe.moe_to_megalite(hf.state_dict(), config)


def write_moe(dst: str, full: State, config: ModelConfig, src: str) -> None:
    moe.save_moe_dir(dst, full, config)


MODEL_TYPES = {  # name -> (HF directory -> (config, full state), write full state as HF dir)
    "gpt": (read_gpt, write_gpt),
    "bert": (read_bert, write_bert),
    "llama": (read_llama, write_llama),
    "mixtral": (read_moe, write_moe),
    "qwen2_moe": (read_moe, write_moe),
}


def hf_to_megalite(model_type: str, src: str, dst: str, tp: int, pp: int) -> None:
    config, full = MODEL_TYPES[model_type][0](src)
    checkpointing.write_weights_checkpoint(dst, full, config, tp, pp)


def megalite_to_hf(model_type: str, src: str, dst: str) -> None:
    meta, full = checkpointing.read_full_model(src)
    MODEL_TYPES[model_type][1](dst, full, ModelConfig(**meta["model_config"]), src)


def reshard(src: str, dst: str, tp: int, pp: int) -> None:
    meta, full = checkpointing.read_full_model(src)
    checkpointing.write_weights_checkpoint(dst, full, ModelConfig(**meta["model_config"]), tp, pp,
                                           meta["iteration"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--direction", required=True,
                        choices=("hf-to-megalite", "megalite-to-hf", "reshard"))
    parser.add_argument("--model-type", default="gpt", choices=sorted(MODEL_TYPES))
    parser.add_argument("--input", required=True, help="source directory (or .gguf file)")
    parser.add_argument("--output", required=True, help="destination directory")
    parser.add_argument("--target-tp", type=int, default=1)
    parser.add_argument("--target-pp", type=int, default=1)
    args = parser.parse_args(argv)
    if not (os.path.isdir(args.input) or args.input.endswith(".gguf")):
        parser.exit(2, f"error: --input {args.input}: no such directory (or .gguf file)\n")
    try:
        if args.direction == "hf-to-megalite":
            hf_to_megalite(args.model_type, args.input, args.output, args.target_tp,
                           args.target_pp)
        elif args.direction == "megalite-to-hf":
            megalite_to_hf(args.model_type, args.input, args.output)
        else:
            reshard(args.input, args.output, args.target_tp, args.target_pp)
    except (ValueError, FileNotFoundError, OSError) as error:
        parser.exit(2, f"error: {error}\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
