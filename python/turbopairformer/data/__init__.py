"""Data: the record store (`RecordWriter`, `RecordReader`), ASE conversion, `tpf pack`, and
streaming shards from files, HTTP(S) or S3 (`StreamingDataset`)."""
from turbopairformer.data.store import RecordReader, RecordWriter, atoms_to_record, record_to_atoms
from turbopairformer.data.streaming import StreamingDataset, read_manifest

__all__ = ["RecordReader", "RecordWriter", "StreamingDataset", "atoms_to_record", "read_manifest",
           "record_to_atoms"]
