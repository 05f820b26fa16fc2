"""python -m benchmarks: the side-by-side benchmark (see benchmarks/sidebyside.py; --quick for a smoke test)."""
from . import sidebyside

if __name__ == "__main__":
    sidebyside.main()
