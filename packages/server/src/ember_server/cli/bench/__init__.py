"""``ember bench``: offline throughput and latency, and a serving sweep against a running server."""
