"""``python -m mambacache.bench``: see ``mambacache.bench.cli``."""

from mambacache.bench.cli import main

if __name__ == "__main__":
    main()
