"""A GGUF file with another GGUF's tokenizer: every tokenizer.* entry of SOURCE dropped and DONOR's
written in their place, everything else (metadata, tensors) copied as it is. benchmarks/gguf_models.py
gives the random Gemma 3 1B-shape model Gemma 3 270M's tokenizer this way.

Run with llama.cpp's gguf-py on the path (benchmarks/llama_tools.sh):
  PYTHONPATH=<tools>/gguf-py:<tools>/pydeps python benchmarks/gguf_tokenizer.py SOURCE DONOR OUT
"""
import sys

import gguf
from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata


def main(source: str, donor: str, out: str) -> None:
    reader, donor_reader = gguf.GGUFReader(source, "r"), gguf.GGUFReader(donor, "r")
    tokenizer = {}
    for field in donor_reader.fields.values():
        if field.name.startswith("tokenizer."):
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            tokenizer[field.name] = MetadataDetails(kind, field.contents(), sub_type=sub)
    if not tokenizer:
        sys.exit(f"{donor} has no tokenizer entries")
    drop = [field.name for field in reader.fields.values() if field.name.startswith("tokenizer.")]
    writer = gguf.GGUFWriter(out, arch=reader.get_field(gguf.Keys.General.ARCHITECTURE).contents(),
                             endianess=reader.endianess)
    alignment = reader.get_field(gguf.Keys.General.ALIGNMENT)
    if alignment is not None:
        writer.data_alignment = alignment.contents()
    copy_with_new_metadata(reader, writer, tokenizer, drop)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(*sys.argv[1:])
