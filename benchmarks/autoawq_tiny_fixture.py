"""One-off: the test fixture tests/data/autoawq-tiny-g64, written by AutoAWQ 0.2.9 itself.

A tiny random Llama (2 layers, vocabulary 256, tied embeddings) is quantized by AutoAWQ's
own calibrated pipeline (scale search, clipping, GEMM packing) on fixed random token rows,
saved with `save_quantized`; the quantized model AutoAWQ holds (its WQLinear_GEMM modules,
whose buffers are what was saved) runs on fixed ids through AutoAWQ's own CPU path
(`dequantize_gemm`, fp16 activations; `from_quantized` on CPU would need IPEX): the logits go
beside it (autoawq-tiny-g64-expected.safetensors). CI then loads the checkpoint with kvboost's loader (no
AutoAWQ installed) and compares. Runs in the throwaway AutoAWQ environment (see
autoawq_reference.py):

    /work/awq-ref-venv/bin/python benchmarks/autoawq_tiny_fixture.py --out tests/data/autoawq-tiny-g64
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

CONFIG = dict(vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True, use_cache=False)
GROUP_SIZE = 64          # AutoAWQ's clip search needs out_features divisible by 64
IDS = [[1, 17, 100, 45, 3, 99, 127, 7, 64, 12, 30, 2]]


def tiny_float_model(directory: Path) -> None:
    """Save a seeded random fp16 Llama with CONFIG into `directory` (transformers 4.x layout)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).half().eval()
    model.save_pretrained(directory)


def expected_path(checkpoint: Path) -> Path:
    """Where the reference logits go: beside the checkpoint directory, not in it."""
    return checkpoint.with_name(checkpoint.name + "-expected.safetensors")


def calibration_rows() -> list[list[int]]:
    import torch
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, CONFIG["vocab_size"], (16, 64), generator=gen).tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import torch
    from awq import AutoAWQForCausalLM
    from safetensors.torch import save_file

    quant_config = {"zero_point": True, "q_group_size": GROUP_SIZE, "w_bit": 4, "version": "GEMM"}
    with tempfile.TemporaryDirectory() as tmp:
        tiny_float_model(Path(tmp))
        model = AutoAWQForCausalLM.from_pretrained(tmp, device_map="cpu", torch_dtype=torch.float16)
        model.model.config.use_cache = False
        model.quantize(None, quant_config=quant_config, calib_data=calibration_rows(), max_calib_samples=16,
                       max_calib_seq_len=64)
        model.save_quantized(str(args.out))
    from awq.modules.linear import gemm
    gemm.TRITON_AVAILABLE = False             # triton imports here but has no GPU: use AutoAWQ's CPU path
    model.model.half()                        # as AutoAWQ runs it: fp16 throughout
    with torch.no_grad():
        logits = model.model(torch.tensor(IDS)).logits.float()
    save_file({"input_ids": torch.tensor(IDS), "logits": logits.contiguous()}, str(expected_path(args.out)))
    print(json.loads((args.out / "config.json").read_text())["quantization_config"])


if __name__ == "__main__":
    main()
