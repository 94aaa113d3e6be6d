"""minisgl: a small LLM inference engine built around torch.compile."""

__version__ = "0.1.0"
