"""The ``lorakit`` command line: a thin argparse layer over the library."""

__all__ = []


def flags(args, *names: str) -> dict:
    """The named parsed flags as keyword arguments of the library call they feed."""
    return {n: getattr(args, n) for n in names}
