"""Benchmarks behind ``mpitrain bench NAME``: each module has ``main(argv) -> int`` and runs as a rank."""

__all__: list[str] = []
