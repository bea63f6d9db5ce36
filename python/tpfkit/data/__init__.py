"""Data: the record store (`RecordWriter`, `RecordReader`), ASE conversion, `tpf pack`, and
streaming shards from files, HTTP(S) or S3 (`StreamingDataset`)."""
from tpfkit import _C

if not _C.with_data:
    raise ImportError("this build of tpfkit has no record store or FoldPipe (it was built "
                      "with TPF_WITH_DATA=OFF, without zstd, lz4, xxhash, libcurl and OpenSSL)")

from tpfkit.data.store import RecordReader, RecordWriter, atoms_to_record, record_to_atoms
from tpfkit.data.streaming import StreamingDataset, read_manifest

__all__ = ["RecordReader", "RecordWriter", "StreamingDataset", "atoms_to_record", "read_manifest",
           "record_to_atoms"]
