"""One step on the host: its rows and their checks, the packed batch, the shape buckets."""
