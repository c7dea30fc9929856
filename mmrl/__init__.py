"""mmrl: group-relative RL alignment for multimodal policies."""
__version__ = "0.1.0"
