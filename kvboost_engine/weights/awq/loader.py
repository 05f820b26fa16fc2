"""Build an HF causal LM from an AWQ GEMM checkpoint, without AutoAWQ and without the full model in memory.

The model skeleton is created on the meta device; every linear layer the checkpoint stores
as qweight/qzeros/scales becomes an AWQLinear; only the dense tensors (embeddings, norms,
biases, lm_head) are materialised. Quantized weights are converted to the compute layout
layer by layer: resident layers keep theirs, streamed layers go to a backing tier (a pack
file under the kvboost cache dir, written once, or host RAM).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import xxhash
from torch import nn

from ...paths import build_folder, build_lock, cache_home
from ...model import compat
from ...model.building import building_model
from ...model.arch import ModelAdapter, check_supported, decoder_layers, rebuild_rotary, tie_output_embeddings
from ...errors import InputError, UnsupportedModelError
from ..residency import LayerBinding, resident_layers_set
from ..memory import release_free_memory
from ..streamer import LayerStreamer
from ..tiers import HostRamTier, PackFileTier, pack_file_ok, write_pack_file
from ..checkpoint import Checkpoint, read_header
from .format import AWQConfig, awq_config_of
from .kernels import CpuInt4PackLayout, NativeLayout, select_layout, torch_cpu_layout
from .linear import AWQLinear

PACK_FORMAT = "kvboost-awq-pack-1"
_PACKED_INTS = (torch.int32, torch.int64)      # eight 4-bit values a word (int64 as some exporters widen it)
_FLOAT_SCALES = (torch.float16, torch.bfloat16, torch.float32)
STREAM_TIERS = ("disk", "ram")


@dataclass(slots=True)
class AWQInfo:
    """What was loaded: layout, residency and weight bytes (reported in Engine.stats())."""

    awq_kernel: str
    awq_group_size: int
    resident_layers: int
    streamed_layers: int
    resident_layer_bytes: int
    streamed_layer_bytes: int
    dense_weight_bytes: int
    weights_digest: str
    pack_file: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def load_awq_model(directory: Path, *, device: torch.device, dtype: torch.dtype,
                   resident_layers: int | None = None, resident_bytes: int | None = None,
                   stream_from: str = "disk", staging_slots: int = 2, kernel: str | None = None,
                   pack_dir: Path | None = None, native: bool = False) -> nn.Module:
    """Load an AWQ (GEMM) checkpoint directory; stream all but the resident decoder layers.

    `native`: the native step runs on this machine (loading.py asks native.build); then, with no
    kernel named, a float32 model with every layer resident loads its layers in the native step's
    layout (kernels.NativeLayout: PackedLinear modules)."""
    from transformers import AutoConfig

    if stream_from not in STREAM_TIERS:
        raise InputError(f"stream_from must be one of {STREAM_TIERS}, got {stream_from!r}")
    if isinstance(staging_slots, bool) or not isinstance(staging_slots, int) or staging_slots < 2:
        raise InputError(f"staging_slots must be an int >= 2 (layer streaming holds one layer while the next "
                         f"loads), got {staging_slots!r}")
    if resident_bytes is not None and (isinstance(resident_bytes, bool) or not isinstance(resident_bytes, int)
                                       or resident_bytes < 0):
        raise InputError(f"resident_bytes must be None or an int >= 0, got {resident_bytes!r}")
    config = compat.fix_loaded_config(AutoConfig.from_pretrained(directory))
    check_supported(config)
    awq = awq_config_of(config)
    if awq is None:
        raise UnsupportedModelError(f"{directory} has no AWQ quantization_config")
    every = resident_bytes is None and (resident_layers is None or (type(resident_layers) is int
                                                                    and resident_layers >= config.num_hidden_layers))
    layout = select_layout(device, kernel, native=native and every and dtype == torch.float32)
    if isinstance(layout, NativeLayout) and not every:
        raise InputError("awq_kernel='native' keeps every layer resident (the native step reads them in place); "
                         "layer streaming (resident_layers, resident_bytes) runs with 'cpu-int4pack' or 'dequant'")
    ckpt = Checkpoint(directory)
    model = _skeleton(config, awq, ckpt, layout, dtype)
    _load_dense(model, ckpt, dtype)
    if isinstance(layout, NativeLayout) and kernel is None and not _step_takes(model):
        _off_native(model)                  # the default: PyTorch's kernels, where the native step would not run
    native_bytes = _native_layers(model, ckpt)
    layers = decoder_layers(model)
    bindings = {i: LayerBinding(awq_modules(layer)) for i, layer in enumerate(layers)}
    resident = resident_layers_set(len(layers), resident_layers, layer_bytes=[bindings[i].nbytes for i in range(len(layers))],
                                   resident_bytes=resident_bytes, staging_slots=staging_slots)
    streamed = [i for i in range(len(layers)) if i not in resident and bindings[i].nbytes]
    digest = ckpt.digest(Path(pack_dir or cache_home() / "awq-packs"))   # cached beside the pack files
    for i in sorted(set(range(len(layers))) - set(streamed)):
        bindings[i].bind(_layer_blob(bindings[i], layers[i], ckpt).to(device))
    model.to(device)
    tier, pack_path = None, None
    if streamed:
        packed = {i: bindings[i] for i in streamed}
        if stream_from == "disk":
            pack_path = _pack_file({i: b for i, b in bindings.items() if b.nbytes}, streamed, layers, ckpt, digest,
                                   pack_dir)
            tier = PackFileTier(pack_path)
        else:
            tier = HostRamTier({i: _layer_blob(b, layers[i], ckpt, pin=device.type == "cuda") for i, b in packed.items()})
        model.kvboost_streamer = LayerStreamer(layers, packed, tier, staging_slots, device)
    model.kvboost_awq = _info(model, awq, bindings, streamed, digest, pack_path, native_bytes)
    # the kernels in the identity too (model_fingerprint reads it): each computes its own numbers,
    # so KV one kernel wrote is not the other's exact hit (cpu-int4pack's also by CPU capability)
    kernels = model.kvboost_awq.awq_kernel
    if "cpu-int4pack" in kernels:
        kernels += f"@{torch.backends.cpu.get_cpu_capability()}"
    model.config.quantization_config = {**awq.to_dict(), "weights_digest": digest, "kvboost_kernels": kernels}
    release_free_memory(collect=True)
    return model.eval()


def awq_modules(layer: nn.Module) -> list[AWQLinear]:
    """The AWQLinear modules of one decoder layer, in module order."""
    return [m for m in layer.modules() if isinstance(m, AWQLinear)]


def _skeleton(config, awq: AWQConfig, ckpt: Checkpoint, layout, dtype) -> nn.Module:
    from transformers import AutoModelForCausalLM

    plain = config.__class__.from_dict({k: v for k, v in config.to_dict().items() if k != "quantization_config"})
    with building_model(), torch.device("meta"):
        model = AutoModelForCausalLM.from_config(plain, dtype=dtype)
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and f"{name}.qweight" in ckpt:
            k, n = module.in_features, module.out_features
            _check_shapes(ckpt, name, k, n, awq.group_size)
            chosen = layout
            if isinstance(layout, (NativeLayout, CpuInt4PackLayout)) and not layout.supports(k, n, awq.group_size):
                chosen = torch_cpu_layout(k, n, awq.group_size)             # cpu-int4pack or dequant
            replacement = AWQLinear(k, n, awq.group_size, chosen, module.bias is not None, device="meta",
                                    dtype=dtype, checkpoint_name=name)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, replacement)
    model.to_empty(device="cpu")
    rebuild_rotary(model)                                           # its buffers were left unset by to_empty
    for module in model.modules():                                  # as is Gemma 3's embedding scale (a
        scale = getattr(module, "scalar_embed_scale", None)         # non-persistent buffer: not in the file)
        if scale is not None and isinstance(getattr(module, "embed_scale", None), torch.Tensor):
            with torch.no_grad():
                module.embed_scale.fill_(scale)
    return model


def _check_shapes(ckpt: Checkpoint, name: str, k: int, n: int, group: int) -> None:
    """The AWQ tensors of linear `name` [n, k] as the config and the group size imply (GEMM packing),
    else UnsupportedModelError naming the tensor."""
    if k % group or n % 8:
        raise UnsupportedModelError(f"{name}: {k} inputs / {n} outputs do not fit AWQ groups of {group} "
                                    f"(and 8 outputs an int32)")
    want = {"qweight": (k, n // 8), "qzeros": (k // group, n // 8), "scales": (k // group, n)}
    for part, shape in want.items():
        entry = ckpt.entries.get(f"{name}.{part}")
        if entry is None or entry.shape != shape:
            got = "absent" if entry is None else list(entry.shape)
            raise UnsupportedModelError(f"{name}.{part}: {got} in the checkpoint, {list(shape)} expected from "
                                        f"its config (group_size {group}): a checkpoint of another model or settings")
        kinds = _FLOAT_SCALES if part == "scales" else _PACKED_INTS
        if entry.dtype not in kinds:
            raise UnsupportedModelError(f"{name}.{part} is {str(entry.dtype).removeprefix('torch.')} in the checkpoint; "
                                        f"AWQ GEMM stores it as {' or '.join(str(d).removeprefix('torch.') for d in kinds)}")


def _load_dense(model: nn.Module, ckpt: Checkpoint, dtype) -> None:
    """Copy every parameter and persistent buffer from the checkpoint (lm_head may be tied).

    Garbage from config/tokenizer loading is returned to the OS first: the dense weights are
    the largest allocation of a streamed model, so this is where peak RSS is set."""
    release_free_memory()
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    missing = []
    for name, tensor in list(model.named_parameters()) + _persistent_buffers(model):
        if name in ckpt:
            try:
                with torch.no_grad():
                    ckpt.copy_into(name, tensor.data)
            except ValueError as err:            # shapes the config does not describe
                raise UnsupportedModelError(f"the AWQ checkpoint does not fit its config: {err}") from err
        elif not (tied and name == "lm_head.weight"):
            missing.append(name)
    if missing:
        raise UnsupportedModelError(f"the AWQ checkpoint lacks tensors the model needs: {', '.join(missing[:8])}")
    if tied:
        tie_output_embeddings(model)


def _persistent_buffers(model: nn.Module) -> list:
    out = []
    for module_name, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                out.append((f"{module_name}.{name}" if module_name else name, buf))
    return out


def _step_takes(model: nn.Module) -> bool:
    """Whether the native step would run this model once its AWQ layers are native: plain Llama layers
    (not Phi-3, no MLP bias), every decoder linear an AWQ layer the native layout reads (none kept
    dense by modules_to_not_convert, none of a shape it does not read), two rotary kinds at most.
    Otherwise every layer would run PackedLinear's float32 dequantization per forward: 8x slower
    than cpu-int4pack in a review."""
    try:
        adapter = ModelAdapter(model)
    except InputError:                      # a KV geometry the engine refuses: it says so when it is built
        return False
    if adapter.plain_llama()[1] is not None or len(set(adapter.layer_rope_kinds)) > 2:
        return False
    linears = [m for i in range(len(adapter.layers)) for m in adapter.layer_parts(i).linears]
    return all(type(m) is AWQLinear and isinstance(m.layout, NativeLayout) for m in linears)


def _off_native(model: nn.Module) -> None:
    """Every AWQ layer of the native layout onto PyTorch's kernel (cpu-int4pack where it reads the shape
    and passes its check, else dequant)."""
    for module in model.modules():
        if isinstance(module, AWQLinear) and isinstance(module.layout, NativeLayout):
            module.layout = torch_cpu_layout(module.in_features, module.out_features, module.group_size)


def _native_layers(model: nn.Module, ckpt: Checkpoint) -> int:
    """Each AWQLinear of the native layout replaced by the PackedLinear of its tensors (read and
    converted one at a time); the bytes they hold."""
    total = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, AWQLinear) and isinstance(module.layout, NativeLayout):
            tensors = _prepared(module, name, ckpt)
            bias = None if module.bias is None else module.bias.data
            packed = module.layout.module(tensors, module.in_features, module.out_features, bias)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, packed)
            total += sum(t.numel() * t.element_size() for t in packed.buffers())
            release_free_memory()
    return total


def _prepared(module: AWQLinear, prefix: str, ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    return module.layout.prepare(ckpt.read(f"{prefix}.qweight"), ckpt.read(f"{prefix}.qzeros"),
                                 ckpt.read(f"{prefix}.scales"), module.group_size)


def _layer_blob(binding: LayerBinding, layer: nn.Module, ckpt: Checkpoint, pin: bool = False) -> torch.Tensor:
    """One layer's weights in its compute layout, as one uint8 blob (see residency.LayerBinding).

    The conversion's temporaries (unpacked nibbles, int32 copies) are handed back to the OS
    before the next layer, so they neither add up nor fragment the heap across layers."""
    out = torch.zeros(binding.nbytes, dtype=torch.uint8, pin_memory=pin)
    binding.pack([_prepared(m, m.checkpoint_name, ckpt) for m in awq_modules(layer)], out)
    release_free_memory()
    return out


def _pack_file(bindings: dict[int, LayerBinding], streamed: list[int], layers, ckpt: Checkpoint, digest: str,
               pack_dir) -> Path:
    """Every layer's blob in a file under the cache dir, written once per checkpoint, layout, PyTorch and
    CPU capability: loads with any residency stream their layers from it (a pack per residency set
    left one model-sized file per setting tried). Packs of the same checkpoint and setup written per
    residency set by earlier versions are removed. The `streamed` layers' bytes are checked (once per
    process): a load streaming one layer does not read the whole model."""
    layouts = sorted({m.layout.name for i in bindings for m in awq_modules(layers[i])})
    cpu = torch.backends.cpu.get_cpu_capability()
    key = xxhash.xxh3_64_hexdigest(":".join([PACK_FORMAT, digest, torch.__version__, ",".join(layouts),
                                             cpu, repr(sorted(bindings))]).encode())
    target = build_folder(Path(pack_dir or cache_home() / "awq-packs")) / f"{key}.safetensors"   # killed writers' files go
    sizes = {i: b.nbytes for i, b in bindings.items()}
    metadata = {"format": PACK_FORMAT, "weights_digest": digest, "layouts": ",".join(layouts),
                "torch": torch.__version__, "cpu": cpu}
    if not pack_file_ok(target, sizes, metadata, streamed):
        with build_lock(target):
            if not pack_file_ok(target, sizes, metadata, streamed):   # absent, cut short, damaged: written again
                blobs = ((i, _layer_blob(bindings[i], layers[i], ckpt)) for i in sorted(bindings))
                write_pack_file(target, sizes, blobs, metadata)
    _drop_other_packs(target, metadata)
    return target


def _drop_other_packs(target: Path, metadata: dict) -> None:
    """Remove the other pack files of the same checkpoint and setup (an earlier version's, one per
    residency set; those without the torch / cpu fields count as this setup's). A process still
    streaming from one keeps reading it until it closes."""
    for other in target.parent.glob("*.safetensors"):
        try:
            if other == target:
                continue
            found = read_header(other)[0].get("__metadata__") or {}
            if all(found.get(k) == metadata[k] for k in ("format", "weights_digest", "layouts")) \
                    and all(found.get(k, metadata[k]) == metadata[k] for k in ("torch", "cpu")):
                other.unlink()
        except (OSError, ValueError, TypeError, AttributeError):     # gone already, not a pack
            continue


def _info(model, awq: AWQConfig, bindings, streamed, digest, pack_path, native_bytes: int) -> AWQInfo:
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    streamed_bytes = sum(bindings[i].nbytes for i in streamed)
    total = sum(b.nbytes for b in bindings.values()) + native_bytes
    kernels = sorted({m.layout.name for b in bindings.values() for m, _, _ in b.placed} | ({"native"} if native_bytes else set()))
    return AWQInfo(",".join(kernels), awq.group_size, len(bindings) - len(streamed), len(streamed),
                   total - streamed_bytes, streamed_bytes, dense, digest, str(pack_path) if pack_path else None)
