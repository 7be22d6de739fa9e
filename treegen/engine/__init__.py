"""The round loop shared by every drafting method: tree, verification, cache compaction, generate()."""
