"""DualPace: an LLM serving runtime with an independently scheduled CPU decode engine."""

__version__ = "0.1.0"
