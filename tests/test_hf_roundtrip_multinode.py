"""Hugging Face round trip through a (TP2, PP2) run, and a 2-node launch on one machine."""
import json
import os
import subprocess

import pytest
import torch

from megalite import checkpoint
from megalite.config import ModelConfig, parse_configs
from megalite.device import current_device, free_port
from megalite.distributed.rank_pool import on_gpus
from megalite.layout import RunLayout
from megalite.models import GPTModel
from megalite.optimizer import get_optimizer
from megalite.training.setup import build_model, setup_parallel
from tests.helpers.gpt_run import make_dataset, tiny_args
from tests.helpers.multirank import run_on_ranks
from tests.helpers.reference import tiny_gpt2
from tests.test_deepseek_v3 import tiny_deepseek_v3
from tests.test_llama_hf_parity import tiny_llama
from tests.test_moe_hf_parity import tiny_moe
from tools import convert_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def convert(*argv: str) -> None:
    """tools/convert_checkpoint.py's main, in this process (a subprocess would spend ~5 s
    importing torch and transformers again)."""
    convert_checkpoint.main(list(argv))


def _load_and_save_sharded(src: str, dst: str, layout: list[str]) -> None:
    """Load the converted checkpoint into the shards of `layout` (flags) and save it from them."""
    meta = checkpoint.read_meta(src)
    model_config = ModelConfig(**meta["model_config"])
    configs = parse_configs([*layout, "--seq-length", str(model_config.max_position_embeddings)])
    configs.model = model_config
    setup_parallel(configs, RunLayout.from_configs(configs, torch.distributed.get_world_size()))

    def provider(pre_process: bool, post_process: bool) -> GPTModel:
        return GPTModel(configs.model, pre_process=pre_process, post_process=post_process,
                        device=current_device())
    model = build_model(configs, provider)
    optimizer, scheduler = get_optimizer(configs.optimizer, configs.precision, model, 10)
    checkpoint.load(src, model, optimizer, scheduler, configs.model)
    checkpoint.save(dst, 1, model, optimizer, scheduler, 0, configs.model)


def _tiny_hf(model_type: str):
    if model_type == "gpt":
        return tiny_gpt2(vocab=203, layers=4)
    if model_type in ("llama", "qwen3"):  # GQA with 2 groups, untied head (Qwen3: q/k norms)
        return tiny_llama(num_hidden_layers=4, num_key_value_heads=2, family=model_type)
    if model_type == "deepseek_v3":  # MLA, 2 dense + 2 MoE layers, interleaved RoPE rows
        return tiny_deepseek_v3(vocab_size=203)
    return tiny_moe(model_type, num_hidden_layers=4)  # 8 experts: 4 per EP rank


@pytest.mark.parametrize("model_type,layout", [
    ("gpt", ["--tp", "2", "--pp", "2"]), ("llama", ["--tp", "2", "--pp", "2"]),
    ("mixtral", ["--ep", "2", "--pp", "2"]), ("qwen2_moe", ["--ep", "2", "--pp", "2"]),
    ("deepseek_v3", ["--tp", "2", "--pp", "2"]), ("qwen3", ["--tp", "2", "--pp", "2"]),
    ("qwen3_moe", ["--tp", "2", "--pp", "2", "--ep", "2", "--sequence-parallel"])])
def test_hf_to_megalite_sharded_to_hf_gives_identical_logits(tmp_path, model_type, layout):
    """HF -> megalite (TP2 x PP2, EP2 x PP2 for MoE, TP2 x PP2 x EP2 for Qwen3-MoE on 8
    ranks) -> HF: bit-identical logits."""
    from transformers import AutoModelForCausalLM
    hf = _tiny_hf(model_type).eval()
    hf.save_pretrained(tmp_path / "hf")
    convert("--direction", "hf-to-megalite", "--model-type", model_type, "--input",
            str(tmp_path / "hf"), "--output", str(tmp_path / "ml"), "--target-pp", "2",
            *(["--target-tp", "2"] if "--tp" in layout else []))
    world = 8 if "--tp" in layout and "--ep" in layout else 4
    run_on_ranks(world, _load_and_save_sharded, str(tmp_path / "ml"), str(tmp_path / "ml2"),
                 layout)
    if "--ep" in layout:  # each of the 4 ranks (2 stages x 2 EP ranks) wrote its own experts
        index = json.load(open(next(tmp_path.glob("ml2/iter_*/index.json"))))
        assert len({piece[0] for name, entry in index["model"].items()
                    if ".local_experts." in name for piece in entry["pieces"]}) == world
    convert("--direction", "megalite-to-hf", "--model-type", model_type, "--input",
            str(tmp_path / "ml2"), "--output", str(tmp_path / "hf2"))
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "hf2",
                                                attn_implementation="eager").eval()
    for param in back.parameters():  # out of the loader's buffers: Mixtral's grouped experts
        param.data = param.data.clone()  # round differently on differently aligned memory
    tokens = torch.randint(0, 203, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(back(tokens).logits, hf(tokens).logits)


def node_gpus(node: int, per_node: int, nodes: int) -> str:
    """CUDA_VISIBLE_DEVICES of one fake node on this machine: its own `per_node` of the GPUs
    this process sees, or none (CPU + gloo) unless every rank of the job has a GPU."""
    if not on_gpus(per_node * nodes):
        return ""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(per_node * nodes)]
    return ",".join(ids[node * per_node:(node + 1) * per_node])


def test_two_launcher_nodes_form_one_4_rank_job(tmp_path):
    """2 nodes x 2 ranks: each node one pipeline stage (its TP pair), the stages' activations
    and gradients crossing between the nodes."""
    prefix = make_dataset(str(tmp_path))
    args = tiny_args(prefix, str(tmp_path / "ck"), 3, "--tp", "2", "--pp", "2",
                     "--log-interval", "1")
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "NNODES": "2", "GPUS_PER_NODE": "2"}
    nodes = [subprocess.Popen(["bash", "tools/run_multinode.sh", *args], cwd=ROOT,
                              env={**env, "NODE_RANK": str(rank),
                                   "CUDA_VISIBLE_DEVICES": node_gpus(rank, 2, 2)},
                              stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    try:
        outputs = [node.communicate(timeout=240)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert "world 4 = TP 2 x PP 2 x DP 1" in outputs[0], outputs[0]
    assert "iteration      3/     3" in outputs[0], outputs[0]
    assert checkpoint.latest_iteration(str(tmp_path / "ck")) == 3
