"""treegen: exact, fast LLM generation with block-diffusion draft trees."""
import os as _os

__version__ = "0.1.0"

# torch's CPU allocator puts its allocations of 2 MB and more on transparent huge pages when this is set (read at
# its first allocation, so before torch loads): a CPU decoder step streams every weight and the KV cache, which on
# 4 KB pages costs a TLB miss each 4 KB. Memory placement only: no bit changes. Set it to 0 to keep 4 KB pages.
_os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def __getattr__(name):  # keep `import treegen` cheap: torch loads on first use of the API
    if name in ("Generator", "Completion", "Chunk", "PrefixCache"):
        from . import api
        return getattr(api, name)
    raise AttributeError(name)
