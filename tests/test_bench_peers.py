"""benchmarks/bench_peers.py cannot rot: its megalite side (ZeRO-2 with offload and TP 2: the
grad buffer, the distributed optimizer, tensor parallelism) runs on the tests' 2-rank pool with
a tiny model, and the Megatron-core weight mapping it uses is checked against the transformers
layout."""
import sys
from pathlib import Path

import torch

from tests.helpers.multirank import run_on_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_peers  # noqa: E402

TINY = ["--quick", "--megalite-only", "--num-layers", "2", "--hidden-size", "32",
        "--num-attention-heads", "4", "--vocab-size", "64", "--seq-length", "16",
        "--micro-batch-size", "2", "--steps", "1", "--only", "zero2+offload", "tp2"]


def test_megalite_side_runs(capsys):
    bench_peers.main(TINY, run_on=run_on_ranks)
    rows = [line for line in capsys.readouterr().out.splitlines() if " vs - |" in line]
    assert [row.split()[1] for row in rows] == ["zero2+offload", "tp2"]


def test_megatron_core_qkv_is_interleaved_per_query_group():
    """Per TP rank, the rows of linear_qkv are [q heads of group g, k_g, v_g] for its groups."""
    heads, groups, head_dim, hidden = 4, 2, 3, 5
    q, k, v = (torch.arange(n * head_dim * hidden, dtype=torch.float32).view(-1, hidden) + base
               for n, base in ((heads, 0), (groups, 1000), (groups, 2000)))
    hf = {"model.embed_tokens.weight": torch.zeros(8, hidden), "model.norm.weight": q[0],
          "lm_head.weight": torch.zeros(8, hidden), "model.layers.0.self_attn.q_proj.weight": q,
          "model.layers.0.self_attn.k_proj.weight": k, "model.layers.0.self_attn.v_proj.weight": v,
          **{f"model.layers.0.{n}": torch.zeros(6, 6) for n in (
              "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
              "mlp.down_proj.weight")},
          "model.layers.0.input_layernorm.weight": q[0],
          "model.layers.0.post_attention_layernorm.weight": q[0]}
    for rank in (0, 1):
        qkv = bench_peers.mcore_state(hf, heads, groups, 2, rank)[
            "decoder.layers.0.self_attention.linear_qkv.weight"]
        d = head_dim
        assert torch.equal(qkv, torch.cat([q[2 * rank * d:(2 * rank + 2) * d],
                                           k[rank * d:(rank + 1) * d], v[rank * d:(rank + 1) * d]]))
