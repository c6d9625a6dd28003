"""Independent references shared by tests: Hugging Face models built from configs, error metrics."""
import torch


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (0 when both are zero)."""
    scale = want.abs().max().item()
    diff = (got.float() - want.float()).abs().max().item()
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


def hf_token_loss(hf_model, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss of a HF causal LM on tokens [b, s + 1] (inputs [:-1], labels [1:])."""
    logits = hf_model(input_ids=tokens[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             tokens[:, 1:].reshape(-1))
