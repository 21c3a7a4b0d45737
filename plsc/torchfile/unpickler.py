"""The restricted unpickler of `load`: it resolves only torch's tensor rebuild functions,
storage classes and dtypes and a few plain containers (`_GLOBALS`), and refuses any other
global before anything is called."""
import collections
import pickle

from .elements import _BF16, _DTYPES, _STORAGE_TYPES, TorchDtype, _numpy_kind


class _StorageType(str):
    """A storage class named in data.pkl (`torch.FloatStorage`, `torch.storage.UntypedStorage`):
    `kind` is its element type (None for untyped bytes)."""

    def __new__(cls, name, kind):
        self = super().__new__(cls, name)
        self.kind = kind
        return self


class _TensorType(str):
    """`torch.Tensor` / `torch.nn.Parameter`: the types `_rebuild_from_type_v2` may name."""


def _device(kind, index=None):
    return kind if index is None else f"{kind}:{index}"


def _encode(text, encoding="utf-8"):
    """`_codecs.encode`, as protocol-2 pickles rebuild bytes: `encode(str, 'latin1')`."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1", "utf-8", "utf8"):
        raise pickle.UnpicklingError(f"_codecs.encode({type(text).__name__}, {encoding!r}) "
                                     "is not supported")
    return text.encode(encoding)


def _globals():
    """(module, name) -> the object `find_class` returns; `None` values are filled per load
    (the rebuild functions, which need the reader)."""
    table = {("collections", "OrderedDict"): collections.OrderedDict,
             ("collections", "Counter"): collections.Counter,
             ("torch", "Size"): tuple, ("torch", "device"): _device,
             ("_codecs", "encode"): _encode}
    for module in ("builtins", "__builtin__"):
        for name, value in (("set", set), ("frozenset", frozenset), ("bytearray", bytearray),
                            ("complex", complex)):
            table[module, name] = value
    for name, kind in _STORAGE_TYPES.items():
        table["torch", name] = _StorageType(f"torch.{name}", kind)
    for module in ("torch", "torch.storage"):
        table[module, "UntypedStorage"] = _StorageType("torch.UntypedStorage", None)
    for name, kind in _DTYPES.items():
        table["torch", name] = TorchDtype(name, None if kind is None else _numpy_kind(kind))
    for module, name in (("torch", "Tensor"), ("torch._tensor", "Tensor"),
                         ("torch.nn.parameter", "Parameter"), ("torch.nn", "Parameter")):
        table[module, name] = _TensorType(f"{module}.{name}")
    for name in ("_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3",
                 "_rebuild_parameter", "_rebuild_parameter_with_state"):
        table["torch._utils", name] = None
    for module in ("torch._tensor", "torch.tensor"):
        for name in ("_rebuild_from_type", "_rebuild_from_type_v2"):
            table[module, name] = None
    return table


_GLOBALS = _globals()


class _Unpickler(pickle.Unpickler):
    """Resolves only `_GLOBALS`; storages come from the zip archive of `reader`."""

    def __init__(self, file, reader):
        super().__init__(file, encoding="utf-8")
        self.reader = reader

        def rebuild_v2(storage, offset, size, stride, requires_grad=False, hooks=None,
                       metadata=None):
            return reader.tensor(storage, offset, tuple(size), tuple(stride), metadata=metadata)

        def rebuild_v3(storage, offset, size, stride, requires_grad, hooks, dtype,
                       metadata=None):
            if not isinstance(dtype, TorchDtype):
                reader.fail(f"malformed data.pkl: tensor dtype {dtype!r}")
            if dtype.numpy is None:
                reader.fail(f"tensor of dtype {dtype}, which numpy has no type for")
            kind = _BF16 if dtype == "torch.bfloat16" else dtype.numpy.str
            return reader.tensor(storage, offset, tuple(size), tuple(stride), kind=kind,
                                 metadata=metadata)

        def rebuild_v1(storage, offset, size, stride):
            return reader.tensor(storage, offset, tuple(size), tuple(stride))

        def rebuild_parameter(data, requires_grad=False, hooks=None, state=None):
            return data

        def rebuild_from_type(func, new_type, args, state):
            if func not in (rebuild_v1, rebuild_v2, rebuild_v3) or \
                    not isinstance(new_type, _TensorType):
                reader.fail(f"malformed data.pkl: _rebuild_from_type_v2 of {new_type!r}")
            return func(*args)

        self.functions = {
            "_rebuild_tensor": rebuild_v1, "_rebuild_tensor_v2": rebuild_v2,
            "_rebuild_tensor_v3": rebuild_v3, "_rebuild_parameter": rebuild_parameter,
            "_rebuild_parameter_with_state": rebuild_parameter,
            "_rebuild_from_type": rebuild_from_type, "_rebuild_from_type_v2": rebuild_from_type,
        }

    def find_class(self, module, name):
        if (module, name) not in _GLOBALS:
            self.reader.fail(f"data.pkl refers to the global '{module}.{name}', which is not "
                             "a tensor, storage or plain container; refusing to load it "
                             "(plsc loads weights, not arbitrary Python objects)")
        value = _GLOBALS[module, name]
        return self.functions[name] if value is None else value

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] in ("storage", b"storage")
                and isinstance(pid[1], _StorageType)):
            self.reader.fail(f"malformed data.pkl: persistent id {pid!r:.200}")
        _, storage_type, key, _location, numel = pid
        if isinstance(key, bytes):
            key = key.decode("ascii")
        self.reader.persistent_loads += 1
        return self.reader.storage(str(key), storage_type.kind, numel)
