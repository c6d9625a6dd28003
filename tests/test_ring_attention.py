"""Ring attention at CP in {2, 4, 8} vs SDPA on the whole sequence in one process.

Every rank builds the same q, k, v [b, heads, s, d] (GQA: 4 heads, 2 KV groups) on its
device, runs
F.scaled_dot_product_attention on the whole sequence as the reference, and ring attention
on its own load-balanced chunks (r and 2 cp - 1 - r): output and dQ/dK/dV of its tokens
within 1e-5 relative, causal and not. Also checked: the chunk assignment as data, the
scores each rank computes (equal on all ranks, the closed form), and the ring's bytes per
call (forward (cp - 1) 2 (s/cp) b g d elements sent, backward (2 cp - 1) of them).
"""
import torch
import torch.nn.functional as F

from megalite.device import current_device
from megalite.mpu import comm, initialize_model_parallel
from megalite.mpu import parallel_state as ps
from megalite.mpu.context_parallel import chunk_positions
from megalite.mpu.ring_attention import attention_work, ring_attention
from tests.helpers.multirank import run_on_ranks
from tests.helpers.reference import rel_err

B, HEADS, GROUPS, SEQ, D = 2, 4, 2, 32, 8


def _case(cp: int, causal: bool) -> dict:
    initialize_model_parallel(1, 1, context_parallel_size=cp)
    gen, dev = torch.Generator().manual_seed(cp + 10 * causal), current_device()
    q, k, v = (torch.randn(B, n, SEQ, D, generator=gen).to(dev) for n in (HEADS, GROUPS, GROUPS))
    dout = torch.randn(B, HEADS, SEQ, D, generator=gen).to(dev)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=causal, enable_gqa=True)
    ref.backward(dout)
    index = chunk_positions(SEQ, cp, ps.get_context_parallel_rank(), device=dev)
    local = [t[:, :, index].clone().requires_grad_() for t in (q, k, v)]
    attention_work.clear()
    with comm.count_bytes() as forward_bytes:
        out = ring_attention(*local, causal, ps.get_context_parallel_group())
    with comm.count_bytes() as backward_bytes:
        out.backward(dout[:, :, index])
    errors = {"out": rel_err(out, ref[:, :, index])}
    for name, mine, theirs in zip("qkv", local, full):
        errors["d" + name] = rel_err(mine.grad, theirs.grad[:, :, index])
    return {"errors": errors, "work": sum(attention_work.values()),
            "forward sent": forward_bytes["send"], "backward sent": backward_bytes["send"]}


def _all_cases() -> dict:
    return {(cp, causal): _case(cp, causal) for cp in (2, 4, 8) for causal in (True, False)}


def test_chunk_assignment_is_r_and_mirror():
    assert chunk_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert chunk_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    every = torch.cat([chunk_positions(24, 3, r) for r in range(3)])
    assert sorted(every.tolist()) == list(range(24))
    assert chunk_positions(24, 3, 2).tolist() == list(range(8, 12)) + list(range(12, 16))


def test_ring_attention_matches_sdpa_balanced_and_counted():
    results = run_on_ranks(8, _all_cases)
    for (cp, causal), result in results[0].items():
        local = SEQ // cp
        kv_bytes = 2 * local * B * GROUPS * D * 4
        for rank, per_rank in enumerate(results):
            r = per_rank[(cp, causal)]
            assert max(r["errors"].values()) < 1e-5, (cp, causal, rank, r["errors"])
            # causal: the local causal block, then cp - 1 half blocks; else cp whole blocks
            want = local * local * (1 + (cp - 1) / 2 if causal else cp)
            assert r["work"] == want, (cp, causal, rank, r["work"], want)
            assert r["forward sent"] == (cp - 1) * kv_bytes, (cp, r)
            assert r["backward sent"] == (2 * cp - 1) * kv_bytes, (cp, r)
    print({key: max(max(p[key]["errors"].values()) for p in results) for key in results[0]})
