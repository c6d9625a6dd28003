"""Tiny random Mixtral, Qwen2-MoE (shared expert, QKV bias) and Qwen3-MoE (per-head q/k norms,
head dim 12, a dense first layer) vs transformers with the same weights, trained through
megalite's own step (DDP buffers, expert grads over the expert-data-parallel group, pipeline
schedule, AdamW) at one rank, EP2 x TP2 (+SP), EP2 x PP2 (4 ranks) and EP4 x DP2 (8 ranks),
fp32: the first loss, every gradient (renamed to megalite's names from
the HF grads, gathered over TP) and the losses after three AdamW steps agree. The batch is
split over DP ranks, so the expert grads sum other ranks' tokens through the all-to-all.
transformers' side (the model's config and initial weights too) is computed once per family
in this process and sent to the ranks."""
import pytest
import torch

from megalite.config import parse_configs
from megalite.device import current_device
from megalite.distributed.finalize import finalize_model_grads
from megalite.hf import FAMILIES
from megalite.hf.moe import moe_to_megalite
from megalite.layout import RunLayout
from megalite.models import GPTModel
from megalite.models.sharding import load_full_state_dict
from megalite.mpu import parallel_state as ps
from megalite.mpu.layers import gather_tensor_parallel
from megalite.training.loop import run_schedule, train_step
from megalite.training.setup import build_model, setup_parallel
from tests.helpers.multirank import run_on_ranks
from tests.helpers.reference import hf_token_loss, random_hf_model, rel_err

VOCAB, SEQ, BATCH = 203, 10, 8
# world size -> [(tp, pp, ep)]
LAYOUTS = {1: [(1, 1, 1)], 4: [(2, 1, 2), (1, 2, 2)], 8: [(1, 1, 4)]}
FAMILIES_UNDER_TEST = ("mixtral", "qwen2_moe", "qwen3_moe")


def tiny_moe(family: str, seed: int = 0, **overrides):
    """A random transformers Mixtral / Qwen2-MoE / Qwen3-MoE (no download); norm weights away
    from 1."""
    from transformers import (MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig,
                              Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)
    kw = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=32, num_experts_per_tok=2,
              rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    if family == "mixtral":
        cfg = MixtralConfig(intermediate_size=40, num_local_experts=8, **{**kw, **overrides})
        cls = MixtralForCausalLM
    elif family == "qwen3_moe":
        cfg = Qwen3MoeConfig(**{**kw, "head_dim": 12, "intermediate_size": 48,
                                "moe_intermediate_size": 32, "num_experts": 8,
                                "norm_topk_prob": True, "mlp_only_layers": [0], **overrides})
        cls = Qwen3MoeForCausalLM
    else:
        cfg = Qwen2MoeConfig(intermediate_size=48, moe_intermediate_size=24,
                             shared_expert_intermediate_size=40, num_experts=8,
                             **{**kw, **overrides})
        cls = Qwen2MoeForCausalLM
    return random_hf_model(cls, cfg, seed)


def _forward_step(data_iterator, model):
    tokens = next(data_iterator)
    return model(tokens[:, :-1], tokens[:, 1:]), lambda loss: (loss.mean(), {"lm loss":
                                                                           loss.mean().detach()})


def _tokens() -> torch.Tensor:
    """The batch [BATCH, SEQ + 1], on the CPU (transformers' input; megalite's rows move to
    its device)."""
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1),
                         device="cpu")


def _model_config(hf_config):
    """megalite's ModelConfig of a tiny_moe model's config."""
    config = FAMILIES[hf_config.model_type].config_from_hf(hf_config)
    config.max_position_embeddings = 32
    return config


