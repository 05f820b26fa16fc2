"""The GGUF files the #28 benchmark (benchmarks/micro/gguf.py) runs, built once under
$KVBOOST_HOME/bench-models (default ~/.cache/kvboost/bench-models) with llama.cpp's own tools
(benchmarks/llama_tools.sh: llama-quantize, convert_hf_to_gguf.py and gguf-py from the
llama-cpp-python 0.3.36 sdist).

  default  SmolLM2-135M-Instruct: the Q4_1 GGUF it ships as (Q8_0 embedding), Q4_0, Q4_K_M and Q8_0
           requants (llama-quantize --allow-requantize), and its HF directory for weights="int4"
  gemma3   Gemma 3 270M: the Q4_K_M GGUF of the named model, Q4_0 and Q4_1 requants of it, and its
           HF directory; "q4_k_m:stored" is the Q4_K_M file with weights="gguf" (Gemma loads as
           float32 by default: the native step does not run it)
  1.7b     random weights (seed 0) with SmolLM2-1.7B's config (speed and memory do not depend on
           the values), saved as bf16 safetensors with the default model's tokenizer (same
           vocabulary), converted to a BF16 GGUF, then quantized to Q4_0, Q4_1, Q4_K_M and Q8_0
           (and Q5_K_M, built only where a benchmark names it: model_file("1.7b", "q5_k_m"))
  qwen3-1.7b  the same with Qwen3-1.7B's config (q/k norms, head_dim 128, 16 / 8 heads, its 151,936-row
           tied embedding; the default model's tokenizer, the vocabulary padded by llama.cpp's
           converter), Q4_0 only
  gemma3-1b  the same with Gemma 3 1B's config (26 layers, 4 query heads over 1 KV head of 256, a
           512-token window on 5 layers of 6, two rotary bases, the 262,144-row tied embedding), with
           Gemma 3 270M's tokenizer: its tokenizer.json for the converter (which keeps as many
           embedding rows as that vocabulary has), then the 270M GGUF's tokenizer entries copied
           into the BF16 GGUF (benchmarks/gguf_tokenizer.py), as the converter writes a tokenizer.json
           without tokenizer.model as a GPT-2 vocabulary that transformers cannot read back; Q4_0 only
  llama3-8b  the same with Llama 3.1 8B's config (32 layers, 32 query heads over 8 KV heads of 128, its
           "llama3" rotary scaling, which the converter stores as a rope_freqs tensor, an untied
           128,256-row head: Q6_K in llama-quantize's Q4_0), the default model's tokenizer (vocabulary
           padded by the converter); Q4_0 only. Building it takes ~16 GB of RAM (the bf16 model) and
           ~37 GB of disk (HF directory 16, BF16 GGUF 16, Q4_0 4.7): the first two may be deleted
           after, the Q4_0 file is used alone once it exists

Run: python -m benchmarks.gguf_models [--model default,gemma3,1.7b,qwen3-1.7b,gemma3-1b,llama3-8b]   (prints the files;
     the default list leaves out llama3-8b, NAMED_ONLY)
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

STORED = ":stored"          # a format's file loaded with weights="gguf" (as stored whatever the architecture)
GGUF_FORMATS = {"q4_0": "Q4_0", "q4_1": "Q4_1", "q4_k_m": "Q4_K_M", "q5_k_m": "Q5_K_M", "q8_0": "Q8_0"}
MODEL_FORMATS = {"default": ("q4_1", "q4_0", "q4_k_m", "q8_0", "hf-int4"),
                 "gemma3": ("q4_k_m", "q4_k_m:stored", "q4_0", "q4_1", "hf-int4"),
                 "1.7b": ("q4_0", "q4_1", "q4_k_m", "q8_0", "hf-int4"),
                 "qwen3-1.7b": ("q4_0",),
                 "gemma3-1b": ("q4_0",),
                 "llama3-8b": ("q4_0",)}
SMOLLM2_1P7B = dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=32,
                    intermediate_size=8192, vocab_size=49152, tie_word_embeddings=True, rope_theta=130000.0,
                    rms_norm_eps=1e-5, max_position_embeddings=8192, bos_token_id=1, eos_token_id=2,
                    pad_token_id=2, hidden_act="silu", initializer_range=0.02)
QWEN3_1P7B = dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, intermediate_size=6144, vocab_size=151936, tie_word_embeddings=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, rms_norm_eps=1e-6,
                  max_position_embeddings=40960, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                  hidden_act="silu", initializer_range=0.02)
GEMMA3_1B = dict(hidden_size=1152, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                 intermediate_size=6912, vocab_size=262144, tie_word_embeddings=True, sliding_window=512,
                 layer_types=[("full_attention" if i % 6 == 5 else "sliding_attention") for i in range(26)],
                 query_pre_attn_scalar=256, rms_norm_eps=1e-6, max_position_embeddings=32768,
                 rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
                 hidden_activation="gelu_pytorch_tanh", bos_token_id=2, eos_token_id=1, pad_token_id=0,
                 initializer_range=0.02)
LLAMA3_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                 intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False,
                 rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                 rms_norm_eps=1e-5, max_position_embeddings=131072, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                 hidden_act="silu", initializer_range=0.02)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "generation_config.json")


def home() -> Path:
    """The real kvboost home (benchmarks may point KVBOOST_HOME of their children elsewhere)."""
    from kvboost_engine.paths import cache_home
    return cache_home()


def tools_dir(variant: str = "") -> Path:
    """llama.cpp's tools, built by benchmarks/llama_tools.sh (run it when they are missing)."""
    dest = home() / ("llama-tools" + (f"-{variant}" if variant else ""))
    if not (dest / "bin" / "llama-quantize").is_file() or not (dest / "pydeps").is_dir():
        script = Path(__file__).with_name("llama_tools.sh")
        subprocess.run(["bash", str(script)] + (["--avx2"] if variant == "avx2" else []), check=True)
    return dest


