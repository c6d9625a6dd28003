"""A Llama-shaped model trained through pretrain_gpt's flags (RMSNorm, rope, SwiGLU, GQA, no
biases, untied head): the loss curve at TP2 x PP2 x VPP2 x DP2 on 8 ranks equals the
single-process run on the same global batches (fp32, dropout off; summation order differs,
so 1e-5 relative)."""
import torch

from tests.gpt_run import make_dataset, tiny_args, train
from tests.multirank import run_on_ranks
from tests.reference import rel_err

LLAMA_FLAGS = ["--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
               "--ffn-hidden-size", "48", "--group-query-attention", "--num-query-groups", "2",
               "--disable-bias-linear", "--untie-embeddings-and-output-weights",
               "--hidden-dropout", "0", "--attention-dropout", "0"]


def test_llama_loss_curve_tp2_pp2_vpp2_dp2_equals_single_process(tmp_path):
    prefix = make_dataset(str(tmp_path))
    single = run_on_ranks(1, train, tiny_args(prefix, f"{tmp_path}/single", 4, *LLAMA_FLAGS))[0]
    layout = ["--tp", "2", "--pp", "2", "--vpp", "2", "--dp", "2"]
    parallel = run_on_ranks(8, train, tiny_args(prefix, f"{tmp_path}/parallel", 4, *LLAMA_FLAGS,
                                                *layout))[0]
    assert sorted(single) == sorted(parallel) == [1, 2, 3, 4]
    for it in single:
        assert rel_err(torch.tensor(parallel[it]), torch.tensor(single[it])) < 1e-5, \
            (single, parallel)
    print("Llama loss curve single vs TP2xPP2xVPP2xDP2:", single, parallel)