def _reference(family: str, steps: int = 3) -> dict:
    """transformers' side, computed once (not on every rank of every layout): the model's
    config and initial weights (megalite's names), the first loss, its grads (renamed) and the
    losses of the `steps` AdamW steps after the first."""
    hf = tiny_moe(family)
    config = _model_config(hf.config)
    weights = moe_to_megalite({n: t.clone() for n, t in hf.state_dict().items()}, config)
    tokens = _tokens()
    loss = hf_token_loss(hf, tokens)
    loss.backward()
    grads = moe_to_megalite({n: p.grad for n, p in hf.named_parameters()}, config)
    ref_opt = torch.optim.AdamW(
        [{"params": [p for p in hf.parameters() if p.ndim > 1], "weight_decay": 0.01},
         {"params": [p for p in hf.parameters() if p.ndim <= 1], "weight_decay": 0.0}],
        lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    ref_opt.step()
    step_losses = []
    for _ in range(steps):
        ref_opt.zero_grad()
        step_loss = hf_token_loss(hf, tokens)
        step_loss.backward()
        ref_opt.step()
        step_losses.append(step_loss.item())
    return {"config": hf.config, "weights": weights, "loss": loss.detach(), "grads": grads,
            "steps": step_losses}


def _parity(reference: dict, tp: int, pp: int, ep: int) -> dict:
    sp = ["--sequence-parallel"] if tp > 1 else []  # needed with TP and EP (Megatron's rule)
    configs = parse_configs(["--tp", str(tp), "--pp", str(pp), "--ep", str(ep), *sp,
                             "--micro-batch-size", "1", "--global-batch-size", str(BATCH),
                             "--seq-length", str(SEQ), "--clip-grad", "0", "--lr", "1e-3",
                             "--lr-decay-style", "constant", "--train-iters", "10"])
    configs.model = _model_config(reference["config"])
    layout = RunLayout.from_configs(configs, torch.distributed.get_world_size())
    setup_parallel(configs, layout)
    model = build_model(configs, lambda pre_process, post_process: GPTModel(
        configs.model, pre_process=pre_process, post_process=post_process,
        device=current_device()))
    load_full_state_dict(model, reference["weights"])
    from megalite.optimizer import get_optimizer
    optimizer, _ = get_optimizer(configs.optimizer, configs.precision, model, 10)
    tokens = _tokens()
    dp, d, dev = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank(), current_device()

    def batches():
        return iter([row[None].to(dev) for row in tokens[d::dp]])
    # step 1 by hand, to compare the grads before the update
    for chunk in model:
        chunk.zero_grad_buffer()
    losses = run_schedule(_forward_step, batches(), model, layout, forward_only=False)
    finalize_model_grads(model)
    grad_errors = {name: rel_err(gather_tensor_parallel(p.main_grad, p),
                                 reference["grads"][name])
                   for chunk in model for name, p in chunk.module.named_parameters()}
    loss = torch.stack([x["lm loss"] for x in losses]).mean()
    torch.distributed.all_reduce(loss, group=ps.get_data_parallel_group())
    errors = {"loss": rel_err(loss / dp, reference["loss"]), "grad": max(grad_errors.values()),
              "params": len(grad_errors)}
    optimizer.step()
    errors["steps"] = []
    for ref_loss in reference["steps"]:
        loss, _, _ = train_step(_forward_step, batches(), model, optimizer, layout)
        errors["steps"].append(abs(loss - ref_loss) / abs(ref_loss))
    return errors


def _both_families(layouts: list[tuple[int, int, int]], references: dict) -> dict:
    return {(family, layout): _parity(references[family], *layout)
            for family in FAMILIES_UNDER_TEST for layout in layouts}


@pytest.fixture(scope="module")
def references() -> dict:
    return {family: _reference(family) for family in FAMILIES_UNDER_TEST}


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_moe_models_match_transformers_under_expert_parallelism(world, references):
    results = run_on_ranks(world, _both_families, LAYOUTS[world], references)
    for rank, per_rank in enumerate(results):
        for key, e in per_rank.items():
            assert e["loss"] < 1e-5 and e["grad"] < 1e-4, (rank, key, e)
            assert len(e["steps"]) == 3 and max(e["steps"]) < 1e-5, (rank, key, e)
    print({k: (e["loss"], e["grad"], max(e["steps"])) for k, e in results[0].items()})
