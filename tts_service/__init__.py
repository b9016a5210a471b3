"""tts-service: best-of-N reasoning with lossless model-free speculative decoding."""

__version__ = "0.1.0"
