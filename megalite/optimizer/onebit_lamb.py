"""1-bit LAMB (`--optimizer onebit_lamb`; Li et al. 2021, arXiv 2104.06069, DeepSpeed's
OnebitLamb): LAMB for `--freeze-step` warm-up steps, then the variance frozen and the
momentum averaged over DP by the 1-bit compressed all-reduce, through the same
`MomentumReducer` as onebit_adam (megalite.optimizer.onebit): each param's grad is the mean
grad in the warm-up, the averaged momentum after it.

Per weight W (whole: its TP shards and ZeRO-1 fragments together), step t, F = freeze step,
m_hat = m / (1 - beta1^t):

    warm-up: m = lerp(m, g, 1 - beta1); v = beta2 v + (1 - beta2) g^2; v_fresh = v
        u = m_hat / (sqrt(v / (1 - beta2^t)) + eps) + wd W
        c = clamp(||W|| / ||u||, min_coeff, max_coeff) (1 where either norm is 0)
        c_freeze = coeff_beta c_freeze + (1 - coeff_beta) c;  W -= lr c u
    compressed: m_new = the averaged momentum; g' = (m_new - beta1 m) / (1 - beta1); m = m_new
        v_fresh = beta2 v_fresh + (1 - beta2) g'^2      (v stays frozen)
        d = sqrt(v / (1 - beta2^F)) + eps;  d_fresh = sqrt(v_fresh / (1 - beta2^t)) + eps
        p = m_hat / d;  u = p + wd W;  f = max over W of d / d_fresh
        with wd > 0: r = min(1, ||p|| / ||u||), f = r f + 1 - r
        f clamped to [factor_min, factor_max], then to last_f (1 -/+ factor_threshold)
        last_f = f;  W -= lr c_freeze f u

The norms and the max need whole weights: `attach` reads from the MixedPrecisionOptimizer
where each weight's fragments are; the partial sums are summed over the weight's DP group
(ZeRO-1) and over the TP group for TP-split weights, the max likewise (two all-reduces per
group and step). Built alone (no `attach`), every tensor is a whole weight.
"""
import torch
import torch.distributed as dist

from megalite.device import current_device
from megalite.mpu import comm
from megalite.mpu import parallel_state as ps

STATS = 3  # per weight: ||W||^2, ||u||^2, ||p||^2 (p: u without weight decay)


