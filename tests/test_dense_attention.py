"""kv/dense.py: a chunk after cached positions attends causally from the last key (queries padded in
front) with the numbers of the explicit mask it replaces, and AttentionStep takes that path only
where it pays (start < chunk, no window that cuts keys)."""
import pytest
import torch
import torch.nn.functional as F

from kvboost_engine.kv.dense import attend_dense
from kvboost_engine.model import attention


def lower_right(n: int, s: int) -> torch.Tensor:
    return torch.ones(n, s, dtype=torch.bool).tril(s - n)


@pytest.mark.parametrize("heads,kv_heads,n,s", [(9, 3, 37, 50), (4, 4, 5, 6), (6, 2, 64, 65), (2, 1, 3, 3)])
def test_padded_causal_equals_the_mask(heads, kv_heads, n, s):
    torch.manual_seed(0)
    q, k, v = torch.randn(1, heads, n, 16), torch.randn(1, kv_heads, s, 16), torch.randn(1, kv_heads, s, 16)
    got = attend_dense(q, k, v, None, True, 0.25)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=lower_right(n, s), scale=0.25,
                                          enable_gqa=heads != kv_heads)
    assert got.shape == (1, heads, n, 16)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


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


@pytest.mark.parametrize("start,n,window,padded", [
    (0, 8, None, True),        # a whole prompt: SDPA's own square
    (3, 8, None, True),        # a chunk after 3 cached positions: padding pays
    (8, 8, None, False),       # as many cached as new: the mask
    (20, 8, None, False),
    (3, 8, 100, True),         # a window that cuts nothing
    (3, 8, 4, False),          # a window that cuts keys: the mask
    (5, 1, None, False),       # one query: no mask at all
])
def test_step_pads_only_where_it_pays(start, n, window, padded):
    kv = FakeKV()
    step = attention.AttentionStep(kv, start, start + n, (window,))
    q = torch.zeros(1, 2, n, 4)
    step.attend(0, q, torch.zeros(1, 1, n, 4), torch.zeros(1, 1, n, 4), 1.0)
    no_mask, is_causal, full_mask_none = kv.calls[0]
    assert is_causal == padded
    assert no_mask == (padded or n == 1)
    # attention split into runs (paged KV past GATHER_MAX_KEYS) still gets the full mask
    assert full_mask_none == (n == 1)
