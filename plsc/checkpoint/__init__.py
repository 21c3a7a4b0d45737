"""The on-disk checkpoint format, owned here: the folder's layout and meta.json keys
(`layout`), the manifest and its checks (`manifest`), the head arrays (`head_arrays`), saving,
finding and loading (`manager`), and checkpoints made from checkpoints (`convert`)."""
from .convert import (convert_checkpoint, copy_checkpoint, export_classifier, import_classifier,
                      reshard_checkpoint, write_k1_checkpoint)
from .errors import IO_ERROR_EXIT_CODE, CheckpointDamaged, CheckpointSaveError
from .head_arrays import (array_dtype, head_array_bytes, head_dtype, load_head_rows,
                          load_head_rows_into, rows_as_float32, save_rows_npy, write_rows_npy)
from .layout import read_meta, training_meta
from .manager import (CheckpointManager, agree_checkpoint, capture_rng, checkpoints_newest_first,
                      find_checkpoint, load_paddle_file, local_optimizer_state,
                      portable_optimizer_state, remove_leftovers, repair_latest, restore_rng,
                      save_best)
from .manifest import VERIFY_LEVELS, read_manifest, verify_checkpoint, write_manifest

__all__ = ["CheckpointManager", "CheckpointDamaged", "CheckpointSaveError", "IO_ERROR_EXIT_CODE",
           "VERIFY_LEVELS", "agree_checkpoint", "array_dtype", "capture_rng",
           "checkpoints_newest_first", "convert_checkpoint", "copy_checkpoint", "export_classifier", "find_checkpoint",
           "head_array_bytes", "head_dtype", "import_classifier", "load_head_rows",
           "load_head_rows_into", "load_paddle_file", "local_optimizer_state",
           "portable_optimizer_state", "read_manifest", "read_meta", "remove_leftovers", "repair_latest",
           "reshard_checkpoint", "restore_rng", "rows_as_float32", "save_best", "save_rows_npy",
           "training_meta", "verify_checkpoint", "write_k1_checkpoint", "write_manifest",
           "write_rows_npy"]
