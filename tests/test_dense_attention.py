"""kv/dense.py: a chunk after cached positions attends causally from the last key without visiting the
masked triangle (queries padded in front while start < chunk, else cached keys and own keys merged by
log-sum-exp, else the mask), with the numbers of the explicit mask; AttentionStep marks every chunk
of several queries causal unless a window cuts keys."""
import pytest
import torch
import torch.nn.functional as F

from kvboost_engine.kv import dense
from kvboost_engine.kv.dense import attend_dense
from kvboost_engine.model import attention


def lower_right(n: int, s: int) -> torch.Tensor:
    return torch.ones(n, s, dtype=torch.bool).tril(s - n)


@pytest.mark.parametrize("heads,kv_heads,n,s", [
    (9, 3, 37, 50), (4, 4, 5, 6), (6, 2, 64, 65), (2, 1, 3, 3),       # padded (start < n) and the square
    (9, 3, 130, 300), (4, 4, 128, 256), (2, 1, 200, 1000),             # cached keys + own keys, merged
    (9, 3, 20, 300), (4, 2, 127, 300),                                 # short chunks: the mask
])
@pytest.mark.parametrize("given_mask", [False, True])
def test_causal_from_the_last_key_equals_the_mask(heads, kv_heads, n, s, given_mask):
    torch.manual_seed(0)
    q, k, v = torch.randn(1, heads, n, 16), torch.randn(1, kv_heads, s, 16), torch.randn(1, kv_heads, s, 16)
    got = attend_dense(q, k, v, lower_right(n, s) if given_mask and s > n else None, True, 0.25)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=lower_right(n, s), scale=0.25,
                                          enable_gqa=heads != kv_heads)
    assert got.shape == (1, heads, n, 16)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_each_path_is_taken(monkeypatch):
    taken = []
    real_merge, real_sdpa = dense.merge_by_lse, F.scaled_dot_product_attention
    monkeypatch.setattr(dense, "merge_by_lse", lambda parts: taken.append("merged") or real_merge(parts))
    monkeypatch.setattr(dense.F, "scaled_dot_product_attention", lambda q, k, v, attn_mask=None, is_causal=False,
                        **kw: taken.append((q.shape[2], attn_mask is not None, is_causal)) or
                        real_sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw))
    q, k = torch.randn(1, 2, 200, 8), torch.randn(1, 2, 1000, 8)
    attend_dense(q[:, :, :150], k[:, :, :200], k[:, :, :200], None, True, 1.0)     # start 50 < 150
    attend_dense(q, k, k, None, True, 1.0)                                          # start 800, 200 queries
    attend_dense(q[:, :, :20], k, k, None, True, 1.0)                               # 20 queries
    assert taken == [(200, False, True), "merged", (20, True, False)]


def test_mask_and_no_mask_pass_through():
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    mask = torch.rand(3, 10) > 0.3
    mask[:, 0] = True
    torch.testing.assert_close(attend_dense(q, k, v, mask, False, 0.5),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.5, enable_gqa=True))
    torch.testing.assert_close(attend_dense(q, k, v, None, False, 0.5),
                               F.scaled_dot_product_attention(q, k, v, scale=0.5, enable_gqa=True))


class FakeKV:
    """Records what AttentionStep asks of the KV."""
    device = torch.device("cpu")

    def __init__(self):
        self.calls = []

    def write(self, *args):
        pass

    def attend(self, layer, query, mask, is_causal, scaling, end, explicit_mask, q_range, window):
        self.calls.append((mask is None, is_causal, explicit_mask() is None))
        return torch.zeros_like(query)


@pytest.mark.parametrize("start,n,window,causal", [
    (0, 8, None, True),        # a whole prompt
    (3, 8, None, True),        # chunks after cached positions
    (8, 8, None, True),
    (20, 8, None, True),
    (3, 8, 100, True),         # a window that cuts nothing
    (3, 8, 4, False),          # a window that cuts keys: the mask alone
    (5, 1, None, False),       # one query: every key, no mask
])
def test_step_marks_chunks_causal(start, n, window, causal):
    kv = FakeKV()
    step = attention.AttentionStep(kv, start, start + n, (window,))
    q = torch.zeros(1, 2, n, 4)
    step.attend(0, q, torch.zeros(1, 1, n, 4), torch.zeros(1, 1, n, 4), 1.0)
    no_mask, is_causal, full_mask_none = kv.calls[0]
    assert is_causal == causal
    assert no_mask == (n == 1 or start == 0)          # the mask goes along for whatever cannot do without
    # attention split into runs (paged KV past GATHER_MAX_KEYS) still gets the full mask
    assert full_mask_none == (n == 1)
