"""The model runner: jitted step programs, pools, host pools, loading, warm-up, compiles."""
