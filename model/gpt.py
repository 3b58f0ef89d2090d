"""megatron's GPTModel, with rotary positions read from the position ids when asked.

megatron's GPTModel gives token i of every sequence the rotary angle of position i: its
``position_ids`` reach only a learned position table. Packed documents whose positions restart
at each document (``data.reset_position_ids``, Megatron-LM's ``--reset-position-ids``) need
token i rotated by its own position id. Built with ``positions_per_token``, this model takes
megatron's rotary table (positions 0..s-1, [s, 1, 1, d]) and gathers each token's row by its
position id ([s, b, 1, d]); megatron's rotary application broadcasts either shape. Its fused
RoPE kernel takes only the first, so such a model is built without it
(``model.megatron_config.transformer_config``).

Under context parallelism megatron's table holds only this rank's positions (its two chunks
of the sequence, ``runtime.context``); position ids are positions in the whole sequence, so
the rows are gathered from the whole table instead.
"""

from __future__ import annotations

from megatron.core.models.gpt import GPTModel


class GPT(GPTModel):
    def __init__(self, *args, positions_per_token: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.positions_per_token = positions_per_token

    def _preprocess(self, input_ids, position_ids, *args, **kwargs):
        output = super()._preprocess(input_ids, position_ids, *args, **kwargs)
        rotary = output[1]
        if not self.positions_per_token or rotary is None or position_ids is None:
            return output
        if self.config.context_parallel_size > 1:
            rotary = self.rotary_pos_emb.get_emb(
                position_ids.shape[1] * self.config.context_parallel_size)
        table = rotary[:, 0, 0, :]  # [positions, d]
        per_token = table[position_ids.t().long()].unsqueeze(2)  # [s, b, 1, d]
        return (output[0], per_token, *output[2:])
