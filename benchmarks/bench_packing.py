"""Packed vs padded chat finetuning, and the cost of the document mask.

    python benchmarks/bench_packing.py [--seq-length 512 --conversations 64 --repeats 3]

Conversations with a chat-like length distribution (log-normal, median 150 tokens, cut to
[24, seq + 1]) train a small Llama-shaped model (fp32, one rank, the real forward step of
finetune_gpt.py: megalite.data.packed rows, pretrain_gpt.forward_step, forward + backward):

- real (non-padding) tokens per second, packed several per sequence (document masks) vs
  one per padded sequence, over the same conversations;
- the document mask's cost: the packed rows with their document mask vs the same rows with
  plain causal attention (equal tokens);
- the attention core alone on the packed rows (forward + backward): SDPA causal, SDPA with
  the [b, 1, s, s] document mask megalite uses, one SDPA call per document, and whether
  FlexAttention's block mask runs (its backward is CUDA-only in torch 2.13).
Times are CPU seconds of the one-thread worker (process time: a shared machine's other load
moves them far less than wall time), the fastest of --repeats runs with the modes
interleaved. Prints a table; asserts nothing.
"""
import time

import numpy as np
import torch
import torch.nn.functional as F
from common import benchmark_parser, machine_line

from megalite.config import ModelConfig
from megalite.data.packed import pack_examples, pad_examples, token_weighted_batches
from megalite.distributed.rank_pool import run_once
from megalite.models import GPTModel
from megalite.mpu import initialize_model_parallel, model_parallel_seed
from megalite.mpu.document_mask import DocumentMask
from megalite.tasks import gpt as pretrain_gpt

VOCAB = 1000


