"""Convert checkpoints: Hugging Face <-> megalite, and megalite -> megalite at another TP/PP.

  hf -> megalite:       --direction hf-to-megalite --input HF_DIR --output CKPT --target-tp 2 --target-pp 2
  megalite -> hf:       --direction megalite-to-hf --input CKPT --output HF_DIR
  megalite -> megalite: --direction reshard --input CKPT --output CKPT2 --target-tp 4 --target-pp 1

megalite checkpoints hold full tensors per pipeline stage, so any of them loads under any
layout; --target-tp/--target-pp record the layout and split the stage files.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite import checkpointing  # noqa: E402
from megalite.config import ModelConfig  # noqa: E402
from megalite.hf import gpt2  # noqa: E402

MODEL_TYPES = {  # name -> (HF model class, config from HF, HF state -> full, full -> HF, HF config)
    "gpt": ("GPT2LMHeadModel", gpt2.gpt2_config, gpt2.gpt2_to_megalite, gpt2.megalite_to_gpt2,
            gpt2.to_gpt2_config),
}


def hf_to_megalite(model_type: str, src: str, dst: str, tp: int, pp: int) -> None:
    import transformers
    cls, to_config, to_full, _, _ = MODEL_TYPES[model_type]
    hf = getattr(transformers, cls).from_pretrained(src, local_files_only=True)
    config = to_config(hf.config)
    checkpointing.write_weights_checkpoint(dst, to_full(hf.state_dict(), config), config, tp, pp)


def megalite_to_hf(model_type: str, src: str, dst: str) -> None:
    import transformers
    cls, _, _, from_full, hf_config = MODEL_TYPES[model_type]
    meta, full = checkpointing.read_full_model(src)
    config = ModelConfig(**meta["model_config"])
    model = getattr(transformers, cls)(hf_config(config))
    missing, unexpected = model.load_state_dict(from_full(full, config), strict=False)
    if unexpected or any("lm_head" not in k and not k.endswith(".attn.bias") for k in missing):
        raise ValueError(f"{src}: weights do not fit {cls}: missing {missing}, "
                         f"unexpected {unexpected}")
    model.tie_weights()
    model.save_pretrained(dst)


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
    parser.add_argument("--input", required=True, help="source directory")
    parser.add_argument("--output", required=True, help="destination directory")
    parser.add_argument("--target-tp", type=int, default=1)
    parser.add_argument("--target-pp", type=int, default=1)
    args = parser.parse_args(argv)
    if not os.path.isdir(args.input):
        parser.exit(2, f"error: --input {args.input}: no such directory\n")
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
