"""Native CPU code: whole steps of Llama-family models in one call (decode.cpp: one token, a token
of each of several sequences, or a prompt chunk; each row's numbers the same whatever shares the
step), built once with the system C++ compiler and cached (build.py), its C structures mirrored in
abi.py, driven from Python (decoder.py)."""
