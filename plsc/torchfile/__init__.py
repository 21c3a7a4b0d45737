"""PyTorch's file format without torch: `load` reads what `torch.save` writes (its zip format,
the default since torch 1.6) into numpy arrays and plain Python values, and `save` writes dicts,
lists and tuples of numpy arrays and plain values as a file that
`torch.load(path, weights_only=True)` reads.

The file `torch.save` writes (torch 2.x) is an uncompressed zip archive whose records sit in one
folder, named after the file's stem when torch saved to a path (`archive` when it saved to a
buffer; a renamed file keeps its old folder name)::

    <folder>/data.pkl                  the object, pickle protocol 2, tensors as calls of
                                       torch._utils._rebuild_tensor_v2 on persistent storages
    <folder>/.format_version           "1" (storage records follow one another in key order)
    <folder>/.storage_alignment        "64" (record data starts at a multiple of 64 bytes)
    <folder>/byteorder                 "little" or "big" (absent in older files: little)
    <folder>/data/<key>                each storage's raw bytes, in that byte order
    <folder>/version                   "3\\n"
    <folder>/.data/serialization_id    a random id

A tensor in `data.pkl` is `_rebuild_tensor_v2(storage, offset, size, stride, requires_grad,
backward_hooks[, metadata])`, and the storage is the persistent id
`('storage', <torch.FloatStorage class ...>, key, location, numel)`; several tensors (views)
may share one storage. Dtypes without a legacy storage class (uint16, uint32, uint64, float8 ...)
use `_rebuild_tensor_v3(..., dtype)` on a `torch.storage.UntypedStorage` of bytes.

`load` unpickles with a restricted unpickler: it resolves only the globals listed in
`_GLOBALS` (torch's tensor rebuild functions, storage classes and dtypes, `torch.Size`,
`torch.device`, `collections.OrderedDict`/`Counter`, and the builtins protocol-2 pickles use for
sets, bytes, bytearrays and complex numbers); any other global is refused with a
`TorchFileError` naming it, before anything is called. What comes back:

- every tensor (and `nn.Parameter`) as a C-contiguous numpy array of its view (storage
  offset, size and stride honoured), owning its memory; `requires_grad`, backward hooks and
  Python attributes of tensors are dropped;
- float32/float64/float16, int64/int32/int16/int8, uint8/uint16/uint32/uint64, bool and
  complex64/complex128 as those numpy dtypes; **bfloat16 as float32** (numpy has no bfloat16):
  each value exactly, its 16 bits as the high half of the float32;
- a torch dtype object as a `TorchDtype` (a `str`, e.g. "torch.float32"), a `torch.device` as
  its string ("cpu", "cuda:0"), a `torch.Size` as a tuple; dicts, OrderedDicts (with the
  `_metadata` attribute `Module.state_dict()` gives them), lists, tuples, sets, numbers,
  strings, bytes and None as themselves.

Refused, each with a one-line `TorchFileError` naming the file: a file of torch's legacy
format (torch < 1.6, or `_use_new_zipfile_serialization=False`), a damaged zip (cut short, a
CRC mismatch, a record of the wrong size), a TorchScript archive, a storage saved bare (not as
a tensor), a tensor view that reaches outside its storage, dtypes numpy lacks (float8, qint8,
complex32).

`save` hand-writes pickle protocol 2 as torch does (Python's pickler would need the torch
classes): `collections.OrderedDict` stays an OrderedDict, every numpy array becomes a tensor
with a storage of its own (C order, little-endian; one array object given twice shares one
storage), numpy scalars become Python numbers. It writes the records torch needs to load the
file (`data.pkl`, `byteorder`, `data/<key>`, `version`), uncompressed, with each record's data
at a multiple of 64 bytes as torch aligns them (so `torch.load(..., mmap=True)` maps them
aligned), through `plsc.fileio.AtomicWriter`. Zip64 records are written where a record or the
archive passes 4 GiB.
"""
from .elements import TorchDtype, TorchFileError
from .reader import LEGACY_MESSAGE, load
from .writer import save

__all__ = ["load", "save", "TorchFileError", "TorchDtype", "LEGACY_MESSAGE"]
