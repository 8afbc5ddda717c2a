"""A request's cache state: the manager, the lease, its pages and windows, admission, dedup."""
