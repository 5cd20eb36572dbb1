"""Read a PyTorch `pytorch_model.bin` without torch and without running pickled code.

A torch checkpoint is a zip holding `data.pkl` (a pickle of the state dict) and one
file per tensor storage. Unpickling can call any importable function, so the
unpickler here resolves only the handful of globals that rebuild tensors; any
other global ends the read with an error naming it, before anything is called.
"""

import io
import pickle
import zipfile
from pathlib import Path
from typing import Dict

import mlx.core as mx
import numpy as np

from ..errors import EagleError

# storage class -> numpy dtype of its bytes (bfloat16 is read as uint16, then viewed)
_STORAGES = {
    "FloatStorage": np.float32, "HalfStorage": np.float16, "BFloat16Storage": np.uint16,
    "DoubleStorage": np.float64, "LongStorage": np.int64, "IntStorage": np.int32,
    "ShortStorage": np.int16, "CharStorage": np.int8, "ByteStorage": np.uint8,
    "BoolStorage": np.bool_,
}


class _StorageType:
    def __init__(self, name):
        self.name = name


class _Storage:
    def __init__(self, array: np.ndarray, bf16: bool):
        self.array = array
        self.bf16 = bf16


class _Tensor:
    def __init__(self, array: np.ndarray, bf16: bool):
        self.array = array
        self.bf16 = bf16


def _rebuild_tensor_v2(storage, offset, size, stride, requires_grad=False,
                       backward_hooks=None, metadata=None):
    if not isinstance(storage, _Storage):
        raise pickle.UnpicklingError("tensor without a storage")
    flat = storage.array
    size, stride = tuple(size), tuple(stride)
    n = int(np.prod(size)) if size else 1
    last = offset + sum((s - 1) * st for s, st in zip(size, stride)) if n else offset
    if offset < 0 or (n and last >= flat.size):
        raise pickle.UnpicklingError("a tensor reaches past the end of its storage")
    view = np.lib.stride_tricks.as_strided(
        flat[offset:], shape=size, strides=[st * flat.itemsize for st in stride]
    )
    return _Tensor(np.ascontiguousarray(view), storage.bf16)


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None):
    return data


def _ordered_dict(*args):
    return dict(*args)


_ALLOWED = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("collections", "OrderedDict"): _ordered_dict,
}


class _SafeUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, zf: zipfile.ZipFile, prefix: str, name: str):
        super().__init__(io.BytesIO(data))
        self.zf, self.prefix, self.name = zf, prefix, name
        self.storages = {}

    def find_class(self, module, name):
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and name in _STORAGES:
            return _StorageType(name)
        raise EagleError(
            f"{self.name} refers to the Python global '{module}.{name}', which a tensor "
            "checkpoint never needs; refusing to load it (it could run code)."
        )

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType)):
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
        _, stype, key, _location, numel = pid[:5]
        if key not in self.storages:
            dtype = np.dtype(_STORAGES[stype.name])
            try:
                raw = self.zf.read(f"{self.prefix}data/{key}")
            except KeyError:
                raise pickle.UnpicklingError(f"storage {key} is missing") from None
            if len(raw) < numel * dtype.itemsize:
                raise pickle.UnpicklingError(f"storage {key} is shorter than its tensor")
            array = np.frombuffer(raw, dtype=dtype, count=numel)
            self.storages[key] = _Storage(array, stype.name == "BFloat16Storage")
        return self.storages[key]


def _to_mx(t: _Tensor) -> mx.array:
    a = mx.array(t.array)
    return a.view(mx.bfloat16) if t.bf16 else a


def load_torch_checkpoint(path: Path) -> Dict[str, mx.array]:
    """The tensors of a torch zip checkpoint as MLX arrays, with their saved dtypes."""
    path = Path(path)
    try:
        zf = zipfile.ZipFile(path)
    except FileNotFoundError:
        raise EagleError(f"checkpoint {path} does not exist.") from None
    except (zipfile.BadZipFile, OSError):
        raise EagleError(
            f"{path} is not a readable PyTorch zip checkpoint (truncated, corrupt, or saved "
            "in the pre-1.6 format)."
        ) from None
    with zf:
        names = zf.namelist()
        pkl = [n for n in names if n.endswith("data.pkl")]
        if len(pkl) != 1:
            raise EagleError(f"{path} holds no data.pkl, so it is not a PyTorch checkpoint.")
        prefix = pkl[0][: -len("data.pkl")]
        byteorder = prefix + "byteorder"
        if byteorder in names and zf.read(byteorder).strip() != b"little":
            raise EagleError(f"{path} was saved on a big-endian machine, which is not supported.")
        try:
            state = _SafeUnpickler(zf.read(pkl[0]), zf, prefix, str(path)).load()
        except EagleError:
            raise
        except (pickle.UnpicklingError, zipfile.BadZipFile, EOFError, ValueError,
                TypeError, IndexError, KeyError, AttributeError, OSError) as e:
            raise EagleError(f"{path} is corrupt or truncated ({e}).") from None
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, _Tensor) for k, v in state.items()
    ):
        raise EagleError(f"{path} does not hold a state dict of named tensors.")
    return {k: _to_mx(v) for k, v in state.items()}
