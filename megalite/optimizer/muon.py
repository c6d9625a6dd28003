"""Muon (`--optimizer muon`): momentum orthogonalised by a Newton-Schulz iteration for the 2-D
hidden weights, AdamW for the rest (embeddings, output layer, norms, biases).

Per hidden weight W (m x n) and step, as torch.optim.Muon and Megatron-core's Muon:

    B <- mu B + (1 - mu) G                          (momentum_buffer, per element)
    U <- (1 - mu) G + mu B  (Nesterov), else B
    O <- NS_k(U)            k Newton-Schulz iterations on U / ||U||_F (bf16 operands, as
                            torch.optim.Muon; fp32 with --muon-fp32-matmul-prec high/highest)
    W <- (1 - lr wd) W - lr s O    s: --muon-scale-mode of (m, n) x --muon-extra-scale-factor

Newton-Schulz needs the whole matrix, so the elementwise momentum runs on this rank's piece
(its fragment) and the update is assembled before orthogonalising ("duplicated", as Megatron's
--muon-tp-mode duplicated): the DP pieces (ZeRO-1 ranges of the flat buffer, ZeRO-2/3 FSDP row
shards) are summed into the TP-local matrix by one all-reduce of zero-filled pieces over the
DP group per group; the TP shards are all-gathered over the TP group
(`gather_tensor_parallel`). Every rank then orthogonalises the whole matrix and keeps its own
piece. A fused weight (`fused_matrices = (blocks, parts)`: QKV as [head: q, k, v], the GQA
key_value as [group: k, v], SwiGLU's [gate; up]) is orthogonalised as its `parts` separate
matrices, all heads of one part together, as Megatron's split_qkv does; each part is scaled
by its own shape.
"""
import math
from collections.abc import Callable
from dataclasses import dataclass
from itertools import cycle, islice

import torch
from torch import nn

from megalite.device import current_device
from megalite.mpu import comm
from megalite.mpu.layers import gather_tensor_parallel, shard_tensor_parallel

EPS = 1e-7  # ||U|| clamp, torch.optim.Muon's
COEFFICIENTS = {  # (a, b, c) per iteration, cycled (Megatron / emerging_optimizers' sets)
    "simple": [(3.4445, -4.7750, 2.0315)],  # torch.optim.Muon's
    "quintic": [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377),
                (3.7418, -5.5913, 2.3037), (2.8769, -3.1427, 1.2046),
                (2.8366, -3.0525, 1.2012)],
    "polar_express": [(8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184),
                      (3.9096, -2.8234, 0.5250), (3.2856, -2.4153, 0.4853),
                      (2.2779, -1.6198, 0.3985), (1.8726, -1.2307, 0.3585),
                      (1.8564, -1.2132, 0.3568), (1.8750, -1.2500, 0.3750)],
}


