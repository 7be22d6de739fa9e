"""Default method options, shared by the drafter classes and the method registry (no torch import here)."""
PLD_MAX_NGRAM = 3
PLD_MIN_NGRAM = 1
PLD_DRAFT_LEN = 10
PLD_BRANCHES = 4
DDTREE_BUDGET = 64      # nodes verified per round (DDTree's common default)
AUTO = "auto"           # `budget: auto`: the drafter drafts AUTO_CEILING nodes, the engine trims each round
AUTO_CEILING = 128      #   to the size with the best expected tokens/s on this hardware (engine/budget.py)
DDTREE_TOP_K = 0        # per-depth candidates; 0 = as many as the budget (no node can rank lower)
# the smallest valid value of numeric options, checked (with the types) before anything loads
MINIMUM = {("pld", "max_ngram"): 1, ("pld", "min_ngram"): 1, ("pld", "draft_len"): 1, ("pld", "branches"): 1,
           ("ddtree", "budget"): 1, ("ddtree", "top_k"): 0}