class OnebitLamb(torch.optim.Optimizer):
    """LAMB warm-up, then the compressed stage (module docstring). State per param: step,
    coeff_freeze and last_factor (float tensors, the same on every piece of a weight),
    exp_avg, exp_avg_sq, exp_avg_sq_fresh."""

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float,
                 freeze_step: int, max_coeff: float = 10.0, min_coeff: float = 0.01,
                 coeff_beta: float = 0.9, factor_max: float = 4.0, factor_min: float = 0.5,
                 factor_threshold: float = 0.1, weight_decay: float = 0.0) -> None:
        super().__init__(params, dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, freeze_step=freeze_step,
            max_coeff=max_coeff, min_coeff=min_coeff, coeff_beta=coeff_beta,
            factor_max=factor_max, factor_min=factor_min, factor_threshold=factor_threshold))
        self.slots: dict | None = None  # main param -> index of its weight in `weights`
        self.weights: list | None = None  # [(model param, DP group or None)], as attached

    @staticmethod
    def attach(optimizer: "OnebitLamb", owner) -> None:
        """Read from `owner` (a MixedPrecisionOptimizer: `param_shards()`, `fragments`) which
        weight each main param is a piece of, and over which DP group its pieces are split."""
        optimizer.weights = owner.param_shards()
        index = {id(p): i for i, (p, _) in enumerate(optimizer.weights)}
        optimizer.slots = {f.main: index[id(f.model_param)] for f in owner.fragments}

    @torch.no_grad()
    def step(self, closure=None) -> None:
        assert closure is None, "OnebitLamb takes no closure"
        work = [(group, p) for group in self.param_groups for p in group["params"]
                if p.grad is not None]
        updates = [self._update(group, p) for group, p in work]
        sums = torch.zeros(len(work), STATS, device=_device(work))
        maxima = torch.zeros(len(work), device=_device(work))
        for i, ((_, p), (pre, update, ratio)) in enumerate(zip(work, updates)):
            sums[i] = torch.stack([p.square().sum(), update.square().sum(), pre.square().sum()])
            maxima[i] = ratio
        sums, maxima = self._whole_weight_stats([p for _, p in work], sums, maxima)
        for (group, p), (_, update, _), total, ratio in zip(work, updates, sums, maxima):
            p.add_(update, alpha=-group["lr"] * float(self._coefficient(group, p, total, ratio)))

    def _update(self, group: dict, p: torch.Tensor) -> tuple:
        """Step p's moments; (u without weight decay, u, this piece's max of d / d_fresh), as
        in the module docstring (its p, u and f before the clamps)."""
        beta1, beta2 = group["betas"]
        state = self.state[p]
        if not state:
            state.update(step=torch.tensor(0.0), coeff_freeze=torch.tensor(0.0),
                         last_factor=torch.tensor(1.0), exp_avg=torch.zeros_like(p),
                         exp_avg_sq=torch.zeros_like(p), exp_avg_sq_fresh=torch.zeros_like(p))
        state["step"] += 1
        step, grad, freeze = float(state["step"]), p.grad, group["freeze_step"]
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        fresh = state["exp_avg_sq_fresh"]
        if step <= freeze:
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            fresh.copy_(exp_avg_sq)
        else:
            reconstructed = (grad - beta1 * exp_avg) / (1 - beta1)
            fresh.mul_(beta2).addcmul_(reconstructed, reconstructed, value=1 - beta2)
            exp_avg.copy_(grad)
        denom = (exp_avg_sq / (1 - beta2 ** min(step, freeze))).sqrt_().add_(group["eps"])
        fresh_denom = (fresh / (1 - beta2 ** step)).sqrt_().add_(group["eps"])
        pre = exp_avg / (1 - beta1 ** step) / denom
        update = pre + group["weight_decay"] * p
        ratio = (denom / fresh_denom).max() if p.numel() else torch.zeros(())
        return pre, update, ratio

    def _whole_weight_stats(self, params: list, sums: torch.Tensor, maxima: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per param, its piece's STATS sums [k, STATS] and max ratio [k] -> its whole weight's
        (summed / maxed over the weight's DP group, then over TP for split weights)."""
        if self.weights is None:
            return sums, maxima
        device = current_device()  # where the collectives run (the pieces may be on the host)
        whole_sums = torch.zeros(len(self.weights), STATS, device=device)
        whole_max = torch.zeros(len(self.weights), device=device)
        slots = torch.tensor([self.slots[p] for p in params], dtype=torch.long, device=device)
        whole_sums.index_add_(0, slots, sums.to(device))
        whole_max.scatter_reduce_(0, slots, maxima.to(device), "amax")
        for group in {id(g): g for _, g in self.weights if g is not None}.values():
            rows = torch.tensor([g is group for _, g in self.weights], device=device)
            for values, op in ((whole_sums, dist.ReduceOp.SUM), (whole_max, dist.ReduceOp.MAX)):
                mask = rows.view(-1, *[1] * (values.ndim - 1))
                reduced = values * mask
                comm.all_reduce(reduced, group, op=op)
                values.copy_(torch.where(mask, reduced, values))
        if ps.get_tensor_model_parallel_world_size() > 1:
            split = torch.tensor([getattr(p, "tensor_model_parallel", False)
                                  for p, _ in self.weights], device=device)
            if ps.get_tensor_model_parallel_rank() > 0:  # replicated weights: rank 0's only
                whole_sums *= split.view(-1, 1)
            tp_group = ps.get_tensor_model_parallel_group()
            comm.all_reduce(whole_sums, tp_group)
            comm.all_reduce(whole_max, tp_group, op=dist.ReduceOp.MAX)
        return whole_sums[slots], whole_max[slots]

    def _coefficient(self, group: dict, p: torch.Tensor, sums: torch.Tensor,
                     ratio: torch.Tensor) -> torch.Tensor:
        """LAMB's trust ratio c in the warm-up (updating c_freeze), c_freeze f after it."""
        state = self.state[p]
        weight_norm, update_norm, pre_norm = sums.sqrt().cpu().unbind()
        if float(state["step"]) <= group["freeze_step"]:
            coeff = torch.tensor(1.0)
            if weight_norm > 0 and update_norm > 0:
                coeff = (weight_norm / update_norm).clamp(group["min_coeff"], group["max_coeff"])
            state["coeff_freeze"].mul_(group["coeff_beta"]).add_(
                coeff * (1 - group["coeff_beta"]))
            return coeff
        factor = ratio.cpu()
        if group["weight_decay"] > 0 and update_norm > 0:
            kept = torch.clamp(pre_norm / update_norm, max=1.0)
            factor = factor * kept + (1 - kept)
        factor = factor.clamp(group["factor_min"], group["factor_max"])
        last, threshold = state["last_factor"], group["factor_threshold"]
        factor = factor.clamp(last * (1 - threshold), last * (1 + threshold))
        state["last_factor"].copy_(factor)
        return state["coeff_freeze"] * factor


def _device(work: list) -> torch.device:
    return work[0][1].device if work else current_device()


def build_onebit_lamb(groups: list[dict], config) -> torch.optim.Optimizer:
    return OnebitLamb(groups, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2),
                      eps=config.adam_eps, freeze_step=config.freeze_step,
                      max_coeff=config.max_coeff, min_coeff=config.min_coeff,
                      coeff_beta=config.coeff_beta, factor_max=config.factor_max,
                      factor_min=config.factor_min, factor_threshold=config.factor_threshold)
