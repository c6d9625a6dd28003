"""Sequence parallelism on vs off at TP 2 and 4, with PP2 (VPP) and DP2 on 8 ranks.

GPT-2- and Llama-shaped models, and BERT with either head (padding mask, token types),
fp32: the same step with and without --sequence-parallel
gives the same mean loss and every parameter the same gradient (full over TP) within
1e-5 relative - dropout off, and attention dropout on with full or selective recompute
(its masks come from the per-TP-rank stream either way). Hidden dropout under SP draws
[s/t, b, h] masks from the per-TP-rank stream: recompute replays them (same loss and grads
with and without it). The replicated parameters that see s/t tokens (norm weights,
row-parallel biases) hold equal grads on all TP ranks after finalize_model_grads.
"""
import pytest
import torch

from megalite.config import ModelConfig
from megalite.device import current_device
from megalite.distributed.finalize import finalize_model_grads
from megalite.models import BertModel
from megalite.mpu import initialize_model_parallel, model_parallel_seed
from megalite.mpu import parallel_state as ps
from megalite.mpu.layers import gather_tensor_parallel
from tests.helpers.multirank import run_on_ranks
from tests.helpers.parallel_step import GPT2, LLAMA, SEED, SEQ, VOCAB, parallel_step, with_
from tests.helpers.reference import rel_err

TOL = 1e-5
DROPOUT = dict(attention_dropout=0.1)
CASES = {  # name: (config, tp, pp, vpp)
    "gpt2 tp2 pp2 dp2": (GPT2, 2, 2, None),
    "llama tp2 pp2 vpp2 dp2": (LLAMA, 2, 2, 2),
    "gpt2 tp4 pp2, attention dropout, full recompute": (
        with_(GPT2, recompute_granularity="full", **DROPOUT), 4, 2, None),
    "llama tp4 pp2, attention dropout, selective recompute": (
        with_(LLAMA, recompute_granularity="selective", **DROPOUT), 4, 2, None),
}
HIDDEN_DROPOUT = with_(LLAMA, hidden_dropout=0.1)
BERT = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB,
                   max_position_embeddings=SEQ, num_tokentypes=2, post_layernorm=True,
                   causal=False, activation="gelu", hidden_dropout=0.0, attention_dropout=0.0)


def bert_step(head: str, tp: int, sp: bool) -> dict:
    """One forward + backward of BERT (no pipeline) on a padded batch: loss and grads."""
    initialize_model_parallel(tp, 1)
    model_parallel_seed(SEED, ps.get_tensor_model_parallel_rank())
    dev = current_device()
    model = BertModel(BERT, head=head, num_labels=3, init_seed=SEED, sequence_parallel=sp,
                      device=dev)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (4, SEQ), generator=gen).to(dev)
    types = torch.randint(0, 2, (4, SEQ), generator=gen).to(dev)
    mask = torch.ones(4, SEQ, dtype=torch.long, device=dev)
    mask[0, 10:] = 0
    labels = torch.randint(0, 3, (4,), generator=gen).to(dev) if head == "classification" \
        else torch.randint(-1, VOCAB, (4, SEQ), generator=gen).to(dev)
    loss = model(ids, mask, types, labels).mean()
    loss.backward()
    finalize_model_grads([model])
    grads = {n: gather_tensor_parallel(p.grad, p) for n, p in model.named_parameters()}
    ps.destroy_model_parallel()
    return {"loss": loss.item(), "grads": grads, "tp partial grads agree": True}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def _errors(a: dict, b: dict) -> dict:
    return {"loss": _rel(a["loss"], b["loss"]),
            "grad": max(rel_err(g, b["grads"][n]) for n, g in a["grads"].items())}


def _gpt_cases() -> dict:
    out = {}
    for name, (config, tp, pp, vpp) in CASES.items():
        off = parallel_step(config, tp, pp, 1, False, vpp)
        on = parallel_step(config, tp, pp, 1, True, vpp)
        out[name] = {**_errors(on, off), "agree": on["tp partial grads agree"]}
    return out


def _bert_and_dropout_cases() -> dict:
    out = {}
    for head, tp in (("classification", 2), ("mlm", 2), ("mlm", 4)):
        out[f"bert {head} tp{tp}"] = {**_errors(bert_step(head, tp, True),
                                                bert_step(head, tp, False)), "agree": True}
    plain = parallel_step(HIDDEN_DROPOUT, 2, 2, 1, True)
    recomputed = parallel_step(with_(HIDDEN_DROPOUT, recompute_granularity="full"), 2, 2, 1,
                               True)
    no_dropout = parallel_step(LLAMA, 2, 2, 1, True)
    out["hidden dropout: recompute vs not"] = {**_errors(recomputed, plain), "agree": True,
                                               "dropout changed the loss": _rel(
                                                   plain["loss"], no_dropout["loss"])}
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    """Per rank: name -> errors (two rank-pool tasks, so each stays well inside the timeout)."""
    return [{**a, **b} for a, b in zip(run_on_ranks(8, _gpt_cases),
                                       run_on_ranks(8, _bert_and_dropout_cases))]


def test_sequence_parallel_matches_tensor_parallel(results):
    for rank, per_rank in enumerate(results):
        for name, e in per_rank.items():
            assert e["loss"] < TOL and e["grad"] < TOL, (rank, name, e)
    print({name: "loss {:.1e} grad {:.1e}".format(
        max(r[name]["loss"] for r in results), max(r[name]["grad"] for r in results))
        for name in results[0]})


def test_sequence_parallel_dropout_is_real(results):
    for per_rank in results:
        assert per_rank["hidden dropout: recompute vs not"]["dropout changed the loss"] > 1e-4


def test_replicated_grads_equal_across_tensor_parallel_ranks(results):
    for rank, per_rank in enumerate(results):
        for name, e in per_rank.items():
            assert e["agree"], (rank, name)
