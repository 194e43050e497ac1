"""State that outlives the process: the record file format (records.py: checksummed arrays and a JSON header, written
atomically, keyed by the artifact's identity) and the prefix cache's disk tier (disk_tier.py)."""
