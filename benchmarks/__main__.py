"""python -m benchmarks: the side-by-side benchmark (see benchmarks/sidebyside/sidebyside.py; --quick for a smoke test)."""
from .sidebyside import sidebyside

if __name__ == "__main__":
    sidebyside.main()
