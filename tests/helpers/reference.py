"""Independent references shared by tests: Hugging Face models built from configs, error metrics."""
import torch


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (0 when both are zero), on the CPU: either may be on a
    GPU, e.g. a rank's result against a transformers reference."""
    got, want = got.detach().float().cpu(), want.detach().float().cpu()
    scale = want.abs().max().item()
    diff = (got - want).abs().max().item()
    return diff / scale if scale else diff


def tiny_gpt2(vocab: int = 203, positions: int = 32, layers: int = 2, hidden: int = 64,
              heads: int = 4, seed: int = 0):
    """A randomly initialised transformers GPT2LMHeadModel with dropout off (no download)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=vocab, n_positions=positions, n_layer=layers, n_embd=hidden,
                     n_head=heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    return GPT2LMHeadModel(cfg)


def random_hf_model(cls, cfg, seed: int = 0):
    """`cls(cfg)` with eager attention, seeded init, norm weights moved away from 1 and the
    fused 3-D expert weights (which transformers leaves uninitialised) drawn N(0, 0.05)."""
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn_like(param))
            elif name.endswith(("gate_up_proj", "down_proj")) and param.ndim == 3:
                param.normal_(0, 0.05)
    return model


def hf_token_loss(hf_model, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss of a HF causal LM (on the CPU) on tokens [b, s + 1] (inputs [:-1],
    labels [1:]), wherever the tokens are."""
    tokens = tokens.cpu()
    logits = hf_model(input_ids=tokens[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             tokens[:, 1:].reshape(-1))


def hf_results(hf_model, tokens: torch.Tensor, steps: int = 3) -> dict:
    """transformers' side of `parity_errors` (computable once, in the test process): a HF causal
    LM's (on the CPU) logits, loss and grads on tokens [b, s + 1], then the losses after each
    of `steps` AdamW steps (lr 1e-3, weight decay 0.01). Trains `hf_model`."""
    tokens = tokens.cpu()
    logits = hf_model(input_ids=tokens[:, :-1]).logits.detach()
    loss = hf_token_loss(hf_model, tokens)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in hf_model.named_parameters()}
    opt = torch.optim.AdamW(hf_model.parameters(), lr=1e-3, weight_decay=0.01)
    step_losses = []
    for _ in range(steps):
        opt.step()
        opt.zero_grad()
        step_loss = hf_token_loss(hf_model, tokens)
        step_loss.backward()
        step_losses.append(step_loss.detach())
    return {"logits": logits, "loss": loss.detach(), "grads": grads, "steps": step_losses}


def parity_errors(model, want: dict, to_hf_names, tokens: torch.Tensor, vocab: int) -> dict:
    """Relative errors of a megalite GPTModel (this rank's TP shard, on its device) vs
    `want`, `hf_results` of a HF causal LM with the same weights, on tokens [b, s + 1] (on the
    model's device): logits, loss, every gradient (gathered over TP, renamed by
    `to_hf_names(full megalite dict)`), then the losses after as many AdamW steps."""
    from megalite.distributed.finalize import finalize_model_grads
    from megalite.mpu.layers import gather_tensor_parallel
    from megalite.mpu.mappings import gather_from_tensor_model_parallel_region
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    logits = gather_from_tensor_model_parallel_region(model(inputs))[..., :vocab]
    errors = {"logits": rel_err(logits, want["logits"])}

    def backward() -> torch.Tensor:
        loss = model(inputs, labels).mean()
        loss.backward()
        finalize_model_grads([model])
        return loss

    errors["loss"] = rel_err(backward(), want["loss"])
    ours = to_hf_names({n: gather_tensor_parallel(p.grad, p) for n, p in model.named_parameters()})
    errors["missing grads"] = sorted(set(want["grads"]) - set(ours))
    errors["grad"] = max(rel_err(ours[n], g) for n, g in want["grads"].items() if n in ours)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    errors["steps"] = []
    for step_loss in want["steps"]:
        opt.step()
        opt.zero_grad()
        errors["steps"].append(rel_err(backward(), step_loss))
    return errors


def hf_parity_errors(model, hf_model, to_hf_names, tokens: torch.Tensor, vocab: int,
                     steps: int = 3) -> dict:
    """`parity_errors` against `hf_model` itself (trained here)."""
    return parity_errors(model, hf_results(hf_model, tokens, steps), to_hf_names, tokens, vocab)


def step_errors(got: dict, want: dict) -> dict:
    """Relative loss error, worst relative grad error and the grads `want` lacks, of one
    parallel step's {"loss", "grads"} against the reference's."""
    return {"loss": abs(got["loss"] - want["loss"]) / abs(want["loss"]),
            "grad": max(rel_err(g, want["grads"][n]) for n, g in got["grads"].items()),
            "missing": sorted(set(got["grads"]) - set(want["grads"]))}


def assert_step_errors(results: list[dict], tolerance: float = 1e-5) -> None:
    """Every rank's {case: step_errors(...)} within `tolerance`, nothing missing; prints the
    worst per case."""
    for rank, per_rank in enumerate(results):
        for name, e in per_rank.items():
            assert not e["missing"] and e["loss"] < tolerance and e["grad"] < tolerance, \
                (rank, name, e)
    print({name: "loss {:.1e} grad {:.1e}".format(
        max(r[name]["loss"] for r in results), max(r[name]["grad"] for r in results))
        for name in results[0]})
