"""The data-flow shadow runner (no model): its pools, multi-step decode and host tier."""
