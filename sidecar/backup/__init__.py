"""The backup tier: committed steps uploaded to an object store or any fsspec URL."""
