"""GPTModel at TP in {1, 2, 4} vs transformers GPT2LMHeadModel with the same random weights.

fp32 (megalite on the rank's device, transformers on the CPU), dropout off, odd vocabulary
(203) and odd sequence length (13): logits and loss within 1e-5 relative, every
parameter's gradient (gathered over TP) within 1e-4 relative, then three AdamW steps on both
and the losses still within 1e-5 relative.
"""
import pytest
import torch

from megalite.device import current_device
from megalite.hf import gpt2_config, load_hf, megalite_to_gpt2
from megalite.models import GPTModel
from megalite.mpu import initialize_model_parallel, model_parallel_seed
from megalite.mpu import parallel_state as ps
from tests.helpers.multirank import run_on_ranks
from tests.helpers.reference import hf_parity_errors, tiny_gpt2

VOCAB, SEQ = 203, 13


def _compare(tp: int) -> dict:
    initialize_model_parallel(tp, 1)
    model_parallel_seed(0, ps.get_tensor_model_parallel_rank())
    hf = tiny_gpt2(vocab=VOCAB)
    config = gpt2_config(hf.config)
    model = GPTModel(config, device=current_device())
    load_hf(model, hf.state_dict())
    torch.manual_seed(1)
    tokens = torch.randint(0, VOCAB, (3, SEQ + 1)).to(current_device())
    return hf_parity_errors(model, hf, lambda state: megalite_to_gpt2(state, config), tokens,
                            VOCAB)


def _at_tp(tps: tuple[int, ...]) -> dict:
    return {tp: _compare(tp) for tp in tps}


@pytest.mark.parametrize("world,tps", [(1, (1,)), (4, (2, 4))], ids=["tp1", "tp2-4"])
def test_gpt_matches_hf_gpt2(world, tps):
    """TP 1 on one rank (so on a machine with one GPU it runs there), TP 2 and 4 on four."""
    for per_tp in run_on_ranks(world, _at_tp, tps):
        for tp, e in per_tp.items():
            assert e["logits"] < 1e-5, (tp, e)
            assert e["loss"] < 1e-5, (tp, e)
            assert e["grad"] < 1e-4 and not e["missing grads"], (tp, e)
            assert max(e["steps"]) < 1e-5, (tp, e)
    print("parity errors (rank 0):", per_tp)