def newton_schulz(matrix: torch.Tensor, coefficients: list[tuple[float, float, float]],
                  steps: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The orthogonalised [m, n] `matrix` (in `dtype`): `steps` quintic iterations X <- aX +
    (bA + cA^2)X, A = XX^T, on the wide orientation, from X = matrix / ||matrix||_F."""
    x = matrix.to(dtype)
    tall = matrix.size(0) > matrix.size(1)
    if tall:
        x = x.T
    x = x.div(x.norm().clamp(min=EPS))
    for a, b, c in islice(cycle(coefficients), steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def scale_factor(rows: int, cols: int, mode: str, extra: float) -> float:
    """The update scale of a rows x cols matrix (--muon-scale-mode, Megatron's modes)."""
    base = {"spectral": math.sqrt(max(rows, cols)), "unit_rms_norm": math.sqrt(rows / cols),
            "shape_scaling": math.sqrt(max(1.0, rows / cols))}[mode]
    return extra * base


def split_fused(full: torch.Tensor, fused: tuple[int, int]) -> list[torch.Tensor]:
    """[blocks * parts * r, n] laid out [block: part 0, part 1, ...] -> `parts` [blocks * r, n]."""
    blocks, parts = fused
    grid = full.reshape(blocks, parts, -1, full.shape[1])
    return [grid[:, i].reshape(-1, full.shape[1]) for i in range(parts)]


def join_fused(parts: list[torch.Tensor], fused: tuple[int, int]) -> torch.Tensor:
    """Inverse of split_fused."""
    blocks, cols = fused[0], parts[0].shape[1]
    return torch.stack([p.reshape(blocks, -1, cols) for p in parts], dim=1).reshape(-1, cols)


def orthogonalize(full: torch.Tensor, fused: tuple[int, int], group: dict
                  ) -> tuple[torch.Tensor, float]:
    """(NS of each part of the whole `full` [m, n], joined; the parts' scale: they share a
    shape)."""
    parts = split_fused(full, fused)
    coefficients = COEFFICIENTS[group["coefficient_type"]]
    dtype = torch.bfloat16 if group["fp32_matmul_prec"] == "medium" else torch.float32
    ortho = [newton_schulz(p, coefficients, group["ns_steps"], dtype) for p in parts]
    scale = scale_factor(*parts[0].shape, group["scale_mode"], group["extra_scale_factor"])
    return join_fused(ortho, fused), scale


def is_hidden_matrix(param: nn.Parameter) -> bool:
    """Muon steps it: 2-D, not an embedding or the output layer."""
    return param.ndim == 2 and not getattr(param, "is_embedding_or_output_parameter", False)


def muon_param_groups(fragments: list, config) -> list[dict]:
    """Three groups of the fragments' main params: Muon's (the hidden matrices), AdamW's with
    weight decay (embeddings, output layer), AdamW's without (1-D: biases, norms)."""
    muon = [f.main for f in fragments if is_hidden_matrix(f.model_param)]
    taken = {id(p) for p in muon}
    return [{"params": muon, "weight_decay": config.weight_decay, "muon": True},
            {"params": [f.main for f in fragments
                        if f.model_param.ndim > 1 and id(f.main) not in taken],
             "weight_decay": config.weight_decay},
            {"params": [f.main for f in fragments if f.model_param.ndim <= 1],
             "weight_decay": 0.0}]


@dataclass
class Matrix:
    """One hidden weight of this rank's chunks: the parameter (TP-local shape), the DP group
    its fragments are split over (None: stepped whole here) and this rank's pieces of it
    (main param, flat offset in the TP-local weight); none when another DP rank owns it all."""

    param: nn.Parameter
    group: object
    pieces: list[tuple[torch.Tensor, int]]


class Muon(torch.optim.Optimizer):
    """Muon on the groups marked {"muon": True}, AdamW (built by `build_adamw`,
    sharing this optimizer's state and groups, so one state_dict holds both) on the others.

    Built alone it orthogonalises each Muon tensor as it is (2-D); `attach(owner)` (a
    MixedPrecisionOptimizer) makes it assemble each weight whole over DP and TP first (see the
    module docstring).
    """

    def __init__(self, groups: list[dict], config,
                 build_adamw: Callable[[list[dict], object], torch.optim.Optimizer]) -> None:
        muon_defaults = dict(momentum=config.muon_momentum, nesterov=config.muon_nesterov,
                             ns_steps=config.muon_num_ns_steps,
                             coefficient_type=config.muon_coefficient_type,
                             scale_mode=config.muon_scale_mode,
                             fp32_matmul_prec=config.muon_fp32_matmul_prec,
                             extra_scale_factor=config.muon_extra_scale_factor)
        muon = [{**muon_defaults, "lr": config.lr, **g} for g in groups if g.get("muon")]
        self._adamw = build_adamw([g for g in groups if not g.get("muon")], config)
        super().__init__(muon + self._adamw.param_groups, {})
        self._share_with_adamw()
        self.matrices: list[Matrix] | None = None

    def _share_with_adamw(self) -> None:
        self._adamw.param_groups = [g for g in self.param_groups if not g.get("muon")]
        self._adamw.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._share_with_adamw()  # loading replaced the groups and the state

    @staticmethod
    def attach(optimizer: "Muon", owner) -> None:
        """Read from `owner` (its `param_shards()`: every trainable parameter of the rank's
        chunks in one order over DP, with the DP group its fragments are split over; its
        `fragments`) where each hidden weight's pieces are."""
        mine = {id(p) for g in optimizer.param_groups if g.get("muon") for p in g["params"]}
        pieces: dict[int, list] = {}
        for f in owner.fragments:
            if id(f.main) in mine:
                pieces.setdefault(id(f.model_param), []).append((f.main, f.offset))
        optimizer.matrices = [Matrix(p, group, pieces.get(id(p), []))
                              for p, group in owner.param_shards() if is_hidden_matrix(p)]

    @torch.no_grad()
    def step(self, closure=None) -> None:
        """AdamW's step on its groups, then Muon's (see the module docstring)."""
        assert closure is None, "Muon takes no closure"
        self._adamw.step()
        for group in self.param_groups:
            if not group.get("muon"):
                continue
            updates = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                buf.lerp_(p.grad, 1 - group["momentum"])
                updates[p] = p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
            for p, (ortho, scale) in self._orthogonalized(updates, group).items():
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(ortho.view_as(p), alpha=-group["lr"] * scale)

    def _orthogonalized(self, updates: dict, group: dict) -> dict:
        """{param: (its piece of the orthogonalised whole weight; the scale)}."""
        if self.matrices is None:  # built alone: every tensor is a whole weight
            return {p: orthogonalize(u, getattr(p, "fused_matrices", (1, 1)), group)
                    for p, u in updates.items()}
        result = {}
        for matrix, local in zip(self.matrices, self._tp_local_updates(updates)):
            full = gather_tensor_parallel(local, matrix.param)
            ortho, scale = orthogonalize(full, getattr(matrix.param, "fused_matrices", (1, 1)),
                                         group)
            flat = shard_tensor_parallel(ortho, matrix.param).reshape(-1)
            for main, offset in matrix.pieces:
                if main in updates:
                    result[main] = (flat[offset:offset + main.numel()].to(main.device), scale)
        return result

    def _tp_local_updates(self, updates: dict) -> list[torch.Tensor]:
        """Each matrix's TP-local update, fp32 [rows, cols] on the device: its pieces placed
        in zeros and, per DP group, summed over it by one all-reduce."""
        by_group: dict[object, list[int]] = {}
        for i, matrix in enumerate(self.matrices):
            by_group.setdefault(matrix.group, []).append(i)
        local: list[torch.Tensor | None] = [None] * len(self.matrices)
        for group, indices in by_group.items():
            sizes = [self.matrices[i].param.numel() for i in indices]
            flat = torch.zeros(sum(sizes), dtype=torch.float32, device=current_device())
            views = flat.split(sizes)
            for i, view in zip(indices, views):
                for main, offset in self.matrices[i].pieces:
                    if main in updates:
                        view[offset:offset + main.numel()] = updates[main].reshape(-1)
            comm.all_reduce(flat, group)
            for i, view in zip(indices, views):
                local[i] = view.view(self.matrices[i].param.shape)
        return local
