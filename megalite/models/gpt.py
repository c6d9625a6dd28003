"""GPT-family decoder (GPT-2, Llama, ... as specs) built one pipeline stage or chunk at a time."""
import torch
from torch import nn

from megalite.config import ModelConfig
from megalite.models.spec import TransformerSpec
from megalite.models.stage import pipeline_layer_range, share_embedding_with_first_stage
from megalite.models.transformer import ParallelTransformer, dropout, init_scope, layer_norm
from megalite.mpu import comm, parallel_state
from megalite.mpu.cross_entropy import vocab_parallel_cross_entropy
from megalite.mpu.layers import VocabParallelEmbedding, init_method_normal
from megalite.mpu.mappings import scatter_to_sequence_parallel_region
from megalite.mpu.rotary import RotaryEmbedding


def _learned_embedding(rows: int, config: ModelConfig, init_seed: int, key: str,
                       params_dtype: torch.dtype, device) -> nn.Embedding:
    """A TP-replicated nn.Embedding [rows, h], normal(std) from the (seed, key) scope."""
    with init_scope(init_seed, key):
        embedding = nn.Embedding(rows, config.hidden_size, dtype=params_dtype, device=device)
        init_method_normal(config.init_method_std)(embedding.weight.data)
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


class GPTModel(nn.Module):
    """The decoder layers of one pipeline stage (or virtual chunk).

    pre_process: this stage embeds input_ids; otherwise it starts from `set_input_tensor`.
    post_process: this stage ends with the final norm and the output layer (the word
    embedding when tied, else `output_layer`).
    forward(input_ids [b, s], labels [b, s] | None, position_ids [b, s] | None,
            attention_mask [b, 1, s | 1, keys] bool | None, inference_params | None) ->
      last stage: per-token loss [b, s] with labels, else vocab-parallel logits [b, s, V/tp]
      (with `inference_params`, a `megalite.inference.KVCache`: of the last position only,
      [b, V/tp]); other stages: hidden states [s, b, h] for the next stage ([s/t, b, h] with
      `sequence_parallel`: the embedding output is scattered along s over the TP group and
      gathered again before the output layer).
    Context parallelism: input_ids, labels and position_ids are this CP rank's tokens
    (megalite.mpu.context_parallel.get_batch_on_this_cp_rank), s is then s/cp.
    """

    def __init__(self, config: ModelConfig, pre_process: bool = True, post_process: bool = True,
                 layer_range: tuple[int, int] | None = None, init_seed: int = 1234, group=None,
                 params_dtype: torch.dtype = torch.float32, device=None,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.config, self.pre_process, self.post_process = config, pre_process, post_process
        tp_group = parallel_state.get_tensor_model_parallel_group() if group is None else group
        self.tp_size = comm.world_size(tp_group)
        self.sequence_parallel = sequence_parallel and self.tp_size > 1
        spec = TransformerSpec.from_config(config)
        self.share_embeddings_and_output_weights = spec.tie_output
        self.layer_range = layer_range or pipeline_layer_range(config.num_layers)
        kw = dict(group=group, params_dtype=params_dtype, device=device)
        tied_head = post_process and spec.tie_output
        if pre_process or tied_head:
            self.embedding = Embedding(config, init_seed, word_only=not pre_process, **kw)
        if tied_head and not pre_process:
            share_embedding_with_first_stage(self.embedding.word_embeddings.weight)
        self.rotary = RotaryEmbedding(**vars(spec.rotary)) if spec.rotary else None
        self.encoder = ParallelTransformer(config, self.layer_range, init_seed,
                                           sequence_parallel=self.sequence_parallel, **kw)
        if post_process:
            self.final_layernorm = layer_norm(config, params_dtype, device,
                                              self.sequence_parallel)
        if post_process and not spec.tie_output:
            with init_scope(init_seed, "output_layer"):
                self.output_layer = VocabParallelEmbedding(
                    config.vocab_size, config.hidden_size,
                    init_method=init_method_normal(config.init_method_std),
                    make_vocab_size_divisible_by=config.make_vocab_size_divisible_by, **kw)
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        """Hidden states [s, b, h] received from the previous stage."""
        self.input_tensor = tensor

    def output_weights(self) -> VocabParallelEmbedding:
        """The vocab-parallel output layer of the last stage (tied or separate)."""
        return self.embedding.word_embeddings if self.share_embeddings_and_output_weights \
            else self.output_layer

    def _rotary(self, input_ids: torch.Tensor | None, position_ids: torch.Tensor | None):
        if self.rotary is None:
            return None
        if position_ids is None:
            split = self.tp_size if self.sequence_parallel else 1
            s = input_ids.shape[1] if input_ids is not None else self.input_tensor.shape[0] * split
            device = self.rotary.inv_freq.device if input_ids is None else input_ids.device
            position_ids = torch.arange(s, device=device).unsqueeze(0)
        return self.rotary(position_ids)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None,
                inference_params=None) -> torch.Tensor:
        if self.pre_process:
            hidden = self.embedding(input_ids, position_ids)
            if self.sequence_parallel:
                hidden = scatter_to_sequence_parallel_region(hidden)
            hidden = dropout(hidden, self.config.hidden_dropout, self.training,
                             self.sequence_parallel)
        else:
            hidden = self.input_tensor
        hidden = self.encoder(hidden, attention_mask, self._rotary(input_ids, position_ids),
                              inference_params)
        if not self.post_process:
            return hidden
        if inference_params is not None:
            return self.output_weights().lm_logits(self.final_layernorm(hidden[-1]))
        logits = self.output_weights().lm_logits(self.final_layernorm(hidden),
                                                 self.sequence_parallel)
        if labels is None:
            return logits.transpose(0, 1)
        return vocab_parallel_cross_entropy(logits, labels.t()).t()
