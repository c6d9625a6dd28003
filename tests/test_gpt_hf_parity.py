"""GPTModel at TP in {1, 2, 4} vs transformers GPT2LMHeadModel with the same random weights.

fp32, dropout off, odd vocabulary (203) and odd sequence length (13): logits and loss
within 1e-5 relative, every parameter's gradient (gathered over TP) within 1e-4 relative,
then three AdamW steps on both and the losses still within 1e-5 relative.
"""
import torch

from megalite.hf import gpt2_config, load_gpt2, megalite_to_gpt2
from megalite.models import GPTModel
from megalite.mpu import initialize_model_parallel, model_parallel_seed
from megalite.mpu import parallel_state as ps
from megalite.mpu.layers import gather_tensor_parallel
from megalite.mpu.mappings import gather_from_tensor_model_parallel_region
from tests.multirank import run_on_ranks
from tests.reference import hf_token_loss, rel_err, tiny_gpt2

VOCAB, SEQ = 203, 13


def _compare(tp: int) -> dict:
    initialize_model_parallel(tp, 1)
    model_parallel_seed(0, ps.get_tensor_model_parallel_rank())
    hf = tiny_gpt2(vocab=VOCAB)
    config = gpt2_config(hf.config)
    model = GPTModel(config)
    load_gpt2(model, hf.state_dict())
    torch.manual_seed(1)
    tokens = torch.randint(0, VOCAB, (3, SEQ + 1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    logits = gather_from_tensor_model_parallel_region(model(inputs))[..., :VOCAB]
    ref_logits = hf(input_ids=inputs).logits
    errors = {"logits": rel_err(logits, ref_logits)}

    loss = model(inputs, labels).mean()
    ref_loss = hf_token_loss(hf, tokens)
    errors["loss"] = rel_err(loss, ref_loss)
    loss.backward()
    ref_loss.backward()
    grads = {n: gather_tensor_parallel(p.grad, p) for n, p in model.named_parameters()}
    ours = megalite_to_gpt2(grads, config)
    ref_grads = dict(hf.named_parameters())
    errors["grad"] = max(rel_err(ours[n], p.grad) for n, p in ref_grads.items() if n in ours)
    assert set(ref_grads) <= set(ours), set(ref_grads) - set(ours)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(hf.parameters(), lr=1e-3, weight_decay=0.01)
    errors["steps"] = []
    for _ in range(3):
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = model(inputs, labels).mean()
        ref_loss = hf_token_loss(hf, tokens)
        errors["steps"].append(rel_err(loss, ref_loss))
        loss.backward()
        ref_loss.backward()
    return errors


def _all_tp() -> dict:
    return {tp: _compare(tp) for tp in (1, 2, 4)}


def test_gpt_matches_hf_gpt2_at_tp_1_2_4():
    for per_tp in run_on_ranks(4, _all_tp):
        for tp, e in per_tp.items():
            assert e["logits"] < 1e-5, (tp, e)
            assert e["loss"] < 1e-5, (tp, e)
            assert e["grad"] < 1e-4, (tp, e)
            assert max(e["steps"]) < 1e-5, (tp, e)
    print("parity errors (rank 0):", per_tp)
