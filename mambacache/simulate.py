"""``python -m mambacache.simulate``: the trace simulator (``mambacache.bench.simulate``)."""

from mambacache.bench.simulate import main

if __name__ == "__main__":
    main()
