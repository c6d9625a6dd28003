"""The pipeline-stage skeleton GPT and BERT share: the embedding on the first stage, the tied
word-embedding copy on the last, the encoder over this stage's layers, the stage input."""
import torch
from torch import nn

from megalite.config import ModelConfig
from megalite.models.embedding import Embedding
from megalite.models.stage import pipeline_layer_range, share_embedding_with_first_stage
from megalite.models.sharding import unwrap
from megalite.models.transformer import ParallelTransformer, dropout, layer_norm
from megalite.moe import MoEState
from megalite.mpu import comm, parallel_state
from megalite.mpu.mappings import scatter_to_sequence_parallel_region


class TransformerStage(nn.Module):
    """One pipeline stage (or virtual chunk) of a transformer; subclasses add the head.

    pre_process: this stage embeds its input (`stage_input`); otherwise it starts from the
    hidden states [s, b, h] given to `set_input_tensor`. post_process: this stage ends with the
    subclass's head; with `tie_output` that head reads the word embedding, of which the last
    stage keeps a copy tied to the first stage's (`share_embedding_with_first_stage`);
    `last_stage_embedding` keeps that copy without a tied head (multi-token prediction).
    `embedding_norm`: the embedding is normalised before the dropout (BERT).
    `sequence_parallel` (only with TP > 1): activations between stages are [s/t, b, h], the
    embedding output scattered along s over the TP group.
    `moe_state`: the chunk's MoEState, shared by its MoE layers (aux-loss backward scale and
    this step's routing stats; see `moe_states`).
    """

    def __init__(self, config: ModelConfig, pre_process: bool, post_process: bool,
                 tie_output: bool, embedding_norm: bool = False,
                 last_stage_embedding: bool = False,
                 layer_range: tuple[int, int] | None = None, init_seed: int = 1234, group=None,
                 params_dtype: torch.dtype = torch.float32, device=None,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.config, self.pre_process, self.post_process = config, pre_process, post_process
        tp_group = parallel_state.get_tensor_model_parallel_group() if group is None else group
        self.tp_size = comm.world_size(tp_group)
        self.sequence_parallel = sequence_parallel and self.tp_size > 1
        self.share_embeddings_and_output_weights = tie_output
        self.shares_word_embedding = tie_output or last_stage_embedding
        self.layer_range = layer_range or pipeline_layer_range(config.num_layers)
        self.moe_state = MoEState()
        kw = dict(group=group, params_dtype=params_dtype, device=device)
        tied_head = post_process and self.shares_word_embedding
        if pre_process or tied_head:
            self.embedding = Embedding(config, init_seed, word_only=not pre_process, **kw)
        self.embedding_layernorm = layer_norm(config, params_dtype, device,
                                              self.sequence_parallel) \
            if pre_process and embedding_norm else None
        if tied_head and not pre_process:
            share_embedding_with_first_stage(self.embedding.word_embeddings.weight)
        self.encoder = ParallelTransformer(config, self.layer_range, init_seed,
                                           sequence_parallel=self.sequence_parallel,
                                           moe_state=self.moe_state, **kw)
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        """Hidden states [s, b, h] received from the previous stage."""
        self.input_tensor = tensor

    def stage_input(self, input_ids: torch.Tensor | None,
                    position_ids: torch.Tensor | None = None,
                    tokentype_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The encoder's input [s, b, h] ([s/t, b, h] sequence parallel): on the first stage the
        embedding of input_ids [b, s] (scattered over the TP group, normalised, dropout);
        otherwise the tensor received from the previous stage."""
        if not self.pre_process:
            return self.input_tensor
        hidden = self.embedding(input_ids, position_ids, tokentype_ids)
        if self.sequence_parallel:
            hidden = scatter_to_sequence_parallel_region(hidden)
        if self.embedding_layernorm is not None:
            hidden = self.embedding_layernorm(hidden)
        return dropout(hidden, self.config.hidden_dropout, self.training, self.sequence_parallel)


def moe_states(model: nn.Module | list[nn.Module]) -> list[MoEState]:
    """The MoEStates of this rank's chunks (wrapped or not; chunks without one are skipped)."""
    chunks = model if isinstance(model, list) else [model]
    return [unwrap(chunk).moe_state for chunk in chunks if hasattr(unwrap(chunk), "moe_state")]
