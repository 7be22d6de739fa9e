"""Default method options, shared by the drafter classes and the method registry (no torch import here)."""
PLD_MAX_NGRAM = 3
PLD_MIN_NGRAM = 1
PLD_DRAFT_LEN = 10
PLD_BRANCHES = 4
DDTREE_BUDGET = 64      # nodes verified per round (DDTree's common default)
DDTREE_TOP_K = 0        # per-depth candidates; 0 = as many as the budget (no node can rank lower)
D2SD_K = 4              # branches re-drafted from the likeliest rejection points
D2SD_B2 = 0             # the second block's length; 0 = the first drafter's block size B
D2SD_MAX_B2 = 64
D2SD_BUDGET = 0         # most nodes verified per round (best path scores kept); 0 = every merged node
D2SD_SKIP_REJECTED = True  # a re-draft never repeats the draft its branch point presumes rejected
