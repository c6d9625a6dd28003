"""The input embedding of a transformer's first stage (and the word embedding alone, for a
tied output layer on the last stage)."""
import torch
from torch import nn

from megalite.config import ModelConfig
from megalite.models.transformer import init_scope
from megalite.mpu.layers import VocabParallelEmbedding, init_method_normal


def _learned_embedding(rows: int, config: ModelConfig, init_seed: int, key: str,
                       params_dtype: torch.dtype, device) -> nn.Embedding:
    """A TP-replicated nn.Embedding [rows, h], normal(std) in params_dtype on the CPU from the
    (seed, key) scope's generator, then moved to `device`. The scope's first [rows, h] normal
    draw is skipped: nn.Embedding's own initialisation took it when the weights were drawn
    from the global generator, and the weights stay what they were."""
    weight = torch.empty(rows, config.hidden_size, dtype=params_dtype)
    with init_scope(init_seed, key) as generator:
        nn.init.normal_(weight, generator=generator)
        init_method_normal(config.init_method_std)(weight)
    embedding = nn.Embedding.from_pretrained(weight.to(device), freeze=False)
    embedding.weight.is_embedding_or_output_parameter = True  # not a hidden matrix (Muon)
    return embedding


class Embedding(nn.Module):
    """Word (vocab-parallel), learned position (unless rotary) and optional token-type
    embeddings.

    forward(ids [b, s], position_ids [b, s] | None, tokentype_ids [b, s] | None) -> [s, b, h].
    `word_only=True` builds just the word embedding (the tied output layer of a last stage).
    """

    def __init__(self, config: ModelConfig, init_seed: int, word_only: bool = False, group=None,
                 params_dtype=torch.float32, device=None) -> None:
        super().__init__()
        init = init_method_normal(config.init_method_std)
        with init_scope(init_seed, "embedding.word"):
            self.word_embeddings = VocabParallelEmbedding(
                config.vocab_size, config.hidden_size, init_method=init,
                make_vocab_size_divisible_by=config.make_vocab_size_divisible_by, group=group,
                params_dtype=params_dtype, device=device)
        self.position_embeddings = self.tokentype_embeddings = None
        if word_only:
            return
        if config.position_embedding_type == "learned_absolute":
            self.position_embeddings = _learned_embedding(
                config.max_position_embeddings, config, init_seed, "embedding.position",
                params_dtype, device)
        if config.num_tokentypes:
            self.tokentype_embeddings = _learned_embedding(
                config.num_tokentypes, config, init_seed, "embedding.tokentype", params_dtype,
                device)

    def forward(self, ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                tokentype_ids: torch.Tensor | None = None) -> torch.Tensor:
        ids = ids.t()
        out = self.word_embeddings(ids)
        if self.position_embeddings is not None:
            if position_ids is None:
                position_ids = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1)
            else:
                position_ids = position_ids.t()
            out = out + self.position_embeddings(position_ids)
        if self.tokentype_embeddings is not None:
            tokentype_ids = torch.zeros_like(ids) if tokentype_ids is None else tokentype_ids.t()
            out = out + self.tokentype_embeddings(tokentype_ids)
        return out
