"""``python -m mambacache.bench_report a.json ...``: README rows (``mambacache.bench.report``)."""

from mambacache.bench.report import main

if __name__ == "__main__":
    main()
