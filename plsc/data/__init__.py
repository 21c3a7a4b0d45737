"""Datasets and file formats for face-recognition training.

Reads and writes insightface's files without MXNet: RecordIO training sets
(``train.rec``/``train.idx``/``property``) and verification packs
(``lfw.bin`` ...); datasets over recs, image folders and list files; a
distributed batch sampler; a synthetic-identity generator; and IJB-B/IJB-C
protocols with five-point face alignment.
"""
from .align import ARCFACE_POINTS, align_face, reference_points, similarity_transform
from .datasets import ImageFolderDataset, ImageListDataset, ImagePathsDataset, RecordIODataset
from .errors import DataError, PeerDataError, WorkerDied
from .facerec import image_keys, read_property, write_face_rec, write_property
from .ijb import IJBFaceDataset, IJBMeta, check_ijb_images, ijb_paths, read_ijb_meta
from .ijb_1n import ijb_1n_paths, read_ijb_1n_lists
from .loader import DataLoader
from .prefetch import Prefetcher
from .recordio import RecordIOReader, RecordIOWriter
from .sampler import DistributedBatchSampler
from .synthetic import generate as generate_synthetic
from .transforms import FaceTransform, decode_image
from .verification import load_verification_arrays, read_verification_bin, write_verification_bin

__all__ = [
    "RecordIODataset", "ImageFolderDataset", "ImageListDataset", "ImagePathsDataset", "DataError", "PeerDataError", "WorkerDied",
    "RecordIOReader",
    "RecordIOWriter", "read_property", "write_property", "image_keys", "write_face_rec",
    "DistributedBatchSampler", "generate_synthetic", "FaceTransform", "decode_image", "read_verification_bin",
    "write_verification_bin", "load_verification_arrays", "ARCFACE_POINTS", "reference_points",
    "similarity_transform", "align_face", "IJBMeta", "ijb_paths", "read_ijb_meta", "check_ijb_images", "ijb_1n_paths", "read_ijb_1n_lists",
    "IJBFaceDataset", "DataLoader", "Prefetcher",
]
