"""The bench's own defaults (no torch import here, so `treegen bench --help` can show them)."""
DEFAULT_REPEATS = 3
DEFAULT_SEED = 0        # sampled runs are reproducible unless --seed says otherwise
WARMUP_TOKENS = 8       # enough for every kernel and cache path to have run once before timing
