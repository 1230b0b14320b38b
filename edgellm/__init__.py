"""edgellm: an LLM inference node for Jetson-class edge devices."""

__version__ = "0.1.0"
