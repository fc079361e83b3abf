"""mlc-spec: compiler-based speculative decoding on Apache TVM Relax."""

__version__ = "0.1.0"
