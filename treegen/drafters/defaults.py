"""Default method options, shared by the drafter classes and the method registry (no torch import here)."""
PLD_MAX_NGRAM = 3
PLD_MIN_NGRAM = 1
PLD_DRAFT_LEN = 10
PLD_BRANCHES = 4
DDTREE_BUDGET = 64      # nodes verified per round (DDTree's common default)
DDTREE_TOP_K = 0        # per-depth candidates; 0 = as many as the budget (no node can rank lower)
DARTREE_BUDGET = 64     # nodes verified per round (DARTree's published setting)
DARTREE_CANDIDATES = 64  # candidate support per depth: the top base-logit tokens
DARTREE_WIDTH = 12      # pruned: children kept per depth before the global cut
DARTREE_DEPTH_BONUS = -0.2  # pruned: added per depth to the path score in the global cut
DARTREE_VARIANT = "pruned"
