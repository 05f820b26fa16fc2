"""Attention of a chunk's queries over one dense piece of KV (SDPA), causal aligned to the last key.

A prompt chunk after cached positions (a cached system prompt or chat template, then new text) has
queries at start..end over keys 0..end: each query sees the keys up to its own position. SDPA's
`is_causal` aligns the diagonal to the first key (query i sees keys 0..i), so such a chunk used to
pass an explicit mask, and with a mask PyTorch's fused CPU kernel visits every key block of every
query: about twice the work of the causal triangle (a probe: the default model's 30 layers over a
1,024-token chunk after 27 cached positions, 426 ms masked, 269 ms padded; Xeon, 2 threads). Padding
the queries in front with `start` rows turns it into SDPA's square causal case, the same attention
for the real rows, at the cost of the padding rows' triangle, which is less than the mask's waste
while start < N (AttentionStep, which knows the chunk and the window, decides).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def attend_dense(query, keys, values, mask, is_causal: bool, scaling: float):
    """query [1, H, N, D] over keys / values [1, Hkv, S, D] (S >= N) -> [1, H, N, D]. `is_causal`: query
    i is at key position S - N + i and sees the keys up to it (the square case when S == N); else
    `mask` (bool [N, S] or None: every key)."""
    gqa = query.shape[1] != keys.shape[1]
    n, s = query.shape[2], keys.shape[2]
    if is_causal and s > n:
        pad = query.new_zeros(query.shape[0], query.shape[1], s - n, query.shape[3])
        out = F.scaled_dot_product_attention(torch.cat([pad, query], dim=2), keys, values, is_causal=True,
                                             scale=scaling, enable_gqa=gqa)
        return out[:, :, s - n:]
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, is_causal=is_causal,
                                          scale=scaling, enable_gqa=gqa)
