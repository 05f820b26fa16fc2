"""int8 disk storage of cached chunks: small, close, and never reported as exact."""
import torch

from kvboost_engine import Engine
from kvboost_engine.kv.geometry import KVGeometry
from kvboost_engine.kv.codec import Int8Codec
from test_engine_exact import SYSTEM


def test_int8_codec_round_trip_is_small_and_close():
    geometry = KVGeometry(4, 2, 16, torch.float32)
    torch.manual_seed(0)
    kv = torch.randn(2, 4, 2, 40, 16) * torch.linspace(0.1, 8, 16)      # channels of very different size
    codec = Int8Codec(geometry)
    data = codec.encode(kv)
    assert data.numel() < 0.3 * kv.numel() * 4
    back = codec.decode(data, 40)
    assert back.shape == kv.shape and back.dtype == kv.dtype
    assert (back - kv).norm() / kv.norm() < 0.01


def test_int8_disk_entries_are_restored_as_inexact_and_answer_stays_close(smol, tmp_path):
    model, tokenizer = smol
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What does a tune-up cost?"}]
    first = Engine(model, tokenizer, disk_cache_dir=str(tmp_path), disk_kv_int8=True)
    reference = first.chat(messages, max_new_tokens=12)
    first.close()
    restarted = Engine(model, tokenizer, disk_cache_dir=str(tmp_path), disk_kv_int8=True)
    g = restarted.chat(messages, max_new_tokens=12)
    assert restarted.stats()["disk_restored_chunks"] > 0
    assert g.reused_moved > 100 and g.reused_exact == 0
    assert g.token_ids[:4] == reference.token_ids[:4]
    float_engine = Engine(model, tokenizer, disk_cache_dir=str(tmp_path))
    assert float_engine.chat(messages, max_new_tokens=2).reused_tokens == 0     # int8 files are not float files