def bench_dir(name: str) -> Path:
    path = home() / "bench-models" / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def _run(cmd: list, **kw) -> None:
    """Run a tool quietly; its output's end is shown when it fails."""
    print("+", " ".join(map(str, cmd)), file=sys.stderr)
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    if done.returncode != 0:
        raise RuntimeError(f"{cmd[0]} exited {done.returncode}: {(done.stdout + done.stderr)[-2000:]}")


def quantize(source: Path, target: Path, kind: str, requantize: bool = False) -> Path:
    """llama-quantize `source` into `target` (`kind`: Q4_0, Q4_1, Q4_K_M, Q8_0), once."""
    if not target.is_file():
        partial = target.with_name(target.name + ".partial")
        extra = ["--allow-requantize"] if requantize else []
        _run([tools_dir() / "bin" / "llama-quantize", *extra, source, partial, kind, "2"])
        os.replace(partial, target)
    return target


RANDOM = {"1.7b": ("smollm2-1.7b-random", "llama", SMOLLM2_1P7B, "LlamaForCausalLM"),
          "qwen3-1.7b": ("qwen3-1.7b-random", "qwen3", QWEN3_1P7B, "Qwen3ForCausalLM"),
          "gemma3-1b": ("gemma3-1b-random", "gemma3_text", GEMMA3_1B, "Gemma3ForCausalLM"),
          "llama3-8b": ("llama3-8b-random", "llama", LLAMA3_8B, "LlamaForCausalLM")}
TOKENIZER_OF = {"gemma3-1b": "gemma3"}    # a RANDOM model's tokenizer: that model's (else the default model's)
NAMED_ONLY = ("llama3-8b",)               # built only where named (~16 GB of RAM, ~37 GB of disk), never by default


def random_hf(model: str = "1.7b") -> Path:
    """The random-weight HF directory (bf16 safetensors) of a RANDOM model, made once."""
    name, model_type, settings, architecture = RANDOM[model]
    target = bench_dir(name) / "hf"
    if any(target.glob("*.safetensors")):
        return target
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvboost_engine.loading import default_model_dir
    from kvboost_engine.model import compat
    config = AutoConfig.for_model(model_type, **compat.config_settings(settings, model_type))
    config.architectures = [architecture]
    torch.manual_seed(0)
    weights = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)     # 3.4-4 GB, never fp32
    staging = target.with_name("hf.partial")
    shutil.rmtree(staging, ignore_errors=True)
    weights.save_pretrained(staging)
    del weights
    tokenizer_dir = hf_dir(TOKENIZER_OF[model]) if model in TOKENIZER_OF else default_model_dir()
    for file in TOKENIZER_FILES:
        if (tokenizer_dir / file).is_file() and file != "generation_config.json":
            shutil.copyfile(tokenizer_dir / file, staging / file)
    os.replace(staging, target)
    return target


