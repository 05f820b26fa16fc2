"""PackedEmbedding: a lookup of one id (a decode step's token, by views of its tile) gives the same
numbers as the indexed lookup of several ids and as the decoded matrix's row."""
import pytest
import torch

from kvboost_engine.weights.packed import PackedEmbedding, PackedLinear, pack_codes


@pytest.mark.parametrize("bits,m_code,scaled", [(4, 0, False), (8, 0, False), (8, 128, True), (4, 8, True)])
def test_one_id_equals_many_and_the_decoded_rows(bits, m_code, scaled):
    torch.manual_seed(0)
    n, k = 48, 96
    codes = torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8)
    scale = torch.rand(n, k // 32) + 0.01
    offset = None if m_code else -torch.rand(n, k // 32)
    tiles = pack_codes(codes, scale, offset, bits, offset_dtype=torch.bfloat16)
    m = tiles["m"] if tiles["m"] is not None else (-m_code * scale).to(torch.bfloat16).view(n // 16, 16, k // 32).permute(0, 2, 1).reshape(-1)
    table = PackedLinear(tiles["codes"], tiles["d"], m, bits, n, k, m_code=m_code)
    embedding = PackedEmbedding(table, scale=torch.tensor(3.0) if scaled else None)
    rows = table.dequantized() * (3.0 if scaled else 1.0)
    ids = torch.tensor([[0, 1, 15, 16, 17, 31, 47]])
    with torch.inference_mode():
        many = embedding(ids)
        assert torch.equal(many[0], rows[ids[0]])
        for j in range(ids.shape[1]):
            one = embedding(ids[:, j:j + 1])
            assert one.shape == (1, 1, k) and torch.equal(one[0, 0], many[0, j])
        assert torch.equal(embedding(torch.tensor(5)), rows[5])                 # a 0-d id: [K]


def test_an_id_outside_the_table_is_an_index_error():
    """As nn.Embedding: a negative id or one past the last row raises, on the one-id and the many-id path
    (tensor indexing alone would wrap -1 to the last row)."""
    codes = torch.randint(0, 16, (32, 64), dtype=torch.uint8)
    tiles = pack_codes(codes, torch.rand(32, 2) + 0.01, -torch.rand(32, 2), 4, offset_dtype=torch.bfloat16)
    embedding = PackedEmbedding(PackedLinear(tiles["codes"], tiles["d"], tiles["m"], 4, 32, 64))
    with torch.inference_mode():
        for ids in ([[-1]], [[32]], [[0, -1]], [[3, 32]]):
            with pytest.raises(IndexError):
                embedding(torch.tensor(ids))
        assert embedding(torch.tensor([[0, 31]])).shape == (1, 2, 64)
