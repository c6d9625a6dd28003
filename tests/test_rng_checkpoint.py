"""Model-parallel RNG: dropout inside TP regions differs across TP ranks, outside agrees;
activation checkpointing with dropout on reproduces the masks (identical gradients)."""
import torch
import torch.nn.functional as F

from megalite.config import ModelConfig
from megalite.device import current_device
from megalite.models import GPTModel
from megalite.mpu import get_rng_tracker, initialize_model_parallel, model_parallel_seed
from megalite.mpu import parallel_state as ps
from megalite.mpu.comm import all_gather_stacked
from tests.helpers.multirank import run_on_ranks


def _masks_across_tp() -> tuple[bool, bool]:
    initialize_model_parallel(2, 1)
    model_parallel_seed(5, ps.get_tensor_model_parallel_rank())
    ones = torch.ones(4096, device=current_device())
    outside = F.dropout(ones, 0.5)
    with get_rng_tracker().fork():
        inside = F.dropout(ones, 0.5)
    group = ps.get_tensor_model_parallel_group()
    outside_all, inside_all = all_gather_stacked(outside, group), all_gather_stacked(inside, group)
    return torch.equal(outside_all[0], outside_all[1]), torch.equal(inside_all[0], inside_all[1])


def test_dropout_masks_inside_differ_outside_agree():
    for outside_equal, inside_equal in run_on_ranks(2, _masks_across_tp):
        assert outside_equal and not inside_equal


def _attention_dropout_differs_per_rank() -> bool:
    """The attention core's dropout draws from the TP stream: per-rank heads get own masks."""
    initialize_model_parallel(2, 1)
    model_parallel_seed(5, ps.get_tensor_model_parallel_rank())
    from megalite.mpu import ParallelAttention
    attn = ParallelAttention(hidden_size=16, num_attention_heads=2, attention_dropout=0.5,
                             device=current_device()).train()
    q = torch.ones(1, 1, 64, 8, device=current_device())  # identical inputs on both ranks
    out = attn.core_attention(q, q, q, None)
    both = all_gather_stacked(out, ps.get_tensor_model_parallel_group())
    return torch.equal(both[0], both[1])


def test_attention_dropout_uses_tp_stream():
    assert run_on_ranks(2, _attention_dropout_differs_per_rank) == [False, False]


def _grads_with_recompute(granularity: str | None, method: str = "uniform", n: int = 1,
                          seed: int = 11) -> dict[str, torch.Tensor]:
    config = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=97,
                         max_position_embeddings=16, hidden_dropout=0.2, attention_dropout=0.2,
                         recompute_granularity=granularity, recompute_method=method,
                         recompute_num_layers=n)
    model_parallel_seed(seed, ps.get_tensor_model_parallel_rank())
    model = GPTModel(config, device=current_device()).train()
    tokens = torch.randint(0, 97, (2, 13),
                           generator=torch.Generator().manual_seed(3)).to(current_device())
    model(tokens[:, :-1], tokens[:, 1:]).mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _recompute_matches() -> list[tuple[str, float]]:
    initialize_model_parallel(2, 1)
    base = _grads_with_recompute(None)
    results = []
    for args in (("full", "uniform", 1), ("full", "uniform", 2), ("full", "block", 3),
                 ("selective",)):
        grads = _grads_with_recompute(*args)
        worst = max((grads[n] - g).abs().max().item() for n, g in base.items())
        results.append((str(args), worst))
    return results


def test_checkpointing_with_dropout_gives_identical_grads():
    for results in run_on_ranks(2, _recompute_matches):
        for name, worst in results:
            assert worst == 0.0, (name, worst)


def test_dropout_is_active_in_recompute_test():
    """Guard for the test above: with dropout on, another RNG seed changes the grads."""
    a, b = _grads_with_recompute(None, seed=11), _grads_with_recompute(None, seed=12)
    assert any(not torch.equal(a[n], b[n]) for n in a)
