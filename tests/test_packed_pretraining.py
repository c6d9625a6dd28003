"""Packed pretraining (--reset-position-ids --reset-attention-mask --eod-mask-loss) against
each document run on its own through transformers (GPT-2 and Llama, fp32, dropout off).

Rows of several documents ended by an EOD token (the last one of a row cut short); the
reference runs every document separately through the transformers model (positions from 0,
no other document in view) and sums its next-token losses; each microbatch's loss is the
mean over its loss-bearing predictions (every one inside a document; the prediction made at
an EOD carries none), averaged over microbatches and DP as the loop does. Loss and every
gradient within 1e-5 relative at DP4 (each rank the single-process model), TP2 x PP2 with
sequence parallelism, and CP2 x DP2 (documents crossing the load-balanced chunks).
"""
import torch
import torch.nn.functional as F

from megalite.data.packed import document_layout, with_document_layout
from megalite.hf import gpt2_config, gpt2_to_megalite, llama_config, llama_to_megalite, load_hf
from tests.helpers.multirank import run_on_ranks
from tests.helpers.parallel_step import MICRO, MICROBATCHES, SEQ, VOCAB, parallel_step
from tests.helpers.reference import assert_step_errors, step_errors, tiny_gpt2
from tests.test_llama_hf_parity import tiny_llama

EOD = 3
LAYOUTS = {"dp4": (1, 1, 1, False), "tp2 pp2 sp": (2, 2, 1, True), "cp2 dp2": (1, 1, 2, False)}


def packed_tokens(rows: int) -> torch.Tensor:
    """[rows, SEQ + 1] tokens: documents of 1 to 9 tokens, each ended by EOD."""
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(4, VOCAB, (rows, SEQ + 1), generator=generator, device="cpu")
    for row in tokens:
        end = -1
        while (end := end + int(torch.randint(1, 10, (1,), generator=generator,
                                                  device="cpu"))) <= SEQ:
            row[end] = EOD
    return tokens


def documents(row: torch.Tensor) -> list[torch.Tensor]:
    """The documents of one row (each with its EOD; the last may be cut)."""
    ends = [i + 1 for i, t in enumerate(row.tolist()) if t == EOD]
    return [d for d in torch.tensor_split(row, ends) if len(d)]


def reference(hf, tokens: torch.Tensor, to_megalite) -> dict:
    """Each document alone through transformers; per microbatch the summed loss over its
    predictions / their count, averaged over microbatches (and DP ranks)."""
    microbatches = tokens.split(MICRO)
    total = 0
    for microbatch in microbatches:
        sums, count = 0, 0
        for row in microbatch:
            for doc in documents(row):
                if len(doc) > 1:
                    logits = hf(input_ids=doc[None, :-1]).logits[0]
                    sums = sums + F.cross_entropy(logits, doc[1:], reduction="sum")
                    count += len(doc) - 1
        total = total + sums / count
    loss = total / len(microbatches)
    loss.backward()
    grads = to_megalite({n: p.grad for n, p in hf.named_parameters()})
    hf.zero_grad()
    return {"loss": loss.item(), "grads": grads}


def _batches(tokens: torch.Tensor):
    """batches(dp_rank, dp) for parallel_step: packed-document fields added to each."""
    def batches(dp_rank: int, dp: int) -> list[dict]:
        rows = tokens.split(MICROBATCHES * MICRO)[dp_rank]
        return list(with_document_layout(({"tokens": t} for t in rows.split(MICRO)), EOD,
                                         True, True, True))
    return batches


def _all() -> dict:
    gpt2 = tiny_gpt2(vocab=VOCAB, positions=SEQ, layers=4, hidden=32)
    llama = tiny_llama(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=4, num_key_value_heads=2)
    gpt2_cfg, llama_cfg = gpt2_config(gpt2.config), llama_config(llama.config)
    models = {"gpt2": (gpt2, gpt2_cfg, load_hf, lambda g: gpt2_to_megalite(g, gpt2_cfg)),
              "llama": (llama, llama_cfg, load_hf, lambda g: llama_to_megalite(g, llama_cfg))}
    tokens = packed_tokens(4 * MICROBATCHES * MICRO)
    out = {}
    for model_name, (hf, config, load, to_megalite) in models.items():
        want = reference(hf, tokens, to_megalite)
        for name, (tp, pp, cp, sp) in LAYOUTS.items():
            dp = 4 // (tp * pp * cp)
            got = parallel_step(config, tp, pp, cp, sp, batches=_batches(tokens),
                                load=lambda chunks: load(chunks, hf.state_dict(), config))
            rows = reference(hf, tokens[:dp * MICROBATCHES * MICRO], to_megalite) \
                if dp != 4 else want
            out[f"{model_name} {name}"] = step_errors(got, rows)
    return out


def test_packed_documents_match_each_document_through_transformers():
    assert_step_errors(run_on_ranks(4, _all))


def test_document_layout_restarts_positions_after_each_eod():
    ids, positions = document_layout(torch.tensor([[5, EOD, 6, 7, EOD, EOD, 8]]), EOD)
    assert ids.tolist() == [[0, 0, 1, 1, 1, 2, 3]]
    assert positions.tolist() == [[0, 1, 0, 1, 2, 0, 0]]
