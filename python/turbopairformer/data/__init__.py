"""Data: streaming record-store shards (`StreamingDataset`)."""
from turbopairformer.data.streaming import StreamingDataset, read_manifest

__all__ = ["StreamingDataset", "read_manifest"]
