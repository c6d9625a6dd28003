"""A Llama-shaped model trained through pretrain_gpt's flags (RMSNorm, rope, SwiGLU, GQA, no
biases, untied head): the loss curve at TP2 x PP2 x VPP2 x DP2 and at PP4 x CP2 on 8 ranks
equals the single-process run on the same global batches (fp32, dropout off; summation order
differs, so 1e-5 relative). At PP4 the two middle stages read no tokens: their rotary
embeddings take this CP rank's positions from the data provider."""
import pytest
import torch

from tests.helpers.gpt_run import make_dataset, tiny_args, train
from tests.helpers.multirank import run_on_ranks
from tests.helpers.reference import rel_err

LLAMA_FLAGS = ["--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
               "--ffn-hidden-size", "48", "--group-query-attention", "--num-query-groups", "2",
               "--disable-bias-linear", "--untie-embeddings-and-output-weights",
               "--hidden-dropout", "0", "--attention-dropout", "0"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[str, dict[int, float]]:
    """(data prefix, the single-process loss curve)."""
    root = tmp_path_factory.mktemp("llama")
    prefix = make_dataset(str(root))
    return prefix, run_on_ranks(1, train, tiny_args(prefix, f"{root}/single", 4,
                                                    *LLAMA_FLAGS))[0]


@pytest.mark.parametrize("layout", [["--tp", "2", "--pp", "2", "--vpp", "2", "--dp", "2"],
                                    ["--pp", "4", "--cp", "2"]])
def test_llama_loss_curve_on_8_ranks_equals_single_process(data, tmp_path, layout):
    prefix, single = data
    parallel = run_on_ranks(8, train, tiny_args(prefix, f"{tmp_path}/parallel", 4, *LLAMA_FLAGS,
                                                *layout))[0]
    assert sorted(single) == sorted(parallel) == [1, 2, 3, 4]
    for it in single:
        assert rel_err(torch.tensor(parallel[it]), torch.tensor(single[it])) < 1e-5, \
            (single, parallel)
    print("Llama loss curve single vs", " ".join(layout), single, parallel)
