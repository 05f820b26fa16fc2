"""Attention of a chunk's queries over dense pieces of KV (SDPA), and the log-sum-exp merge of pieces.

A prompt chunk after cached positions (a cached system prompt or chat template, then new text) has
queries at start..end over keys 0..end: each query sees the keys up to its own position. SDPA's
`is_causal` aligns the diagonal to the first key (query i sees keys 0..i), so such a chunk used to
pass an explicit mask, and with a mask PyTorch's fused CPU kernel visits every key block of every
query, the chunk's own triangle included (a probe: the default model's 30 layers over a 1,024-token
chunk after 27 cached positions, 426 ms masked, 269 ms padded; Xeon, 2 threads). So `attend_dense`,
told the chunk is causal from the last key:
- start < N: pads the queries in front with `start` rows, which turns it into SDPA's square causal
  case (the same attention for the real rows) at the cost of the padding rows' triangle, less than
  the mask's waste;
- start >= N, on CPU, N >= SPLIT_MIN_QUERIES: the cached keys with no mask and the chunk's own keys
  causally, merged by log-sum-exp (the fused kernel's own lse), which leaves out the masked triangle;
- else the mask.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .element import load

# Chunks of at least this many queries after at least as many cached positions attend in two parts
# (cached keys, own keys causally) merged by log-sum-exp on CPU; shorter ones keep the mask: the
# triangle they save is small next to a second kernel call and the merge.
SPLIT_MIN_QUERIES = 128


def attend_dense(query, keys, values, mask, is_causal: bool, scaling: float):
    """query [1, H, N, D] over keys / values [1, Hkv, S, D] (values, S >= N) -> [1, H, N, D].
    `is_causal`: query i is at key position S - N + i and sees the keys up to it (`mask`, when given,
    says the same; the square case when S == N); else `mask` (bool [N, S] or None: every key)."""
    gqa = query.shape[1] != keys.shape[1]
    n, s = query.shape[2], keys.shape[2]
    if is_causal and s > n:
        start = s - n
        if start < n:
            pad = query.new_zeros(query.shape[0], query.shape[1], start, query.shape[3])
            out = F.scaled_dot_product_attention(torch.cat([pad, query], dim=2), keys, values, is_causal=True,
                                                 scale=scaling, enable_gqa=gqa)
            return out[:, :, start:]
        if query.device.type == "cpu" and n >= SPLIT_MIN_QUERIES:
            return merge_by_lse([attend_with_lse(query, keys[:, :, :start], values[:, :, :start], None, scaling),
                                 _causal_with_lse(query, keys[:, :, start:], values[:, :, start:], scaling)])
        if mask is None:
            mask = torch.ones(n, s, dtype=torch.bool, device=query.device).tril(start)
        is_causal = False
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=None if is_causal else mask,
                                          is_causal=is_causal, scale=scaling, enable_gqa=gqa)


def _causal_with_lse(query, keys, values, scale):
    """query [1, H, N, D] over N keys / values [1, Hkv, N, D] (values), query i seeing keys 0..i, on
    CPU: (out [1, H, N, D], lse [1, H, N]). The keys are repeated per query head (N rows only):
    attend_with_lse's grouping of heads into rows would break the causal diagonal."""
    group = query.shape[1] // keys.shape[1]
    if group > 1:
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, keys, values, 0.0, True,
                                                                         scale=scale)[:2]
    return out, lse


def attend_with_lse(query, keys, values, mask, scale):
    """Attention of query [1, H, N, D] over one run of stored keys and values [1, Hkv, S, row_width]
    (kv/element.py): (out [1, H, N, D], lse [1, H, N])."""
    _, heads, n, dim = query.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    keys, values = load(keys, query.dtype), load(values, query.dtype)  # KV kept in another dtype (kv_dtype)
    q = query.reshape(1, kv_heads, group * n, dim)                      # rows: (group, position)
    additive = None
    visible = None
    if mask is not None:
        rows = mask.repeat(group, 1)                                    # [G * N, S]
        visible = rows.any(-1)
        additive = torch.zeros(rows.shape, dtype=query.dtype, device=query.device).masked_fill(~rows, float("-inf"))
    if query.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, keys, values, 0.0, False, attn_mask=additive, scale=scale)
    else:
        scores = torch.matmul(q.float(), keys.float().transpose(-1, -2)) * scale
        if additive is not None:
            scores = scores + additive.float()
        lse = torch.logsumexp(scores, dim=-1)
        out = torch.matmul(torch.softmax(scores, dim=-1), values.float()).to(query.dtype)
    if visible is not None:
        lse = lse.masked_fill(~visible, float("-inf"))
    return out.reshape(1, heads, n, dim), lse.reshape(1, heads, n)


def merge_by_lse(parts):
    """Combine per-run attention outputs into attention over all runs."""
    if len(parts) == 1:
        return parts[0][0]
    lses = torch.stack([lse.float() for _, lse in parts])                # [R, 1, H, N]
    total = torch.logsumexp(lses, dim=0)
    out = None
    for (part, _), lse in zip(parts, lses):
        weight = torch.exp(lse - total).nan_to_num(0.0).unsqueeze(-1)
        term = (part.float() * weight).nan_to_num(0.0)
        out = term if out is None else out + term
    return out.to(parts[0][0].dtype)