def random_gguf(fmt: str, model: str = "1.7b") -> Path:
    """A RANDOM model's GGUF in `fmt` (a GGUF_FORMATS key), via a BF16 GGUF (kept)."""
    name = RANDOM[model][0]
    folder = bench_dir(name)
    target = folder / f"{name}.{GGUF_FORMATS[fmt]}.gguf"
    if target.is_file():                        # (the BF16 file and HF directory may be deleted after)
        return target
    bf16 = folder / f"{name}.BF16.gguf"
    if not bf16.is_file():
        tools = tools_dir()
        partial = bf16.with_name(bf16.name + ".partial")
        env = dict(os.environ, PYTHONPATH=f"{tools / 'gguf-py'}{os.pathsep}{tools / 'pydeps'}")
        _run([sys.executable, tools / "convert_hf_to_gguf.py", random_hf(model), "--outtype", "bf16",
              "--outfile", partial, "--model-name", name], env=env)
        if model in TOKENIZER_OF:
            donor = model_file(TOKENIZER_OF[model], MODEL_FORMATS[TOKENIZER_OF[model]][0])
            converted = partial.with_name(partial.name + ".converted")
            os.replace(partial, converted)
            _run([sys.executable, Path(__file__).with_name("gguf_tokenizer.py"), converted, donor, partial], env=env)
            converted.unlink()
        os.replace(partial, bf16)
    return quantize(bf16, target, GGUF_FORMATS[fmt])


def default_gguf(fmt: str) -> Path:
    from kvboost_engine.loading import default_gguf_file
    shipped = default_gguf_file()
    if fmt == "q4_1":
        return shipped
    return quantize(shipped, bench_dir("smollm2-135m") / f"SmolLM2-135M-Instruct.{GGUF_FORMATS[fmt]}.gguf",
                    GGUF_FORMATS[fmt], requantize=True)


def gemma3_gguf(fmt: str) -> Path:
    from kvboost_engine.named_models import fetch_gguf, named_model
    model = named_model("gemma3-270m")
    shipped = bench_dir("gemma3-270m") / model.gguf_name
    if not shipped.is_file():
        with tempfile.TemporaryDirectory(dir=shipped.parent) as tmp:        # the part wheels: not kept
            os.replace(fetch_gguf(model, Path(tmp)), shipped)
    if fmt == "q4_k_m":
        return shipped
    return quantize(shipped, shipped.parent / f"gemma-3-270m.{GGUF_FORMATS[fmt]}.gguf", GGUF_FORMATS[fmt],
                    requantize=True)


def hf_dir(model: str) -> Path:
    from kvboost_engine.loading import default_model_dir, resolve_model_dir
    if model == "default":
        return default_model_dir()
    if model == "gemma3":
        return Path(resolve_model_dir("gemma3-270m"))
    return random_hf(model)


def model_file(model: str, fmt: str) -> Path:
    """The file (GGUF) or directory (hf-int4) of `model` in `fmt`, built once ("<fmt>:stored": the
    same file, loaded with weights="gguf")."""
    fmt = fmt.removesuffix(STORED)
    if fmt == "hf-int4":
        return hf_dir(model)
    if model in RANDOM:
        return random_gguf(fmt, model)
    return {"default": default_gguf, "gemma3": gemma3_gguf}[model](fmt)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=",".join(m for m in MODEL_FORMATS if m not in NAMED_ONLY))
    args = parser.parse_args(argv)
    for model in args.model.split(","):
        for fmt in MODEL_FORMATS[model]:
            print(f"{model:8} {fmt:8} {model_file(model, fmt)}")


if __name__ == "__main__":
    main()
