"""One-off: write the default model as an AWQ checkpoint with AutoAWQ 0.2.9 itself.

AutoAWQ needs transformers 4.x, so this runs in a throwaway environment, not ours:

    python3 -m venv /work/awq-ref-venv
    /work/awq-ref-venv/bin/pip install torch==2.13.0
    /work/awq-ref-venv/bin/pip install "transformers>=4.45,<4.52" accelerate datasets zstandard autoawq==0.2.9
    /work/awq-ref-venv/bin/python benchmarks/autoawq_reference.py --src ~/.cache/kvboost/models/SmolLM2-135M-Instruct \
        --out /tmp/smol-autoawq-g64 --group-size 64

Then, in our environment: `python -m benchmarks.awq_check --awq /tmp/smol-autoawq-g64`.
Calibration text is CPython's own pydoc topics (kvboost_engine/awq/texts.py, loaded by path).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import tempfile
import time
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def load_texts_module():
    path = Path(__file__).resolve().parents[1] / "kvboost_engine" / "awq" / "texts.py"
    spec = importlib.util.spec_from_file_location("kvboost_texts", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def v4_view(src: Path, workdir: Path) -> Path:
    """The model directory as transformers 4.x reads it (rope_theta, a fast tokenizer class)."""
    view = workdir / "v4"
    view.mkdir()
    config = json.loads((src / "config.json").read_text())
    rope = config.pop("rope_parameters", None) or {}
    config["rope_theta"] = rope.get("rope_theta", 10000.0)
    config["torch_dtype"] = config.pop("dtype", "float32")
    (view / "config.json").write_text(json.dumps(config, indent=2))
    tok = json.loads((src / "tokenizer_config.json").read_text())
    tok["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok.pop("backend", None)
    template = src / "chat_template.jinja"
    if template.exists():
        tok["chat_template"] = template.read_text()
    (view / "tokenizer_config.json").write_text(json.dumps(tok, indent=2))
    for name in ("model.safetensors", "tokenizer.json", "generation_config.json"):
        (view / name).symlink_to(src / name)
    return view


def autoawq_rtn(model, quant_config: dict) -> None:
    """AutoAWQ's quantize-and-pack step (AwqQuantizer._apply_quant) on every decoder linear, no search."""
    from awq.models._config import AwqConfig
    from awq.quantize.quantizer import AwqQuantizer
    from awq.utils.module import get_named_linears

    quantizer = AwqQuantizer.__new__(AwqQuantizer)
    quantizer.w_bit, quantizer.group_size = 4, quant_config["q_group_size"]
    quantizer.zero_point, quantizer.version = True, "gemm"
    for layer in model.model.model.layers:
        quantizer._apply_quant(layer, get_named_linears(layer))
    model.quant_config = AwqConfig.from_dict(quant_config)
    model.is_quantized = True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--no-clip", action="store_true", help="skip AutoAWQ's clip search (slow on CPU)")
    parser.add_argument("--dtype", choices=["float16", "float32"], default="float16",
                        help="compute dtype of the float model (AutoAWQ's default float16 is very slow on CPU)")
    parser.add_argument("--rtn", action="store_true",
                        help="no calibration: AutoAWQ's own round-to-nearest and GEMM packing per linear")
    args = parser.parse_args()
    import torch
    from awq import AutoAWQForCausalLM
    from transformers import AutoTokenizer

    texts = load_texts_module().calibration_texts(args.samples)
    with tempfile.TemporaryDirectory() as tmp:
        view = v4_view(args.src.expanduser(), Path(tmp))
        model = AutoAWQForCausalLM.from_pretrained(str(view), device_map="cpu", torch_dtype=getattr(torch, args.dtype))
        # AutoAWQ catches layer 0's kwargs from a full forward; with the config's use_cache=True
        # that includes a DynamicCache, so every search forward appends to it and later ones
        # attend to stale keys: the loss is wrong and the chosen scales are garbage.
        model.model.config.use_cache = False
        tokenizer = AutoTokenizer.from_pretrained(str(view))
        quant_config = {"zero_point": True, "q_group_size": args.group_size, "w_bit": 4, "version": "GEMM"}
        started = time.perf_counter()
        if args.rtn:
            autoawq_rtn(model, quant_config)
        else:
            model.quantize(tokenizer, quant_config=quant_config, calib_data=texts,
                           max_calib_samples=args.samples, max_calib_seq_len=256, n_parallel_calib_samples=8,
                           apply_clip=not args.no_clip)
        print(f"quantized in {time.perf_counter() - started:.0f} s")
        model.save_quantized(str(args.out))
    for name in TOKENIZER_FILES:   # our (transformers 5) tokenizer files, so kvboost reads them as usual
        if (args.src / name).exists():
            shutil.copy(args.src.expanduser() / name, args.out / name)
    print(json.loads((args.out / "config.json").read_text())["quantization_config"])


if __name__ == "__main__":
    main()
