"""Data: the record store (`RecordWriter`, `RecordReader`), ASE conversion, `tpf pack`, and
streaming record-store shards (`StreamingDataset`)."""
from turbopairformer.data.store import RecordReader, RecordWriter, atoms_to_record, record_to_atoms
from turbopairformer.data.streaming import StreamingDataset, read_manifest

__all__ = ["RecordReader", "RecordWriter", "StreamingDataset", "atoms_to_record", "read_manifest",
           "record_to_atoms"]
