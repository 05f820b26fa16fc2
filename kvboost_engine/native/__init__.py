"""Native CPU code: a whole decode step of Llama-family models in one call (decode.cpp), built once
with the system C++ compiler and cached (build.py), driven from Python (decoder.py)."""
