"""Hugging Face round trip through a (TP2, PP2) run, and a 2-node launch on one machine."""
import os
import socket
import subprocess
import sys

import pytest
import torch

from megalite import checkpointing
from megalite.config import ModelConfig, parse_configs
from megalite.models import GPTModel
from megalite.optimizer import get_optimizer
from megalite.training import build_model, setup_parallel
from tests.gpt_run import make_dataset, tiny_args
from tests.multirank import run_on_ranks
from tests.reference import tiny_gpt2
from tests.test_llama_hf_parity import tiny_llama

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def convert(*argv: str) -> None:
    subprocess.run([sys.executable, "tools/convert_checkpoint.py", *argv], cwd=ROOT, check=True,
                   capture_output=True, timeout=120)


def _load_and_save_sharded(src: str, dst: str) -> None:
    """Load the converted checkpoint into TP2 x PP2 shards and save it from those shards."""
    meta = checkpointing.read_meta(src)
    configs = parse_configs(["--tp", "2", "--pp", "2"])
    configs.model = ModelConfig(**meta["model_config"])
    setup_parallel(configs)

    def provider(pre_process: bool, post_process: bool) -> GPTModel:
        return GPTModel(configs.model, pre_process=pre_process, post_process=post_process)
    model = build_model(configs, provider)
    optimizer, scheduler = get_optimizer(configs.optimizer, configs.precision, model, 10)
    checkpointing.load_checkpoint(src, model, optimizer, scheduler, configs.model)
    checkpointing.save_checkpoint(dst, 1, model, optimizer, scheduler, 0, configs.model)


@pytest.mark.parametrize("model_type", ["gpt", "llama"])
def test_hf_to_megalite_tp2_pp2_to_hf_gives_identical_logits(tmp_path, model_type):
    from transformers import GPT2LMHeadModel, LlamaForCausalLM
    if model_type == "gpt":
        hf, hf_class = tiny_gpt2(vocab=203, layers=4).eval(), GPT2LMHeadModel
    else:  # GQA with 2 groups, untied head
        hf = tiny_llama(num_hidden_layers=4, num_key_value_heads=2).eval()
        hf_class = LlamaForCausalLM
    hf.save_pretrained(tmp_path / "hf")
    convert("--direction", "hf-to-megalite", "--model-type", model_type, "--input",
            str(tmp_path / "hf"), "--output", str(tmp_path / "ml"), "--target-tp", "2",
            "--target-pp", "2")
    run_on_ranks(4, _load_and_save_sharded, str(tmp_path / "ml"), str(tmp_path / "ml2"))
    convert("--direction", "megalite-to-hf", "--model-type", model_type, "--input",
            str(tmp_path / "ml2"), "--output", str(tmp_path / "hf2"))
    back = hf_class.from_pretrained(tmp_path / "hf2", attn_implementation="eager").eval()
    tokens = torch.randint(0, 203, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(back(tokens).logits, hf(tokens).logits)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_launcher_nodes_form_one_8_rank_job(tmp_path):
    prefix = make_dataset(str(tmp_path))
    args = tiny_args(prefix, str(tmp_path / "ck"), 3, "--tp", "2", "--pp", "2", "--dp", "2",
                     "--log-interval", "1")
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "NNODES": "2", "GPUS_PER_NODE": "4"}
    nodes = [subprocess.Popen(["bash", "tools/run_multinode.sh", *args], cwd=ROOT,
                              env={**env, "NODE_RANK": str(rank)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    try:
        outputs = [node.communicate(timeout=240)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert "world 8 = TP 2 x PP 2 x DP 2" in outputs[0], outputs[0]
    assert "iteration      3/     3" in outputs[0], outputs[0]
    assert checkpointing.latest_iteration(str(tmp_path / "ck")) == 3
