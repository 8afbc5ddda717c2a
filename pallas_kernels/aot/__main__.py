"""``python -m pallas_kernels.aot``: see ``pallas_kernels.aot.gate``."""

from pallas_kernels.aot.gate import main

if __name__ == "__main__":
    raise SystemExit(main())
