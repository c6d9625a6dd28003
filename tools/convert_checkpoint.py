"""Convert checkpoints: Hugging Face <-> megalite, and megalite -> megalite at another TP/PP.

  hf -> megalite:       --direction hf-to-megalite --input HF_DIR --output CKPT --target-tp 2 --target-pp 2
  megalite -> hf:       --direction megalite-to-hf --input CKPT --output HF_DIR
  megalite -> megalite: --direction reshard --input CKPT --output CKPT2 --target-tp 4 --target-pp 1

--model-type is read from the input (a transformers directory's config.json model_type, a
GGUF file's architecture, a megalite checkpoint's model config); given, it must agree. The
families are megalite.hf.FAMILIES: gpt (GPT-2), llama (LlamaForCausalLM directory, or a llama
GGUF file as --input, e.g. SmolLM2 from `megalite.hf.smollm2_gguf_path()`), qwen3 (per-head
q/k norms), bert (BertModel, BertForSequenceClassification or BertForMaskedLM, picked by the
head the weights have), mixtral, qwen2_moe and qwen3_moe (experts are stored by global index,
so a checkpoint loads under any expert-parallel size too), deepseek_v3 (multi-head latent
attention, dense then MoE layers; its multi-token-prediction modules are not transformers
weights: exporting drops them). The special-token ids (bos/eos/pad) travel both ways. A
weight the model lacks or does not use, or a --target-tp/--target-pp the model cannot be split
into, is one error line.
The checkpoint written is megalite's format 3 (megalite/checkpoint/: meta.json, index.json and
a safetensors shard of full tensors), which loads under any TP/PP/DP/EP layout: --target-tp/
--target-pp are checked against the model and recorded as its layout. Format-3 and format-2
checkpoints are read.
The tokenizer travels too: the input's (a transformers directory's, a GGUF file's) is saved in
the checkpoint, and a checkpoint's is written beside exported weights (chat template
included), so `pretrain_gpt.py --load`, tools/generate.py and AutoTokenizer find it.
"""
import argparse
import os

from megalite import checkpoint
from megalite.config import (CheckpointConfig, Configs, DataConfig, ModelConfig, OptimizerConfig,
                             ParallelConfig, PrecisionConfig, TrainConfig)
from megalite.data.tokenizers import Tokenizer, build_tokenizer
from megalite.hf.families import FAMILIES, check_weights, family_of_config, family_of_source
from megalite.hf.family import State
from megalite.hf.tokenizer_io import export_tokenizer, source_tokenizer
from megalite.layout import RunLayout


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
    config, full = FAMILIES[model_type].read(src)
    write_checkpoint(dst, full, config, src, tp, pp, tokenizer=source_tokenizer(src))


def megalite_to_hf(model_type: str | None, src: str, dst: str) -> None:
    meta, full = checkpoint.read_full_model(src)
    config = ModelConfig(**meta["model_config"])
    check_weights(full, config, src)
    FAMILIES[model_type_of(model_type, family_of_config(config), src)].write(dst, full, config)
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
    parser.add_argument("--model-type", choices=sorted(FAMILIES),
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
