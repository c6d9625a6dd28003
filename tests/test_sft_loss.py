"""Chat finetuning's loss: assistant tokens only, the mean over every loss-bearing token of
the global batch, against transformers.

Eight conversations (random ids, an assistant answer at the end of each and a second one
inside some) are packed several per sequence with document masks, or one per padded
sequence, and split into microbatches and DP ranks as finetune_gpt.py does
(megalite.data.packed.token_weighted_batches). The reference runs each conversation alone
through LlamaForCausalLM with labels -100 outside the assistant tokens and weights each
one's mean loss by its label count. Loss and every gradient within 1e-5 relative (fp32) at
DP4 (each rank the single-process model), TP2 with sequence parallelism and PP2 (x DP2),
packed and padded.
"""
import torch

from megalite.data.packed import pack_examples, pad_examples, pad_rows, token_weighted_batches
from megalite.hf import llama_config, llama_to_megalite, load_hf
from tests.helpers.multirank import run_on_ranks
from tests.helpers.parallel_step import MICRO, SEQ, VOCAB, parallel_step
from tests.helpers.reference import assert_step_errors, step_errors
from tests.test_llama_hf_parity import tiny_llama

ROWS = 8  # one global batch: 1 microbatch x 2 rows x DP4, or 2 x 2 x DP2
LAYOUTS = {"dp4": (1, 1, False), "tp2 sp": (2, 1, True), "pp2": (1, 2, False)}


def conversations() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(ids, assistant flags) of 8 conversations of 4 to 12 tokens."""
    generator = torch.Generator().manual_seed(3)
    out = []
    for i in range(8):
        length = int(torch.randint(4, 13, (1,), generator=generator, device="cpu"))
        ids = torch.randint(0, VOCAB, (length,), generator=generator, device="cpu")
        flags = torch.zeros(length, dtype=torch.bool, device="cpu")
        flags[length // 2 + 1:] = True
        if i % 3 == 0:
            flags[1:3] = True
        out.append((ids, flags))
    return out


def reference(hf, examples) -> dict:
    """transformers on each conversation (labels -100 outside the assistant's), token-weighted."""
    total, count = 0, 0
    for ids, flags in examples:
        labels = torch.where(flags, ids, -100)
        n = int(flags[1:].sum())
        total = total + hf(input_ids=ids[None], labels=labels[None]).loss * n
        count += n
    loss = total / count
    loss.backward()
    return {"loss": loss.item(), "grads": {n: p.grad.clone() for n, p in hf.named_parameters()}}


def rows_of(examples, packing: bool) -> dict[str, torch.Tensor]:
    arrays = [(ids.numpy(), flags.numpy()) for ids, flags in examples]
    if packing:
        return pad_rows(pack_examples(arrays, SEQ, pad=0), ROWS)
    rows = pad_examples(arrays, SEQ, pad=0)
    return {k: v for k, v in rows.items() if k in ("tokens", "loss_mask")}


def _all() -> dict:
    hf = tiny_llama(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                    num_hidden_layers=4, num_key_value_heads=2)
    config = llama_config(hf.config)
    examples = conversations()
    want = reference(hf, examples)
    want["grads"] = llama_to_megalite(want["grads"], config)
    out = {}
    for packing in (True, False):
        rows = rows_of(examples, packing)
        assert len(rows["tokens"]) == ROWS
        for name, (tp, pp, sp) in LAYOUTS.items():
            dp = 4 // (tp * pp)
            m = ROWS // (MICRO * dp)

            def batches(dp_rank: int, dp: int) -> list[dict]:
                return list(token_weighted_batches(rows, iter([torch.arange(ROWS, device="cpu")]), MICRO,
                                                   dp_rank, dp, divisor=m * dp))
            got = parallel_step(config, tp, pp, 1, sp, batches=batches, microbatches=m,
                                load=lambda chunks: load_hf(chunks, hf.state_dict(), config))
            out[f"{'packed' if packing else 'padded'} {name}"] = step_errors(got, want)
    return out


def test_sft_loss_and_grads_match_transformers_per_conversation():
    assert_step_errors(run_on_ranks(4, _all))
