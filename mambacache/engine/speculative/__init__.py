"""Speculative decoding: drafters, verify rows and acceptance, chains under overlap, trees."""
