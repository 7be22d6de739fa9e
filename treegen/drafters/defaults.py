"""Default method options, shared by the drafter classes and the method registry (no torch import here)."""
PLD_MAX_NGRAM = 3
PLD_MIN_NGRAM = 1
PLD_DRAFT_LEN = 10
PLD_BRANCHES = 4
LOOKUP = False          # any drafter's method: prompt-lookup rounds where the text repeats and they pay
SAMPLE = True           # any drafter's method at T > 0: a chain drawn from the draft laws first (speculative sampling)
DRAWS = 1               # with `sample`: drawn children at depth 1 (half as many each depth after); 1 = a chain
DTYPE = "auto"          # any drafter's method: its compute precision; auto = 4-bit block products (engine/q4.py) on
                        #   a CPU where they build, beside a q4 target or where it would draft in bf16; else bf16
                        #   for an fp32 target on a CPU with native bf16 dot products (docs/ablations/dtype.md),
                        #   int8 products on another CPU (engine/int8.py), else the target's
DTYPES = ("auto", "fp32", "bf16", "fp16", "int8", "q4")
VOCAB = "auto"          # any drafter's method: the tokens its head scores; auto = the frequent tokens its drafter
VOCABS = ("auto", "full")   #   ships (draft_vocab.safetensors) and the context's, else all; full = all (drafters/vocab.py)
DRAFT_VOCAB = 8192      # frequent tokens `treegen train` lists beside a drafter it exports (--draft-vocab)
DRAW_SHAPE = "tree"     # with `sample`, a tree method's drawn part: chain = the first draws' chain with its siblings;
DRAW_SHAPES = ("chain", "tree")   # tree = every drawn node's children drawn too (drafters/drawn.py)
TREE_DRAWS = 16         # the tree methods' default (docs/benchmarks.md: acceptance rose to 16 at T=1)
DDTREE_BUDGET = 64      # nodes verified per round (DDTree's common default)
AUTO = "auto"           # `budget: auto`: the drafter drafts AUTO_CEILING nodes, the engine trims each round
AUTO_CEILING = 128      #   to the size with the best expected tokens/s on this hardware (engine/budget.py)
DDTREE_TOP_K = 0        # per-depth candidates; 0 = as many as the budget (no node can rank lower)
DDTREE_SAMPLED_BUDGET = 0   # nodes a round at T > 0; 0 = the budget (a sibling pays more when sampling)
D2SD_K = 4              # branches re-drafted from the likeliest rejection points
D2SD_B2 = 0             # the second block's length; 0 = the first drafter's block size B
D2SD_MAX_B2 = 64
D2SD_BUDGET = 0         # most nodes verified per round (best path scores kept); 0 = every merged node
D2SD_SKIP_REJECTED = True  # a re-draft never repeats the draft its branch point presumes rejected
D2SD_BRANCH = "token"   # token: K (position, alternative token) pairs (ours: it accepts more than the paper's
                        # rule, docs/ablations/d2sd-branch.md); point: the paper's K positions by r(i)
D2SD_BRANCHES = ("point", "token")
DARTREE_BUDGET = 64     # nodes verified per round (DARTree's published setting)
DARTREE_CANDIDATES = 64  # candidate support per depth: the top base-logit tokens
DARTREE_WIDTH = 12      # pruned: children kept per depth before the global cut
DARTREE_DEPTH_BONUS = -0.2  # pruned: added per depth to the path score in the global cut
DARTREE_VARIANT = "pruned"
DARTREE_VARIANTS = ("pruned", "fixed")
TREEFLASH_BUDGET = 64       # nodes verified per round (TreeFlash's tree_size, less the root)
TREEFLASH_TOP_M = 16        # candidate previous tokens per depth (treeflash_config.candidate_tokens)
TREEFLASH_TOP_M_CPU = 8     # on a CPU, half as many: each is a head row at every depth, and a CPU pays per row
TREEFLASH_DRAWN_TOP_M = 4   # candidates of the tables behind a drawn tree (T > 0): its tail and a few nodes
TREEFLASH_TOP_K = 16        # conditional children kept per (depth, candidate)
TREEFLASH_TEMPERATURE = 1.0  # drafter temperature: rescales the heap's log-probs, not which tokens are kept
TREEFLASH_SUPPORT_CPU = 64  # on a CPU, score each depth over its marginal top-64 only (0 = full vocabulary)
TREEFLASH_TABLE_MAX = 2 ** 25  # largest vocab x 2I token table kept on a CPU (fp32: 128 MB)
# the values a string option takes, checked before anything loads (None: any method that has the option)
CHOICES = {(None, "dtype"): DTYPES, (None, "vocab"): VOCABS, (None, "draw_shape"): DRAW_SHAPES, ("dartree", "variant"): DARTREE_VARIANTS,
           ("d2sd", "branch"): D2SD_BRANCHES}
# the smallest valid value of numeric options, checked (with the types) before anything loads
MINIMUM = {("pld", "max_ngram"): 1, ("pld", "min_ngram"): 1, ("pld", "draft_len"): 1, ("pld", "branches"): 1,
           ("ddtree", "budget"): 1, ("ddtree", "top_k"): 0, ("ddtree", "sampled_budget"): 0,
           ("treeflash", "budget"): 1, ("treeflash", "top_m"): 1, ("treeflash", "top_k"): 1,
           ("treeflash", "support"): 0, ("dartree", "budget"): 1, ("dartree", "candidates"): 1,
           ("dartree", "width"): 1, ("d2sd", "k"): 1, ("d2sd", "b2"): 0, ("d2sd", "budget"): 0,
           (None, "draws"): 1}   # None: any method that has the option
# the largest valid value of size-like options, checked before anything loads: past these a tree's tables
# and its verify rows outgrow a machine's memory (a budget of 10**8 asked for tens of GB) with no gain
MAX_TREE = 2048         # nodes verified per round: 16x the `budget: auto` ceiling
MAX_WIDTH = 1024        # per-depth candidates and children (clamped to the vocabulary as well)
MAXIMUM = {("pld", "max_ngram"): 64, ("pld", "min_ngram"): 64, ("pld", "draft_len"): 256, ("pld", "branches"): 64,
           ("ddtree", "budget"): MAX_TREE, ("ddtree", "top_k"): MAX_TREE,
           ("ddtree", "sampled_budget"): MAX_TREE,
           ("treeflash", "budget"): MAX_TREE, ("treeflash", "top_m"): 256, ("treeflash", "top_k"): MAX_WIDTH,
           ("treeflash", "support"): 2 ** 18, ("dartree", "budget"): MAX_TREE,
           ("dartree", "candidates"): 4096, ("dartree", "width"): MAX_WIDTH, ("d2sd", "k"): 64,
           ("d2sd", "b2"): D2SD_MAX_B2, ("d2sd", "budget"): MAX_TREE, (None, "draws"): 256}
