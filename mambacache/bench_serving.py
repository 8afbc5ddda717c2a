"""``python -m mambacache.bench_serving``: the serving benchmark client
(``mambacache.bench.serving``)."""

from mambacache.bench.serving import main

if __name__ == "__main__":
    main()
