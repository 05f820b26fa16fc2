"""Run every benchmark: python -m benchmarks"""
from . import multiturn

if __name__ == "__main__":
    multiturn.main()
