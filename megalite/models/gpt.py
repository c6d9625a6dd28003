"""GPT-family decoder (GPT-2, Llama, ... as specs) built one pipeline stage or chunk at a time."""
import torch

from megalite.config import ModelConfig
from megalite.models.mtp import MultiTokenPrediction
from megalite.models.spec import TransformerSpec
from megalite.models.transformer import init_scope, layer_norm
from megalite.models.transformer_stage import TransformerStage
from megalite.moe.stats import attach_aux_loss
from megalite.mpu.cross_entropy import vocab_parallel_cross_entropy
from megalite.mpu.layers import VocabParallelEmbedding, init_method_normal
from megalite.mpu.rotary import RotaryEmbedding


class GPTModel(TransformerStage):
    """The decoder layers of one pipeline stage (or virtual chunk); see TransformerStage.

    post_process: this stage ends with the final norm and the output layer (the word
    embedding when tied, else `output_layer`); rotary positions when the spec has them.
    forward(input_ids [b, s], labels [b, s] | None, position_ids [b, s] | None,
            attention_mask [b, 1, s | 1, keys] bool | None, inference_params | None) ->
      last stage: per-token loss [b, s] with labels, else vocab-parallel logits [b, s, V/tp]
      (with `inference_params`, a `megalite.inference.KVCache`: of the last position only,
      [b, V/tp]); other stages: hidden states [s, b, h] for the next stage ([s/t, b, h] with
      `sequence_parallel`: the embedding output is scattered along s over the TP group and
      gathered again before the output layer).
    Context parallelism: input_ids, labels and position_ids are this CP rank's tokens
    (megalite.mpu.context_parallel.get_batch_on_this_cp_rank), s is then s/cp.
    Multi-token prediction (last stage, with labels; input_ids given there too): the
    per-token loss returned is the main one, and in backward the MTP loss (recorded in the
    chunk's `moe_state` for the log) gets the gradient --mtp-loss-scaling-factor times
    `moe_state.backward_scale`, the factor the executor gives the main loss.
    """

    def __init__(self, config: ModelConfig, pre_process: bool = True, post_process: bool = True,
                 layer_range: tuple[int, int] | None = None, init_seed: int = 1234, group=None,
                 params_dtype: torch.dtype = torch.float32, device=None,
                 sequence_parallel: bool = False) -> None:
        spec = TransformerSpec.from_config(config)
        super().__init__(config, pre_process, post_process, spec.tie_output,
                         last_stage_embedding=spec.mtp_num_layers > 0,
                         layer_range=layer_range, init_seed=init_seed, group=group,
                         params_dtype=params_dtype, device=device,
                         sequence_parallel=sequence_parallel)
        self.rotary = RotaryEmbedding(**vars(spec.rotary), device=device) if spec.rotary \
            else None
        if post_process:
            self.final_layernorm = layer_norm(config, params_dtype, device,
                                              self.sequence_parallel)
        self.mtp = None
        if post_process and spec.mtp_num_layers:
            self.mtp = MultiTokenPrediction(config, init_seed, self.sequence_parallel,
                                            group=group, params_dtype=params_dtype,
                                            device=device, moe_state=self.moe_state)
        if post_process and not spec.tie_output:
            with init_scope(init_seed, "output_layer"):
                self.output_layer = VocabParallelEmbedding(
                    config.vocab_size, config.hidden_size,
                    init_method=init_method_normal(config.init_method_std),
                    make_vocab_size_divisible_by=config.make_vocab_size_divisible_by,
                    group=group, params_dtype=params_dtype, device=device)

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
            position_ids = torch.arange(s, device=self.rotary.inv_freq.device).unsqueeze(0)
        return self.rotary(position_ids)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None,
                inference_params=None) -> torch.Tensor:
        hidden = self.encoder(self.stage_input(input_ids, position_ids), attention_mask,
                              self._rotary(input_ids, position_ids), inference_params)
        if not self.post_process:
            return hidden
        if inference_params is not None:
            return self.output_weights().lm_logits(self.final_layernorm(hidden[-1]))
        logits = self.output_weights().lm_logits(self.final_layernorm(hidden),
                                                 self.sequence_parallel)
        if labels is None:
            return logits.transpose(0, 1)
        loss = vocab_parallel_cross_entropy(logits, labels.t()).t()
        if self.mtp is None:
            return loss
        mtp_loss = self.mtp(hidden, input_ids, labels, self.embedding,
                            self.output_weights(), self._rotary(input_ids, position_ids))
        self.moe_state.record_mtp_loss(mtp_loss)
        return attach_aux_loss(loss, self.config.mtp_loss_scaling_factor * mtp_loss,
                               self.moe_state)
