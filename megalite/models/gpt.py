"""GPT (GPT-2 architecture) built from the mpu blocks, one pipeline stage or chunk at a time."""
import torch
import torch.nn.functional as F
from torch import nn

from megalite.config import ModelConfig
from megalite.models.stage import pipeline_layer_range, share_embedding_with_first_stage
from megalite.mpu.cross_entropy import vocab_parallel_cross_entropy
from megalite.mpu.layers import VocabParallelEmbedding, init_method_normal
from megalite.mpu.transformer import ParallelTransformer, init_scope, layer_norm


class Embedding(nn.Module):
    """Word (vocab-parallel), position and optional token-type embeddings.

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
        if word_only:
            return
        with init_scope(init_seed, "embedding.position"):
            self.position_embeddings = nn.Embedding(config.max_position_embeddings,
                                                    config.hidden_size, dtype=params_dtype,
                                                    device=device)
            init(self.position_embeddings.weight.data)
        self.tokentype_embeddings = None
        if config.num_tokentypes:
            with init_scope(init_seed, "embedding.tokentype"):
                self.tokentype_embeddings = nn.Embedding(config.num_tokentypes,
                                                         config.hidden_size, dtype=params_dtype,
                                                         device=device)
                init(self.tokentype_embeddings.weight.data)

    def forward(self, ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                tokentype_ids: torch.Tensor | None = None) -> torch.Tensor:
        ids = ids.t()
        if position_ids is None:
            position_ids = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1)
        else:
            position_ids = position_ids.t()
        out = self.word_embeddings(ids) + self.position_embeddings(position_ids)
        if self.tokentype_embeddings is not None:
            tokentype_ids = torch.zeros_like(ids) if tokentype_ids is None else tokentype_ids.t()
            out = out + self.tokentype_embeddings(tokentype_ids)
        return out


class GPTModel(nn.Module):
    """The GPT layers of one pipeline stage (or virtual chunk).

    pre_process: this stage embeds input_ids; otherwise it starts from `set_input_tensor`.
    post_process: this stage ends with the final LayerNorm and the tied LM head.
    forward(input_ids [b, s], labels [b, s] | None) ->
      last stage: per-token loss [b, s] with labels, else vocab-parallel logits [b, s, V/tp];
      other stages: hidden states [s, b, h] for the next stage.
    """

    def __init__(self, config: ModelConfig, pre_process: bool = True, post_process: bool = True,
                 layer_range: tuple[int, int] | None = None, init_seed: int = 1234, group=None,
                 params_dtype: torch.dtype = torch.float32, device=None) -> None:
        super().__init__()
        self.config, self.pre_process, self.post_process = config, pre_process, post_process
        self.layer_range = layer_range or pipeline_layer_range(config.num_layers)
        kw = dict(group=group, params_dtype=params_dtype, device=device)
        if pre_process or post_process:
            self.embedding = Embedding(config, init_seed, word_only=not pre_process, **kw)
        if post_process and not pre_process:
            share_embedding_with_first_stage(self.embedding.word_embeddings.weight)
        self.encoder = ParallelTransformer(config, self.layer_range, init_seed, **kw)
        if post_process:
            self.final_layernorm = layer_norm(config, params_dtype, device)
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        """Hidden states [s, b, h] received from the previous stage."""
        self.input_tensor = tensor

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if self.pre_process:
            hidden = F.dropout(self.embedding(input_ids, position_ids),
                               self.config.hidden_dropout, self.training)
        else:
            hidden = self.input_tensor
        hidden = self.encoder(hidden)
        if not self.post_process:
            return hidden
        logits = self.embedding.word_embeddings.lm_logits(self.final_layernorm(hidden))
        if labels is None:
            return logits.transpose(0, 1)
        return vocab_parallel_cross_entropy(logits, labels.t()).t()
