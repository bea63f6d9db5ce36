"""Data: the record store (`RecordWriter`, `RecordReader`), ASE conversion and `tpf pack`."""
from turbopairformer.data.store import RecordReader, RecordWriter, atoms_to_record, record_to_atoms

__all__ = ["RecordReader", "RecordWriter", "atoms_to_record", "record_to_atoms"]
