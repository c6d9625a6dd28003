"""Ring attention over the context-parallel group, load-balanced for causal masks.

Each CP rank holds q, k, v for its two chunks (r and 2 cp - 1 - r, see
megalite.mpu.context_parallel). In cp steps the K/V blocks travel around the ring (one
batched send to the next rank and receive from the previous, posted before the step's
block is computed, waited for after); partial results are merged with the log-sum-exp
rule. Backward recomputes each block's probabilities from the saved log-sum-exp and
passes dK/dV around the ring with the K/V they belong to; a last send returns them home.

Which (q rows, kv rows, mask) a step computes is data (`block_plan`): with a causal mask,
step 0 is the causal local block, a block from an earlier rank is seen whole by all local
rows against its first chunk, a block from a later rank only by the second local chunk -
so every rank computes the same number of scores. `attention_work` counts them. Packed
documents: each block is also masked to the pairs of one document (a row may then see no
key of a block; every row sees itself at step 0, so its log-sum-exp stays finite).
"""
from collections import Counter
from dataclasses import dataclass

import torch

from megalite.mpu import comm
from megalite.mpu.context_parallel import chunk_positions
from megalite.mpu.document_mask import DocumentMask

attention_work: Counter = Counter()  # q x k scores computed in forward, per CP rank


@dataclass(frozen=True)
class Block:
    """Local q rows and remote kv rows one step computes (slices of the two chunks)."""

    q: slice
    kv: slice
    causal: bool


def block_plan(cp: int, rank: int, local: int, causal: bool) -> list[Block]:
    """The block of each of the cp steps of rank `rank` (step i: the kv of rank rank - i),
    for `local` = s / cp tokens per rank."""
    half, whole = local // 2, slice(0, local)
    plan = []
    for step in range(cp):
        source = (rank - step) % cp
        if not causal:
            plan.append(Block(whole, whole, False))
        elif step == 0:
            plan.append(Block(whole, whole, True))
        elif source < rank:  # its first chunk precedes both of mine, its second follows both
            plan.append(Block(whole, slice(0, half), False))
        else:  # both of its chunks lie between my first and my second chunk
            plan.append(Block(slice(half, local), whole, False))
    return plan


