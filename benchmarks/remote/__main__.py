"""python -m benchmarks.remote (see benchmarks/remote/remote.py; --quick for a smoke test)."""
from .remote import main

if __name__ == "__main__":
    main()
