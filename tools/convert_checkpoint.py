"""Convert checkpoints: Hugging Face <-> megalite, and megalite -> megalite at another TP/PP.

  hf -> megalite:       --direction hf-to-megalite --input HF_DIR --output CKPT --target-tp 2 --target-pp 2
  megalite -> hf:       --direction megalite-to-hf --input CKPT --output HF_DIR
  megalite -> megalite: --direction reshard --input CKPT --output CKPT2 --target-tp 4 --target-pp 1

--model-type is read from the input (a transformers directory's config.json model_type, a
GGUF file's architecture, a megalite checkpoint's model config); given, it must agree:
gpt (GPT-2), llama (LlamaForCausalLM directory, or a llama GGUF file as --input, e.g.
SmolLM2 from `megalite.hf.smollm2_gguf_path()`), bert (BertModel,
BertForSequenceClassification or BertForMaskedLM, picked by the head the weights have),
mixtral or qwen2_moe (MixtralForCausalLM / Qwen2MoeForCausalLM directories; experts are
stored by global index, so a checkpoint loads under any expert-parallel size too),
deepseek_v3 (DeepseekV3ForCausalLM: multi-head latent attention, dense then MoE layers; its
multi-token-prediction modules are not transformers weights: exporting drops them). A weight
the model lacks or does not use, or a --target-tp/--target-pp the model cannot be split into,
is one error line.
megalite checkpoints hold full tensors per pipeline stage, so any of them loads under any
layout; --target-tp/--target-pp record the layout and split the stage files.
The tokenizer travels too: the input's (a transformers directory's, a GGUF file's) is saved in
the checkpoint, and a checkpoint's is written beside exported weights (chat template
included), so `pretrain_gpt.py --load`, tools/generate.py and AutoTokenizer find it.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite import checkpoint  # noqa: E402
from megalite.checkpoint.files import save_pretrained  # noqa: E402
from megalite.config import (CheckpointConfig, Configs, DataConfig, ModelConfig,  # noqa: E402
                             OptimizerConfig, ParallelConfig, PrecisionConfig, TrainConfig)
from megalite.data.tokenizers import Tokenizer, build_tokenizer  # noqa: E402
from megalite.hf import bert, deepseek_v3, gpt2, llama, moe  # noqa: E402
from megalite.hf.families import check_weights, family_of_config, family_of_source  # noqa: E402
from megalite.hf.readers import READERS, State  # noqa: E402
from megalite.hf.tokenizer_io import export_tokenizer, source_tokenizer  # noqa: E402
from megalite.layout import RunLayout  # noqa: E402


def write_gpt(dst: str, full: State, config: ModelConfig, src: str) -> None:
    from transformers import GPT2LMHeadModel
    model = GPT2LMHeadModel(gpt2.to_gpt2_config(config))
    missing, unexpected = model.load_state_dict(gpt2.megalite_to_gpt2(full, config), strict=False)
    if unexpected or any("lm_head" not in k and not k.endswith(".attn.bias") for k in missing):
        raise ValueError(f"{src}: weights do not fit GPT2LMHeadModel: missing {missing}, "
                         f"unexpected {unexpected}")
    model.tie_weights()
    save_pretrained(model, dst)


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
    save_pretrained(model, dst)


def write_llama(dst: str, full: State, config: ModelConfig, src: str) -> None:
    llama.save_llama_dir(dst, full, config)


def write_moe(dst: str, full: State, config: ModelConfig, src: str) -> None:
    moe.save_moe_dir(dst, full, config)


def write_deepseek_v3(dst: str, full: State, config: ModelConfig, src: str) -> None:
    deepseek_v3.save_deepseek_v3_dir(dst, full, config)


WRITERS = {  # name -> write a full megalite state as a transformers directory
    "gpt": write_gpt, "bert": write_bert, "llama": write_llama, "mixtral": write_moe,
    "qwen2_moe": write_moe, "deepseek_v3": write_deepseek_v3}


def model_type_of(asked: str | None, found: str, src: str) -> str:
    """The family found in the input; ValueError if --model-type names another."""
    if asked is not None and asked != found:
        raise ValueError(f"--model-type {asked} disagrees with --input {src}, which holds a "
                         f"{found} model (drop --model-type, or give the right input)")
    return found


def check_target_layout(config: ModelConfig, tp: int, pp: int) -> None:
    """--target-tp/--target-pp the model can be split into: the run layout's rules (heads and
    KV groups over TP, layers over PP, ...); ValueError naming both flags."""
    configs = Configs(config,
                      ParallelConfig(tensor_model_parallel_size=tp,
                                     pipeline_model_parallel_size=pp),
                      PrecisionConfig(), OptimizerConfig(),
                      TrainConfig(seq_length=config.max_position_embeddings), DataConfig(),
                      CheckpointConfig())
    try:
        RunLayout.from_configs(configs, tp * pp)
    except ValueError as error:
        raise ValueError(f"--target-tp {tp} --target-pp {pp}: {error}") from None


def write_checkpoint(dst: str, full: State, config: ModelConfig, src: str, tp: int, pp: int,
                     iteration: int = 0, tokenizer: Tokenizer | None = None) -> None:
    check_target_layout(config, tp, pp)
    check_weights(full, config, src)
    checkpoint.write_weights_checkpoint(dst, full, config, tp, pp, iteration, tokenizer)


def hf_to_megalite(model_type: str | None, src: str, dst: str, tp: int, pp: int) -> None:
    model_type = model_type_of(model_type, family_of_source(src), src)
    config, full = READERS[model_type](src)
    write_checkpoint(dst, full, config, src, tp, pp, tokenizer=source_tokenizer(src))


def megalite_to_hf(model_type: str | None, src: str, dst: str) -> None:
    meta, full = checkpoint.read_full_model(src)
    config = ModelConfig(**meta["model_config"])
    check_weights(full, config, src)
    WRITERS[model_type_of(model_type, family_of_config(config), src)](dst, full, config, src)
    export_tokenizer(checkpoint.checkpoint_tokenizer(src, meta), dst)


def reshard(src: str, dst: str, tp: int, pp: int) -> None:
    meta, full = checkpoint.read_full_model(src)
    tokenizer = checkpoint.checkpoint_tokenizer(src, meta)
    write_checkpoint(dst, full, ModelConfig(**meta["model_config"]), src, tp, pp,
                     meta["iteration"], tokenizer and build_tokenizer(tokenizer))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--direction", required=True,
                        choices=("hf-to-megalite", "megalite-to-hf", "reshard"))
    parser.add_argument("--model-type", choices=sorted(READERS),
                        help="checked against the input (default: read from it)")
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
    except (ValueError, KeyError, OSError) as error:
        parser.exit(2, f"error: {error}\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