def _repeat(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x.repeat_interleave(heads // x.shape[1], dim=1) if x.shape[1] != heads else x


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool,
            allowed: torch.Tensor | None) -> torch.Tensor:
    """[b, heads, sq, sk] fp32 scaled scores, -inf above the diagonal when causal and where
    `allowed` [b, 1, sq, sk] (a document mask's block) is False."""
    scores = torch.matmul(q.float(), _repeat(k, q.shape[1]).float().transpose(-1, -2)) * scale
    if allowed is not None:
        scores.masked_fill_(~allowed, float("-inf"))
    elif causal:
        scores.masked_fill_(torch.ones(scores.shape[-2:], dtype=torch.bool,
                                       device=q.device).triu(1), float("-inf"))
    return scores


def _allowed(documents: DocumentMask | None, cp: int, rank: int, step: int,
             block: Block) -> torch.Tensor | None:
    """The document mask of one step's block [b, 1, sq, sk] (None without documents): the
    local rows of `block.q` against the rows `block.kv` of the rank `step` places back."""
    if documents is None:
        return None
    s, device = documents.document_ids.shape[1], documents.document_ids.device
    q_positions = chunk_positions(s, cp, rank, device)[block.q]
    k_positions = chunk_positions(s, cp, (rank - step) % cp, device)[block.kv]
    return documents.block(q_positions, k_positions)


def _fold(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """[b, heads, s, d] -> [b, groups, s, d]: sum the heads that share a KV group."""
    b, heads, s, d = grad.shape
    return grad.view(b, groups, heads // groups, s, d).sum(2)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, group, scale, document_ids):
        cp, rank = comm.world_size(group), torch.distributed.get_rank(group)
        ranks = torch.distributed.get_process_group_ranks(group)
        nxt, prev = ranks[(rank + 1) % cp], ranks[(rank - 1) % cp]
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        plan = block_plan(cp, rank, q.shape[2], causal)
        documents = None if document_ids is None else DocumentMask(document_ids)
        out = q.new_zeros(*q.shape[:3], v.shape[-1], dtype=torch.float32)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        kv, dk = torch.cat([k, v], dim=-1), k.shape[-1]  # one message; k and v widths may differ
        for step, block in enumerate(plan):
            incoming = torch.empty_like(kv)
            works = comm.batch_send_recv([("send", kv, nxt), ("recv", incoming, prev)], group) \
                if step < cp - 1 else []
            scores = _scores(q[:, :, block.q], kv[..., :dk][:, :, block.kv], scale, block.causal,
                             _allowed(documents, cp, rank, step, block))
            attention_work[rank] += scores.shape[-2] * scores.shape[-1]
            block_lse = scores.logsumexp(-1)  # -inf: a row that sees no key of this block
            finite_lse = block_lse.masked_fill(block_lse == float("-inf"), 0.0)
            block_out = torch.matmul(torch.exp(scores - finite_lse.unsqueeze(-1)),
                                     _repeat(kv[..., dk:][:, :, block.kv], q.shape[1]).float())
            new_lse = torch.logaddexp(lse[:, :, block.q], block_lse)
            out[:, :, block.q] = (out[:, :, block.q] * (lse[:, :, block.q] - new_lse).exp()
                                  .unsqueeze(-1)
                                  + block_out * (block_lse - new_lse).exp().unsqueeze(-1))
            lse[:, :, block.q] = new_lse
            for work in works:
                work.wait()
            kv = incoming
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.group, ctx.peers, ctx.scale = causal, group, (nxt, prev), scale
        ctx.documents = documents
        return out.to(v.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, (nxt, prev), scale = ctx.group, ctx.peers, ctx.scale
        cp, rank = comm.world_size(group), torch.distributed.get_rank(group)
        dout = dout.float()
        delta = (dout * out).sum(-1)  # [b, heads, sq]
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv, dk = torch.cat([k, v], dim=-1), k.shape[-1]
        total = None  # dK/dV of the block computed in the previous step, summed so far
        for step, block in enumerate(block_plan(cp, rank, q.shape[2], ctx.causal)):
            incoming, partial = torch.empty_like(kv), None
            ops = [("send", kv, nxt), ("recv", incoming, prev)] if step < cp - 1 else []
            if step > 0:
                partial = torch.empty(kv.shape, dtype=torch.float32, device=kv.device)
                ops += [("send", total, nxt), ("recv", partial, prev)]
            works = comm.batch_send_recv(ops, group) if ops else []
            kvb = kv[:, :, block.kv]
            qb, kb, vb = q[:, :, block.q], kvb[..., :dk], kvb[..., dk:]
            allowed = _allowed(ctx.documents, cp, rank, step, block)
            probs = torch.exp(_scores(qb, kb, scale, block.causal, allowed)
                              - lse[:, :, block.q].unsqueeze(-1))
            dout_b = dout[:, :, block.q]
            dprobs = torch.matmul(dout_b, _repeat(vb, q.shape[1]).float().transpose(-1, -2))
            dscores = probs * (dprobs - delta[:, :, block.q].unsqueeze(-1)) * scale
            dq[:, :, block.q] += torch.matmul(dscores, _repeat(kb, q.shape[1]).float())
            contribution = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            contribution[..., :dk][:, :, block.kv] = _fold(
                torch.matmul(dscores.transpose(-1, -2), qb.float()), k.shape[1])
            contribution[..., dk:][:, :, block.kv] = _fold(
                torch.matmul(probs.transpose(-1, -2), dout_b), k.shape[1])
            for work in works:
                work.wait()
            total = contribution if partial is None else partial + contribution
            kv = incoming
        if cp > 1:  # the last block's dK/dV belong to the next rank; mine arrive from the previous
            home = torch.empty_like(total)
            for work in comm.batch_send_recv([("send", total, nxt), ("recv", home, prev)], group):
                work.wait()
            total = home
        return (dq.to(q.dtype), total[..., :dk].to(k.dtype), total[..., dk:].to(v.dtype), None,
                None, None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                   group, scale: float | None = None,
                   document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention of this CP rank's q [b, heads, s/cp, d] over the whole sequence's
    k [b, groups, s/cp, d], v [b, groups, s/cp, dv] per rank (ring on the CP `group`) ->
    [b, heads, s/cp, dv]. Scale `scale`, default 1/sqrt(d) as SDPA; heads/groups query heads
    share a KV group; k and v travel as one [.., d + dv] message. `document_ids` [b, s] of
    the whole sequence (packed documents, with `causal`): attend within a document only."""
    return _RingAttention.apply(q, k, v, causal, group, scale, document_ids)
