"""DeepSpeed-Ulysses' DistributedAttention (deepspeed.sequence.layer) on spd.

    from spclient.compat.deepspeed import DistributedAttention
    attn = DistributedAttention(local_attention, sequence_process_group)   # scatter_idx=2, gather_idx=0
    out = attn(query, key, value, *args, **kwargs)

As DeepSpeed's: query, key and value hold this rank's piece of the sequence,
[S/P, B, H, D] with the default indices (gather_idx=1: [B, S/P, H, D]); they
go seq->head over the group, local_attention(q, k, v, *args, **kwargs) runs on
the whole sequence of this rank's heads ([S, B, H/P, D]) and returns its
output in that layout, which goes head->seq back to this rank's piece, all
heads. Gradients flow back through both all-to-alls.

What spd adds. The three inputs travel in one all-to-all, not three. The
heads need not divide by P: spd pads dummy (zero) heads, which
local_attention sees and whose output is dropped. key and value may have
fewer heads than query (GQA), even fewer than P (spd replicates them to the
ranks whose query heads use them, and sums their gradients back): a rank's
query head i uses its key/value head i // (H_loc / Hk_loc), the
repeat_interleave mapping, as DeepSpeed's split gives where P divides both
head counts. And the pieces may have any lengths (one small all-gather of
them per call): local_attention gets the real tokens of the whole sequence,
no padding.

sequence_process_group: see spclient.compat (a torch.distributed group as
DeepSpeed takes, or spclient.compat.ProcessGroup). sp_stream, DeepSpeed's
option of a side stream for overlap, is taken and not needed: spd's
all-to-all runs on its own stream.
"""
import torch

from . import Split, head_to_seq, layout_of, process_group, seq_to_head

__all__ = ["DistributedAttention"]


class DistributedAttention(torch.nn.Module):
    """DeepSpeed's DistributedAttention: Ulysses around local_attention."""

    def __init__(self, local_attention, sequence_process_group, scatter_idx=2, gather_idx=0, sp_stream=None):
        super().__init__()
        self.local_attn = local_attention
        self.spg = process_group(sequence_process_group)
        self.scatter_idx, self.gather_idx = scatter_idx, gather_idx
        self.layout = layout_of(scatter_idx, gather_idx)
        self.sp_stream = sp_stream

    def forward(self, query, key, value, *args, **kwargs):
        if self.spg.size() == 1:
            return self.local_attn(query, key, value, *args, **kwargs)
        split = Split.of(self.spg, query.shape[self.gather_idx % 4])
        q, k, v = seq_to_head(self.spg, split, self.layout, query, key, value)
        context = self.local_attn(q, k, v, *args, **kwargs)
        return head_to_seq(self.spg, split, self.layout, context, query.shape[2], key.shape[2])
