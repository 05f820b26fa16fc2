"""Linear layers and embeddings stored in the native kernel's tile layout, the numbers of a
quantized file kept exactly (GGUF Q4_0 / Q4_1 / Q8_0 / K-quants; weights/gguf_model.py builds them).

A weight [N, K] is stored as integer codes (4 or 8 bits) with, per row and block of 32 input
columns, a scale `d` and an offset `m`: w[n, k] = code * d + m, or, for a matrix with an `m_code`
(weights="int4": m is the bf16 zero of code 8), w = code * d + (m - m_code * d), code 0's value
computed in float32 with one rounding (m_code * d is exact: a power of two). Tiles of 16 rows x 32
columns (`pack_codes`): what native/decode.cpp reads with vpdpbusd, so the native step reads these
very tensors, with no copy. `d` and `m` keep the file's own precision: float16 for Q4_0 / Q4_1 /
Q8_0 (GGUF stores fp16); an m that is -zero_code * d (Q4_0's -8 d, Q8_0's -128 d) may be left out
(None) and is then derived from d, exactly. The K-quants
keep their two levels: d and m are the 6-bit sub-block scale and minimum (uint8), `d2` and `m2` the
float16 super-block scale and minus the super-block minimum, one per 8 blocks; d * d2 and m * m2,
exact in float32, are the file's d * sc and -(dmin * mn) (4.6 bits a weight read, not 6 as float32
products). Q6_K keeps its 6-bit codes (the low 4 bits as 4-bit codes, the high 2 in two planes
after them), its int8 scale per 16 columns as d and its float16 super-block scale as d2: a weight
is (code - 32) * (d * d2), gguf's own expression (6.56 bits a weight, as the file). The 5-bit codes
of Q5_0, Q5_1 and Q5_K take the same 6-bit layout with their own scales per block.

The PyTorch path (prefill until the native kernel family takes it, CPUs without the native step)
dequantizes a layer's weight per forward (`dequantized`): a transient float copy of one matrix,
never of the model.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

TILE, BLOCK = 16, 32                # rows per tile, columns per block (one d and one m per row and block)
SCALE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SUPER = 8                       # blocks per super-block scale (uint8 d and m: K-quants)
FORWARD_SLICE = 1 << 23         # weight values decoded to float at once by the PyTorch path (32 MB)


def pack_codes(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, bits: int,
               scale_dtype: torch.dtype = torch.bfloat16, offset_dtype: torch.dtype = torch.float32) -> dict:
    """codes uint8 [N, K] (< 2**bits), scale [N, K/32], offset [N, K/32] (what code 0 decodes to;
    None: no m, for a matrix whose m the native step derives from d) -> the kernel's tiles
    {"codes": uint8, "d": scale_dtype, "m": offset_dtype or None}, each flat: codes [tiles, blocks,
    256 (4-bit: octet, half, row, 4 cols) or 512 (8-bit: quad, row, 4 cols), or 384 (6-bit: the low 4
    bits as 4-bit codes, then 2 planes of [row, 4 cols] bytes, plane p's bits 2s, 2s + 1 the high bits
    of quad 4p + s)], d and m [tiles, groups, 16 rows] (6-bit: two groups of 16 columns a block).
    The caller checks the scales are exact in their dtype."""
    n, k = codes.shape
    tiles, blocks = n // TILE, k // BLOCK
    if bits == 6:
        high = codes >> 4
        low = pack_codes(codes & 15, scale, None, 4, scale_dtype)["codes"].view(tiles, blocks, 256)
        h = high.view(tiles, TILE, blocks, 2, 4, 4).permute(0, 2, 3, 4, 1, 5)       # [T, B, plane, s, row, col]
        planes = h[:, :, :, 0] | (h[:, :, :, 1] << 2) | (h[:, :, :, 2] << 4) | (h[:, :, :, 3] << 6)
        packed = torch.cat([low, planes.reshape(tiles, blocks, 128)], dim=-1).contiguous()
    elif bits == 4:
        c = codes.view(tiles, TILE, blocks, 4, 2, 4).permute(0, 2, 3, 4, 1, 5)    # [T, B, octet, half, row, col]
        packed = (c[:, :, :, 0] | (c[:, :, :, 1] << 4)).contiguous()
    else:
        packed = codes.view(tiles, TILE, blocks, 8, 4).permute(0, 2, 3, 1, 4).contiguous()
    m = None if offset is None else tile_scales(offset, offset_dtype)
    return {"codes": packed.view(-1), "d": tile_scales(scale, scale_dtype), "m": m}


def tile_scales(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-row scales [N, G] (one per block, or per super-block) -> the kernel's order, flat [tiles, G, 16]."""
    n, groups = values.shape
    return values.to(dtype).view(n // TILE, TILE, groups).permute(0, 2, 1).contiguous().view(-1)


def unpack_codes(packed: torch.Tensor, n: int, k: int, bits: int) -> torch.Tensor:
    """The inverse of pack_codes for the codes: uint8 [N, K]."""
    tiles, blocks = n // TILE, k // BLOCK
    if bits == 6:
        p = packed.view(tiles, blocks, 384)
        low = unpack_codes(p[..., :256].reshape(-1), n, k, 4)
        planes = p[..., 256:].reshape(tiles, blocks, 2, 1, TILE, 4)                # [T, B, plane, -, row, col]
        high = torch.cat([(planes >> (2 * s)) & 3 for s in range(4)], dim=3)        # [T, B, plane, s, row, col]
        return low | (high.permute(0, 4, 1, 2, 3, 5).reshape(n, k) << 4)
    if bits == 4:
        p = packed.view(tiles, blocks, 4, TILE, 4)                                  # [T, B, octet, row, col]
        c = torch.stack([p & 15, p >> 4], dim=3)                                    # [T, B, octet, half, row, col]
        return c.permute(0, 4, 1, 2, 3, 5).reshape(n, k)
    return packed.view(tiles, blocks, 8, TILE, 4).permute(0, 3, 1, 2, 4).reshape(n, k)


class PackedLinear(nn.Module):
    """nn.Linear over a packed weight (module docstring): buffers codes, d, m (and bias)."""

    def __init__(self, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, bits: int,
                 out_features: int, in_features: int, bias: torch.Tensor | None = None,
                 zero_code: int | None = None, m_code: int = 0,
                 d2: torch.Tensor | None = None, m2: torch.Tensor | None = None):
        """zero_code: where m == -zero_code * d exactly (Q4_0: 8, Q5_0: 16, Q8_0 and re-quantized
        matrices: 128; a power of two), the native step derives m from d and never reads it.
        m_code: m is the value of this code (a power of two; 0: of code 0), so m may be stored in
        bf16 (weights="int4": the quantizer's own bf16 zero, half the bytes of a float32 offset).
        d2, m2: with uint8 d and m (K-quants), their float16 super-block scales [tiles, blocks / 8,
        16] (module docstring). Q6_K: 6-bit codes, int8 d [tiles, 2 blocks, 16], float16 d2, no m,
        zero_code 32; 6-bit codes with any other d hold 5-bit ones (Q5_0, Q5_1, Q5_K), scaled per
        block. m may be None wherever zero_code gives it."""
        super().__init__()
        for name, code in (("zero_code", zero_code), ("m_code", m_code or None)):
            if code is not None and (code <= 0 or code & (code - 1)):
                raise ValueError(f"{name} is a power of two (got {code})")
        if zero_code is not None and m_code:
            raise ValueError("zero_code (m derived from d) and m_code (m stored for a code) exclude each other")
        if bits not in (4, 6, 8) or out_features % TILE or in_features % BLOCK:
            raise ValueError(f"a packed weight is 4-, 6- or 8-bit with rows a multiple of {TILE} and columns of "
                             f"{BLOCK}; got {bits} bits, [{out_features}, {in_features}]")
        if m is None and zero_code is None:
            raise ValueError("a packed weight without m needs the zero_code that gives it")
        if d.dtype == torch.int8:
            if bits != 6 or m is not None or zero_code != 32 or d2 is None \
                    or d2.dtype != torch.float16 or m2 is not None or in_features % (BLOCK * SUPER):
                raise ValueError("int8 d (Q6_K) takes 6-bit codes, float16 d2, no m and zero_code 32, over columns "
                                 f"in whole super-blocks of {BLOCK * SUPER}")
        elif d.dtype == torch.uint8:
            if m.dtype != torch.uint8 or d2 is None or m2 is None or d2.dtype != torch.float16 \
                    or m2.dtype != torch.float16 or in_features % (BLOCK * SUPER) or zero_code or m_code:
                raise ValueError("uint8 d goes with uint8 m, float16 d2 and m2 and columns in whole super-blocks "
                                 f"of {BLOCK * SUPER} (got m {m.dtype}, d2 {None if d2 is None else d2.dtype}, "
                                 f"m2 {None if m2 is None else m2.dtype}, {in_features} columns)")
        elif d.dtype not in SCALE_DTYPES or (m is not None and m.dtype not in SCALE_DTYPES) \
                or d2 is not None or m2 is not None:
            raise ValueError(f"scales d {d.dtype} / m {None if m is None else m.dtype}: each is bf16, fp16 or fp32 "
                             "(or uint8 with d2 and m2)")
        self.in_features, self.out_features, self.bits = in_features, out_features, bits
        self.exact_top = 0              # the native head recomputes its best rows in float (as _FormatLinear)
        self.zero_code = zero_code
        self.m_code = m_code
        self.register_buffer("codes", codes)
        self.register_buffer("d", d)
        self.register_buffer("m", m)
        self.register_buffer("d2", d2)
        self.register_buffer("m2", m2)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())

    def scales(self, tiles, row=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Float32 d and m of `tiles` (an index or slice of tiles): [.., groups, 16]; or of row `row` of
        each (an index, as `tiles`): [.., groups] (a group: a block of 32 columns, 16 for Q6_K).
        Two-level scales multiplied out (exact products); m derived where it is not stored."""
        blocks = self.in_features // BLOCK
        groups = self.in_features // self.group

        def pick(flat: torch.Tensor, count: int) -> torch.Tensor:
            view = flat.view(-1, count, TILE)
            return (view[tiles] if row is None else view[tiles, :, row]).float()

        dim = -2 if row is None else -1
        d = pick(self.d, groups)
        if self.d2 is not None:
            d = d * pick(self.d2, blocks // SUPER).repeat_interleave(groups // (blocks // SUPER), dim=dim)
        if self.m is None:
            return d, -self.zero_code * d
        m = pick(self.m, groups)
        if self.m2 is not None:
            m = m * pick(self.m2, blocks // SUPER).repeat_interleave(SUPER, dim=dim)
        return d, m

    @property
    def group(self) -> int:
        """Columns sharing one d: 32, or 16 for Q6_K (int8 d)."""
        return 16 if self.d.dtype == torch.int8 else BLOCK

    def values(self, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        """Weights from codes [.., K] and their groups' float32 d and m [.., K / group]: code * d + offset
        (an exact product and one rounding; `offset_of`), or for Q6_K (code - zero) * d (gguf's)."""
        c = codes.view(*codes.shape[:-1], -1, self.group).float()
        if self.d.dtype == torch.int8:
            return ((c - self.zero_code) * d[..., None]).flatten(-2)
        return torch.addcmul(self.offset_of(m, d)[..., None], c, d[..., None]).flatten(-2)

    def row_codes(self, tiles, row) -> torch.Tensor:
        """The codes of row `row` of tile `tiles` (ints, or index tensors of one length): uint8 [.., K]."""
        blocks, k = self.in_features // BLOCK, self.in_features
        part = self.codes.view(-1, blocks, {4: 256, 6: 384, 8: 512}[self.bits])[tiles]    # [.., B, bytes]
        lead = part.shape[:-2]

        def of_row(raw: torch.Tensor, chunks: int) -> torch.Tensor:                # [.., B, chunks, 4]
            view = raw.reshape(*lead, blocks, chunks, TILE, 4)
            return view[torch.arange(len(tiles)), :, :, row] if lead else view[:, :, row]

        if self.bits == 8:
            return of_row(part, 8).reshape(*lead, k)
        low = of_row(part[..., :256], 4)                                            # [.., B, octet, 4]
        codes = torch.stack([low & 15, low >> 4], dim=-2).reshape(*lead, k)
        if self.bits == 4:
            return codes
        planes = of_row(part[..., 256:], 2)                                         # [.., B, plane, 4]
        high = torch.stack([(planes >> (2 * s)) & 3 for s in range(4)], dim=-2)     # [.., B, plane, s, 4]
        return codes | (high.reshape(*lead, k) << 4)

    def dequantized(self, first: int = 0, end: int | None = None) -> torch.Tensor:
        """Rows first..end (multiples of 16; default all) as float32 [rows, K]: exactly code * d +
        offset (an fp16/fp32 product and sum; `offset_of`), or (code - 32) * d for Q6_K (`values`)."""
        k, end = self.in_features, self.out_features if end is None else end
        tiles = self.out_features // TILE
        n, t0, t1 = end - first, first // TILE, end // TILE
        codes = unpack_codes(self.codes.view(tiles, -1)[t0:t1].reshape(-1), n, k, self.bits)
        d, m = (s.permute(0, 2, 1).reshape(n, k // self.group) for s in self.scales(slice(t0, t1)))
        return self.values(codes, d, m)

    def offset_of(self, m: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        """Code 0's value from float32 m and d: m, or m - m_code * d (what the native step computes)."""
        return m - self.m_code * d if self.m_code else m

    def float_rows(self, index: torch.Tensor) -> torch.Tensor:
        """Weight rows `index` [T] as float32 [T, K]."""
        return PackedEmbedding(self)(index)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T + b in float32, the weight decoded a slice of rows at a time (at most
        FORWARD_SLICE values in float at once: a large head never has a float copy)."""
        flat = x.reshape(-1, self.in_features).float()
        step = max(TILE, FORWARD_SLICE // self.in_features // TILE * TILE)
        if step >= self.out_features:
            out = F.linear(flat, self.dequantized(), self.bias)
        else:
            out = torch.empty(flat.shape[0], self.out_features)
            for first in range(0, self.out_features, step):
                end = min(first + step, self.out_features)
                bias = None if self.bias is None else self.bias[first:end]
                out[:, first:end] = F.linear(flat, self.dequantized(first, end), bias)
        return out.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"d={str(self.d.dtype).removeprefix('torch.')}, "
                f"m={'derived' if self.m is None else str(self.m.dtype).removeprefix('torch.')}, "
                f"bias={self.bias is not None}")


class PackedEmbedding(nn.Module):
    """Embedding rows decoded on lookup from a packed matrix (a tied model's head, or its own)."""

    def __init__(self, table: PackedLinear, out_dtype: torch.dtype = torch.float32, padding_idx: int | None = None,
                 scale: torch.Tensor | None = None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features
        self.table = table
        self.out_dtype, self.padding_idx = out_dtype, padding_idx
        # Gemma's embedding multiplies its rows by sqrt(hidden) (a buffer of the module it replaces)
        self.register_buffer("embed_scale", None if scale is None else scale.detach().clone(), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.numel() == 1:
            return self._one(self._checked(int(ids.reshape(-1)[0]))).view(*ids.shape, -1)
        flat = ids.reshape(-1)
        if flat.numel():
            self._checked(int(flat.min()))
            self._checked(int(flat.max()))
        t = self.table
        tiles, row = flat // TILE, flat % TILE
        values = t.values(t.row_codes(tiles, row), *t.scales(tiles, row))           # [R, K]
        values = values.view(*ids.shape, t.in_features).to(self.out_dtype)
        return values if self.embed_scale is None else values * self.embed_scale.to(self.out_dtype)

    def _checked(self, index: int) -> int:
        """`index`, or nn.Embedding's IndexError where it is no row (a negative id would otherwise
        read a row from the table's end, as tensor indexing wraps)."""
        if not 0 <= index < self.num_embeddings:
            raise IndexError(f"token id {index} out of range of the embedding's {self.num_embeddings} rows")
        return index

    def _one(self, index: int) -> torch.Tensor:
        """Row `index` [K] (a decode step's token): the same numbers as forward's, by views of the
        row's tile (about half the time of the indexed path, which a step of one token paid)."""
        t = self.table
        tile, row = divmod(index, TILE)
        values = t.values(t.row_codes(tile, row), *t.scales(tile, row)).to(self.out_dtype)
        return values if self.embed_scale is None else values * self.embed_scale.to(self.out_dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, packed {self.table.bits}-bit"
