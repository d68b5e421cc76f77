"""The prefix cache and the KV pool's bookkeeping: which device blocks hold which tokens
(block_manager.py, the device tier), the RAM tier (host_tier.py), the SSD tier (ssd_tier.py), the
hybrids' state snapshots (snapshots.py), the file a cache is saved to (cache_file.py), and the plan
that ties them together on admission (prefix_cache.py). The engine (engine/) asks; the block moves a
plan implies run on the device just before a step."""
