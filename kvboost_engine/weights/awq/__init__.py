"""AWQ 4-bit checkpoints: format (format.py), compute layouts (kernels.py), AWQLinear (linear.py),
loader (loader.py), our quantizer (quantize.py). Submodules are imported where used."""
