"""The ``lorakit`` command line: a thin argparse layer over the library."""

__all__ = []
