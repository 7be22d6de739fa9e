"""treegen: exact, fast LLM generation with block-diffusion draft trees."""
__version__ = "0.1.0"


def __getattr__(name):  # keep `import treegen` cheap: torch loads on first use of the API
    if name in ("Generator", "Completion", "Chunk", "PrefixCache"):
        from . import api
        return getattr(api, name)
    raise AttributeError(name)