def conversations(n: int, seq_length: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """(ids, loss flags on the second half) of n chat-like conversations."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(150), 0.7, n).astype(int), 24, seq_length + 1)
    return [(rng.integers(1, VOCAB, length), np.arange(length) >= length // 2)
            for length in lengths]


def _step_seconds(model: torch.nn.Module, rows: dict, micro: int) -> float:
    """CPU seconds of forward + backward over every row, `micro` rows per microbatch."""
    n = len(rows["tokens"])
    start = time.process_time()
    for batch in token_weighted_batches(rows, iter([torch.arange(n)]), micro, 0, 1,
                                        divisor=-(-n // micro)):
        output, loss_func = pretrain_gpt.forward_step(iter([batch]), model)
        loss_func(output)[0].backward()
    return time.process_time() - start


def _attention_seconds(rows: dict, heads: int, head_dim: int) -> dict[str, float]:
    """Forward + backward CPU seconds of the attention core on the packed rows' shape."""
    b, s = rows["document_ids"].shape
    q, k, v = (torch.randn(b, heads, s, head_dim, requires_grad=True) for _ in range(3))
    mask = DocumentMask(rows["document_ids"])
    lengths = [torch.unique_consecutive(row, return_counts=True)[1].tolist()
               for row in rows["document_ids"]]

    def per_document():
        outs = []
        for i, row in enumerate(lengths):
            start = 0
            for n in row:
                part = slice(start, start + n)
                outs.append(F.scaled_dot_product_attention(
                    q[i:i + 1, :, part], k[i:i + 1, :, part], v[i:i + 1, :, part],
                    is_causal=True))
                start += n
        return torch.cat(outs, 2)
    cases = {"SDPA causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
             "SDPA + document mask": lambda: F.scaled_dot_product_attention(
                 q, k, v, attn_mask=DocumentMask(mask.document_ids).dense),
             "SDPA per document": per_document}
    out = {}
    for name, run in cases.items():
        start = time.process_time()
        run().sum().backward()
        out[name] = time.process_time() - start
    return out


def flex_status() -> str:
    """Whether FlexAttention with a document block mask runs forward + backward here."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        ids = torch.zeros(1, 128, dtype=torch.long)
        block = create_block_mask(lambda b, h, i, j: (ids[b, i] == ids[b, j]) & (i >= j),
                                  1, None, 128, 128, device="cpu")
        q = torch.randn(1, 2, 128, 16, requires_grad=True)
        flex_attention(q, q, q, block_mask=block).sum().backward()
        return "runs"
    except Exception as error:  # the reason it does not, in one line
        return f"unavailable ({type(error).__name__}: {str(error).splitlines()[0][:90]})"


def _bench(args) -> dict:
    initialize_model_parallel(1, 1)
    model_parallel_seed(1234, 0)
    config = ModelConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                         num_attention_heads=args.num_attention_heads, vocab_size=VOCAB,
                         max_position_embeddings=args.seq_length, hidden_dropout=0.0,
                         attention_dropout=0.0, normalization="RMSNorm",
                         position_embedding_type="rope", swiglu=True,
                         ffn_hidden_size=4 * args.hidden_size, disable_bias_linear=True)
    model = GPTModel(config)
    examples = conversations(args.conversations, args.seq_length)
    packed = pack_examples(examples, args.seq_length, pad=0)
    padded = {k: v for k, v in pad_examples(examples, args.seq_length, pad=0).items()
              if k in ("tokens", "loss_mask")}
    causal = {k: v for k, v in packed.items() if k != "document_ids"}
    modes = {"padded": padded, "packed": packed, "packed, causal only": causal}
    best = {name: float("inf") for name in modes}
    attention = {}
    for _ in range(args.repeats):
        for name, rows in modes.items():
            best[name] = min(best[name], _step_seconds(model, rows, args.micro_batch_size))
        for name, seconds in _attention_seconds(packed, args.num_attention_heads,
                                                args.hidden_size // args.num_attention_heads
                                                ).items():
            attention[name] = min(attention.get(name, float("inf")), seconds)
    real = int(sum(len(ids) for ids, _ in examples))
    return {"rows": {name: len(rows["tokens"]) for name, rows in modes.items()},
            "seconds": best, "real tokens": real, "attention": attention,
            "flex": flex_status()}


def main() -> None:
    parser = benchmark_parser(__doc__, repeats=3, num_layers=4, hidden_size=256,
                              num_attention_heads=4, seq_length=512, micro_batch_size=4)
    parser.add_argument("--conversations", type=int, default=64)
    args = parser.parse_args()
    print(machine_line())
    r = run_once(1, _bench, args, timeout=3000)[0]
    s = args.seq_length
    print(f"Llama shape: {args.num_layers} layers, hidden {args.hidden_size}, "
          f"{args.num_attention_heads} heads, seq {s}, micro batch {args.micro_batch_size}, "
          f"fp32, one rank | {args.conversations} conversations, {r['real tokens']} real tokens "
          f"(log-normal lengths, median 150)")
    print(f"{'mode':22} {'sequences':>9} {'fill':>6} {'CPU s fwd+bwd':>14} "
          f"{'real tokens/s':>14}")
    for name, seconds in r["seconds"].items():
        rows = r["rows"][name]
        print(f"{name:22} {rows:9} {r['real tokens'] / (rows * (s + 1)):6.1%} {seconds:14.2f} "
              f"{r['real tokens'] / seconds:14.0f}")
    sec = r["seconds"]
    print(f"packed / padded real tokens/s: {sec['padded'] / sec['packed']:.2f}x (target >= 1.5x)")
    print(f"document mask / plain causal, whole step: "
          f"{sec['packed'] / sec['packed, causal only']:.3f}x (target <= 1.15x)")
    base = r["attention"]["SDPA causal"]
    print("attention core alone (forward + backward, the packed rows' shape):")
    for name, seconds in r["attention"].items():
        print(f"  {name:22} {seconds * 1e3:8.1f} ms  {seconds / base:5.2f}x")
    print(f"  FlexAttention block mask: {r['flex']}")


if __name__ == "__main__":
    main()
